"""GLM-5's mixture of experts: the router, the routed experts (HF layout) and the shared expert."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import glm5_ops
from glm5_ops.nvtx import nvtx_range

from .config import GLM5Config
from .layers import MLP


class Router(nn.Module):
    def __init__(self, config: GLM5Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))


class Experts(nn.Module):
    """Routed experts in the HF layout: gate_up_proj [E, 2I, D], down_proj [E, D, I]."""

    def __init__(self, config: GLM5Config):
        super().__init__()
        E, I, D = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))

    def forward(self, h, weights, ids):
        """The fused routed-expert layer (a quantised model swaps this module: models/glm5/quantization.py)."""
        return glm5_ops.fused_moe(h, self.gate_up_proj, self.down_proj, weights, ids)


class MoE(nn.Module):
    def __init__(self, config: GLM5Config, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x, ctx: "ForwardContext"):
        c, i = self.config, self.layer_idx
        h = x.reshape(-1, x.shape[-1])
        with nvtx_range(f"layer{i}/moe/route"):
            weights, ids = glm5_ops.moe_route(
                h.float(), self.gate.weight.float(), self.gate.e_score_correction_bias, top_k=c.num_experts_per_tok,
                n_group=c.n_group, topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor,
                norm_topk_prob=c.norm_topk_prob)      # differentiable in h and gate.weight (the op's backward)
        ctx.record_routing(i, ids)
        weights = weights.to(x.dtype)
        if ctx.fused:
            with nvtx_range(f"layer{i}/moe/experts"):
                routed = self.experts(h, weights, ids)
        else:
            routed = self._unfused(h, weights, ids)
        with nvtx_range(f"layer{i}/moe/shared"):
            out = routed + self.shared_experts(h)
        return out.view_as(x)

    def _unfused(self, h, weights, ids):
        i, E = self.layer_idx, self.config.n_routed_experts
        with nvtx_range(f"layer{i}/moe/dispatch"):
            x_sorted, plan = glm5_ops.moe_dispatch(h, ids, E)
        with nvtx_range(f"layer{i}/moe/experts"):
            offsets = plan.expert_offsets.tolist()
            parts = []
            for e in range(E):
                rows = x_sorted[offsets[e]:offsets[e + 1]]
                if rows.shape[0]:
                    gate, up = F.linear(rows, self.experts.gate_up_proj[e]).chunk(2, dim=-1)
                    rows = F.linear(F.silu(gate) * up, self.experts.down_proj[e])
                parts.append(rows)
            y_sorted = torch.cat(parts)
        with nvtx_range(f"layer{i}/moe/combine"):
            return glm5_ops.moe_combine(y_sorted, plan, weights)
