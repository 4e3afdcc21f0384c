"""Pure-PyTorch oracles for every op of the lab: the spec the kernels are built to.

Readable first, fast never. Each function states its layouts and semantics;
the kernels in csrc/ and glm5_ops/triton/ must agree with these (tolerances in
tests/). Shapes: B batch, S queries, T keys, H heads, D head dim, E experts.

Conventions shared by every op:
- Query s of batch b sits at absolute position q_start[b] + s; q_start
  defaults to T - S (the queries are the last S positions of the keys). With
  causal=True, key t is visible to query s iff t <= q_start[b] + s.
- Index tensors are int32; -1 marks an empty slot.
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def query_positions(B: int, S: int, T: int, q_start, device) -> torch.Tensor:
    """Absolute positions [B, S] (int64) of the queries: q_start[b] + s.

    q_start: None (T - S for every batch element), an int, or an int tensor [B]."""
    if q_start is None:
        q_start = T - S
    if isinstance(q_start, int):
        start = torch.full((B,), q_start, dtype=torch.int64, device=device)
    else:
        start = q_start.to(device=device, dtype=torch.int64).reshape(B)
    return start[:, None] + torch.arange(S, device=device)[None, :]


def causal_mask(B: int, S: int, T: int, q_start, device) -> torch.Tensor:
    """bool [B, S, T]: True where key t is in query s's future (t > q_start[b] + s)."""
    pos = query_positions(B, S, T, q_start, device)
    return torch.arange(T, device=device)[None, None, :] > pos[:, :, None]


# --------------------------------------------------------------------------
# Similarity predictor (DSA lightning indexer) and top-k selection
# --------------------------------------------------------------------------

def indexer_scores(q, w, k, *, causal=True, q_start=None):
    """score[b,s,t] = sum_h w[b,s,h] * relu(q[b,s,h,:] . k[b,t,:]), fp32 [B,S,T].

    q [B,S,H,D], w [B,S,H], k [B,T,D] (one key head shared by all H query
    heads, as in GLM-5 / DeepSeek-V3.2). Computed in fp32 whatever the input
    dtype. causal=True sets score = -inf where t > q_start[b] + s.
    Loops over heads so the oracle itself holds [B,S,T], never [B,S,H,T]."""
    B, S, H, _ = q.shape
    T = k.shape[1]
    qf, wf, kf = q.float(), w.float(), k.float()
    score = torch.zeros(B, S, T, dtype=torch.float32, device=q.device)
    for h in range(H):
        score += wf[:, :, h, None] * torch.relu(torch.einsum("bsd,btd->bst", qf[:, :, h], kf))
    if causal:
        score.masked_fill_(causal_mask(B, S, T, q_start, q.device), NEG_INF)
    return score


def topk_indices(scores, k, *, sorted=False):
    """int32 [..., k]: indices of the k largest entries along the last dim.

    NaN and -inf are never selected (+inf is); a row with fewer than k
    selectable entries fills the remaining slots with -1, after the real
    ones. Ties at the k-th value may be broken either way. sorted=True orders
    the slots by score, descending; this oracle always returns them sorted,
    and for sorted=False any order of the same set is equally correct."""
    s = scores.float()
    s = torch.where(torch.isnan(s), torch.full_like(s, NEG_INF), s)
    values, idx = torch.topk(s, k, dim=-1, sorted=True)
    return torch.where(values == NEG_INF, torch.full_like(idx, -1), idx).to(torch.int32)


def indexer_topk(q, w, k, topk, *, causal=True, q_start=None):
    """int32 [B,S,topk] = topk_indices(indexer_scores(q, w, k, ...), topk).

    Kernels compute this fused (streaming key chunks, running top-k), never
    holding [B,S,T]; their slots may come in any order, -1 padding last."""
    return topk_indices(indexer_scores(q, w, k, causal=causal, q_start=q_start), topk)
