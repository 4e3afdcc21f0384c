"""The decode linear kernel (glm5_ops.gemv) against its oracle, the choice
glm5_ops.linear makes, and the model's linear layers taking it."""
import pytest
import torch
import torch.nn.functional as F

import glm5_ops
from glm5_ops import plan
from glm5_ops import reference as ref
from conftest import DEVICE, fresh

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="gemv has a CPU kernel only")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=["cpp", "reference"])
def impl(request):
    with glm5_ops.use_backend(request.param):
        yield request.param


def _tol(dtype, K):
    if dtype == torch.float32:   # fp32 accumulation order against float64
        return dict(rtol=1e-5, atol=1e-5 * K ** 0.5)
    return dict(rtol=1e-2, atol=1e-2)   # one rounding of the bf16 output


# K: below, at and past the 16/32-wide steps and their masked tails; N: past the 8-row tiles;
# (1, 700, 19): one fp32 row against 2.7 KiB weight rows, read a row at a time (kOneRowMaxRowBytes).
@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (1, 33, 9), (2, 64, 17), (3, 31, 8), (4, 100, 23), (5, 257, 40),
                                   (1, 700, 19),
                                   (16, 48, 7), (17, 16, 12), (2, 0, 5), (0, 8, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_oracle(impl, poisoned, M, K, N, dtype, with_bias):
    x, w = fresh(M, K, dtype=dtype), fresh(N, K, dtype=dtype, scale=max(K, 1) ** -0.5)
    b = fresh(N, dtype=dtype) if with_bias else None
    y = glm5_ops.gemv(x, w, b)
    assert y.shape == (M, N) and y.dtype == dtype
    torch.testing.assert_close(y.float(), ref.gemv(x, w, b).float(), **_tol(dtype, K))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_leading_dims_and_strided_inputs(poisoned, dtype):
    x = fresh(2, 3, 50, dtype=dtype)[:, :, ::2]            # non-contiguous [2,3,25]
    w = fresh(25, 11, dtype=dtype).t()                       # [11,25] transposed view
    y = glm5_ops.gemv(x, w)
    assert y.shape == (2, 3, 11)
    torch.testing.assert_close(y.float(), ref.gemv(x.reshape(-1, 25), w).reshape(2, 3, 11).float(),
                               **_tol(dtype, 25))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_result_does_not_depend_on_the_other_rows(dtype):
    """Bit for bit: row r of an M-row call equals the same row alone (a lone
    request and the same request in a busy serving batch see the same numbers)."""
    K, N = 1000, 37
    x, w, b = fresh(13, K, dtype=dtype), fresh(N, K, dtype=dtype), fresh(N, dtype=dtype)
    full = glm5_ops.gemv(x, w, b)
    for r in (0, 5, 12):
        assert torch.equal(full[r], glm5_ops.gemv(x[r:r + 1], w, b)[0])
        assert torch.equal(full[r], glm5_ops.gemv(x[r:r + 3][:1], w, b)[0])


# H, M, K, N: one head, odd rows and tails, more rows than the tile; MLA's decode shapes.
@pytest.mark.parametrize("H,M,K,N", [(1, 1, 33, 9), (3, 2, 64, 17), (5, 3, 31, 8), (16, 1, 64, 256),
                                     (16, 5, 256, 64), (2, 1, 0, 5), (2, 0, 8, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_heads_matches_oracle(impl, poisoned, H, M, K, N, dtype):
    x, w = fresh(H, M, K, dtype=dtype), fresh(H, N, K, dtype=dtype, scale=max(K, 1) ** -0.5)
    y = glm5_ops.gemv_heads(x, w)
    assert y.shape == (H, M, N) and y.dtype == dtype
    torch.testing.assert_close(y.float(), ref.gemv(x, w).float(), **_tol(dtype, K))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_heads_reads_a_strided_view_in_place(poisoned, dtype):
    """MLA's W_UV: the last v of each head's nope+v rows of kv_b_proj's weight,
    heads (nope+v)*C apart; and a head's result equals the same head alone."""
    H, n, v, C = 6, 5, 7, 40
    kv_b = fresh(H, n + v, C, dtype=dtype)
    w_uv = kv_b[:, n:]
    x = fresh(H, 3, C, dtype=dtype)
    y = glm5_ops.gemv_heads(x, w_uv)
    torch.testing.assert_close(y.float(), ref.gemv(x, w_uv).float(), **_tol(dtype, C))
    for h in (0, 4):
        assert torch.equal(y[h], glm5_ops.gemv(x[h], w_uv[h].contiguous()))
    w_t = fresh(H, C, 9, dtype=dtype).transpose(1, 2)        # [H, 9, C], rows not contiguous: copied
    torch.testing.assert_close(glm5_ops.gemv_heads(x, w_t).float(), ref.gemv(x, w_t).float(), **_tol(dtype, C))


def test_linear_heads_takes_gemv_only_where_it_may():
    x, w = fresh(4, 1, 32), torch.nn.Parameter(fresh(4, 8, 32))
    with torch.no_grad():
        assert glm5_ops.linear_takes_gemv(x, w)
        assert not glm5_ops.linear_takes_gemv(fresh(4, plan.GEMV_MAX_ROWS[torch.float32] + 1, 32), w)
        torch.testing.assert_close(glm5_ops.linear_heads(x, w), x @ w.transpose(1, 2), rtol=1e-5, atol=1e-5)
    glm5_ops.linear_heads(x, w).sum().backward()                 # recording: torch.matmul, differentiable
    torch.testing.assert_close(w.grad, x.sum(1, keepdim=True).expand(4, 8, 32))


def test_gemv_heads_bad_input():
    x, w = fresh(2, 1, 8), fresh(2, 3, 8)
    with pytest.raises(ValueError, match=r"^w must have shape \[H=2, N, K=8\] with H=2, got shape \(3, 3, 8\)"):
        glm5_ops.gemv_heads(x, fresh(3, 3, 8))
    with pytest.raises(ValueError, match=r"^w must have shape \[H=2, N, K=8\] with K=8, got shape \(2, 3, 7\)"):
        glm5_ops.gemv_heads(x, fresh(2, 3, 7))
    with pytest.raises(ValueError, match=r"^x must have shape \[H, M, K\] \(rank 3\)"):
        glm5_ops.gemv_heads(fresh(1, 8), w)
    with pytest.raises(TypeError, match=r"^w must have the dtype of x \(float32\), got bfloat16"):
        glm5_ops.gemv_heads(x, w.bfloat16())
    with pytest.raises(ValueError, match=r"bias must be None when x and w have heads"):   # C++ guards a direct call
        torch.ops.glm5.gemv(x, w, fresh(3))
    with pytest.raises(ValueError, match=r"w must have shape \[H=2,N,K=8\] like x"):
        torch.ops.glm5.gemv(x, fresh(3, 8), None)


def test_linear_takes_gemv_only_where_it_may():
    K, N = 64, 24
    w = torch.nn.Parameter(fresh(N, K))
    x = fresh(1, 3, K)
    with torch.no_grad():
        assert glm5_ops.linear_takes_gemv(x, w)                  # decode rows, plain CPU tensors, no grad
        assert not glm5_ops.linear_takes_gemv(fresh(plan.GEMV_MAX_ROWS[torch.float32] + 1, K), w)   # prefill
        assert not glm5_ops.linear_takes_gemv(x.half(), w.half())                                      # fp16
        assert not glm5_ops.linear_takes_gemv(x.bfloat16(), w)                                         # mixed
        with glm5_ops.use_backend("reference"):
            assert not glm5_ops.linear_takes_gemv(x, w)
    assert not glm5_ops.linear_takes_gemv(x, w)                  # autograd records: F.linear
    y = glm5_ops.linear(x, w)
    y.sum().backward()
    torch.testing.assert_close(w.grad, x.reshape(-1, K).sum(0).expand(N, K))
    with torch.no_grad():
        torch.testing.assert_close(glm5_ops.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_gemv_bad_input():
    x, w = fresh(2, 8), fresh(3, 8)
    with pytest.raises(ValueError, match=r"^w must have shape \[N, K=8\] with K=8, got shape \(3, 7\)"):
        glm5_ops.gemv(x, fresh(3, 7))
    with pytest.raises(TypeError, match=r"^w must have the dtype of x \(float32\), got bfloat16"):
        glm5_ops.gemv(x, w.bfloat16())
    with pytest.raises(TypeError, match=r"^x must have dtype in \(float32, bfloat16\), got float16"):
        glm5_ops.gemv(x.half(), w.half())
    with pytest.raises(ValueError, match=r"^bias must have shape \[N=3\] with N=3, got shape \(4,\)"):
        glm5_ops.gemv(x, w, fresh(4))
    with pytest.raises(TypeError, match=r"^bias must have dtype in \(float32\), got bfloat16"):
        glm5_ops.gemv(x, w, fresh(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"^x must have shape \[\.\.\., K\]"):
        glm5_ops.gemv(torch.tensor(1.0), w)
    with pytest.raises(ValueError, match=r"w must have shape \[N,K=8\]"):      # a direct call: C++ guards it
        torch.ops.glm5.gemv(x, fresh(3, 7), None)


def test_model_linear_layers_take_gemv_at_decode(monkeypatch):
    """The seam: every linear layer of the model (the LM head too) calls
    glm5_ops.linear; at decode without autograd that is the gemv kernel, with
    parameter names unchanged (HF checkpoints, FSDP/TP and LoRA see nn.Linear)."""
    from models.glm5 import GLM5ForCausalLM, preset
    from models.glm5.layers import Linear
    torch.manual_seed(0)
    model = GLM5ForCausalLM(preset("tiny")).eval()
    assert all(isinstance(m, torch.nn.Linear) for m in model.modules() if isinstance(m, Linear))
    assert "lm_head.weight" in model.state_dict() and "model.layers.0.self_attn.q_a_proj.weight" in model.state_dict()
    calls = []
    real = glm5_ops.linear_module._gemv_kernel
    monkeypatch.setattr(glm5_ops.linear_module, "_gemv_kernel", lambda *a: calls.append(a[1].shape) or real(*a))
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    with torch.no_grad():
        cache = model.new_cache(1, 16)
        model(ids[:, :5], cache)
        calls.clear()
        step = model(ids[:, 5:], cache)
        assert (model.config.vocab_size, model.config.hidden_size) in calls      # the LM head
        assert len(calls) >= 5 * model.config.num_hidden_layers
        with glm5_ops.use_backend("reference"):   # the same step through F.linear everywhere
            cache.truncate(5)
            calls.clear()
            again = model(ids[:, 5:], cache)
    assert not calls
    torch.testing.assert_close(step, again, rtol=1e-4, atol=1e-4)
