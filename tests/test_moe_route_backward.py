"""moe_route's backward on every backend ("cpp" and "triton": the autograd
registered on their ops; "reference": autograd through the oracle): gradients
of the weights in h and gate_w against the router formula the model
used to re-derive before it called this backward (_formula below) in float64,
finite differences, and no gradient for bias."""
import pytest
import torch
import torch.nn.functional as F

import glm5_ops
from conftest import DEVICE, fresh

ROUTERS = [  # (E, n_group, topk_group, top_k, routed_scaling_factor, norm_topk_prob)
    (8, 1, 1, 2, 2.5, True),
    (16, 4, 2, 3, 1.0, False),
    (12, 3, 1, 4, 0.7, True),
]


def _inputs(T, D, E, dtype, separated=False):
    """h [2, T//2, D] (the op flattens leading dims), gate_w [E, D], bias [E].
    separated: distinct powers of two as bias fix the choice (sigmoid is in
    (0, 1)), so small perturbations of h and gate_w never change ids: every
    expert's and every group's top-2 sum differ by >= 1 (steps of 1 let two
    groups' sums tie, and then sigmoid decided the group: a flaky gradcheck)."""
    h = fresh(2, T // 2, D, dtype=dtype).requires_grad_()
    gate_w = fresh(E, D, scale=D ** -0.5).requires_grad_()
    if separated:
        bias = (2.0 ** torch.randperm(E)).to(DEVICE, torch.float32)
    else:
        bias = fresh(E, scale=0.05)
    return h, gate_w, bias.requires_grad_()


def _formula(h, gate_w, ids, scale, norm):
    """The router's weights as a function of h and gate_w at fixed ids."""
    w = torch.sigmoid(F.linear(h.reshape(-1, h.shape[-1]), gate_w)).gather(1, ids.long())
    if norm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grads_match_the_model_formula(backend, router, dtype):
    E, n_group, topk_group, top_k, scale, norm = router
    h, gate_w, bias = _inputs(10, 32, E, dtype)
    weights, ids = glm5_ops.moe_route(h, gate_w, bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                                      routed_scaling_factor=scale, norm_topk_prob=norm)
    grad = fresh(*weights.shape)
    dh, dgate_w = torch.autograd.grad(weights, (h, gate_w), grad)
    assert dh.dtype == h.dtype and dh.shape == h.shape and dgate_w.dtype == gate_w.dtype

    h64, w64 = h.detach().double().requires_grad_(), gate_w.detach().double().requires_grad_()
    want = _formula(h64, w64, ids, scale, norm)
    torch.testing.assert_close(weights.double(), want, rtol=1e-3 if dtype == torch.float16 else 1e-5, atol=1e-6)
    want_dh, want_dgate_w = torch.autograd.grad(want, (h64, w64), grad.double())
    tol = dict(rtol=2e-3, atol=2e-4) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dh.double(), want_dh, **tol)
    torch.testing.assert_close(dgate_w.double(), want_dgate_w, **tol)


@pytest.mark.filterwarnings("ignore:Input #")   # fp32: the op's weights are fp32 on every backend
@pytest.mark.parametrize("router", ROUTERS)
def test_gradcheck(backend, router):
    """Finite differences of the forward kernel itself (fp32 is the widest
    dtype moe_route takes, hence the tolerances)."""
    E, n_group, topk_group, top_k, scale, norm = router
    h, gate_w, bias = _inputs(6, 8, E, torch.float32, separated=True)

    def weights(h, gate_w):
        return glm5_ops.moe_route(h, gate_w, bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                                  routed_scaling_factor=scale, norm_topk_prob=norm)[0]

    assert torch.autograd.gradcheck(weights, (h, gate_w), eps=1e-2, atol=2e-3, rtol=2e-2)


def test_ids_and_bias_get_no_gradient(backend):
    h, gate_w, bias = _inputs(8, 16, 16, torch.float32)
    weights, ids = glm5_ops.moe_route(h, gate_w, bias, top_k=3, n_group=4, topk_group=2)
    assert not ids.requires_grad and weights.requires_grad
    (weights * fresh(*weights.shape)).sum().backward()
    assert bias.grad is None
    assert h.grad is not None and gate_w.grad is not None and bool(h.grad.abs().sum() > 0)
