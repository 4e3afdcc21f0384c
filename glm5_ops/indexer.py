"""The similarity predictor (DSA "lightning indexer") and top-k selection.

Layouts (all row-major, contiguous after the call makes them so):
  q       [B, S, H, D]  fp32 | fp16 | bf16  indexer queries, H heads
  w       [B, S, H]     fp32 | fp16 | bf16  per-query head weights
  k       [B, T, D]     same dtype as q     one indexer key per token (MQA)
  q_start None | int | int32/int64 [B]      absolute position of query 0; default T - S
  scores  [B, S, T]     fp32                sum_h w * relu(q_h . k), -inf in the causal future
  indices [..., k]      int32               selected positions, -1 in unused slots (last)

Semantics: glm5_ops/reference.py; argument contract and degenerate shapes:
docs/OPS.md. Backends: glm5_ops/_backend.py.
"""
from __future__ import annotations

import torch

from . import _checks as check
from . import reference
from ._backend import _C, cpp_ops, dispatch, register_op, triton_module


def _check_indexer_inputs(q, w, k, q_start):
    check.tensor(q, "q", "[B,S,H,D]", rank=4)
    B, S, H, D = q.shape
    check.nonempty(q, "q", "[B,S,H,D]", 2, "H")  # the kernels divide by H
    check.nonempty(q, "q", "[B,S,H,D]", 3, "D")
    check.tensor(w, "w", f"[B,S,H]=[{B},{S},{H}]", rank=3)
    check.tensor(k, "k", f"[B,T,D]=[{B},T,{D}]", rank=3)
    if tuple(w.shape) != (B, S, H):
        raise ValueError(f"w must have shape [B,S,H]=[{B},{S},{H}] to match q, got shape {tuple(w.shape)}")
    check.dim(k, "k", f"[B,T,D]=[{B},T,{D}]", 0, B, "B")
    check.dim(k, "k", f"[B,T,D]=[{B},T,{D}]", 2, D, "D")
    if k.dtype != q.dtype:
        raise TypeError(f"k must have the dtype of q ({check.dtype_name(q.dtype)}), got {check.dtype_name(k.dtype)}")
    check.nonempty(k, "k", f"[B,T,D]=[{B},T,{D}]", 1, "T")
    device = check.same_device(q=q, w=w, k=k)
    return q.contiguous(), w.contiguous(), k.contiguous(), check.q_start(q_start, B, device), device


def indexer_scores(q, w, k, *, causal: bool = True, q_start=None) -> torch.Tensor:
    """fp32 [B,S,T]: score[b,s,t] = sum_h w[b,s,h] * relu(q[b,s,h] . k[b,t]);
    -inf where causal and t > q_start[b] + s. Materialises [B,S,T]: for
    selection prefer indexer_topk, which never does."""
    q, w, k, qs, device = _check_indexer_inputs(q, w, k, q_start)
    return dispatch("indexer_scores", device, {
        "cpp": lambda: cpp_ops().indexer_scores(q, w, k, causal, qs),
        "triton": lambda: triton_module("indexer", device).indexer_scores(q, w, k, causal, qs),
        "reference": lambda: reference.indexer_scores(q, w, k, causal=causal, q_start=qs),
    })


def topk_indices(scores, k: int, *, sorted: bool = False) -> torch.Tensor:
    """int32 [..., k]: the k largest entries of each row of scores[..., T]
    (any choice among ties). NaN and -inf are never chosen; slots beyond a
    row's selectable entries hold -1 and come last. sorted=True orders the
    chosen slots by score, descending; otherwise their order is unspecified."""
    check.tensor(scores, "scores", "[..., T]")
    if scores.dim() < 1:
        raise ValueError("scores must have shape [..., T] (rank >= 1), got a 0-d tensor")
    check.nonempty(scores, "scores", "[..., T]", -1, "T")
    check.int_in_range(k, "k", 1, scores.shape[-1])
    scores = scores.contiguous()
    return dispatch("topk_indices", scores.device, {
        "cpp": lambda: cpp_ops().topk_indices(scores, k, sorted),
        "triton": lambda: triton_module("indexer", scores.device).topk_indices(scores, k, sorted),
        "reference": lambda: reference.topk_indices(scores, k, sorted=sorted),
    })


def indexer_topk(q, w, k, topk: int, *, causal: bool = True, q_start=None) -> torch.Tensor:
    """int32 [B,S,topk]: topk_indices(indexer_scores(q, w, k), topk), fused.

    Streams key chunks through a running top-k per query: memory O(B*S*topk),
    never the [B,S,T] scores nor a per-head [B,S,H,T]. Causally dead key
    chunks are skipped. Slots come in no particular order; -1 pads the rows
    of queries that see fewer than topk keys."""
    q, w, k, qs, device = _check_indexer_inputs(q, w, k, q_start)
    check.int_in_range(topk, "topk", 1, k.shape[1])
    return dispatch("indexer_topk", device, {
        "cpp": lambda: cpp_ops().indexer_topk(q, w, k, topk, causal, qs),
        "triton": lambda: triton_module("indexer", device).indexer_topk(q, w, k, topk, causal, qs),
        "reference": lambda: reference.indexer_topk(q, w, k, topk, causal=causal, q_start=qs),
    })


# ------------------------------------------------------------------ fakes --

def _indexer_scores_fake(q, w, k, causal, q_start):
    return q.new_empty((q.shape[0], q.shape[1], k.shape[1]), dtype=torch.float32)


def _topk_indices_fake(scores, k, sorted):
    return scores.new_empty((*scores.shape[:-1], k), dtype=torch.int32)


def _indexer_topk_fake(q, w, k, topk, causal, q_start):
    return q.new_empty((q.shape[0], q.shape[1], topk), dtype=torch.int32)


if _C is not None:
    register_op("indexer_scores", _indexer_scores_fake, namespaces=("glm5",))
    register_op("topk_indices", _topk_indices_fake, namespaces=("glm5",))
    register_op("indexer_topk", _indexer_topk_fake, namespaces=("glm5",))
