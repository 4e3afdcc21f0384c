"""moe_route, moe_dispatch and moe_combine on every backend vs the reference
(glm5_ops/reference.py), their gradients and bad input (opcheck: tests/test_opcheck.py)."""
import importlib.util

import pytest
import torch

import glm5_ops
from conftest import DEVICE, INTERPRETED, fresh
from glm5_ops import moe, reference
from glm5_ops import MoEPlan

ops = torch.ops.glm5
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# combine accumulates in fp32 in another order than torch.sum: a few fp32 ulps,
# then at most one rounding step of the output dtype.
COMBINE_TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3),
               torch.float64: (1e-12, 1e-12)}

# (E, n_group, topk_group, top_k): GLM-5 (256 experts, 8 groups, 4 kept, top-8), the seed
# article's 128 experts with 8-12 active, a tiny top-1, and a mid-size grouped case.
ROUTES = [(256, 8, 4, 8), (256, 1, 1, 8), (128, 1, 1, 8), (128, 1, 1, 12), (16, 1, 1, 1), (64, 4, 2, 6),
          (8, 4, 1, 2)]


def _route_inputs(T, D, E, dtype, seed):
    h = fresh(T, D, dtype=dtype, seed=seed)
    gate_w = fresh(E, D, seed=seed + 1, scale=D ** -0.5)
    bias = fresh(E, seed=seed + 2, scale=0.05)
    return h, gate_w, bias


@pytest.fixture
def impl(backend):
    """The backends that implement the MoE ops (Triton's kernels are later work)."""
    if backend == "triton":
        pytest.skip("no Triton MoE kernel yet")
    return backend


@pytest.fixture
def route_impl(backend):
    """moe_route also has a Triton kernel (glm5_ops/triton/moe.py), tested once it is merged."""
    if backend == "triton" and importlib.util.find_spec("glm5_ops.triton.moe") is None:
        pytest.skip("glm5_ops/triton/moe.py not merged yet")
    return backend


def _as_sets(weights, ids):
    """Sorts each row's slots by expert id (HF's topk(sorted=False) order is unspecified)."""
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


@pytest.mark.parametrize("E,n_group,topk_group,top_k", ROUTES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_route_matches_reference(route_impl, poisoned, E, n_group, topk_group, top_k, dtype):
    if route_impl == "triton" and INTERPRETED and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter has no bf16 math")
    for T, D, norm, scale in [(1, 64, True, 2.5), (67, 96, True, 1.0), (200, 33, False, 2.5)]:
        h, gate_w, bias = _route_inputs(T, D, E, dtype, seed=T + E)
        args = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale,
                    norm_topk_prob=norm)
        w, ids = glm5_ops.moe.moe_route(h, gate_w, bias, **args)
        w_ref, ids_ref = reference.moe_route(h, gate_w, bias, **args)
        assert w.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (T, top_k)
        ws, idss = _as_sets(w, ids)
        wr, idr = _as_sets(w_ref, ids_ref)
        assert torch.equal(idss, idr), "chosen experts differ from the reference"
        torch.testing.assert_close(ws, wr, rtol=0, atol=1e-6)
        # Slot order: decreasing biased score, as the reference lists them.
        assert torch.equal(ids, ids_ref)
        groups = ids.long() // (E // n_group)  # chosen experts lie in at most topk_group groups per token
        assert all(len(set(row)) <= topk_group for row in groups.tolist())


def test_route_bias_steers_choice_not_weights(route_impl):
    E, D = 16, 32
    h, gate_w, _ = _route_inputs(5, D, E, torch.float32, seed=3)
    bias = torch.zeros(E, device=DEVICE)
    bias[7] = 10.0  # expert 7 always chosen, with its un-biased sigmoid score as weight
    w, ids = glm5_ops.moe.moe_route(h, gate_w, bias, top_k=2, norm_topk_prob=False)
    assert (ids[:, 0] == 7).all()
    want = torch.sigmoid(h.float() @ gate_w.float().t())[:, 7]
    torch.testing.assert_close(w[:, 0], want, rtol=0, atol=1e-6)


def _dispatch_cases():
    # (T, D, E, k, ids kind): random, experts with no token, one expert in every token, T=1, odd D.
    return [(64, 32, 16, 4, "random"), (37, 17, 40, 8, "sparse"), (50, 24, 8, 3, "one_gets_all"),
            (1, 33, 256, 8, "random"), (100, 7, 1, 1, "random"), (129, 65, 128, 12, "random"),
            (20, 16, 6, 1, "one_gets_all")]


def _ids(T, E, k, kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "sparse":  # only experts 3, 9 and 21 (with repeats) get tokens
        pool = torch.tensor([3, 9, 21])
        ids = pool[torch.randint(0, 3, (T, k), generator=g)]
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if E >= k else \
            torch.randint(0, E, (T, k), generator=g)
        if kind == "one_gets_all":
            ids[:, 0] = E - 1
            ids[:, 1:] = torch.where(ids[:, 1:] == E - 1, torch.zeros_like(ids[:, 1:]), ids[:, 1:])
    return ids.to(device=DEVICE, dtype=torch.int32)


@pytest.mark.parametrize("align", [1, 16, 64])
@pytest.mark.parametrize("T,D,E,k,kind", _dispatch_cases())
def test_dispatch_combine_match_reference(impl, poisoned, T, D, E, k, kind, align):
    ids = _ids(T, E, k, kind, seed=T * 31 + E)
    for dtype in DTYPES + [torch.float64]:
        x = fresh(T, D, dtype=dtype, seed=T + D)
        x_sorted, plan = glm5_ops.moe.moe_dispatch(x, ids, E, align=align)
        x_ref, plan_ref = reference.moe_dispatch(x, ids, E, align=align)
        assert isinstance(plan, MoEPlan)
        for name, got, want in zip(("expert_offsets", "slot_token", "token_slot"), plan, plan_ref):
            assert got.dtype == torch.int32 and torch.equal(got, want), name
        assert x_sorted.dtype == dtype and torch.equal(x_sorted, x_ref)  # padding rows are zero
        assert int(plan.expert_offsets[-1]) == x_sorted.shape[0]
        assert (torch.diff(plan.expert_offsets) % align == 0).all()

        y = fresh(*x_sorted.shape, dtype=dtype, seed=7)
        weights = fresh(T, k, seed=8).abs()
        for p in (plan, plan.token_slot):
            out = glm5_ops.moe.moe_combine(y, p, weights)
            want = reference.moe_combine(y, plan_ref, weights)
            rtol, atol = COMBINE_TOL[dtype]
            assert out.dtype == dtype and out.shape == (T, D)
            torch.testing.assert_close(out, want, rtol=rtol, atol=atol)
        # Round trip: combine(dispatch(x)) with unit weights is k * x.
        back = glm5_ops.moe.moe_combine(x_sorted, plan, torch.ones(T, k, device=DEVICE))
        torch.testing.assert_close(back.double(), k * x.double(), **dict(zip(("rtol", "atol"),
                                                                            COMBINE_TOL[dtype])))


def test_dispatch_int64_ids_and_empty(impl):
    x = fresh(6, 8)
    ids = _ids(6, 5, 2, "random", seed=1)
    a, pa = glm5_ops.moe.moe_dispatch(x, ids.long(), 5)
    b, pb = glm5_ops.moe.moe_dispatch(x, ids, 5)
    assert torch.equal(a, b) and all(torch.equal(u, v) for u, v in zip(pa, pb))
    e, pe = glm5_ops.moe.moe_dispatch(fresh(0, 8), torch.zeros(0, 2, dtype=torch.int32, device=DEVICE), 5, align=4)
    assert e.shape == (0, 8) and torch.equal(pe.expert_offsets, torch.zeros(6, dtype=torch.int32, device=DEVICE))


def test_dispatch_stable_order(impl):
    """Within an expert: by token, then by slot (a token may pick one expert twice)."""
    ids = torch.tensor([[2, 0], [0, 0], [1, 2]], dtype=torch.int32, device=DEVICE)
    x = torch.arange(3, dtype=torch.float32, device=DEVICE)[:, None]
    xs, plan = glm5_ops.moe.moe_dispatch(x, ids, 3, align=2)
    assert plan.expert_offsets.tolist() == [0, 4, 6, 8]
    assert plan.slot_token.tolist() == [0, 1, 1, -1, 2, -1, 0, 2]
    assert plan.token_slot.tolist() == [[6, 0], [1, 2], [4, 7]]
    assert xs[:, 0].tolist() == [0, 1, 1, 0, 2, 0, 0, 2]


def _grad_inputs(dtype, T=5, D=3, E=4, k=2, align=2):
    ids = _ids(T, E, k, "random", seed=11)
    x = fresh(T, D, dtype=dtype, seed=12).requires_grad_()
    w = fresh(T, k, dtype=dtype, seed=13).requires_grad_()
    return x, ids, w, E, align


def test_gradcheck_float64(impl):
    x, ids, w, E, align = _grad_inputs(torch.float64)

    def layer(x, w):  # dispatch -> a per-row nonlinearity standing in for the experts -> combine
        xs, plan = glm5_ops.moe.moe_dispatch(x, ids, E, align=align)
        return glm5_ops.moe.moe_combine(torch.tanh(xs) * 1.5, plan, w)

    assert torch.autograd.gradcheck(layer, (x, w))
    assert torch.autograd.gradgradcheck(layer, (x, w))  # the backward is differentiable too
    xs, plan = reference.moe_dispatch(x.detach(), ids, E, align=align)
    y = fresh(*xs.shape, dtype=torch.float64, seed=14).requires_grad_()
    assert torch.autograd.gradcheck(lambda y, w: glm5_ops.moe.moe_combine(y, plan, w), (y, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_reference_autograd(impl, dtype):
    T, D, E, k = 33, 19, 16, 4
    ids = _ids(T, E, k, "random", seed=21)
    grads = []
    for fn in (glm5_ops.moe, reference):
        x = fresh(T, D, dtype=dtype, seed=22).requires_grad_()
        w = fresh(T, k, seed=23).requires_grad_()
        xs, plan = fn.moe_dispatch(x, ids, E, align=16)
        y = (xs.float() * fresh(*xs.shape, seed=24)).to(dtype)
        y.retain_grad()
        out = fn.moe_combine(y, plan, w)
        out.backward(fresh(T, D, dtype=dtype, seed=25))
        grads.append((x.grad, w.grad, y.grad))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, **tol)


# ------------------------------------------------------------------ bad input --

def test_route_bad_input(backend):
    h, gate_w, bias = _route_inputs(4, 16, 32, torch.float32, seed=5)
    cases = [
        (dict(h=h[0]), ValueError, r"h must have shape \[T,D\]"),
        (dict(gate_w=gate_w[:, :8]), ValueError, r"gate_w must have shape \[E,D=16\]"),
        (dict(bias=bias[:5]), ValueError, r"bias must have shape \[E=32\]"),
        (dict(h=h.int()), TypeError, r"h must have dtype"),
        (dict(n_group=5), ValueError, r"n_group must divide the E=32 experts .*got 5"),
        (dict(n_group=4, topk_group=5), ValueError, r"topk_group must be in \[1, 4\]"),
        (dict(n_group=4, topk_group=1, top_k=9), ValueError, r"top_k must be in \[1, 8\]"),
        (dict(top_k=0), ValueError, r"top_k must be in \[1, 32\]"),
    ]
    for override, exc, match in cases:
        a = dict(h=h, gate_w=gate_w, bias=bias, top_k=4, n_group=1, topk_group=1)
        a.update(override)
        with pytest.raises(exc, match=match):
            glm5_ops.moe.moe_route(a.pop("h"), a.pop("gate_w"), a.pop("bias"), **a)


def test_dispatch_combine_bad_input(backend):
    x, ids = fresh(6, 8), _ids(6, 5, 2, "random", seed=1)
    with pytest.raises(ValueError, match=r"ids must hold expert ids in \[0, 5\), got values in \[\d, 5\]"):
        glm5_ops.moe.moe_dispatch(x, torch.where(ids == 0, 5, ids), 5)
    with pytest.raises(ValueError, match=r"ids must hold expert ids in \[0, 5\)"):
        glm5_ops.moe.moe_dispatch(x, ids - 1, 5)
    with pytest.raises(TypeError, match=r"ids must have dtype in \(int32, int64\)"):
        glm5_ops.moe.moe_dispatch(x, ids.float(), 5)
    with pytest.raises(TypeError, match=r"x must have dtype"):
        glm5_ops.moe.moe_dispatch(x.int(), ids, 5)
    with pytest.raises(ValueError, match=r"ids must have shape \[T=6,k\]"):
        glm5_ops.moe.moe_dispatch(x, ids[:4], 5)
    with pytest.raises(ValueError, match=r"align must be in \[1, "):
        glm5_ops.moe.moe_dispatch(x, ids, 5, align=0)
    with pytest.raises(ValueError, match=r"num_experts must be in \[1, "):
        glm5_ops.moe.moe_dispatch(x, ids, 0)
    xs, plan = reference.moe_dispatch(x, ids, 5, align=4)
    with pytest.raises(ValueError, match=r"weights must have shape \[T,k\]=\[6,2\]"):
        glm5_ops.moe.moe_combine(xs, plan, fresh(6, 3))
    with pytest.raises(TypeError, match=r"weights must have dtype"):
        glm5_ops.moe.moe_combine(xs, plan, torch.ones(6, 2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"token_slot must hold rows of y_sorted in \[0, 3\)"):
        glm5_ops.moe.moe_combine(xs[:3], plan, fresh(6, 2))
    with pytest.raises(TypeError, match=r"plan must be a MoEPlan or the token_slot"):
        glm5_ops.moe.moe_combine(xs, [1, 2], fresh(6, 2))
    with pytest.raises(ValueError, match=r"y_sorted must have shape \[N,D\]"):
        glm5_ops.moe.moe_combine(xs[0], plan, fresh(6, 2))


def test_cpp_ops_guard_direct_calls():
    x, ids = fresh(6, 8), _ids(6, 5, 2, "random", seed=1)
    with pytest.raises(ValueError, match=r"ids must be expert ids in \[0, num_experts=4\)"):
        ops.moe_dispatch(x, ids, 4, 1)
    with pytest.raises(ValueError, match=r"align must be in \[1, 4096\], got"):
        ops.moe_dispatch(x, ids, 5, 0)
    with pytest.raises(ValueError, match=r"token_slot entries must be rows of y_sorted"):
        ops.moe_combine(fresh(3, 8), ids, fresh(6, 2))
    with pytest.raises(ValueError, match=r"weights must have shape \[T,k\]"):
        ops.moe_combine(fresh(12, 8), ids, fresh(6, 3))
    with pytest.raises(ValueError, match=r"top_k must be in \[1, topk_group \* E / n_group = 8\]"):
        ops.moe_route(fresh(4, 16), fresh(32, 16), fresh(32), 9, 4, 1, 1.0, True)
    with pytest.raises(TypeError, match=r"h must be fp32, fp16 or bf16"):
        ops.moe_route(fresh(4, 16).double(), fresh(32, 16), fresh(32), 2, 1, 1, 1.0, True)


def test_triton_backend_is_not_implemented():
    with glm5_ops.use_backend("triton"):
        with pytest.raises(NotImplementedError, match=r"glm5_ops.moe_combine has no 'triton' backend"):
            glm5_ops.moe.moe_combine(fresh(4, 8), torch.zeros(2, 2, dtype=torch.int32, device=DEVICE), fresh(2, 2))


def test_route_nan_input_gives_valid_ids(route_impl):
    """NaN activations never produce garbage ids (a NaN score never beats a number on "cpp")."""
    h, gate_w, bias = _route_inputs(4, 16, 32, torch.float32, seed=9)
    h[1] = float("nan")
    w, ids = glm5_ops.moe.moe_route(h, gate_w, bias, top_k=4, n_group=4, topk_group=2)
    assert ((ids >= 0) & (ids < 32)).all()
    assert all(len(set(row)) == 4 for row in ids.tolist())


def test_layouts_and_mixed_dtypes(impl):
    """Leading dims of h are flattened; non-contiguous inputs; bf16 h with an fp32 router; fp16 weights."""
    E, D = 32, 24
    h3, gate_w, bias = fresh(2, 5, D, dtype=torch.bfloat16, seed=4), fresh(E, D, seed=5), fresh(E, seed=6)
    args = dict(top_k=3, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    w, ids = glm5_ops.moe.moe_route(h3, gate_w, bias, **args)
    w_ref, ids_ref = reference.moe_route(h3.reshape(10, D), gate_w, bias, norm_topk_prob=True, **args)
    assert ids.shape == (10, 3) and torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=0, atol=1e-6)
    x = fresh(D, 10, seed=7).t()  # non-contiguous [T,D]
    xs, plan = glm5_ops.moe.moe_dispatch(x, ids, E, align=8)
    assert torch.equal(xs, reference.moe_dispatch(x.contiguous(), ids, E, align=8)[0])
    y = fresh(D, xs.shape[0], seed=8).t()
    out = glm5_ops.moe.moe_combine(y, plan, w.half())
    torch.testing.assert_close(out, reference.moe_combine(y.contiguous(), plan, w.half()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("E,n_group,topk_group,top_k", ROUTES)
def test_route_matches_hf_router_transcription(route_impl, E, n_group, topk_group, top_k):
    """Against the line-by-line transcription of transformers' GlmMoeDsaTopkRouter.forward
    (tests/test_reference_oracles.py; HF's own class is checked there when transformers is
    installed): same experts (as sets: HF uses topk(sorted=False)), weights within 1e-6."""
    from test_reference_oracles import _route_transcribed
    h, gate_w, bias = _route_inputs(45, 40, E, torch.float32, seed=E + top_k)
    w, ids = glm5_ops.moe.moe_route(h, gate_w, bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                                    routed_scaling_factor=2.5, norm_topk_prob=True)
    w_hf, ids_hf = _route_transcribed(h, gate_w, bias, top_k, n_group, topk_group, 2.5, True)
    ws, idss = _as_sets(w, ids)
    wh, idh = _as_sets(w_hf, ids_hf)
    assert torch.equal(idss, idh)
    torch.testing.assert_close(ws, wh, rtol=0, atol=1e-6)
