"""Inference-only buffer reuse and in-place writes, behind one boundary.

Without autograd (generation, prefill, profiling), a forward may write into
buffers every layer reuses and update tensors in place: a fresh tensor over
32 MiB is fresh mmap'd memory, one page fault per 4 KiB on first touch (an
absorbed 2K-token chunk's q alone cost ~5 ms of faults per layer). While a
graph is being recorded, saved tensors must stay as they are, so every
method here computes out of place then. The model asks this module, never
torch.is_grad_enabled() itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import glm5_ops

# Fewer queries (decode) make small products: heads_product, no lifted weight.
_BATCHED_MIN_QUERIES = 64
# More rows than this: an int8 heads_product dequantises and runs the GEMM (as int8_linear does)
_INT8_HEADS_MAX_ROWS = 16


def reusing() -> bool:
    """Whether buffers may be reused and tensors written in place: no autograd graph is being recorded."""
    return not torch.is_grad_enabled()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; in place into gate when reusing (two fewer [tokens,
    intermediate] tensors, 23 MiB each at a 2K-token chunk of the small preset)."""
    if reusing():
        return F.silu(gate, inplace=True).mul_(up)
    return F.silu(gate) * up


def assign(view: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """value, written into `view` (and `view` returned) when reusing: q's roped
    part goes back into q, so q_nope and q_rot stay views of one tensor (joined)."""
    if not reusing():
        return value
    view.copy_(value)
    return view


def joined(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[a, b] along the last dim: the tensor both are adjacent views of (see
    assign), else a concatenation."""
    n = a.shape[-1]
    if b.stride() == a.stride() and b.data_ptr() == a.data_ptr() + n * a.element_size():
        return a.as_strided((*a.shape[:-1], n + b.shape[-1]), a.stride())
    return torch.cat([a, b], dim=-1)


@dataclass(frozen=True)
class Int8Heads:
    """Each head's int8 rows, for heads_product: q int8 [H,N,K] with scale fp32 [H,N]
    (one per row), and x_scale [H,K] or None, a per-column scale folded into x first
    (W_UK^T from a per-row int8 kv_b_proj: kv_b's row scales run along K here)."""
    q: torch.Tensor
    scale: torch.Tensor
    x_scale: torch.Tensor | None = None


def heads_product(x: torch.Tensor, w_rows) -> torch.Tensor:
    """x [B,S,H,K] times each head's w_rows [H,N,K] transposed: [B,S,H,N]. Few
    rows (decode) on the CPU: the gemv kernel, one call for every head (reads
    w_rows' heads in place; torch.bmm's per-head GEMMs took ~100 us for MLA's
    1 MB a layer); else einsum. Int8Heads: glm5_ops.int8_linear_heads (inference)."""
    B, S, H, K = x.shape
    by_head = x.reshape(B * S, H, K).transpose(0, 1)
    if isinstance(w_rows, Int8Heads):
        if w_rows.x_scale is not None:
            by_head = by_head * w_rows.x_scale[:, None, :]
        if B * S > _INT8_HEADS_MAX_ROWS:   # compute-bound: dequantise once, then the batched GEMM
            w = glm5_ops.reference.int8_dequantize_rows(w_rows.q, w_rows.scale, x.dtype)
            return torch.einsum("hmk,hnk->mhn", by_head, w).reshape(B, S, H, w.shape[1])
        y = glm5_ops.int8_linear_heads(by_head, w_rows.q, w_rows.scale)
        return y.transpose(0, 1).reshape(B, S, H, w_rows.q.shape[1])
    if glm5_ops.linear_takes_gemv(by_head, w_rows):
        return glm5_ops.linear_heads(by_head, w_rows).transpose(0, 1).reshape(B, S, H, w_rows.shape[1])
    return torch.einsum("bshk,hnk->bshn", x, w_rows)


class Workspace:
    """The buffers one forward's layers share (by name), handed out only when reusing."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def out(self, name: str, shape, like: torch.Tensor) -> torch.Tensor | None:
        """An uninitialised buffer for an `out=` argument, or None (a fresh result) while recording."""
        return self._buffer(name, shape, like) if reusing() else None

    def _buffer(self, name, shape, like):
        buf = self._buffers.get(name)
        if buf is None or buf.shape != tuple(shape) or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[name] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return buf

    def head_products(self, name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [B,T,C] times each head's w [H,N,C] transposed: [B,H,T,N]. Reusing,
        one mm per (batch, head) into the buffer; else one broadcast matmul."""
        (B, T, _), (H, N, _) = x.shape, w.shape
        out = self.out(name, (B, H, T, N), x)
        if out is None:
            return torch.matmul(x[:, None], w.transpose(1, 2))
        for b in range(B):
            for h in range(H):
                torch.mm(x[b], w[h].t(), out=out[b, h])
        return out

    def absorbed_queries(self, q_nope, q_rot, w_uk, lifted, w_uk_rows) -> torch.Tensor:
        """[q_nope W_UK, q_rot] [B,S,H,C+r] for q_nope [B,S,H,n], w_uk() [H,n,C].
        Reusing with few queries: heads_product by w_uk_rows() = W_UK^T
        [H,C,n], a contiguous copy (the gemv kernel reads rows). Reusing with
        many: one batched product per head of [q_nope, q_rot] by lifted() =
        [[W_UK, 0], [0, I]] [H,n+r,C+r] into reused buffers, which carries
        q_rot through exactly (x*1 + 0s): no separate cat, nothing over 32 MiB
        allocated afresh. Recording: einsum by w_uk itself (its gradient)."""
        B, S, H, _ = q_nope.shape
        if not reusing():
            return torch.cat([torch.einsum("bshn,hnc->bshc", q_nope, w_uk()), q_rot], dim=-1)
        if S < _BATCHED_MIN_QUERIES:
            return torch.cat([heads_product(q_nope, w_uk_rows()), q_rot], dim=-1)
        w = lifted()
        by_head = self._buffer("absorbed_q_by_head", (B, H, S, w.shape[-1]), q_nope)
        torch.matmul(joined(q_nope, q_rot).transpose(1, 2), w, out=by_head)
        q = self._buffer("absorbed_q", (B, S, H, w.shape[-1]), q_nope)
        return q.copy_(by_head.transpose(1, 2))
