"""fused_moe on every backend vs the reference (the per-expert loop, HF's
GlmMoeDsaExperts), forward and backward; bad input (opcheck: tests/test_opcheck.py).

Errors are measured against the float64 oracle run on the same (rounded)
inputs: fp32 within 1e-5 relative (norm-wise, as DeepGEMM-style checks do),
fp16/bf16 within 2x the error of the reference itself run in that dtype."""
import importlib.util

import pytest
import torch

import glm5_ops
from conftest import DEVICE, INTERPRETED, LOW_PRECISION_FACTOR, big_ok, fresh
from glm5_ops import reference

ops = torch.ops.glm5
HALF = [torch.float16, torch.bfloat16]


@pytest.fixture
def impl(backend):
    if backend == "triton":
        if importlib.util.find_spec("glm5_ops.triton.moe") is None:
            pytest.skip("glm5_ops/triton/moe.py not merged yet")
    return backend


def _ids(T, E, k, kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "sparse":  # experts 3, 9, 21 only (with repeats inside a token): the others get nothing
        ids = torch.tensor([3, 9, 21])[torch.randint(0, 3, (T, k), generator=g)]
    elif kind == "repeats":  # any expert, repeats inside a token allowed
        ids = torch.randint(0, E, (T, k), generator=g)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        if kind == "one_gets_all":  # expert E-1 in every token
            ids[:, 0] = E - 1
            ids[:, 1:] = torch.where(ids[:, 1:] == E - 1, torch.zeros_like(ids[:, 1:]), ids[:, 1:])
    return ids.to(device=DEVICE, dtype=torch.int32)


def _inputs(T, D, I, E, k, kind, dtype, seed):
    x = fresh(T, D, dtype=dtype, seed=seed)
    wgu = fresh(E, 2 * I, D, dtype=dtype, seed=seed + 1, scale=D ** -0.5)
    wd = fresh(E, D, I, dtype=dtype, seed=seed + 2, scale=I ** -0.5)
    w = fresh(T, k, dtype=torch.float64 if dtype == torch.float64 else torch.float32, seed=seed + 3).abs()
    return x, wgu, wd, w, _ids(T, E, k, kind, seed + 4)


def _rel(got, want):
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-300))


def _run(fn, x, wgu, wd, w, ids, dout):
    """(out, dx, dw_gate_up, dw_down, dweights) through autograd."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, wgu, wd, w)]
    out = fn(*leaves, ids)
    out.backward(dout.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


NAMES = ("out", "dx", "dw_gate_up", "dw_down", "dweights")

# (T, D, I, E, k, kind): T=1 decode at E=256; top-k 1..12; experts with no token; one expert in
# every token; odd D and I; rows per expert on both sides of the small-row GEMM threshold (24).
CASES = [(1, 33, 17, 256, 8, "random"), (37, 17, 11, 40, 12, "sparse"), (50, 24, 13, 8, 3, "one_gets_all"),
         (64, 32, 16, 16, 1, "random"), (40, 20, 9, 16, 8, "random"), (129, 65, 31, 256, 12, "random"),
         (90, 16, 8, 6, 5, "repeats"), (300, 12, 7, 4, 2, "one_gets_all")]


@pytest.mark.parametrize("T,D,I,E,k,kind", CASES, ids=[f"T{c[0]}-D{c[1]}-I{c[2]}-E{c[3]}-k{c[4]}-{c[5]}"
                                                        for c in CASES])
def test_fp32_matches_reference(impl, poisoned, T, D, I, E, k, kind):
    if not big_ok(impl) and T * k * D * I > 2e6:
        pytest.skip("too large for the Triton interpreter")
    x, wgu, wd, w, ids = _inputs(T, D, I, E, k, kind, torch.float32, seed=T * 7 + E)
    dout = fresh(T, D, seed=T + 99)
    got = _run(glm5_ops.fused_moe, x, wgu, wd, w, ids, dout)
    truth = _run(reference.fused_moe, x.double(), wgu.double(), wd.double(), w.double(), ids, dout)
    for name, g, t in zip(NAMES, got, truth):
        assert g.dtype == (torch.float32), name
        assert torch.isfinite(g).all(), name
        assert _rel(g, t) <= 1e-5, f"{name}: rel err {_rel(g, t):.2e}"
    # Experts nobody chose get exactly zero weight gradients.
    unused = torch.ones(E, dtype=torch.bool, device=DEVICE)
    unused[ids.long().unique()] = False
    assert (got[2][unused] == 0).all() and (got[3][unused] == 0).all()


@pytest.mark.parametrize("dtype", HALF + [torch.float64])
@pytest.mark.parametrize("T,D,I,E,k,kind", [(1, 33, 17, 256, 8, "random"), (45, 40, 24, 16, 4, "one_gets_all"),
                                            (70, 19, 13, 32, 6, "random")])
def test_other_dtypes(impl, poisoned, dtype, T, D, I, E, k, kind):
    if impl == "triton" and INTERPRETED and dtype != torch.float16:
        pytest.skip("the Triton interpreter runs fp32/fp16 only")
    if impl == "triton" and dtype == torch.float64:
        pytest.skip("Triton has no float64 kernels")
    x, wgu, wd, w, ids = _inputs(T, D, I, E, k, kind, dtype, seed=T + D)
    dout = fresh(T, D, dtype=dtype, seed=T + 5)
    got = _run(glm5_ops.fused_moe, x, wgu, wd, w, ids, dout)
    ref = _run(reference.fused_moe, x, wgu, wd, w, ids, dout)
    truth = _run(reference.fused_moe, x.double(), wgu.double(), wd.double(), w.double(), ids, dout)
    for name, g, r, t in zip(NAMES, got, ref, truth):
        assert g.dtype == r.dtype and torch.isfinite(g).all(), name
        if dtype == torch.float64:
            assert _rel(g, t) <= 1e-12, name
        else:  # within 2x (3x on CUDA) the reference's own rounding error in this precision (+ fp32 noise)
            assert _rel(g, t) <= LOW_PRECISION_FACTOR * _rel(r, t) + 1e-6, \
                f"{name}: {_rel(g, t):.2e} vs ref {_rel(r, t):.2e}"


def test_big_expert_paths(impl):
    """One expert holding half the rows (the multi-threaded backward phase, >1 row block) and
    experts of ~300 rows in the parallel phase (row blocks accumulated into dW), at 2 threads."""
    if not big_ok(impl):
        pytest.skip("too large for the Triton interpreter")
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for T, E, k, kind in [(1100, 4, 2, "one_gets_all"), (600, 16, 8, "random")]:
            x, wgu, wd, w, ids = _inputs(T, 32, 16, E, k, kind, torch.float32, seed=T)
            dout = fresh(T, 32, seed=3)
            got = _run(glm5_ops.fused_moe, x, wgu, wd, w, ids, dout)
            truth = _run(reference.fused_moe, x.double(), wgu.double(), wd.double(), w.double(), ids, dout)
            for name, g, t in zip(NAMES, got, truth):
                assert _rel(g, t) <= 1e-5, f"T={T} {name}: {_rel(g, t):.2e}"
    finally:
        torch.set_num_threads(old)


def test_layouts_and_edge_shapes(impl):
    """Non-contiguous inputs, int64 ids, fp16 mixing weights with fp32 activations, T=0."""
    x, wgu, wd, w, ids = _inputs(9, 16, 6, 5, 3, "random", torch.float32, seed=4)
    out = glm5_ops.fused_moe(x.t().contiguous().t(), wgu.transpose(1, 2).contiguous().transpose(1, 2),
                             wd, w.half(), ids.long())
    want = reference.fused_moe(x.double(), wgu.double(), wd.double(), w.half().double(), ids)
    assert _rel(out, want) <= 1e-5
    empty = glm5_ops.fused_moe(x[:0], wgu, wd, w[:0], ids[:0])
    assert empty.shape == (0, 16)


def test_gradcheck_float64():
    x, wgu, wd, w, ids = _inputs(4, 5, 3, 3, 2, "repeats", torch.float64, seed=1)
    with glm5_ops.use_backend("cpp"):
        assert torch.autograd.gradcheck(lambda *a: glm5_ops.fused_moe(*a, ids),
                                        tuple(t.requires_grad_() for t in (x, wgu, wd, w)))


def test_bad_input(backend):
    x, wgu, wd, w, ids = _inputs(6, 8, 3, 5, 2, "random", torch.float32, seed=3)
    cases = [
        (dict(ids=torch.where(ids == 0, 5, ids)), ValueError, r"ids must hold expert ids of w_gate_up's E=5 experts"
                                                              r" in \[0, 5\)"),
        (dict(ids=ids - 1), ValueError, r"ids must hold expert ids"),
        (dict(ids=ids.float()), TypeError, r"ids must have dtype in \(int32, int64\)"),
        (dict(ids=ids[:4]), ValueError, r"ids must have shape \[T=6,k\]"),
        (dict(weights=fresh(6, 3)), ValueError, r"weights must have shape \[T,k\]=\[6,2\] like ids"),
        (dict(weights=w.int()), TypeError, r"weights must have dtype"),
        (dict(x=x.int()), TypeError, r"x must have dtype"),
        (dict(x=x[0]), ValueError, r"x must have shape \[T,D\]"),
        (dict(w_gate_up=wgu[:, :5]), ValueError, r"w_gate_up must have shape \[E,2I,D=8\] \(an even"),
        (dict(w_gate_up=wgu[..., :4]), ValueError, r"w_gate_up must have shape \[E,2I,D=8\]"),
        (dict(w_down=wd[:4]), ValueError, r"w_down must have shape \[E=5,D=8,I=3\]"),
        (dict(w_down=wd.double()), TypeError, r"w_down must have the dtype of x \(float32\), got float64"),
        (dict(w_gate_up=wgu.half(), w_down=wd.half()), TypeError, r"w_gate_up must have the dtype of x"),
    ]
    for override, exc, match in cases:
        a = dict(x=x, w_gate_up=wgu, w_down=wd, weights=w, ids=ids)
        a.update(override)
        with pytest.raises(exc, match=match):
            glm5_ops.fused_moe(**a)


def test_cpp_ops_guard_direct_calls():
    x, wgu, wd, w, ids = _inputs(6, 8, 3, 5, 2, "random", torch.float32, seed=3)
    with pytest.raises(ValueError, match=r"ids must be expert ids in \[0, E=4\)"):
        ops.fused_moe_fwd(x, wgu[:4], wd[:4], w, torch.full_like(ids, 4))
    with pytest.raises(ValueError, match=r"weights must have shape \[T,k\]"):
        ops.fused_moe_fwd(x, wgu, wd, w[:, :1], ids)
    with pytest.raises(TypeError, match=r"ids must be int32"):
        ops.fused_moe_fwd(x, wgu, wd, w, ids.long())
    with pytest.raises(TypeError, match=r"w_gate_up and w_down must have the dtype of x"):
        ops.fused_moe_fwd(x, wgu.half(), wd, w, ids)
    with pytest.raises(ValueError, match=r"dout must have shape \[T,D\]"):
        ops.fused_moe_bwd(x[:3], x, wgu, wd, w, ids)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU kernel's decode tiles")
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_decode_token_alone_equals_it_in_a_small_batch(threads):
    """A decode token's output is bit-for-bit the same alone and inside a batch
    of 4 tokens (each expert then holds 1-4 rows: the matrix-vector tiles,
    one chain per (row, output)), at 1 and 2 threads: the serving engine's
    lone request and the same request in a busy step see the same numbers."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        E, D, I, k, T = 16, 96, 40, 4, 4
        x, w = fresh(T, D, seed=1), fresh(T, k, seed=2).abs()
        wgu, wd = fresh(E, 2 * I, D, seed=3), fresh(E, D, I, seed=4)
        ids = _ids(T, E, k, "distinct", seed=5)
        batch = ops.fused_moe_fwd(x, wgu, wd, w, ids)
        for t in range(T):
            alone = ops.fused_moe_fwd(x[t:t + 1], wgu, wd, w[t:t + 1], ids[t:t + 1])
            assert torch.equal(alone[0], batch[t]), t
    finally:
        torch.set_num_threads(old)
