"""Timings of fused_moe forward at GLM-5 scale (256 routed experts, top-8,
D=6144, I=2048, one 16K-token batch, bf16) against the measured bf16 matmul
peak (target >= 50%), torch's grouped GEMM on pre-sorted rows and the
HF-style per-expert loop; the dispatch + combine share of it (target <= 10%).
The kernels are called directly ("cpp": torch.ops.glm5, the CUDA kernels on a
GPU; "triton": glm5_ops/triton/moe.py): the public API only adds argument
checks. Correctness at GLM-5's width: tests/test_device_moe.py."""
import os

import torch
import torch.nn.functional as F

from glm5_ops._backend import triton_module

# T, E, k, D, I
SHAPE = {"full": (16384, 256, 8, 6144, 2048), "quick": (16384, 256, 8, 6144, 2048), "cpu": (256, 16, 4, 256, 128)}
PEAK_N = {"cuda": 8192, "cpu": 1024}   # the square bf16 GEMM measured as the ceiling
PEAK_TARGET, SHARE_TARGET = 0.5, 0.10


def run(rec, backends, quick):
    size = "cpu" if rec.device == "cpu" else ("quick" if quick else "full")
    n = PEAK_N[rec.device]
    a, b = (torch.randn(n, n, device=rec.device, dtype=torch.bfloat16) for _ in range(2))
    peak_ms = rec.timed(f"bf16 matmul peak ({n}^3)", "torch.mm", lambda: a @ b, flops=2.0 * n ** 3)
    peak = 2.0 * n ** 3 / peak_ms / 1e9 if peak_ms else None   # TFLOP/s
    del a, b
    inputs = _inputs(rec.device, *SHAPE[size])
    for be in backends:
        fused_moe_timings(rec, be, inputs, peak)
    baselines(rec, inputs)


def _inputs(device, T, E, k, D, I):
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(T, D, device=device, generator=g, dtype=torch.bfloat16)
    wgu = torch.randn(E, 2 * I, D, device=device, generator=g, dtype=torch.bfloat16) * D ** -0.5
    wd = torch.randn(E, D, I, device=device, generator=g, dtype=torch.bfloat16) * I ** -0.5
    ids = torch.rand(T, E, device=device, generator=g).topk(k, dim=-1).indices.int()   # distinct, as routed
    weights = torch.rand(T, k, device=device, generator=g)
    return dict(x=x, wgu=wgu, wd=wd, ids=ids, weights=weights, T=T, E=E, k=k, D=D, I=I)


def _group(p):
    return f"fused_moe fwd bf16 T={p['T']} E={p['E']} k={p['k']} D={p['D']} I={p['I']}"


def _flops(p):
    return 2.0 * p["T"] * p["k"] * 3 * p["D"] * p["I"]


class _GemmMode:
    """GLM5_MOE_GEMM for the CUDA kernel's GEMM path ('loop' or 'grouped'), restored after."""

    def __init__(self, mode):
        self.mode = mode

    def __enter__(self):
        self.old = os.environ.get("GLM5_MOE_GEMM")
        os.environ["GLM5_MOE_GEMM"] = self.mode

    def __exit__(self, *exc):
        os.environ.pop("GLM5_MOE_GEMM")
        if self.old is not None:
            os.environ["GLM5_MOE_GEMM"] = self.old


def fused_moe_timings(rec, be, p, peak):
    x, wgu, wd, ids, wts = p["x"], p["wgu"], p["wd"], p["ids"], p["weights"]
    group, flops = _group(p), _flops(p)
    if be == "cpp":
        ops = torch.ops.glm5
        fwd = ops.fused_moe_fwd
    else:
        tm = triton_module("moe", x.device)
        fwd = tm.fused_moe_fwd
    fused_ms = rec.timed(group, f"{be} fused_moe_fwd", lambda: fwd(x, wgu, wd, wts, ids), flops=flops)
    if fused_ms and peak:
        frac = flops / fused_ms / 1e9 / peak
        rec.annotate(f"{frac:.0%} of the bf16 peak {peak:.0f} TFLOP/s")
        rec.target(f"fused_moe fwd {be} vs bf16 matmul peak", frac, PEAK_TARGET,
                   f"{frac:.0%} of {peak:.0f} TFLOP/s (target {PEAK_TARGET:.0%})")
    if be == "cpp":
        if rec.cuda:
            def loop():
                with _GemmMode("loop"):
                    return fwd(x, wgu, wd, wts, ids)
            rec.timed(group, "cpp fused_moe_fwd [GEMM loop]", loop, flops=flops)
        xs, _, _, token_slot = ops.moe_dispatch(x, ids, p["E"], 1)
        y = torch.empty_like(xs).normal_()
        dc_ms = rec.timed(group, "cpp dispatch + combine",
                          lambda: (ops.moe_dispatch(x, ids, p["E"], 1), ops.moe_combine(y, token_slot, wts)))
    else:
        cfg = tm._config(torch.bfloat16, False, p["T"] * p["k"] / p["E"])
        y = torch.randn(p["T"] * p["k"], p["D"], device=x.device, dtype=torch.bfloat16)
        dc_ms = rec.timed(group, "triton align + combine", lambda: (
            tm._Plan(ids, p["E"], cfg["BLOCK_M"]), tm._combine(y, wts, p["T"], p["k"], p["D"], torch.bfloat16)))
    if fused_ms and dc_ms:
        share = dc_ms / fused_ms
        rec.target(f"fused_moe fwd {be}: dispatch + combine share", share, SHARE_TARGET,
                   f"{share:.1%} ({dc_ms:.2f} of {fused_ms:.2f} ms; target <= {SHARE_TARGET:.0%})",
                   higher_is_better=False)


def baselines(rec, p):
    """torch's grouped GEMM on rows already sorted by expert (the GEMM ceiling without
    fusion), and the HF-style per-expert loop (GlmMoeDsaExperts) in bf16."""
    x, wgu, wd, ids, wts = p["x"], p["wgu"], p["wd"], p["ids"], p["weights"]
    T, E, k, D, I = (p[n] for n in "TEkDI")
    group, flops = _group(p), _flops(p)
    flat = ids.flatten().long()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=E)
    if rec.cuda and hasattr(torch, "_grouped_mm"):
        xs = x[order // k]
        ends = counts.cumsum(0).int()

        def grouped():
            gu = torch._grouped_mm(xs, wgu.transpose(1, 2), offs=ends)
            return torch._grouped_mm(F.silu(gu[:, :I]) * gu[:, I:], wd.transpose(1, 2), offs=ends)
        rec.timed(group, "torch._grouped_mm x2 + silu (GEMMs only, sorted rows)", grouped, flops=flops)
    counts = counts.tolist()

    def per_expert_loop():
        out = torch.zeros(T, D, device=x.device, dtype=torch.bfloat16)
        s = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            slots = order[s:s + n]
            s += n
            tok = slots // k
            gate, up = (x[tok] @ wgu[e].T).chunk(2, dim=-1)
            out.index_add_(0, tok, ((F.silu(gate) * up) @ wd[e].T * wts.flatten()[slots, None]).to(out.dtype))
        return out
    rec.timed(group, "torch per-expert loop (HF GlmMoeDsaExperts style, bf16)", per_expert_loop, flops=flops)
