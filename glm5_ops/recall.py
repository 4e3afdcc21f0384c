"""The recall metric: how much of dense attention a sparse selection keeps.

    r = glm5_ops.attention_recall(q, k, v, indices)          # or a BlockMask
    r.mean_recall, r.output_rel_err

Computed with the oracles' helpers (glm5_ops/reference.py), never a kernel.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import _checks as check
from .attention import _as_block_mask, _check_block_mask, _check_indices, _check_qkv, _scale
from .reference import (_acc_dtype, _attention_dims, _chunk_rows, _mask_rows_to_gqa, _masked_softmax_lse,
                        block_mask_to_dense, query_positions)


class AttentionRecall(NamedTuple):
    """What a selection keeps of dense attention (see attention_recall)."""
    recall: torch.Tensor          # fp32 [B,S,Hq]: softmax mass covered, in [0, 1]
    rel_err: torch.Tensor         # fp32 [B,S,Hq]: ||o_sel - o|| / ||o|| per query and head
    mean_recall: float            # recall averaged over queries and heads
    output_rel_err: float         # ||O_sel - O||_F / ||O||_F over the whole output


def attention_recall(q, k, v, selection, *, scale=None, causal: bool = True, q_start=None) -> AttentionRecall:
    """How much of dense attention a selection keeps.

    q [B,S,Hq,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv]; selection is either
      - token indices int32 [B,S,topk] (as for sparse_attention; -1 skipped,
        duplicates count once here), or
      - a block mask (a glm5_ops.BlockMask, its (kv_num_blocks, kv_indices,
        block_size) tuple or a torch FlexAttention BlockMask) as for
        block_sparse_attention.
    Arguments are checked as for sparse_attention / block_sparse_attention;
    scale defaults to 1/sqrt(Dk).
    With P the dense softmax (causal when causal=True, q_start as usual) and
    A[b,s,h] the set of visible keys the selection keeps (selection ∩ causal):
      recall[b,s,h]  = sum_{t in A} P[b,s,h,t]   (the softmax mass covered)
      rel_err[b,s,h] = ||o_sel - o|| / ||o||, o = dense output, o_sel = attention
                       over A only (what sparse attention computes), norms over Dv
      output_rel_err = ||O_sel - O||_F / ||O||_F over all (b, s, h)
    Equivalently recall = exp(lse_sel - lse_dense). A query with no visible key
    counts as fully recalled (recall 1, rel_err 0); a selection that keeps none
    of a query's visible keys has recall 0 and rel_err 1. Computed in fp32,
    one query chunk at a time (holds [B, chunk, Hq, T])."""
    q, k, v, dev = _check_qkv(q, k, v)
    B, S, Hq, Dk, T, Hkv, Dv = _attention_dims(q, k, v)
    G = Hq // Hkv
    scale = _scale(scale, Dk)
    q_start = check.q_start(q_start, B, dev)
    if isinstance(selection, torch.Tensor):
        idx = _check_indices(selection, B, S, T, dev, name="selection").long()
        sel_idx = torch.where(idx >= 0, idx, torch.full_like(idx, T))

        def sel_rows(s0, s1):
            m = torch.zeros(B, s1 - s0, T + 1, dtype=torch.bool, device=dev)
            m.scatter_(-1, sel_idx[:, s0:s1], True)
            return m[:, None, :, :T]
    else:
        kv_num_blocks, kv_indices, block_size = _check_block_mask(_as_block_mask(selection), B, S, Hq, T, dev)
        sel_dense = block_mask_to_dense(kv_num_blocks, kv_indices, block_size, S, T)

        def sel_rows(s0, s1):
            return sel_dense[:, :, s0:s1]
    pos = query_positions(B, S, T, q_start, dev)
    t = torch.arange(T, device=dev)
    acc = _acc_dtype(q, k, v)
    qf = q.to(acc).reshape(B, S, Hkv, G, Dk)
    kf, vf = k.to(acc), v.to(acc)
    recalls, errs = [], []
    num = torch.zeros((), dtype=acc, device=dev)
    den = torch.zeros((), dtype=acc, device=dev)
    step = _chunk_rows(S, B * Hq * T * 3)
    for s0 in range(0, S, step):
        s1 = min(S, s0 + step)
        sc = s1 - s0
        scores = torch.einsum("bshgd,bthd->bshgt", qf[:, s0:s1], kf) * scale
        if causal:
            vis = (t[None, None, :] <= pos[:, s0:s1, None]).reshape(B, sc, 1, 1, T)
        else:
            vis = torch.ones(1, 1, 1, 1, T, dtype=torch.bool, device=dev)
        keep = vis & _mask_rows_to_gqa(sel_rows(s0, s1), B, sc, Hq, Hkv, T)
        p, _ = _masked_softmax_lse(scores, vis.expand_as(scores))
        p_sel, _ = _masked_softmax_lse(scores, keep.expand_as(scores))
        o = torch.einsum("bshgt,bthd->bshgd", p, vf)
        o_sel = torch.einsum("bshgt,bthd->bshgd", p_sel, vf)
        empty = ~vis.expand_as(scores).any(-1)
        rec = torch.where(empty, torch.ones_like(p[..., 0]), (p * keep).sum(-1))
        diff = (o_sel - o).norm(dim=-1)
        ref = o.norm(dim=-1)
        err = torch.where(ref > 0, diff / torch.where(ref > 0, ref, torch.ones_like(ref)),
                          torch.zeros_like(ref))
        recalls.append(rec.reshape(B, sc, Hq))
        errs.append(err.reshape(B, sc, Hq))
        num = num + (diff ** 2).sum()
        den = den + (ref ** 2).sum()
    recall = torch.cat(recalls, 1).float() if recalls else torch.ones(B, 0, Hq, device=dev)
    rel_err = torch.cat(errs, 1).float() if errs else torch.zeros(B, 0, Hq, device=dev)
    out_err = float((num / den).sqrt()) if float(den) > 0 else 0.0
    return AttentionRecall(recall, rel_err, float(recall.mean()) if recall.numel() else 1.0, out_err)
