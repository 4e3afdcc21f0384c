"""Converters between glm5_ops' block masks and torch FlexAttention's BlockMask.

Our format (kv_num_blocks int32 [B,H,Qb], kv_indices int32 [B,H,Qb,maxKV],
block_size) is described in glm5_ops/reference.py above block_topk_mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import _blocks_to_ordered, _ordered_to_blocks, query_positions


def from_flex_block_mask(block_mask):
    """torch FlexAttention BlockMask -> (kv_num_blocks int32 [B,H,Qb],
    kv_indices int32 [B,H,Qb,Kb], block_size).

    Merges the mask's partial blocks (kv_num_blocks / kv_indices) and full blocks
    (full_kv_num_blocks / full_kv_indices) into one ascending list per row,
    padded with 0; Qb and Kb follow the mask's seq_lengths. Only the block
    structure carries over: the mask_mod is dropped, and block_sparse_attention
    applies its own causal (token) mask inside the blocks. So the two agree
    exactly when the BlockMask's mask_mod is "block-level selection and causal"
    (key t visible to query s iff t <= q_start + s, e.g. FlexAttention's usual
    q_idx >= kv_idx with S == T). Requires equal query and key block sizes."""
    bq, bk = block_mask.BLOCK_SIZE
    if bq != bk:
        raise ValueError(f"block_mask must have one block size for queries and keys, got "
                         f"Q_BLOCK_SIZE={bq} and KV_BLOCK_SIZE={bk}")
    S, T = block_mask.seq_lengths
    Qb, Kb = -(-S // bq), -(-T // bq)
    n_cols = max(Kb, block_mask.kv_indices.shape[-1])
    blocks = _ordered_to_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, n_cols)
    if block_mask.full_kv_num_blocks is not None:
        blocks = blocks | _ordered_to_blocks(block_mask.full_kv_num_blocks,
                                             block_mask.full_kv_indices, n_cols)
    num, idx = _blocks_to_ordered(blocks[..., :Qb, :Kb])
    return num, idx, bq


def to_flex_block_mask(kv_num_blocks, kv_indices, block_size, S, T, *, causal=True, q_start=None):
    """Wrap our block mask in a torch FlexAttention BlockMask (for comparing with
    flex_attention). Its mask_mod carries the whole rule, block selection and
    (when causal) t <= q_start[b] + s (q_start defaulting to T - S): eager
    flex_attention applies only the mask_mod and ignores the block lists, the
    compiled kernel uses both, and this way the two agree. Every selected
    block is listed as partial (the mask_mod runs on all of them)."""
    from torch.nn.attention.flex_attention import BlockMask

    Bm, Hm = kv_num_blocks.shape[0], kv_num_blocks.shape[1]
    Kb = -(-T // block_size)
    blocks = _ordered_to_blocks(kv_num_blocks, kv_indices, Kb)          # [Bm,Hm,Qb,Kb]
    n_start = q_start.numel() if isinstance(q_start, torch.Tensor) else 1
    start = query_positions(n_start, 1, T, T - S if q_start is None else q_start,
                            kv_num_blocks.device)[:, 0]                 # [n_start]

    def mask_mod(b, h, q_idx, kv_idx):
        bb = b if Bm > 1 else 0
        hh = h if Hm > 1 else 0
        ok = blocks[bb, hh, q_idx // block_size, kv_idx // block_size]
        if causal:
            ok = ok & (kv_idx <= start[b if n_start > 1 else 0] + q_idx)
        return ok

    # Compiled flex_attention sizes its grid from kv_indices' last dim: pad it to Kb.
    kv_indices = F.pad(kv_indices, (0, max(0, Kb - kv_indices.shape[-1])))
    return BlockMask.from_kv_blocks(kv_num_blocks.to(torch.int32), kv_indices.to(torch.int32),
                                    BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(S, T))
