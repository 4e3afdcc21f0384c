"""Timings of DSA's selection: topk_indices against torch.topk, and the fused
indexer_topk / indexer_scores against the unfused torch chain (bench/baselines.py),
in bf16 at GLM-5's indexer shape (32 heads of 128). Their correctness at these
shapes is tests/test_device_indexer.py::test_bench_shapes."""
import torch

import glm5_ops
from baselines import unfused_indexer_topk

# (rows, T, k)
TOPK = {"full": [(1, 131072, 2048), (64, 32768, 2048), (128, 8192, 2048), (8, 262144, 2048)],
        "quick": [(1, 131072, 2048), (64, 32768, 2048)],
        "cpu": [(4, 8192, 256)]}
# (B, S, T, H, D, topk), causal
INDEXER = {"full": [(1, 1024, 16384, 32, 128, 2048), (1, 4096, 65536, 32, 128, 2048), (8, 1, 65536, 32, 128, 2048)],
           "quick": [(1, 1024, 16384, 32, 128, 2048)],
           "cpu": [(1, 64, 1024, 8, 64, 128)]}
UNFUSED_MAX_BYTES = 40e9   # the chain's [B,S,H,T] bf16 product; larger ones are not run
SCORES_MAX_BYTES = 2e9     # indexer_scores' [B,S,T] fp32 output


def _size(rec, quick):
    return "cpu" if rec.device == "cpu" else ("quick" if quick else "full")


def run(rec, backends, quick):
    size = _size(rec, quick)
    topk_timings(rec, backends, quick, TOPK[size])
    indexer_timings(rec, backends, INDEXER[size])


def topk_timings(rec, backends, quick, shapes):
    for rows, T, k in shapes:
        x = torch.randn(rows, T, device=rec.device)
        group, nbytes = f"topk fp32 [{rows},{T}] k={k}", rows * T * 4
        base = rec.timed(group, "torch.topk(sorted=False)", lambda: torch.topk(x, k, dim=-1, sorted=False),
                         nbytes=nbytes)
        for be in backends:
            def ours(be=be, srt=False):
                with glm5_ops.use_backend(be):
                    return glm5_ops.topk_indices(x, k, sorted=srt)
            rec.timed(group, be, ours, nbytes=nbytes, base_ms=base)
            if not quick:
                rec.timed(group, f"{be} sorted=True", lambda be=be: ours(be, True), nbytes=nbytes, base_ms=base)


def indexer_timings(rec, backends, shapes):
    for B, S, T, H, D, topk in shapes:
        q = (torch.randn(B, S, H, D, device=rec.device) * D ** -0.5).bfloat16()
        w = torch.randn(B, S, H, device=rec.device) * H ** -0.5
        k = torch.randn(B, T, D, device=rec.device).bfloat16()
        flops = 2.0 * B * S * T * H * D
        group = f"indexer bf16 B={B} S={S} T={T} H={H} D={D} topk={topk} causal"
        nbytes = (q.numel() + k.numel()) * 2 + w.numel() * 4 + B * S * topk * 4
        base = None
        if B * S * H * T * 2 <= UNFUSED_MAX_BYTES:
            base = rec.timed(group, "unfused chain (torch)",
                             lambda: unfused_indexer_topk(q, w.to(q.dtype), k, topk), flops=flops)
        for be in backends:
            def fused(be=be):
                with glm5_ops.use_backend(be):
                    return glm5_ops.indexer_topk(q, w, k, topk)
            rec.timed(group, f"{be} indexer_topk", fused, flops=flops, nbytes=nbytes, base_ms=base)
            if B * S * T * 4 <= SCORES_MAX_BYTES:
                def scores(be=be):
                    with glm5_ops.use_backend(be):
                        return glm5_ops.indexer_scores(q, w, k)
                rec.timed(group, f"{be} indexer_scores", scores, flops=flops, nbytes=nbytes + B * S * T * 4)
        del q, w, k
        if rec.cuda:
            torch.cuda.empty_cache()
