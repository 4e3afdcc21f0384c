"""Timings of the INT8 ops (issue 20 item 5) against bf16, the GPU baseline the
issue names: decode-size int8_linear (M = 1, 16) and fused_moe_int8 (T = 1, 16)
as GB/s of the int8 weight bytes they must read against the measured copy
bandwidth, and prefill-size w8a8_linear / fused_moe_int8(w8a8=True) as TFLOP/s
against bf16 F.linear / fused_moe on the same shapes. Weights are drawn as
int8 codes directly (quantising 10 GB of experts would cost more than the
timings). Correctness: tests/test_int8.py (every backend, on the device)."""
import torch
import torch.nn.functional as F

import glm5_ops

# GLM-5's hidden size and expert shapes (D=6144, I=2048, 256 experts, top-8); CPU: the dry run.
LINEAR = {"cuda": [(6144, 6144), (24576, 6144), (6144, 2048)], "cpu": [(256, 192)]}
MOE = {"cuda": (256, 8, 6144, 2048), "cpu": (8, 2, 128, 64)}
ROWS = {"cuda": {"decode": (1, 16), "prefill": 4096}, "cpu": {"decode": (1, 16), "prefill": 64}}
COPY_BYTES = {"cuda": 2 ** 30, "cpu": 64 * 2 ** 20}


def _int8(*shape, device, g):
    return torch.randint(-127, 128, shape, device=device, dtype=torch.int8, generator=g)


def _scales(*shape, device, g, fan_in):
    return torch.rand(*shape, device=device, generator=g) * (2.0 / 127) * fan_in ** -0.5 + 1e-4


def run(rec, backends, quick):
    dev = rec.device
    g = torch.Generator(device=dev).manual_seed(3)
    src = torch.empty(COPY_BYTES[dev] // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    copy_ms = rec.timed(f"memory bandwidth ({src.numel() * 4 // 2 ** 20} MiB copy)", "torch copy_",
                        lambda: dst.copy_(src), nbytes=2 * src.numel() * 4)
    bw = 2 * src.numel() * 4 / copy_ms / 1e6 if copy_ms else None   # GB/s, read + write
    del src, dst
    for N, K in LINEAR[dev][:1] if quick else LINEAR[dev]:
        linear_timings(rec, backends, g, N, K, bw)
    moe_timings(rec, backends, g, *MOE[dev], bw)


def _note_bw(rec, nbytes, ms, bw):
    if ms and bw:
        rec.annotate(f"{nbytes / ms / 1e6 / bw:.0%} of the measured copy bandwidth {bw:.0f} GB/s")


def linear_timings(rec, backends, g, N, K, bw):
    dev = rec.device
    w, s = _int8(N, K, device=dev, g=g), _scales(N, device=dev, g=g, fan_in=K)
    w_bf16 = (w.float() * s[:, None]).bfloat16()
    for M in ROWS[dev]["decode"]:
        x = torch.randn(M, K, device=dev, generator=g).bfloat16()
        group = f"int8_linear decode bf16 M={M} N={N} K={K}"
        base = rec.timed(group, "torch F.linear bf16 (baseline)", lambda x=x: F.linear(x, w_bf16),
                         nbytes=2 * N * K)
        _note_bw(rec, 2 * N * K, base, bw)
        for be in backends:
            def call(be=be, x=x):
                with glm5_ops.use_backend(be):
                    return glm5_ops.int8_linear(x, w, s)
            ms = rec.timed(group, f"{be} int8_linear", call, nbytes=N * K + 4 * N, base_ms=base)
            _note_bw(rec, N * K + 4 * N, ms, bw)
    M = ROWS[dev]["prefill"]
    x = torch.randn(M, K, device=dev, generator=g).bfloat16()
    group, flops = f"w8a8_linear prefill bf16 M={M} N={N} K={K}", 2.0 * M * N * K
    base = rec.timed(group, "torch F.linear bf16 (baseline)", lambda: F.linear(x, w_bf16), flops=flops)
    for be in backends:
        for op in ("w8a8_linear", "int8_linear"):
            def call(be=be, op=op):
                with glm5_ops.use_backend(be):
                    return getattr(glm5_ops, op)(x, w, s)
            rec.timed(group, f"{be} {op}", call, flops=flops, base_ms=base)


def _dequantized(q, scale):
    """q * scale in bf16, one expert at a time (an fp32 copy of all of them would not fit)."""
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    for e in range(q.shape[0]):
        out[e] = (q[e].float() * scale[e, :, None]).bfloat16()
    return out


def moe_timings(rec, backends, g, E, k, D, I, bw):
    dev = rec.device
    wgu, sgu = _int8(E, 2 * I, D, device=dev, g=g), _scales(E, 2 * I, device=dev, g=g, fan_in=D)
    wd, sd = _int8(E, D, I, device=dev, g=g), _scales(E, D, device=dev, g=g, fan_in=I)
    wgu_bf16, wd_bf16 = _dequantized(wgu, sgu), _dequantized(wd, sd)   # 19 GB at GLM-5's size
    for T in ROWS[dev]["decode"] + (ROWS[dev]["prefill"],):
        x = torch.randn(T, D, device=dev, generator=g).bfloat16()
        ids = torch.rand(T, E, device=dev, generator=g).topk(k, dim=-1).indices.int()
        weights = torch.rand(T, k, device=dev, generator=g)
        chosen = int(torch.unique(ids).numel())
        nbytes = chosen * 3 * I * D + chosen * (2 * I + D) * 4      # the chosen experts' codes + scales
        decode = T <= 16
        group = f"fused_moe_int8 {'decode' if decode else 'prefill'} bf16 T={T} E={E} k={k} D={D} I={I}"
        flops = 2.0 * T * k * 3 * D * I

        def dense(x=x, ids=ids, weights=weights):
            return glm5_ops.fused_moe(x, wgu_bf16, wd_bf16, weights, ids)
        base = rec.timed(group, "cpp fused_moe bf16 (baseline)", dense, flops=flops, nbytes=2 * nbytes)
        for be in backends:
            for w8a8 in ((False,) if decode else (False, True)):
                def call(be=be, x=x, ids=ids, weights=weights, w8a8=w8a8):
                    with glm5_ops.use_backend(be):
                        return glm5_ops.fused_moe_int8(x, wgu, sgu, wd, sd, weights, ids, w8a8=w8a8)
                ms = rec.timed(group, f"{be} fused_moe_int8{' w8a8' if w8a8 else ''}", call, flops=flops,
                               nbytes=nbytes, base_ms=base)
                if decode:
                    _note_bw(rec, nbytes, ms, bw)
