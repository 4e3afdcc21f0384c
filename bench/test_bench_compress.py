"""Activation compression: quantize_groupwise and dequantize (ours: the
default backend's kernel) against the pure-PyTorch reference doing the same
work, one group per op, bit width and shape. Bytes = read + written, so the
GB/s column compares with the copy bandwidth ceiling."""
import pytest
import torch

from glm5_ops import reference
from glm5_ops.compress import dequantize, quantize_groupwise
from conftest import DEVICE

SHAPE = (4096, 4096)   # 64 MiB of fp32 activations
GROUP = 128


def _run(benchmark, fn, rounds):
    benchmark.pedantic(fn, rounds=rounds, warmup_rounds=1, iterations=1)


def _bytes(numel, bits, elem=4):
    return numel * elem + numel * bits // 8 + 8 * numel // GROUP   # fp32 side + codes + scale/zero


@pytest.mark.parametrize("impl", ["ours", "baseline"])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantize(benchmark, bits, impl):
    benchmark.group = f"quantize_groupwise {bits}-bit {SHAPE[0]}x{SHAPE[1]} fp32 g{GROUP}"
    x = torch.randn(*SHAPE, device=DEVICE)
    benchmark.extra_info.update(role=impl, impl="glm5 quantize_groupwise" if impl == "ours" else "reference (torch ops)",
                                bytes=_bytes(x.numel(), bits), ceiling="bandwidth")
    fn = (lambda: quantize_groupwise(x, bits, GROUP)) if impl == "ours" else (
        lambda: reference.quantize_groupwise(x, bits, GROUP))
    _run(benchmark, fn, rounds=10 if impl == "ours" else 3)


@pytest.mark.parametrize("impl", ["ours", "baseline"])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_dequantize(benchmark, bits, impl):
    benchmark.group = f"dequantize {bits}-bit {SHAPE[0]}x{SHAPE[1]} -> fp32 g{GROUP}"
    packed, scale, zero = quantize_groupwise(torch.randn(*SHAPE, device=DEVICE), bits, GROUP)
    benchmark.extra_info.update(role=impl, impl="glm5 dequantize" if impl == "ours" else "reference (torch ops)",
                                bytes=_bytes(SHAPE[0] * SHAPE[1], bits), ceiling="bandwidth")
    fn = (lambda: dequantize(packed, scale, zero, bits, GROUP, SHAPE)) if impl == "ours" else (
        lambda: reference.dequantize(packed, scale, zero, bits, GROUP, SHAPE))
    _run(benchmark, fn, rounds=10 if impl == "ours" else 3)
