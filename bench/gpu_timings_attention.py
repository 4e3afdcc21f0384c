"""Timings of sparse attention in bf16:
- DSA sparse_attention in GLM-5's absorbed MLA form (one key head, Dk=576,
  Dv=512, v = k[..., :512], topk=2048 of T=65536) with Hq=64 query heads
  (target 300 TFLOP/s) and Hq=8 (GLM-5 at TP8); forward + backward at S=128;
- block_sparse_attention against dense causal SDPA (flash), per computed
  block (target >= 60% of SDPA's throughput), and block_topk_mask.
Their correctness at GLM-5's sizes: tests/test_device_attention.py."""
import torch
import torch.nn.functional as F

import glm5_ops

# (B, S, T, Dk, Dv, topk, query heads)
SPARSE = {"full": (1, 4096, 65536, 576, 512, 2048, [64, 8]), "quick": (1, 4096, 65536, 576, 512, 2048, [64]),
          "cpu": (1, 64, 2048, 576, 512, 256, [8])}
SPARSE_BWD_S = {"cuda": 128, "cpu": 8}   # the backward (fp32 atomics) at a shorter S
SPARSE_TARGET_TFLOPS = 300
# (B, S=T, H, D, block_size, topk_blocks), causal
BLOCK = {"full": [(1, 8192, 16, 128, 128, 16), (1, 16384, 32, 128, 128, 32)], "quick": [(1, 8192, 16, 128, 128, 16)],
         "cpu": [(1, 1024, 4, 64, 64, 4)]}
BLOCK_TARGET = 0.6


def run(rec, backends, quick):
    size = "cpu" if rec.device == "cpu" else ("quick" if quick else "full")
    g = torch.Generator(device=rec.device).manual_seed(0)
    sparse_timings(rec, backends, SPARSE[size], g)
    block_timings(rec, backends, BLOCK[size], g)


def _distinct_random_keys(B, S, T, topk, g, device):
    idx = torch.empty(B, S, topk, dtype=torch.int32, device=device)
    for s0 in range(0, S, 512):   # in chunks: [512, T] uniforms at a time
        n = min(512, S - s0)
        idx[0, s0:s0 + n] = torch.rand(n, T, device=device, generator=g).topk(topk, -1).indices
    return idx


def sparse_timings(rec, backends, shape, g):
    B, S, T, Dk, Dv, topk, heads = shape
    kv = torch.randn(B, T, 1, Dk, device=rec.device, generator=g).bfloat16()
    idx = _distinct_random_keys(B, S, T, topk, g, rec.device)
    for Hq in heads:
        q = (torch.randn(B, S, Hq, Dk, device=rec.device, generator=g) * Dk ** -0.5).bfloat16()
        flops = 2.0 * B * S * topk * Hq * (Dk + Dv)
        nbytes = q.numel() * 2 + B * S * topk * Dk * 2 + B * S * Hq * Dv * 2
        group = f"attention sparse fwd bf16 S={S} T={T} Hq={Hq} Hkv=1 Dk={Dk} Dv={Dv} topk={topk} (v=k[..., :Dv])"
        for be in backends:
            def fwd(be=be, q=q):
                with glm5_ops.use_backend(be):
                    return glm5_ops.sparse_attention(q, kv, kv[..., :Dv], idx)
            ms = rec.timed(group, be, fwd, flops=flops, nbytes=nbytes)
            if ms and Hq == 64:
                rec.target(f"sparse_attention fwd {be} Hq=64", flops / ms / 1e9, SPARSE_TARGET_TFLOPS,
                           f"{flops / ms / 1e9:.0f} of {SPARSE_TARGET_TFLOPS} TFLOP/s")
        Sb = SPARSE_BWD_S[rec.device]
        qb = q[:, :Sb].clone().requires_grad_(True)
        kb = kv.clone().requires_grad_(True)
        for be in backends:
            def fwd_bwd(be=be):
                with glm5_ops.use_backend(be):
                    out, _ = glm5_ops.sparse_attention(qb, kb, kb[..., :Dv], idx[:, :Sb])
                return torch.autograd.grad(out, (qb, kb), torch.ones_like(out))
            rec.timed(f"attention sparse fwd+bwd bf16 S={Sb} T={T} Hq={Hq} Dk={Dk} Dv={Dv} topk={topk}", be,
                      fwd_bwd, flops=3.5 * flops * Sb / S)
        del q, qb, kb
    del kv, idx
    if rec.cuda:
        torch.cuda.empty_cache()


def block_timings(rec, backends, shapes, g):
    for B, S, H, D, bs, tb in shapes:
        q, k, v = (torch.randn(B, S, H, D, device=rec.device, generator=g).bfloat16() for _ in range(3))
        dense_flops = 4.0 * B * H * S * S * D / 2
        group = f"attention block-sparse bf16 S=T={S} H={H} D={D} bs={bs} topk_blocks={tb} causal"
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        base = rec.timed(group, "dense SDPA causal (flash)",
                         lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True), flops=dense_flops)
        for be in backends:
            def predict(be=be):
                with glm5_ops.use_backend(be):
                    return glm5_ops.block_topk_mask(q, k, block_size=bs, topk_blocks=tb)
            try:
                mask = predict()
            except Exception as e:  # noqa: BLE001 - reported; the other backends still run
                rec.log(f"TIME {group} | {be}: block_topk_mask failed ({type(e).__name__}: {str(e)[:200]})")
                continue
            blocks = int(mask.kv_num_blocks.sum())
            flops = 4.0 * blocks * bs * bs * D   # every computed block counted in full

            def attend(be=be, mask=mask):
                with glm5_ops.use_backend(be):
                    return glm5_ops.block_sparse_attention(q, k, v, mask)
            rec.timed(group, f"{be} block_topk_mask", predict)
            ms = rec.timed(group, f"{be} block_sparse_attention ({blocks} blocks, {mask.density(S, S):.0%} dense)",
                           attend, flops=flops, base_ms=base)
            if ms and base:
                eff = (flops / ms) / (dense_flops / base)
                rec.target(f"block_sparse_attention {be} S={S} per computed block vs SDPA", eff, BLOCK_TARGET,
                           f"{eff:.0%} of dense SDPA's throughput (target {BLOCK_TARGET:.0%})")
        del q, k, v, qt, kt, vt
        if rec.cuda:
            torch.cuda.empty_cache()
