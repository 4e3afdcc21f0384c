"""Expert load balancing for GLM-5's router: the auxiliary-loss-free bias
update (DeepSeek-V3 section 2.1.2), the metrics (MaxVio, per-expert load
histograms) and top_k adjustable at run time (the seed article's lever on
latency variance: fewer experts per token when a step must be fast).

    bal = ExpertBalancer(num_experts=256, top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5)
    weights, ids = bal.route(h, gate_w)       # moe_route with bal.bias steering the choice
    bal.update(ids)                           # after the step: bias += rate * sign(mean load - load)
    bal.max_violation(), bal.histogram        # (max load - mean) / mean; loads summed since reset()

The bias only changes which experts are chosen, never the mixing weights
(moe_route takes the weights from the un-biased sigmoid scores), so balancing
does not bias the layer's output or its gradients; there is no loss term.

The formulas (expert_load, max_violation, bias_update, switch_aux_loss,
seq_aux_loss) are plain PyTorch functions at the bottom of this module.
"""
from __future__ import annotations

import torch

from . import _checks as check
from .moe import moe_route

__all__ = ["ExpertBalancer", "bias_update", "expert_load", "max_violation", "seq_aux_loss", "switch_aux_loss"]


class ExpertBalancer:
    """The balancing state of one MoE layer: the routing bias (fp32 [E],
    GLM-5's e_score_correction_bias), the load histogram, the router settings.

    rate: the bias step per update (DeepSeek-V3: 1e-3). Each update moves
    every expert's bias by +-rate (0 for an expert at exactly the mean load)."""

    def __init__(self, num_experts: int, *, top_k: int, rate: float = 1e-3, n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, norm_topk_prob: bool = True, bias=None, device=None):
        self.num_experts = check.int_in_range(num_experts, "num_experts", 1, 2**31 - 1)
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 0:
            raise ValueError(f"rate must be a float >= 0, got {rate!r}")
        self.rate = float(rate)
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor, self.norm_topk_prob = routed_scaling_factor, norm_topk_prob
        self.top_k = top_k  # checked by the setter
        if bias is None:
            bias = torch.zeros(num_experts, dtype=torch.float32, device=device)
        check.tensor(bias, "bias", f"[E={num_experts}]", rank=1)
        check.dim(bias, "bias", f"[E={num_experts}]", 0, num_experts, "E")
        self.bias = bias.detach().float().clone()
        self.histogram = torch.zeros(num_experts, dtype=torch.int64, device=self.bias.device)
        self.last_load = torch.zeros_like(self.histogram)
        self.steps = 0

    @property
    def top_k(self) -> int:
        return self._top_k

    @top_k.setter
    def top_k(self, value: int) -> None:
        """Experts per token, changeable between steps (e.g. lowered when a step must be fast)."""
        hi = self.topk_group * (self.num_experts // max(self.n_group, 1))
        self._top_k = check.int_in_range(value, "top_k", 1, max(hi, 1))

    def route(self, h, gate_w):
        """glm5_ops.moe_route with this balancer's bias and settings -> (weights fp32 [T,k], ids int32 [T,k])."""
        return moe_route(h, gate_w, self.bias.to(gate_w.device), top_k=self.top_k, n_group=self.n_group,
                         topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor,
                         norm_topk_prob=self.norm_topk_prob)

    @torch.no_grad()
    def update(self, ids) -> torch.Tensor:
        """Records one step's routing (ids [..., k]) and moves the bias. Returns the step's load int64 [E]."""
        check.tensor(ids, "ids", "[...,k]", dtypes=check.INDEX_DTYPES)
        load = expert_load(ids.to(self.bias.device), self.num_experts)
        self.bias = bias_update(self.bias, load, self.rate)
        self.histogram += load
        self.last_load = load
        self.steps += 1
        return load

    def max_violation(self, load=None) -> float:
        """MaxVio of `load` (default: the last step's), (max - mean) / mean."""
        return float(max_violation(self.last_load if load is None else load))

    def reset(self) -> None:
        """Clears the histogram and the step count (the bias stays)."""
        self.histogram.zero_()
        self.steps = 0


# Load balancing. Sources: DeepSeek-V3 technical report (arXiv 2412.19437)
# section 2.1.2 (auxiliary-loss-free bias update, eqs. 16; sequence-wise
# balance loss, eqs. 17-20, alpha = 1e-4 in its runs) and section 4.5.2
# (MaxVio); Switch Transformer (Fedus et al., arXiv 2101.03961) eqs. 4-6.

def expert_load(ids, num_experts):
    """int64 [E]: how many (token, slot) pairs chose each expert (ids [...], in [0,E))."""
    return torch.bincount(ids.reshape(-1).long(), minlength=num_experts)


def max_violation(load):
    """MaxVio = (max_e load_e - mean load) / mean load, a 0-dim fp32 tensor
    (0 for perfect balance; 0 when nothing was routed)."""
    lf = load.float()
    mean = lf.mean()
    return torch.where(mean > 0, (lf.max() - mean) / torch.where(mean > 0, mean, 1.0),
                       torch.zeros_like(mean))


def bias_update(bias, load, rate=1e-3):
    """DeepSeek-V3's auxiliary-loss-free update, out of place:
        bias_e + rate * sign(mean(load) - load_e)
    (overloaded experts go down by rate, underloaded up, exact-mean ones stay).
    The bias only steers moe_route's choice, never the mixing weights."""
    lf = load.to(torch.float32)
    return (bias.float() + rate * torch.sign(lf.mean() - lf)).to(bias.dtype)


def switch_aux_loss(probs, ids):
    """Switch Transformer load-balancing loss, generalised to top-k:
        f_e = count_e / (T * k)   (fraction of the T*k assignments sent to e)
        P_e = mean_t probs[t, e]  (mean router probability of e)
        loss = E * sum_e f_e * P_e
    probs [T,E] are the router probabilities as the caller defines them
    (Switch: softmax of the logits); ids [T,k]. 1 at perfect balance with
    uniform probabilities; HF Mixtral's load_balancing_loss_func is k times
    this. Multiply by the loss coefficient (Switch: 1e-2) outside.
    Differentiable with respect to probs (fp32 scalar)."""
    T, E = probs.shape
    k = ids.shape[1]
    f = expert_load(ids, E).float() / max(T * k, 1)
    return E * (f * probs.float().mean(0)).sum()


def seq_aux_loss(scores, ids):
    """DeepSeek-V3's sequence-wise balance loss (eqs. 17-20), averaged over sequences.

    scores [..., L, E]: the router's un-biased affinities s_{t,e} (sigmoid
    scores) for the L tokens of each sequence (a 2-D [L,E] is one sequence);
    ids [..., L, k]: the experts each token was routed to. Per sequence:
        s'_{t,e} = s_{t,e} / sum_e' s_{t,e'}
        f_e = E / (k * L) * #{t : e in ids[t]}
        P_e = (1/L) sum_t s'_{t,e}
        L_bal = sum_e f_e * P_e
    Returns the mean of L_bal over sequences (fp32 scalar, differentiable with
    respect to scores); multiply by alpha (DeepSeek-V3: 1e-4) outside. 1 at
    perfect balance with uniform affinities."""
    E, k, L = scores.shape[-1], ids.shape[-1], scores.shape[-2]
    s = scores.float().reshape(-1, L, E)
    i = ids.long().reshape(-1, L, k)
    s_norm = s / s.sum(-1, keepdim=True)
    hits = torch.zeros_like(s).scatter_(-1, i, 1.0)                # [n, L, E] one-hot of chosen
    f = hits.sum(1) * (E / (k * L))                                # [n, E]
    P = s_norm.mean(1)                                             # [n, E]
    return (f * P).sum(-1).mean()
