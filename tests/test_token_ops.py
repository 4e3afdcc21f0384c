"""glm5_ops.rms_norm and glm5_ops.rope (csrc/cpu/token_ops.cpp) against the
composites they replace (glm5_ops/reference.py), the choice between kernel and
composite, and bad input (opcheck: tests/test_opcheck.py)."""
import pytest
import torch

import glm5_ops
from glm5_ops import reference as ref
from glm5_ops import token_ops
from conftest import DEVICE, fresh

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="rms_norm and rope have CPU kernels only")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OPS = torch.ops.glm5


def _rms_tol(dtype):
    # fp32: the sum of squares in another order than torch's (a few ulp of the
    # normaliser); 16-bit: that can move the rounding of an output by one ulp.
    return dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1, 1024), (3, 5, 17), (2, 33), (65, 100), (4, 0, 8), (7,)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_kernel_matches_the_composite(poisoned, shape, dtype):
    x, w = fresh(*shape, dtype=dtype), fresh(shape[-1], dtype=dtype)
    y = OPS.rms_norm(x, w, 1e-5)
    expect = ref.rms_norm(x.double(), w.double(), 1e-5)
    assert y.shape == x.shape and y.dtype == dtype
    torch.testing.assert_close(y.double(), expect, **_rms_tol(dtype))
    torch.testing.assert_close(y, ref.rms_norm(x, w, 1e-5), **_rms_tol(dtype))


def test_rms_norm_tiny_and_huge_rows():
    """eps guards an all-zero row; a row of 1e30s squares past fp32 (inf ->
    zero output), as the composite does."""
    w = fresh(16)
    zeros = torch.zeros(1, 16)
    assert torch.equal(OPS.rms_norm(zeros, w, 1e-6), ref.rms_norm(zeros, w, 1e-6))
    x = torch.full((1, 16), 1e-20)
    torch.testing.assert_close(OPS.rms_norm(x, w, 0.0), ref.rms_norm(x, w, 0.0))


@pytest.mark.parametrize("heads", [None, 1, 3, 16])
@pytest.mark.parametrize("rotary,width", [(64, 64), (16, 40), (0, 8), (2, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kernel_equals_the_composite_bit_for_bit(poisoned, heads, rotary, width, dtype):
    B, S = 2, 5
    lead = (B, S) if heads is None else (B, S, heads)
    x = fresh(*lead, 2 * width, dtype=dtype)[..., ::2]        # strided last dim
    cos, sin = fresh(B, S, rotary // 2, dtype=dtype), fresh(B, S, rotary // 2, dtype=dtype)
    y = OPS.rope(x, cos, sin, rotary)
    assert y.shape == x.shape and torch.equal(y, ref.rope(x, cos, sin, rotary))
    if dtype == torch.float32:    # against float64: three fp32 roundings of O(1) terms (cancellation: atol)
        torch.testing.assert_close(y.double(), ref.rope(x.double(), cos.double(), sin.double(), rotary),
                                   rtol=1e-6, atol=1e-6)


def test_rope_is_the_rotation_it_claims():
    """Pair (x0, x1) rotated by angle a: (x0 cos a - x1 sin a, x1 cos a + x0 sin a), de-interleaved."""
    a = torch.tensor([0.3, 1.1])
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0, 9.0]]])
    y = OPS.rope(x, a.cos().view(1, 1, 2), a.sin().view(1, 1, 2), 4)[0, 0]
    c, s = a.cos(), a.sin()
    expect = torch.stack([1 * c[0] - 2 * s[0], 3 * c[1] - 4 * s[1], 2 * c[0] + 1 * s[0], 4 * c[1] + 3 * s[1],
                          torch.tensor(9.0)])
    torch.testing.assert_close(y, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_other_rows(dtype):
    """A token alone gets the bits it gets in a batch (the serving engine's contract)."""
    x, w = fresh(300, 257, dtype=dtype), fresh(257, dtype=dtype)
    full = OPS.rms_norm(x, w, 1e-6)
    for r in (0, 131, 299):
        assert torch.equal(full[r], OPS.rms_norm(x[r:r + 1], w, 1e-6)[0])
    q, cos, sin = fresh(1, 300, 4, 32, dtype=dtype), fresh(1, 300, 16, dtype=dtype), fresh(1, 300, 16, dtype=dtype)
    full = OPS.rope(q, cos, sin, 32)
    assert torch.equal(full[:, 131:132], OPS.rope(q[:, 131:132], cos[:, 131:132], sin[:, 131:132], 32))


def test_the_kernel_runs_at_inference_and_the_composite_under_autograd():
    x, w = fresh(2, 3, 8), fresh(8).requires_grad_()
    assert not token_ops.takes_kernel(x, w)
    y = glm5_ops.rms_norm(x, w, 1e-6)
    y.sum().backward()     # differentiable: the composite ran
    assert w.grad is not None and torch.equal(y, ref.rms_norm(x, w, 1e-6))
    with torch.no_grad():
        assert token_ops.takes_kernel(x, w)
    with glm5_ops.use_backend("reference"):
        assert not token_ops.takes_kernel(x, w.detach())
    q = fresh(2, 3, 4, 8).requires_grad_()
    cos, sin = fresh(2, 3, 4), fresh(2, 3, 4)
    glm5_ops.rope(q, cos, sin).sum().backward()
    torch.testing.assert_close(q.grad.sum(), (cos - sin + sin + cos).sum() * 4)


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_bad_input_names_the_argument(backend):
    x, w = fresh(2, 8), fresh(8)
    with glm5_ops.use_backend(backend):
        for call, match in [
            (lambda: glm5_ops.rms_norm(x, fresh(7), 1e-6), "weight must have shape"),
            (lambda: glm5_ops.rms_norm(x, w, -1.0), "eps must be"),
            (lambda: glm5_ops.rms_norm(x, w, float("nan")), "eps must be"),
            (lambda: glm5_ops.rms_norm(x.long(), w.long(), 1e-6), "x must"),
            (lambda: glm5_ops.rope(fresh(2, 3, 8), fresh(2, 3, 3), fresh(2, 3, 4)), "cos must have shape"),
            (lambda: glm5_ops.rope(fresh(2, 3, 8), fresh(2, 3, 4), fresh(2, 4, 4)), "sin must have shape"),
            (lambda: glm5_ops.rope(fresh(2, 3, 8), fresh(2, 3, 2), fresh(2, 3, 2), 3), "rotary_dim must be even"),
            (lambda: glm5_ops.rope(fresh(2, 3, 8), fresh(2, 3, 6), fresh(2, 3, 6), 12), "rotary_dim must be even"),
            (lambda: glm5_ops.rope(fresh(8), fresh(4), fresh(4)), "x must have shape"),
        ]:
            with pytest.raises((ValueError, TypeError), match=match):
                call()


def test_the_model_runs_them_at_decode():
    """A decode step of the tiny model calls both kernels (and no composite norm)."""
    from models.glm5 import GLM5ForCausalLM, preset
    torch.manual_seed(0)
    model = GLM5ForCausalLM(preset("tiny")).eval()
    cache = model.new_cache(1, 16)
    with torch.no_grad():
        model.prefill(torch.randint(0, 100, (1, 3)), cache)
        calls = {"rms_norm": 0, "rope": 0}
        real = token_ops.cpp_ops

        class Counting:
            def __getattr__(self, name):
                calls[name] = calls.get(name, 0) + 1
                return getattr(real(), name)
        token_ops.cpp_ops = Counting
        try:
            model(torch.tensor([[5]]), cache)
        finally:
            token_ops.cpp_ops = real
    assert calls["rms_norm"] >= 2 * model.config.num_hidden_layers and calls["rope"] >= 2 * model.config.num_hidden_layers


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_degenerate_shapes_give_empty_results(backend):
    """docs/OPS.md, "Degenerate shapes": empty in, empty out of x's shape; rotary_dim 0 copies x."""
    with glm5_ops.use_backend(backend):
        assert glm5_ops.rms_norm(fresh(3, 0), fresh(0), 1e-6).shape == (3, 0)
        assert glm5_ops.rms_norm(fresh(0, 5), fresh(5), 1e-6).shape == (0, 5)
        assert glm5_ops.rope(fresh(0, 3, 8), fresh(0, 3, 4), fresh(0, 3, 4)).shape == (0, 3, 8)
        x = fresh(2, 3, 2, 6)
        assert torch.equal(glm5_ops.rope(x, fresh(2, 3, 0), fresh(2, 3, 0), 0), x)
