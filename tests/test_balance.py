"""Load balancing (glm5_ops/balance.py): the auxiliary-loss-free bias update on a
skewed router, MaxVio, the load histogram, run-time top_k, and the two
auxiliary losses' defining properties."""
import pytest
import torch

from conftest import DEVICE, fresh
from glm5_ops import reference
from glm5_ops.balance import ExpertBalancer, bias_update, expert_load, max_violation, seq_aux_loss, switch_aux_loss

E, D = 16, 32


def _skewed_router():
    """gate_w whose logits carry a strong per-expert offset (feature 0 of every token is 1):
    the un-biased router sends ~3.8x the mean load to the most popular expert."""
    gate_w = fresh(E, D, seed=0, scale=D ** -0.5)
    gate_w[:, 0] = torch.linspace(-1.5, 1.5, E, device=DEVICE)
    return gate_w


def _tokens(T, seed):
    h = fresh(T, D, seed=seed)
    h[:, 0] = 1.0
    return h


def test_bias_update_balances_a_skewed_router_without_touching_the_gates():
    gate_w = _skewed_router()
    held_out = _tokens(32768, seed=123)
    bal = ExpertBalancer(E, top_k=2, rate=1e-3, device=DEVICE)  # DeepSeek-V3's rate
    _, ids0 = bal.route(held_out, gate_w)
    assert max_violation(expert_load(ids0, E)) > 2.0  # strongly skewed to start with
    vio = []
    for step in range(400):  # fresh tokens every step, as in training
        _, ids = bal.route(_tokens(4096, seed=step), gate_w)
        load = bal.update(ids)
        assert int(load.sum()) == 4096 * 2
        if step % 50 == 49:
            vio.append(bal.max_violation(expert_load(bal.route(held_out, gate_w)[1], E)))
    assert vio[0] > 1.0 and all(v < 0.1 for v in vio[-3:]), f"{vio}"  # balanced after ~300 updates, and stays so
    assert bal.steps == 400 and int(bal.histogram.sum()) == 400 * 4096 * 2

    # The bias changed which experts are chosen, but the mixing weights are the un-biased sigmoid scores.
    weights, ids = bal.route(held_out, gate_w)
    assert (ids != ids0).any(dim=1).float().mean() > 0.3
    scores = torch.sigmoid(held_out @ gate_w.t())
    want = scores.gather(1, ids.long())
    want = want / (want.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(weights, want, rtol=0, atol=1e-6)
    w_ref, ids_ref = reference.moe_route(held_out, gate_w, bal.bias, top_k=2, n_group=1, topk_group=1,
                                         routed_scaling_factor=1.0, norm_topk_prob=True)
    want_ref = scores.gather(1, ids_ref.long())
    assert torch.equal(w_ref, want_ref / (want_ref.sum(-1, keepdim=True) + 1e-20))  # exactly, in the oracle


def test_bias_update_step_and_metrics():
    load = torch.tensor([10, 2, 6, 6], device=DEVICE)
    bias = torch.zeros(4, device=DEVICE)
    assert bias_update(bias, load, 0.5).tolist() == [-0.5, 0.5, 0.0, 0.0]  # mean 6: exact-mean stays
    assert float(max_violation(load)) == pytest.approx(4 / 6)
    assert float(max_violation(torch.zeros(4, dtype=torch.int64))) == 0.0
    bal = ExpertBalancer(4, top_k=2, rate=0.25)
    bal.update(torch.tensor([[0, 0], [0, 1], [2, 3]], device=DEVICE))
    assert bal.last_load.tolist() == [3, 1, 1, 1] and bal.bias.tolist() == [-0.25, 0.25, 0.25, 0.25]
    assert bal.max_violation() == pytest.approx((3 - 1.5) / 1.5)
    bal.update(torch.tensor([[1, 2]], device=DEVICE))
    assert bal.histogram.tolist() == [3, 2, 2, 1] and bal.steps == 2
    bal.reset()
    assert bal.histogram.tolist() == [0, 0, 0, 0] and bal.steps == 0 and bal.bias.tolist() != [0, 0, 0, 0]


def test_top_k_adjustable_at_run_time():
    gate_w = _skewed_router()
    bal = ExpertBalancer(E, top_k=4, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    h = _tokens(10, seed=1)
    w4, ids4 = bal.route(h, gate_w)
    bal.top_k = 1
    w1, ids1 = bal.route(h, gate_w)
    assert ids4.shape == (10, 4) and ids1.shape == (10, 1)
    assert torch.equal(ids1[:, 0], ids4[:, 0])  # the best expert stays first
    torch.testing.assert_close(w1, torch.full_like(w1, 2.5))  # one expert, normalised, scaled
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 8\]"):
        bal.top_k = 9
    with pytest.raises(ValueError, match=r"rate must be a float >= 0"):
        ExpertBalancer(E, top_k=2, rate=-1.0)
    with pytest.raises(ValueError, match=r"bias must have shape \[E=16\]"):
        ExpertBalancer(E, top_k=2, bias=torch.zeros(3))


def test_switch_aux_loss_properties():
    T, n = 64, 8
    ids = torch.arange(T, device=DEVICE).reshape(T, 1) % n  # perfectly balanced, top-1
    uniform = torch.full((T, n), 1 / n, device=DEVICE)
    assert float(switch_aux_loss(uniform, ids)) == pytest.approx(1.0)
    collapsed = torch.zeros(T, n, device=DEVICE)
    collapsed[:, 0] = 1
    assert float(switch_aux_loss(collapsed, torch.zeros(T, 1, dtype=torch.int64, device=DEVICE))) == pytest.approx(n)
    probs = torch.softmax(fresh(T, n, seed=2), -1).requires_grad_()
    ids2 = torch.randint(0, n, (T, 2), device=DEVICE)
    switch_aux_loss(probs, ids2).backward()
    f = expert_load(ids2, n).float() / (2 * T)
    torch.testing.assert_close(probs.grad, (n * f / T).expand(T, n))  # d/dP_e = E f_e / T


def test_seq_aux_loss_properties():
    L, n, k = 12, 6, 2
    ids = (torch.arange(L * k, device=DEVICE) % n).reshape(L, k)  # each expert chosen L*k/n times
    assert float(seq_aux_loss(torch.full((L, n), 0.3, device=DEVICE), ids)) == pytest.approx(1.0)
    scores = torch.sigmoid(fresh(3, L, n, seed=3))
    ids3 = torch.stack([torch.stack([torch.randperm(n)[:k] for _ in range(L)]) for _ in range(3)]).to(DEVICE)
    per_seq = [float(seq_aux_loss(scores[i], ids3[i])) for i in range(3)]
    assert float(seq_aux_loss(scores, ids3)) == pytest.approx(sum(per_seq) / 3)  # averaged over sequences
    # Invariant to scaling one token's affinities (they are normalised per token).
    scaled = scores.clone()
    scaled[0, 4] *= 7
    assert float(seq_aux_loss(scaled, ids3)) == pytest.approx(float(seq_aux_loss(scores, ids3)))
    # Concentrating affinity on the experts already over-chosen raises the loss.
    skew = torch.full((L, n), 0.1, device=DEVICE)
    skew[:, 0] = 0.9
    ids_skew = torch.zeros(L, k, dtype=torch.int64, device=DEVICE)
    ids_skew[:, 1] = 1
    assert float(seq_aux_loss(skew, ids_skew)) > 2.0
    s = scores.clone().requires_grad_()
    seq_aux_loss(s, ids3).backward()
    assert torch.isfinite(s.grad).all() and s.grad.abs().sum() > 0
