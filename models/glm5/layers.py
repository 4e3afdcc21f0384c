"""The network's small pieces: the linear layer, RMSNorm, GLM-5's RoPE tables, the SwiGLU MLP
(RoPE itself: glm5_ops.rope)."""
from __future__ import annotations

import torch
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
        # transformers' order (normalise in fp32, round to x's dtype, then the
        # weight), one kernel at inference: glm5_ops.rms_norm.
        return glm5_ops.rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [B, S, dim/2] for absolute positions [B, S]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=positions.device) / dim))
    freqs = positions[..., None].float() * inv_freq
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
