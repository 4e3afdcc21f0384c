"""Timings of activation compression: quantize_groupwise and dequantize of a
bf16 activation (one 16K-token batch at GLM-5's hidden size 6144, 201 MB)
against the measured device-to-device copy bandwidth (read + write). Their
correctness: tests/test_compress.py and tests/test_device_quantize.py."""
import torch

import glm5_ops

SHAPE = {"full": (16384, 6144), "quick": (16384, 6144), "cpu": (256, 6144)}
BITS = {"full": [8, 4, 2], "quick": [8, 4], "cpu": [8, 4]}
GROUP = 128
COPY_BYTES = {"cuda": 2 ** 30, "cpu": 64 * 2 ** 20}


def run(rec, backends, quick):
    size = "cpu" if rec.device == "cpu" else ("quick" if quick else "full")
    src = torch.empty(COPY_BYTES[rec.device] // 4, dtype=torch.float32, device=rec.device)
    dst = torch.empty_like(src)
    copy_ms = rec.timed(f"memory bandwidth ({src.numel() * 4 // 2 ** 20} MiB copy)", "torch copy_",
                        lambda: dst.copy_(src), nbytes=2 * src.numel() * 4)
    bw = 2 * src.numel() * 4 / copy_ms / 1e6 if copy_ms else None   # GB/s
    del src, dst
    R, C = SHAPE[size]
    x = torch.randn(R, C, device=rec.device).bfloat16()
    n = x.numel()
    for bits in BITS[size]:
        nbytes = n * 2 + n * bits // 8 + n // GROUP * 8      # x, the codes, scale + zero per group
        group = f"quantize bf16 [{R},{C}] bits={bits} group={GROUP}"
        for be in backends:
            with glm5_ops.use_backend(be):
                packed, scale, zero = glm5_ops.quantize_groupwise(x, bits, GROUP)

            def quantize(be=be, bits=bits):
                with glm5_ops.use_backend(be):
                    return glm5_ops.quantize_groupwise(x, bits, GROUP)

            def dequantize(be=be, bits=bits, packed=packed, scale=scale, zero=zero):
                with glm5_ops.use_backend(be):
                    return glm5_ops.dequantize(packed, scale, zero, bits, GROUP, x.shape, dtype=torch.bfloat16)

            for name, fn in ((f"{be} quantize_groupwise", quantize), (f"{be} dequantize", dequantize)):
                ms = rec.timed(group, name, fn, nbytes=nbytes)
                if ms and bw:
                    rec.annotate(f"{nbytes / ms / 1e6 / bw:.0%} of the measured copy bandwidth {bw:.0f} GB/s")
