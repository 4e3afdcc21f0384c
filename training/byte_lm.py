"""A small byte-level transformer LM: the stand-in for the GLM-5 model until
models/glm5 lands (pre-norm blocks: RMSNorm, causal attention via torch SDPA,
SwiGLU MLP; learned positions). Flat and short, nanoGPT style. The memory
policy (training/memory_policy.py) is applied from outside by wrapping the
submodules named here: block.norm1/norm2, block.mlp.act, model.embed, model.head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ByteLMConfig:
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn: int = 352          # SwiGLU hidden size
    seq_len: int = 256
    vocab: int = 256        # bytes
    eps: float = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: ByteLMConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, S, D))


class SwiGLU(nn.Module):
    """silu(gate) * up, from the fused gate/up projection [..., 2F]."""

    def forward(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, cfg: ByteLMConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.dim, 2 * cfg.ffn, bias=False)
        self.act = SwiGLU()
        self.down = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x):
        return self.down(self.act(self.gate_up(x)))


class Block(nn.Module):
    def __init__(self, cfg: ByteLMConfig):
        super().__init__()
        self.norm1, self.attn = RMSNorm(cfg.dim, cfg.eps), Attention(cfg)
        self.norm2, self.mlp = RMSNorm(cfg.dim, cfg.eps), MLP(cfg)

    def forward(self, h):
        h = h + self.attn(self.norm1(h))
        return h + self.mlp(self.norm2(h))


class Embed(nn.Module):
    def __init__(self, cfg: ByteLMConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)

    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    def __init__(self, cfg: ByteLMConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.proj = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, h, targets):
        logits = self.proj(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class ByteLM(nn.Module):
    def __init__(self, cfg: ByteLMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embed(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.head = Head(cfg)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets):
        """Mean next-byte cross-entropy of idx [B,S] against targets [B,S]."""
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h, targets)
