"""The network's small pieces: the linear layer, RMSNorm, GLM-5's RoPE, the SwiGLU MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import glm5_ops

from .workspace import silu_mul


class Linear(nn.Linear):
    """nn.Linear (same parameters, names and state dict) whose forward is
    glm5_ops.linear: a decode step's few rows run the matrix-vector kernel,
    everything else (autograd, DTensor weights, CUDA, prefill) F.linear."""

    def forward(self, x):
        return glm5_ops.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # transformers' order: normalise in fp32, round to x's dtype, then the
        # weight. F.rms_norm does the normalising in one call (a decode step
        # runs 33 norms: 6 dispatches each before, 2 now).
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [B, S, dim/2] for absolute positions [B, S]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=positions.device) / dim))
    freqs = positions[..., None].float() * inv_freq
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x, cos, sin):
    """GLM-5's interleaved RoPE: pairs (x0,x1), (x2,x3)... each rotated by one
    frequency; like transformers, the result is laid out de-interleaved
    (all first members, then all second members). x [B,S,(H,)dim]."""
    if x.dim() == 4:
        cos, sin = cos[:, :, None], sin[:, :, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
