"""quantize_groupwise / dequantize on every backend at the widths the other
tests skip: GLM-5's hidden size as one group (6144: one group per program),
odd groups, a constant group and an outlier; and stochastic rounding at every
width and dtype: scale and zero those of deterministic rounding, each code
within one step of the exact value, and the codes of the C++/CUDA kernel for
the same seed (one counter-based hash), including seeds whose key is 0 and 1."""
import pytest
import torch

import glm5_ops
from conftest import big_ok, float_dtypes, fresh
from glm5_ops import reference
from test_compress import codes

# (bits, group_size): every width, power-of-two, odd and one-group-per-row sizes.
CASES = [(8, 128), (4, 128), (2, 128), (4, 32), (8, 256), (2, 96), (4, 6144), (8, 64)]
SEEDS = [33350994, 3343701148, 42]   # seed keys 0 and 1 (tests/test_triton_quantize.py), an ordinary one


def _input(bits, gs, dtype, backend):
    rows = max(4, 8192 // gs) if big_ok(backend) else 4
    x = fresh(rows, 2 * gs, dtype=dtype, scale=3.0)
    x[0, :gs] = 1.5      # a constant group: scale 0, codes 0
    x[1, 3] = 1e4        # one outlier: a wide group
    return x


@pytest.mark.parametrize("bits,gs", CASES, ids=[f"bits{b}-group{g}" for b, g in CASES])
def test_deterministic_matches_reference(backend, poisoned, bits, gs):
    for dtype in float_dtypes(backend):
        x = _input(bits, gs, dtype, backend)
        packed, scale, zero = glm5_ops.quantize_groupwise(x, bits, gs)
        rp, rs, rz = reference.quantize_groupwise(x, bits, gs)
        assert packed.dtype == torch.uint8 and packed.shape == rp.shape and scale.shape == rs.shape
        assert torch.equal(scale, rs) and torch.equal(zero, rz), f"{dtype}: scale/zero differ from the reference"
        diff = (codes(packed, bits) - codes(rp, bits)).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() <= 1e-3, f"{dtype}: codes differ beyond .5 ties"
        # dequantize of the same codes: zero + q * scale in fp32 within 2 ulp of the group's
        # largest term (an FMA may fuse it), then one rounding to the output dtype.
        y = glm5_ops.dequantize(packed, scale, zero, bits, gs, x.shape, dtype=dtype)
        ry = reference.dequantize(packed, scale, zero, bits, gs, x.shape, dtype)
        assert y.dtype == dtype and y.shape == x.shape and torch.isfinite(y).all()
        mag = (zero.abs() + scale * ((1 << bits) - 1)).repeat_interleave(gs).reshape(x.shape)
        out_eps = {torch.float32: 0.0, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
        bound = 2 ** -22 * mag + out_eps * ry.float().abs() + 1e-30
        assert ((y.float() - ry.float()).abs() <= bound).all(), f"{dtype}: dequantize off the reference"


@pytest.mark.parametrize("bits,gs", CASES, ids=[f"bits{b}-group{g}" for b, g in CASES])
def test_stochastic_within_one_code_and_same_hash(backend, bits, gs):
    for dtype in float_dtypes(backend):
        x = _input(bits, gs, dtype, backend)
        _, rs, rz = reference.quantize_groupwise(x, bits, gs)
        exact = ((x.float().reshape(-1, gs) - rz[:, None]) / torch.where(rs > 0, rs, 1)[:, None]).reshape(-1)
        for seed in SEEDS:
            packed, scale, zero = glm5_ops.quantize_groupwise(x, bits, gs, stochastic=True, seed=seed)
            assert torch.equal(scale, rs) and torch.equal(zero, rz), f"{dtype} seed {seed}: scale/zero"
            off = float((codes(packed, bits).float() - exact).abs().max())
            assert off < 1 + 1e-3, f"{dtype} seed {seed}: a code {off:.3f} steps from its value"
            if backend == "triton":   # the reference draws its own uniforms (compared statistically)
                with glm5_ops.use_backend("cpp"):
                    cpp = glm5_ops.quantize_groupwise(x, bits, gs, stochastic=True, seed=seed)[0]
                assert torch.equal(packed, cpp), f"{dtype} seed {seed}: codes differ from the cpp kernel's"
