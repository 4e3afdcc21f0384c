"""Sparse attention: token-level (DSA) and block-sparse, and the block-level predictor.

Layouts (row-major):
  q        [B, S, Hq, Dk]  fp32 | fp16 | bf16   made contiguous by the call
  k        [B, T, Hkv, Dk] dtype of q           Hkv divides Hq; query head h reads kv head h // (Hq // Hkv)
  v        [B, T, Hkv, Dv] dtype of q           may be a strided view of k (MLA's absorbed form:
                                                v = k[..., :Dv]); k and v need unit stride along D only
  indices  [B, S, topk]    int32 (int64 accepted) key positions per query, any order, -1 = empty slot;
                                                 expected duplicate-free (the indexer's top-k is)
  q_start  None | int | int [B]                 absolute position of query 0 (default T - S)
  out      [B, S, Hq, Dv]  dtype of q
  lse      [B, S, Hq]      fp32, natural log of the softmax normaliser; -inf for a query with no key
  BlockMask(kv_num_blocks int32 [B,H,Qb], kv_indices int32 [B,H,Qb,maxKV], block_size):
           FlexAttention's layout (H counts query heads; B, H may be 1 to broadcast);
           row (b,h,i) selects key blocks kv_indices[b,h,i,:kv_num_blocks[b,h,i]].

Semantics: glm5_ops/reference.py (sparse_attention, block_topk_mask,
block_sparse_attention); argument contract and degenerate shapes: docs/OPS.md.
Both attentions are differentiable in q, k and v (lse is returned for
inspection and is not differentiable). Backends: glm5_ops/_backend.py.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import _checks as check
from . import reference
from .flex import from_flex_block_mask, to_flex_block_mask
from ._backend import _C, cpp_ops, define_triton_ops, dispatch, register_op, triton_module, triton_ops


class BlockMask(NamedTuple):
    """A block mask in FlexAttention's layout (see the module docstring)."""
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    block_size: int

    def to_flex(self, S: int, T: int, *, causal: bool = True, q_start=None):
        """The same mask as a torch FlexAttention BlockMask (mask_mod included)."""
        return to_flex_block_mask(self.kv_num_blocks, self.kv_indices, self.block_size, S, T,
                                            causal=causal, q_start=q_start)

    @classmethod
    def causal(cls, S: int, T: int, block_size: int, *, q_start: int | None = None, device=None) -> "BlockMask":
        """Every key block up to each query block's last position (broadcast
        over B and H): dense causal attention on the block-sparse kernels."""
        q0 = T - S if q_start is None else int(q_start)
        Qb, Kb = -(-S // block_size), -(-T // block_size)
        last = torch.clamp(torch.arange(1, Qb + 1, device=device) * block_size, max=S) - 1 + q0
        num = torch.clamp(last // block_size + 1, 0, Kb).to(torch.int32).view(1, 1, Qb)
        idx = torch.arange(Kb, dtype=torch.int32, device=device).expand(1, 1, Qb, Kb)
        return cls(num, idx, block_size)

    def density(self, S: int, T: int) -> float:
        """Fraction of the [S, T] block grid the mask selects (averaged over B, H)."""
        Kb = -(-T // self.block_size)
        return float(self.kv_num_blocks.float().mean()) / Kb if self.kv_num_blocks.numel() else 0.0


# ------------------------------------------------------------ arguments --

def _check_q_k(q, k, q_name: str = "Hq") -> None:
    """q [B,S,Hq,Dk] and k [B,T,Hkv,Dk]: ranks, dtypes, and the axes that must not be empty."""
    check.tensor(q, "q", f"[B,S,{q_name},Dk]", rank=4)
    B, S, Hq, Dk = q.shape
    check.nonempty(q, "q", f"[B,S,{q_name},Dk]", 2, q_name)
    check.nonempty(q, "q", f"[B,S,{q_name},Dk]", 3, "Dk")
    k_shape = f"[B,T,Hkv,Dk]=[{B},T,Hkv,{Dk}]"
    check.tensor(k, "k", k_shape, rank=4)
    if k.shape[0] != B or k.shape[3] != Dk:
        raise ValueError(f"k must have shape {k_shape} to match q, got shape {tuple(k.shape)}")
    check.nonempty(k, "k", k_shape, 1, "T")
    Hkv = k.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"k must have a kv head count Hkv that divides q's {q_name}={Hq}, got shape {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"k must have the dtype of q ({check.dtype_name(q.dtype)}), got {check.dtype_name(k.dtype)}")


def _check_qkv(q, k, v):
    _check_q_k(q, k)
    B, T, Hkv = k.shape[0], k.shape[1], k.shape[2]
    v_shape = f"[B,T,Hkv,Dv]=[{B},{T},{Hkv},Dv]"
    check.tensor(v, "v", v_shape, rank=4)
    if tuple(v.shape[:3]) != (B, T, Hkv):
        raise ValueError(f"v must have shape {v_shape} to match k, got shape {tuple(v.shape)}")
    check.nonempty(v, "v", v_shape, 3, "Dv")
    if v.dtype != q.dtype:
        raise TypeError(f"v must have the dtype of q ({check.dtype_name(q.dtype)}), got {check.dtype_name(v.dtype)}")
    device = check.same_device(q=q, k=k, v=v)
    return q.contiguous(), _unit_head_stride(k), _unit_head_stride(v), device


def _unit_head_stride(t: torch.Tensor) -> torch.Tensor:
    """k and v keep their strides (v may view k); only the head dim must be dense. A size-1 or
    empty tensor counts as contiguous whatever its strides, so .contiguous() would hand it back
    as is: clone it to the canonical strides instead."""
    if t.stride(3) == 1:
        return t
    return t.clone(memory_format=torch.contiguous_format) if t.is_contiguous() else t.contiguous()


def _scale(scale, Dk: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(Dk)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    return float(scale)


def _check_indices(indices, B: int, S: int, T: int, device, name: str = "indices") -> torch.Tensor:
    check.tensor(indices, name, f"[B,S,topk]=[{B},{S},topk]", rank=3, dtypes=check.INDEX_DTYPES)
    if tuple(indices.shape[:2]) != (B, S):
        raise ValueError(f"{name} must have shape [B,S,topk]=[{B},{S},topk], got shape {tuple(indices.shape)}")
    if indices.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {indices.device}")
    if check.host_value_check(indices):
        lo, hi = int(indices.min()), int(indices.max())
        if lo < -1 or hi >= T:
            raise ValueError(f"{name} must hold -1 or key positions in [0, T={T}), got values in [{lo}, {hi}]")
    return indices.to(torch.int32).contiguous()


def _as_block_mask(block_mask) -> BlockMask:
    if isinstance(block_mask, BlockMask):
        return block_mask
    if type(block_mask).__name__ == "BlockMask" and hasattr(block_mask, "kv_num_blocks"):
        return BlockMask(*from_flex_block_mask(block_mask))   # torch FlexAttention's
    if isinstance(block_mask, tuple) and len(block_mask) == 3:
        return BlockMask(*block_mask)
    raise TypeError("block_mask must be a glm5_ops.BlockMask (kv_num_blocks, kv_indices, block_size) or a torch "
                    f"FlexAttention BlockMask, got {type(block_mask).__name__}")


def _check_block_mask(mask: BlockMask, B: int, S: int, Hq: int, T: int, device) -> BlockMask:
    """Expands a broadcast mask to [B,Hq,...] and checks every used entry: the
    kernels index key blocks with it, so a bad entry must never reach them."""
    bs = check.int_in_range(mask.block_size, "block_size", 1, 2**31 - 1)
    num, idx = mask.kv_num_blocks, mask.kv_indices
    Qb, Kb = -(-S // bs), -(-T // bs)
    check.tensor(num, "kv_num_blocks", f"[B,Hq,Qb]=[{B},{Hq},{Qb}]", rank=3, dtypes=check.INDEX_DTYPES)
    check.tensor(idx, "kv_indices", f"[B,Hq,Qb,maxKV]=[{B},{Hq},{Qb},maxKV]", rank=4, dtypes=check.INDEX_DTYPES)
    if num.shape[0] not in (1, B) or num.shape[1] not in (1, Hq) or num.shape[2] != Qb:
        raise ValueError(f"kv_num_blocks must have shape [B,Hq,Qb]=[{B}|1,{Hq}|1,{Qb}] to match q (S={S}, "
                         f"block_size={bs}): the block mask is for another shape, got shape {tuple(num.shape)}")
    if tuple(idx.shape[:3]) != tuple(num.shape):
        raise ValueError(f"kv_indices must be [*kv_num_blocks.shape, maxKV]=[{', '.join(map(str, num.shape))}, "
                         f"maxKV], got shape {tuple(idx.shape)}")
    if num.device != device or idx.device != device:
        raise ValueError(f"block_mask must be on {device} like q, got {num.device} and {idx.device}")
    if device.type != "meta" and num.numel():
        W = idx.shape[3]
        if int(num.min()) < 0 or int(num.max()) > min(W, Kb):
            raise ValueError(f"kv_num_blocks must hold counts in [0, min(maxKV={W}, Kb={Kb})], got values in "
                             f"[{int(num.min())}, {int(num.max())}]")
        used = torch.arange(W, device=device) < num[..., None]
        used_idx = idx[used]
        if used_idx.numel() and (int(used_idx.min()) < 0 or int(used_idx.max()) >= Kb):
            raise ValueError(f"kv_indices must hold key block indices in [0, Kb={Kb}) (T={T}, block_size={bs}) in "
                             f"the first kv_num_blocks entries of each row, got values in "
                             f"[{int(used_idx.min())}, {int(used_idx.max())}]")
        keyed = torch.where(used, idx.long(), torch.full_like(idx, Kb, dtype=torch.long)).sort(-1).values
        dup = (keyed[..., 1:] == keyed[..., :-1]) & (keyed[..., 1:] < Kb)
        if bool(dup.any()):
            row = tuple(int(i) for i in dup.nonzero()[0][:-1])
            raise ValueError(f"kv_indices must list each key block at most once per row, got a repeat in row {row}")
    num = num.to(torch.int32).expand(B, Hq, Qb).contiguous()
    idx = idx.to(torch.int32).expand(B, Hq, Qb, idx.shape[3]).contiguous()
    # Any block_size >= max(S, T) is one query block and one key block, the same mask as
    # max(S, T): run with that, so a huge one never sizes a dense mask or a kernel's scratch.
    return BlockMask(num, idx, min(bs, max(S, T, 1)))


# ------------------------------------------------------------------ ops --

def sparse_attention(q, k, v, indices, *, scale=None, causal: bool = False, q_start=None):
    """(out [B,S,Hq,Dv], lse fp32 [B,S,Hq]): each query attends only to its
    selected keys indices[b,s,:] (shared by all its heads); -1 slots are
    skipped, and so are keys t > q_start[b] + s when causal. A query left with
    no key outputs zeros and lse = -inf. scale defaults to 1/sqrt(Dk).
    Memory: never more than a tile of gathered keys per worker; no [S,T]."""
    q, k, v, device = _check_qkv(q, k, v)
    B, S, Hq, Dk = q.shape
    T = k.shape[1]
    idx = _check_indices(indices, B, S, T, device)
    sc = _scale(scale, Dk)
    qs = check.q_start(q_start, B, device)
    return dispatch("sparse_attention", device, {
        "cpp": lambda: cpp_ops().sparse_attention_fwd(q, k, v, idx, sc, causal, qs),
        "triton": lambda: triton_ops(device).sparse_attention_fwd(q, k, v, idx, sc, causal, qs),
        "reference": lambda: reference.sparse_attention(q, k, v, idx, scale=sc, causal=causal, q_start=qs),
    })


def block_topk_mask(q, k, *, block_size: int, topk_blocks: int, causal: bool = True, sink_blocks: int = 1,
                    local_blocks: int = 1, pooling: str = "mean", q_start=None) -> BlockMask:
    """The block-level predictor: per (query block, query head), the sink and
    local key blocks plus the topk_blocks best-scoring others (mean-pooled
    q·k by default; pooling="minmax" is Quest's upper bound). q [B,S,H,D],
    k [B,T,Hkv,D]. Returns a BlockMask of width min(Kb, sink+local+topk_blocks),
    blocks ascending then 0 padding (reference.block_topk_mask defines it)."""
    _check_q_k(q, k, q_name="H")
    B = q.shape[0]
    bs = check.int_in_range(block_size, "block_size", 1, 2**31 - 1)
    for name, val in (("topk_blocks", topk_blocks), ("sink_blocks", sink_blocks), ("local_blocks", local_blocks)):
        check.int_in_range(val, name, 0, 2**31 - 1)
    if pooling not in ("mean", "minmax"):
        raise ValueError(f"pooling must be 'mean' or 'minmax', got {pooling!r}")
    device = check.same_device(q=q, k=k)
    qs = check.q_start(q_start, B, device)
    q, k = q.contiguous(), k.contiguous()
    run_bs = min(bs, max(q.shape[1], k.shape[1]))   # >= max(S, T): one block either way (see _check_block_mask)
    args = (q, k, run_bs, topk_blocks, causal, sink_blocks, local_blocks, pooling, qs)
    num, idx = dispatch("block_topk_mask", device, {
        "cpp": lambda: cpp_ops().block_topk_mask(*args),
        "triton": lambda: triton_module("attention", device).block_topk_mask(*args),
        "reference": lambda: reference.block_topk_mask(q, k, block_size=run_bs, topk_blocks=topk_blocks, causal=causal,
                                                       sink_blocks=sink_blocks, local_blocks=local_blocks,
                                                       pooling=pooling, q_start=qs),
    })
    return BlockMask(num, idx, bs)


def block_sparse_attention(q, k, v, block_mask, *, scale=None, causal: bool = True, q_start=None):
    """(out [B,S,Hq,Dv], lse fp32 [B,S,Hq]): attention restricted to the key
    blocks of block_mask (a glm5_ops.BlockMask, or a torch FlexAttention
    BlockMask whose block structure is used; its mask_mod is not run, so pass
    causal=True for the usual causal mask). causal applies t <= q_start[b] + s
    token by token inside the selected blocks. scale defaults to 1/sqrt(Dk)."""
    q, k, v, device = _check_qkv(q, k, v)
    B, S, Hq, Dk = q.shape
    T = k.shape[1]
    mask = _check_block_mask(_as_block_mask(block_mask), B, S, Hq, T, device)
    sc = _scale(scale, Dk)
    qs = check.q_start(q_start, B, device)
    args = (q, k, v, mask.kv_num_blocks, mask.kv_indices, mask.block_size, sc, causal, qs)
    return dispatch("block_sparse_attention", device, {
        "cpp": lambda: cpp_ops().block_sparse_attention_fwd(*args),
        "triton": lambda: triton_ops(device).block_sparse_attention_fwd(*args),
        "reference": lambda: reference.block_sparse_attention(q, k, v, mask.kv_num_blocks, mask.kv_indices,
                                                              block_size=mask.block_size, scale=sc, causal=causal,
                                                              q_start=qs),
    })


# ------------------------------------------------ autograd and fakes --
# One mechanism on every backend: the C++ ops (glm5::) and the Triton kernels
# (glm5_triton::, same schemas) register the fakes and the autograd formulas
# below, the backward calling its own namespace's backward op; "reference"
# differentiates through the oracle.

def _attn_fake(q, v):
    B, S, Hq, _ = q.shape
    return q.new_empty((B, S, Hq, v.shape[3])), q.new_empty((B, S, Hq), dtype=torch.float32)


def _sparse_fwd_fake(q, k, v, indices, scale, causal, q_start):
    return _attn_fake(q, v)


def _block_fwd_fake(q, k, v, kv_num_blocks, kv_indices, block_size, scale, causal, q_start):
    return _attn_fake(q, v)


def _grads_fake(q, k, v):
    return torch.empty_like(q), k.new_empty(k.shape), v.new_empty(v.shape)


def _sparse_bwd_fake(dout, q, k, v, indices, out, lse, scale, causal, q_start):
    return _grads_fake(q, k, v)


def _block_bwd_fake(dout, q, k, v, kv_num_blocks, kv_indices, out, lse, block_size, scale, causal, q_start):
    return _grads_fake(q, k, v)


def _block_topk_fake(q, k, block_size, topk_blocks, causal, sink_blocks, local_blocks, pooling, q_start):
    B, S, H, _ = q.shape
    Qb, Kb = -(-S // block_size), -(-k.shape[1] // block_size)
    width = min(Kb, sink_blocks + local_blocks + topk_blocks)
    return (q.new_empty((B, H, Qb), dtype=torch.int32), q.new_empty((B, H, Qb, width), dtype=torch.int32))


def _save_inputs_outputs(ctx, inputs, output):
    ctx.save_for_backward(*[t for t in inputs if isinstance(t, torch.Tensor)], *output)
    ctx.non_tensor = [a for a in inputs if not isinstance(a, torch.Tensor)]
    ctx.has_q_start = inputs[-1] is not None
    ctx.mark_non_differentiable(output[1])


def _unpack(ctx, n_tensor_inputs):
    saved = list(ctx.saved_tensors)
    tensors, (out, lse) = saved[:n_tensor_inputs], saved[n_tensor_inputs:]
    qs = tensors.pop() if ctx.has_q_start else None
    return tensors, out, lse, qs


def _sparse_backward(ops):
    def backward(ctx, dout, _dlse):
        (q, k, v, idx), out, lse, qs = _unpack(ctx, 4 + ctx.has_q_start)
        scale, causal = ctx.non_tensor[:2]
        dq, dk, dv = ops.sparse_attention_bwd(dout.contiguous(), q, k, v, idx, out, lse, scale, causal, qs)
        return dq, dk, dv, None, None, None, None
    return backward


def _block_backward(ops):
    def backward(ctx, dout, _dlse):
        (q, k, v, num, idx), out, lse, qs = _unpack(ctx, 5 + ctx.has_q_start)
        block_size, scale, causal = ctx.non_tensor[:3]
        dq, dk, dv = ops.block_sparse_attention_bwd(dout.contiguous(), q, k, v, num, idx, out, lse,
                                                    block_size, scale, causal, qs)
        return dq, dk, dv, None, None, None, None, None, None
    return backward


if _C is not None:
    define_triton_ops("attention", ("sparse_attention_fwd", "sparse_attention_bwd", "block_sparse_attention_fwd",
                                    "block_sparse_attention_bwd"))
    register_op("sparse_attention_fwd", _sparse_fwd_fake, _sparse_backward, _save_inputs_outputs)
    register_op("block_sparse_attention_fwd", _block_fwd_fake, _block_backward, _save_inputs_outputs)
    register_op("sparse_attention_bwd", _sparse_bwd_fake)
    register_op("block_sparse_attention_bwd", _block_bwd_fake)
    register_op("block_topk_mask", _block_topk_fake, namespaces=("glm5",))
