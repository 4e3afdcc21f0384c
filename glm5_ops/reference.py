"""Pure-PyTorch oracles for every op of the lab: the spec the kernels are built to.

Readable first, fast never. Each function states its layouts and semantics;
the kernels in csrc/ and glm5_ops/triton/ must agree with these (tolerances in
tests/). Shapes: B batch, S queries, T keys, H heads, D head dim, E experts.

Conventions shared by every op:
- Query s of batch b sits at absolute position q_start[b] + s; q_start
  defaults to T - S (the queries are the last S positions of the keys). With
  causal=True, key t is visible to query s iff t <= q_start[b] + s.
- Index tensors are int32; -1 marks an empty slot.

The oracles assume valid input: each op's contract is checked once, by its
public wrapper in glm5_ops (docs/OPS.md), before any backend runs. The
helpers that are not oracles live with their owners: FlexAttention
converters in glm5_ops/flex.py, the recall metric in glm5_ops/recall.py,
MoEPlan in glm5_ops/moe_plan.py, the balancing losses in glm5_ops/balance.py.
"""
from __future__ import annotations

import math
import torch
import torch.nn.functional as F

from .moe_plan import MoEPlan

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


# --------------------------------------------------------------------------
# Shared helpers for the attention oracles
# --------------------------------------------------------------------------

# Elements per intermediate tensor the attention oracles allow themselves when
# they loop over query chunks (2^24 fp32 = 64 MiB).
_CHUNK_ELEMS = 1 << 24


def _acc_dtype(*tensors) -> torch.dtype:
    """The dtype the oracles compute in: fp32, or float64 when an input is float64
    (so that torch.autograd.gradcheck can run through them)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _attention_dims(q, k, v):
    """(B, S, Hq, Dk, T, Hkv, Dv) of q[B,S,Hq,Dk], k[B,T,Hkv,Dk], v[B,T,Hkv,Dv]."""
    B, S, Hq, Dk = q.shape
    return B, S, Hq, Dk, k.shape[1], k.shape[2], v.shape[3]


def _chunk_rows(S: int, per_row: int) -> int:
    """Query rows per chunk so that one chunk holds about _CHUNK_ELEMS elements."""
    return max(1, min(max(S, 1), _CHUNK_ELEMS // max(per_row, 1)))


def _masked_softmax_lse(scores, valid):
    """Softmax over the last dim restricted to `valid`, and its natural-log logsumexp.

    Returns (p, lse) with p shaped like scores and lse = scores.shape[:-1]. A row
    with no valid entry gets p = 0 and lse = -inf. Written so that neither the
    forward nor autograd's backward produces NaN on such rows (or on masked
    entries), since the backward oracles are autograd through this."""
    if scores.shape[-1] == 0:
        return scores, scores.new_full(scores.shape[:-1], NEG_INF)
    s = scores.masked_fill(~valid, NEG_INF)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)                       # exactly 0 at masked entries
    z = e.sum(-1, keepdim=True)
    nonempty = z > 0
    z_safe = torch.where(nonempty, z, torch.ones_like(z))
    p = e / z_safe
    lse = torch.where(nonempty, m + torch.log(z_safe), torch.full_like(z, NEG_INF))
    return p, lse.squeeze(-1)


def _mask_rows_to_gqa(mask, B, sc, Hq, Hkv, T):
    """bool [Bm, Hm, sc, T] (Bm in {1,B}, Hm in {1,Hq}) -> broadcastable to the
    grouped score layout [B, sc, Hkv, G, T] used by the dense oracles."""
    Bm, Hm = mask.shape[0], mask.shape[1]
    m = mask.permute(0, 2, 1, 3)               # [Bm, sc, Hm, T]
    if Hm == 1:
        return m.reshape(Bm, sc, 1, 1, T)
    return m.reshape(Bm, sc, Hkv, Hq // Hkv, T)


def _dense_masked_attention(q, k, v, scale, allowed_rows):
    """Dense attention restricted by a mask produced chunk by chunk.

    allowed_rows(s0, s1) -> bool [Bm, Hm, s1-s0, T] (Bm in {1,B}, Hm in {1,Hq}):
    True where query s (of rows s0..s1-1) may attend to key t. Returns
    (out [B,S,Hq,Dv] in q.dtype, lse [B,S,Hq] in the compute dtype).
    Holds one [B, chunk, Hq, T] score block at a time."""
    B, S, Hq, Dk, T, Hkv, Dv = _attention_dims(q, k, v)
    G = Hq // Hkv
    acc = _acc_dtype(q, k, v)
    qf = q.to(acc).reshape(B, S, Hkv, G, Dk)
    kf, vf = k.to(acc), v.to(acc)
    outs, lses = [], []
    step = _chunk_rows(S, B * Hq * T)
    for s0 in range(0, max(S, 1), step):        # S = 0: one empty chunk, so autograd sees the inputs
        s1 = min(S, s0 + step)
        scores = torch.einsum("bshgd,bthd->bshgt", qf[:, s0:s1], kf) * scale
        valid = _mask_rows_to_gqa(allowed_rows(s0, s1), B, s1 - s0, Hq, Hkv, T)
        p, lse = _masked_softmax_lse(scores, valid.expand_as(scores))
        o = torch.einsum("bshgt,bthd->bshgd", p, vf)
        outs.append(o.reshape(B, s1 - s0, Hq, Dv))
        lses.append(lse.reshape(B, s1 - s0, Hq))
    return torch.cat(outs, 1).to(q.dtype), torch.cat(lses, 1)


# --------------------------------------------------------------------------
# Sparse attention: token-level (DSA)
# --------------------------------------------------------------------------

def dense_attention(q, k, v, *, scale, causal=True, q_start=None):
    """Dense softmax attention, the baseline the sparse oracles are measured against.

    q [B,S,Hq,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv]; query head h uses kv head
    h // (Hq // Hkv). causal: key t visible to query s iff t <= q_start[b] + s
    (q_start defaults to T - S). Returns (out [B,S,Hq,Dv] in q.dtype,
    lse [B,S,Hq] fp32 (float64 for float64 inputs), natural log); a query with
    no visible key gets zeros and lse = -inf. Loops over query chunks; never
    holds more than one [B, chunk, Hq, T] score block."""
    B, S, _, _, T, _, _ = _attention_dims(q, k, v)
    if causal:
        pos = query_positions(B, S, T, q_start, q.device)
        t = torch.arange(T, device=q.device)

        def rows(s0, s1):
            return (t[None, None, :] <= pos[:, s0:s1, None])[:, None]
    else:
        def rows(s0, s1):
            return torch.ones(1, 1, s1 - s0, T, dtype=torch.bool, device=q.device)
    return _dense_masked_attention(q, k, v, scale, rows)


def sparse_attention(q, k, v, indices, *, scale, causal=False, q_start=None):
    """Token-level sparse attention (DSA): each query attends only to its selected keys.

    Layouts:
      q       [B,S,Hq,Dk]   any float dtype
      k       [B,T,Hkv,Dk]  Hkv divides Hq; query head h uses kv head h // (Hq // Hkv)
                            (Hkv = 1 is MLA's absorbed / MQA form)
      v       [B,T,Hkv,Dv]  may be a view of k (MLA: v = k[..., :Dv])
      indices int32 [B,S,topk]: the key positions query (b, s) attends to, shared
                            by all its heads, in any order; -1 marks an empty slot.
    Returns (out [B,S,Hq,Dv] in q.dtype, lse [B,S,Hq] fp32), computed in fp32
    (float64 when an input is float64, then lse is float64 too).

    Semantics: slot j of query (b, s) contributes key t = indices[b,s,j] unless
    t == -1, or causal=True and t > q_start[b] + s (q_start defaults to T - S).
      lse[b,s,h] = log sum_{contributing j} exp(scale * q[b,s,h]·k[b,t_j,h//G])
      out[b,s,h] = sum_j exp(scale * q·k[t_j] - lse) * v[b,t_j,h//G]
    A query left with no contributing slot outputs zeros and lse = -inf.
    Duplicates: indices are expected duplicate-free (the indexer's top-k is).
    The oracle treats every slot independently, so a key listed twice counts
    twice; kernels need not reproduce that and the tests never rely on it.

    Differentiable (the backward oracle is autograd through this; no NaN on
    empty rows). Memory: gathers the selected keys ([B, chunk, topk, Hkv, D])
    a query chunk at a time; never builds anything of size T per query."""
    B, S, Hq, Dk, T, Hkv, Dv = _attention_dims(q, k, v)
    G = Hq // Hkv
    topk = indices.shape[2]
    acc = _acc_dtype(q, k, v)
    qf = q.to(acc).reshape(B, S, Hkv, G, Dk)
    kf, vf = k.to(acc), v.to(acc)
    idx = indices.long()
    valid = idx >= 0
    if causal:
        valid &= idx <= query_positions(B, S, T, q_start, q.device)[:, :, None]
    safe = idx.clamp(min=0)
    b = torch.arange(B, device=q.device)[:, None, None]
    outs, lses = [], []
    step = _chunk_rows(S, B * topk * (Hkv * (Dk + Dv) + 2 * Hq))
    for s0 in range(0, max(S, 1), step):        # S = 0: one empty chunk, so autograd sees the inputs
        s1 = min(S, s0 + step)
        kg = kf[b, safe[:, s0:s1]]             # [B, sc, topk, Hkv, Dk]
        vg = vf[b, safe[:, s0:s1]]             # [B, sc, topk, Hkv, Dv]
        scores = torch.einsum("bshgd,bsthd->bshgt", qf[:, s0:s1], kg) * scale
        ok = valid[:, s0:s1, None, None, :].expand_as(scores)
        p, lse = _masked_softmax_lse(scores, ok)
        o = torch.einsum("bshgt,bsthd->bshgd", p, vg)
        outs.append(o.reshape(B, s1 - s0, Hq, Dv))
        lses.append(lse.reshape(B, s1 - s0, Hq))
    return torch.cat(outs, 1).to(q.dtype), torch.cat(lses, 1)


# --------------------------------------------------------------------------
# Block-sparse attention (FlexAttention BlockMask format)
# --------------------------------------------------------------------------
#
# A block mask is (kv_num_blocks int32 [B,H,Qb], kv_indices int32 [B,H,Qb,maxKV],
# block_size), FlexAttention's layout: query block i covers queries
# s in [i*block_size, min((i+1)*block_size, S)), key block j covers keys
# t in [j*block_size, min((j+1)*block_size, T)); Qb = ceil(S/block_size),
# Kb = ceil(T/block_size). Row (b, h, i) selects the key blocks
# kv_indices[b,h,i,:kv_num_blocks[b,h,i]]; only those entries count, whatever
# the rest of the row holds. The masks produced here list them ascending and
# pad the rest with 0 (a valid block index, so kernels that read a whole row
# never go out of bounds). B and H may be 1 to broadcast; H counts query heads.
# To hand a mask of width maxKV < Kb to FlexAttention, pass seq_lengths:
# BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=block_size,
# mask_mod=..., seq_lengths=(S, T)) (see to_flex_block_mask).


def _block_means(x, bs):
    """x [B,N,H,D] -> mean over each block of bs rows [B,ceil(N/bs),H,D] (last block partial)."""
    B, N, H, D = x.shape
    nb = -(-N // bs)
    pad = nb * bs - N
    xs = F.pad(x, (0, 0, 0, 0, 0, pad)).reshape(B, nb, bs, H, D).sum(2)
    counts = torch.clamp(N - torch.arange(nb, device=x.device) * bs, max=bs).to(x.dtype)
    return xs / counts[None, :, None, None]


def _block_extreme(x, bs, largest):
    """Per-block, per-channel max (largest=True) or min of x [B,N,H,D] -> [B,nb,H,D]."""
    B, N, H, D = x.shape
    nb = -(-N // bs)
    pad = nb * bs - N
    fill = NEG_INF if largest else float("inf")
    xs = F.pad(x, (0, 0, 0, 0, 0, pad), value=fill).reshape(B, nb, bs, H, D)
    return xs.amax(2) if largest else xs.amin(2)


def _blocks_to_ordered(blocks, width=None):
    """bool [..., Qb, Kb] -> (num int32 [..., Qb], indices int32 [..., Qb, width]):
    the selected block indices ascending, padded with 0."""
    Kb = blocks.shape[-1]
    width = Kb if width is None else width
    col = torch.arange(Kb, device=blocks.device).expand(blocks.shape)
    keyed = torch.where(blocks, col, torch.full_like(col, Kb))
    ordered = keyed.sort(-1).values[..., :width]
    num = blocks.sum(-1).to(torch.int32)
    if width > Kb:
        ordered = F.pad(ordered, (0, width - Kb), value=Kb)
    ordered = torch.where(ordered == Kb, torch.zeros_like(ordered), ordered)
    return num, ordered.to(torch.int32)


def _ordered_to_blocks(kv_num_blocks, kv_indices, n_cols):
    """(num [...,Qb], indices [...,Qb,W]) -> bool [..., Qb, n_cols]; only the first
    num entries of each row count (block indices in [0, n_cols))."""
    W = kv_indices.shape[-1]
    used = torch.arange(W, device=kv_indices.device) < kv_num_blocks[..., None].long()
    idx = kv_indices.long()
    target = torch.where(used, idx, torch.full_like(idx, n_cols))
    blocks = torch.zeros(*idx.shape[:-1], n_cols + 1, dtype=torch.bool, device=idx.device)
    blocks.scatter_(-1, target, True)
    return blocks[..., :n_cols]


def block_topk_mask(q, k, *, block_size, topk_blocks, causal=True, sink_blocks=1,
                    local_blocks=1, pooling="mean", q_start=None):
    """Block-level predictor: which key blocks each (query block, query head) attends to.

    q [B,S,H,D], k [B,T,Hkv,D] (Hkv divides H; query head h is scored against
    kv head h // (H // Hkv)). Returns (kv_num_blocks int32 [B,H,Qb],
    kv_indices int32 [B,H,Qb,maxKV]) in FlexAttention's format (see the
    section comment above): Qb = ceil(S/block_size), Kb = ceil(T/block_size),
    maxKV = min(Kb, sink_blocks + local_blocks + topk_blocks); the selected
    blocks ascending, then 0 padding; only the first kv_num_blocks entries count.

    Definitions, for query block i of batch b (computed in fp32):
      last_i  = q_start[b] + min((i+1)*block_size, S) - 1, the absolute position
                of the block's last query (q_start defaults to T - S)
      diag_i  = min(floor(last_i / block_size), Kb - 1), the key block holding it
      allowed = key blocks j <= diag_i when causal (key block start j*block_size
                <= last_i), every block otherwise
      qbar    = mean of q over the queries of block i, per head   [D]
      kbar    = mean of k over the keys of block j, per kv head   [D] (last block partial)
      score   = qbar · kbar                                       pooling="mean" (MoBA)
              = sum_d max(qbar_d * kmin_d, qbar_d * kmax_d)       pooling="minmax" (Quest;
                kmin/kmax the per-channel min/max of k over block j: an upper bound
                on qbar·k_t for every key t of the block)
    Selection: the mandatory blocks, sink (j < sink_blocks) and local
    (diag_i - local_blocks < j <= diag_i), each kept only if allowed; then the
    topk_blocks highest-scoring allowed blocks among the rest (fewer if fewer
    remain; among equal scores the lower block index wins, kernels may break
    ties either way). kv_num_blocks = #mandatory + min(topk_blocks, #remaining).
    The mask is block-level only: token-level causality inside the diagonal
    blocks is applied by the attention (block_sparse_attention(causal=True)).
    Scale does not matter for ranking, so none is taken."""
    B, S, H, D = q.shape
    T, Hkv = k.shape[1], k.shape[2]
    bs = block_size
    Qb, Kb = -(-S // bs), -(-T // bs)
    G = H // Hkv
    dev = q.device

    qbar = _block_means(q.float(), bs)                                   # [B,Qb,H,D]
    kf = k.float()
    if pooling == "mean":
        kbar = _block_means(kf, bs).repeat_interleave(G, dim=2)          # [B,Kb,H,D]
        score = torch.einsum("bihd,bjhd->bhij", qbar, kbar)
    else:
        kmax = _block_extreme(kf, bs, True).repeat_interleave(G, dim=2)
        kmin = _block_extreme(kf, bs, False).repeat_interleave(G, dim=2)
        # max(a*m, a*M) with m <= M is a*M for a >= 0 and a*m for a < 0
        score = (torch.einsum("bihd,bjhd->bhij", qbar.clamp(min=0), kmax)
                 + torch.einsum("bihd,bjhd->bhij", qbar.clamp(max=0), kmin))

    pos = query_positions(B, S, T, q_start, dev)                         # [B,S]
    last_row = torch.clamp((torch.arange(Qb, device=dev) + 1) * bs, max=S) - 1
    last = pos[:, last_row]                                              # [B,Qb]
    diag = torch.div(last, bs, rounding_mode="floor").clamp(max=Kb - 1)
    j = torch.arange(Kb, device=dev)[None, None, :]
    d = diag[:, :, None]
    allowed = (j <= d) if causal else torch.ones(B, Qb, Kb, dtype=torch.bool, device=dev)
    mandatory = ((j < sink_blocks) | ((j <= d) & (j > d - local_blocks))) & allowed
    cand = (allowed & ~mandatory)[:, None].expand(B, H, Qb, Kb)          # [B,H,Qb,Kb]

    keyed = score.masked_fill(~cand, NEG_INF)
    order = torch.sort(keyed, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(Kb, device=dev).expand_as(order))
    take = cand.sum(-1, keepdim=True).clamp(max=topk_blocks)
    chosen = cand & (rank < take)
    blocks = mandatory[:, None] | chosen
    return _blocks_to_ordered(blocks, width=min(Kb, sink_blocks + local_blocks + topk_blocks))


def block_mask_to_dense(kv_num_blocks, kv_indices, block_size, S, T):
    """bool [B,H,S,T]: True where query s may attend key t under the block mask,
    i.e. block t // block_size is among the first kv_num_blocks[b,h,s // block_size]
    entries of kv_indices[b,h,s // block_size]. Block structure only: no causal
    mask. B and H are the mask's own (1 stays 1, for broadcasting)."""
    Kb = -(-T // block_size)
    blocks = _ordered_to_blocks(kv_num_blocks, kv_indices, Kb)         # [B,H,Qb,Kb]
    dense = blocks.repeat_interleave(block_size, dim=2)[:, :, :S]
    return dense.repeat_interleave(block_size, dim=3)[..., :T]


def block_sparse_attention(q, k, v, kv_num_blocks, kv_indices, *, block_size, scale,
                           causal=True, q_start=None):
    """Attention restricted to the key blocks of a block mask.

    q [B,S,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,Dv] as for sparse_attention; the
    mask (kv_num_blocks [B|1, Hq|1, Qb], kv_indices [B|1, Hq|1, Qb, maxKV],
    block_size) in the format described above (mask heads are query heads).
    Query s attends key t iff block_mask_to_dense(...)[b,h,s,t] and, when causal,
    t <= q_start[b] + s (q_start defaults to T - S; token-level inside the
    selected blocks). Returns (out [B,S,Hq,Dv] in q.dtype, lse fp32 [B,S,Hq]),
    natural-log lse; a query left with no key outputs zeros and lse = -inf.
    Differentiable. The oracle materialises the dense [B,H,S,T] mask."""
    B, S, Hq, _, T, _, _ = _attention_dims(q, k, v)
    dense = block_mask_to_dense(kv_num_blocks, kv_indices, block_size, S, T)
    if causal:
        dense = dense & ~causal_mask(B, S, T, q_start, q.device)[:, None]
    return _dense_masked_attention(q, k, v, scale, lambda s0, s1: dense[:, :, s0:s1])


# --------------------------------------------------------------------------
# Mixture of Experts (HF layout: gate_w [E,D], w_gate_up [E,2I,D] with the
# gate rows first and the up rows second, w_down [E,D,I])
# --------------------------------------------------------------------------

def moe_route(h, gate_w, bias, *, top_k, n_group, topk_group, routed_scaling_factor,
              norm_topk_prob):
    """GLM-5's router: transformers' GlmMoeDsaTopkRouter (= DeepSeek-V3 "noaux_tc").

    h [T,D] (any float dtype; leading dims are flattened), gate_w [E,D],
    bias [E] (e_score_correction_bias). Returns (weights fp32 [T,top_k],
    ids int32 [T,top_k]). Step by step, all in fp32:
      logits  = h @ gate_w^T;  scores = sigmoid(logits)                 [T,E]
      choice  = scores + bias              (the bias only steers the choice)
      group g = experts [g*E/n_group, (g+1)*E/n_group); its score is the sum
                of the 2 largest `choice` values in it
      keep the topk_group best groups; set `choice` = -inf in the others
      ids     = the top_k experts by masked `choice`
      weights = scores[ids] (un-biased); if norm_topk_prob:
                weights /= (weights.sum(-1) + 1e-20); then weights *= routed_scaling_factor
    Slot order: this oracle lists ids by decreasing `choice`; HF uses
    topk(sorted=False), so compare (id, weight) pairs as sets. Ties (equal
    `choice` or group scores) may be broken either way.
    Requires E % n_group == 0, at least 2 experts per group (HF takes a top-2
    per group) and top_k <= topk_group * E / n_group (otherwise HF would pick
    among -inf entries arbitrarily)."""
    hf = h.reshape(-1, h.shape[-1]).float()
    E = gate_w.shape[0]
    logits = F.linear(hf, gate_w.float())
    scores = logits.sigmoid()
    choice = scores + bias.float()
    group_scores = choice.view(-1, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)
    group_idx = group_scores.topk(topk_group, dim=-1).indices
    group_keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    expert_keep = group_keep.repeat_interleave(E // n_group, dim=1)
    choice = choice.masked_fill(~expert_keep, NEG_INF)
    ids = choice.topk(top_k, dim=-1, sorted=True).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)


def moe_dispatch(x, ids, num_experts, *, align=1):
    """Group the (token, slot) pairs by expert: x [T,D], ids int32 [T,k] in [0,E).

    Returns (x_sorted [N,D] in x.dtype, plan: MoEPlan). A counting sort:
      count_e   = #{(t,j): ids[t,j] == e}
      padded_e  = ceil(count_e / align) * align     (0 for an expert with no token)
      expert_offsets = [0, cumsum(padded)]           N = expert_offsets[E]
    Within expert e's segment the real rows come first, in (t, j) order
    (stable: by token, then by slot), then padded_e - count_e padding rows.
      x_sorted[r]  = x[slot_token[r]] for real rows, 0 for padding rows
      token_slot[t,j] = the row r that holds (t, j), so x_sorted[token_slot[t,j]] = x[t]
    Differentiable with respect to x."""
    T, D = x.shape
    k = ids.shape[1]
    dev = x.device
    flat = ids.reshape(-1).long()                                  # pair p = t*k + j
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + align - 1) // align * align
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    offsets[1:] = torch.cumsum(padded, 0)
    real_starts = torch.cumsum(counts, 0) - counts                 # unpadded segment starts
    order = torch.sort(flat, stable=True).indices                  # pairs grouped by expert, (t,j) order
    e_sorted = flat[order]
    rank = torch.arange(flat.numel(), device=dev) - real_starts[e_sorted]
    rows = offsets[e_sorted] + rank
    N = int(offsets[-1])
    token_slot = torch.empty_like(flat)
    token_slot[order] = rows
    slot_token = torch.full((N,), -1, dtype=torch.long, device=dev)
    slot_token[rows] = order // k if k else order
    real = slot_token >= 0
    x_sorted = x.index_select(0, slot_token.clamp(min=0)) * real[:, None].to(x.dtype)
    plan = MoEPlan(offsets.to(torch.int32), slot_token.to(torch.int32),
                   token_slot.reshape(T, k).to(torch.int32))
    return x_sorted, plan


def moe_combine(y_sorted, plan, weights):
    """Weighted un-permute: out[t] = sum_j weights[t,j] * y_sorted[token_slot[t,j]].

    y_sorted [N,D]; plan is a MoEPlan or the token_slot tensor int32 [T,k]
    itself (the schema passes token_slot); weights [T,k]. Returns [T,D] in
    y_sorted.dtype, accumulated in fp32 (float64 for float64 inputs); padding
    rows are never read. Differentiable with respect to y_sorted and weights."""
    token_slot = plan.token_slot if isinstance(plan, MoEPlan) else plan
    acc = _acc_dtype(y_sorted, weights)
    T, k = token_slot.shape
    gathered = y_sorted.to(acc).index_select(0, token_slot.reshape(-1).long()).reshape(T, k, y_sorted.shape[1])
    out = (weights.to(acc)[:, :, None] * gathered).sum(1)
    return out.to(y_sorted.dtype)


def swiglu_expert(x, w_gate_up_e, w_down_e):
    """One SwiGLU expert in HF layout: x [n,D], w_gate_up_e [2I,D] (gate rows
    0..I-1, up rows I..2I-1), w_down_e [D,I] -> [n,D]:
        gate, up = (x @ w_gate_up_e^T).chunk(2, -1);  (silu(gate) * up) @ w_down_e^T
    Computed and returned in fp32 (float64 for float64 inputs)."""
    acc = _acc_dtype(x, w_gate_up_e, w_down_e)
    gate, up = F.linear(x.to(acc), w_gate_up_e.to(acc)).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down_e.to(acc))


def fused_moe(x, w_gate_up, w_down, weights, ids):
    """The routed-expert layer, as transformers' GlmMoeDsaExperts computes it.

    x [T,D], w_gate_up [E,2I,D], w_down [E,D,I], weights [T,k] (from moe_route),
    ids int32 [T,k] in [0,E). Returns [T,D] in x.dtype:
        out[t] = sum_j weights[t,j] * swiglu_expert(x[t], w_gate_up[ids[t,j]], w_down[ids[t,j]])
    The per-expert loop: for each expert that received a token, gather its
    (token, slot) pairs, run the expert on those rows, scale by the weights and
    index_add into the output; accumulated in fp32 (float64 for float64
    inputs) and cast once at the end (HF casts each expert's contribution to
    x.dtype before adding; identical in fp32). Differentiable with respect to
    x, w_gate_up, w_down and weights (the backward oracle is autograd through it)."""
    T, D = x.shape
    acc = _acc_dtype(x, w_gate_up, w_down, weights)
    out = torch.zeros(T, D, dtype=acc, device=x.device)
    ids_l = ids.long()
    for e in torch.unique(ids_l).tolist() or [0]:   # no (token, slot): expert 0 on no rows keeps the graph
        token_idx, slot = torch.where(ids_l == e)
        y = swiglu_expert(x[token_idx], w_gate_up[e], w_down[e])
        y = y * weights[token_idx, slot, None].to(acc)
        out = out.index_add(0, token_idx, y)
    return out.to(x.dtype)


# --------------------------------------------------------------------------
# Activation compression: group-wise asymmetric quantisation, packed
# --------------------------------------------------------------------------
#
# Byte layout. x is read in C order and cut into G = x.numel() / group_size
# groups of group_size consecutive elements (group_size divides x.shape[-1],
# so a group never spans two rows). Each element becomes an unsigned code
# q in [0, 2^bits - 1]. packed is a flat uint8 tensor [x.numel() * bits / 8]:
# element n sits in byte n // (8 / bits) at bit offset (n % (8 / bits)) * bits,
# first element in the lowest bits:
#   8-bit: byte n = q[n]
#   4-bit: byte i = q[2i] | q[2i+1] << 4
#   2-bit: byte i = q[4i] | q[4i+1] << 2 | q[4i+2] << 4 | q[4i+3] << 6
# group_size must be a multiple of 8 / bits, so every group starts on a byte.
# scale and zero are fp32 [G]: x ≈ zero[g] + q * scale[g].

def quantize_groupwise(x, bits, group_size=128, stochastic=False, generator=None, *, seed=None):
    """Asymmetric min/max quantisation of contiguous groups, packed (layout above).

    x: floating tensor of rank >= 1 whose last dimension group_size divides.
    Per group g, in fp32:
        zero[g]  = min(x_g)
        scale[g] = (max(x_g) - min(x_g)) / (2^bits - 1)   (0 for a constant group)
        v = (x - zero[g]) / scale[g]     (v = 0 where scale[g] == 0)
        q = round(v)  (half to even)     or, stochastic: floor(v + u), u ~ U[0,1)
        q = clamp(q, 0, 2^bits - 1)
    so deterministic rounding is off by at most scale/2 and stochastic rounding
    is unbiased (E[q] = v). u is drawn with torch.rand over the [G, group_size]
    codes in order, from `generator` (or a fresh one seeded with `seed`; the
    global RNG if both are None). The C++/CUDA kernels take a seed and draw
    differently: stochastic results are compared statistically, and kernels
    may differ from this oracle by one code where v is within rounding of a
    .5 tie. Returns (packed uint8 [x.numel()*bits/8], scale fp32 [G], zero fp32 [G])."""
    levels = (1 << bits) - 1
    xg = x.detach().float().reshape(-1, group_size)                # [G, group_size]
    G = xg.shape[0]
    if G == 0:
        empty = torch.zeros(0, dtype=torch.float32, device=x.device)
        return torch.zeros(0, dtype=torch.uint8, device=x.device), empty, empty.clone()
    zero = xg.amin(1)
    # A tensor divisor: on CUDA `tensor / python_number` runs as tensor * fl(1/number),
    # one more rounding than the kernels' exact division (the CPU divides either way).
    scale = (xg.amax(1) - zero) / torch.full_like(zero, levels)
    has_range = scale > 0
    v = (xg - zero[:, None]) / torch.where(has_range, scale, torch.ones_like(scale))[:, None]
    v = torch.where(has_range[:, None], v, torch.zeros_like(v))
    if stochastic:
        if generator is None and seed is not None:
            generator = torch.Generator(device=x.device).manual_seed(int(seed))
        u = torch.rand(xg.shape, generator=generator, device=x.device, dtype=torch.float32)
        q = torch.floor(v + u)
    else:
        q = torch.round(v)
    q = q.clamp(0, levels).to(torch.uint8).reshape(-1)
    per = 8 // bits
    shifts = torch.arange(per, device=x.device, dtype=torch.uint8) * bits
    packed = (q.reshape(-1, per) << shifts).sum(1, dtype=torch.int32).to(torch.uint8)
    return packed, scale, zero


def dequantize(packed, scale, zero, bits, group_size, shape, dtype=torch.float32):
    """Inverse of quantize_groupwise: x_hat = zero[g] + q * scale[g], computed in
    fp32, returned as `dtype` with `shape` (the shape that was quantised)."""
    shape = tuple(int(s) for s in shape)
    G = math.prod(shape) // group_size
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.uint8) * bits
    mask = (1 << bits) - 1
    q = ((packed.reshape(-1, 1) >> shifts) & mask).reshape(G, group_size).float()
    x = zero.float().reshape(G, 1) + q * scale.float().reshape(G, 1)
    return x.reshape(shape).to(dtype)


# --------------------------------------------------------------------------
# INT8 inference: per-row symmetric int8 (weights per output channel,
# activations per token)
# --------------------------------------------------------------------------
#
# A row r of x [..., K] is stored as q int8 [..., K] and scale fp32 [...]:
#   scale[r] = max_k |x[r, k]| / 127   (computed in fp32)
#   q[r, k]  = clamp(round(x[r, k] / scale[r]), -127, 127)   (half to even, exact fp32
#              division; 0 for an all-zero row), so |x - q * scale| <= scale / 2.
# -128 is never produced: the range is symmetric, so negating a row negates its codes.

def int8_quantize_rows(x):
    """(q int8 [..., K], scale fp32 [...]) for floating x [..., K] (layout above)."""
    xf = x.detach().float()
    if xf.shape[-1] == 0:
        return torch.zeros(xf.shape, dtype=torch.int8, device=x.device), torch.zeros(xf.shape[:-1], device=x.device)
    # max / 127 rounded once from float64: exact, where a CUDA tensor's division by a
    # Python number multiplies by its reciprocal (1 ulp off the kernels' __fdiv_rn)
    scale = (xf.abs().amax(-1).double() / 127).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    q = torch.where(scale[..., None] > 0, torch.round(xf / safe), torch.zeros_like(xf))
    return q.clamp(-127, 127).to(torch.int8), scale


def int8_dequantize_rows(q, scale, dtype=torch.float32):
    """q * scale[..., None] as `dtype` (computed in fp32)."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def int8_linear(x, w, scale, bias=None):
    """Weight-only int8 linear: x [M,K] float, w int8 [N,K], scale fp32 [N],
    bias [N] or None -> [M,N] in x.dtype:
        y = x @ (w * scale[:, None])^T + bias
    The kernels accumulate in fp32; this oracle in float64, then casts once."""
    y = x.double() @ (w.double() * scale.double()[:, None]).T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def int8_linear_heads(x, w, scale):
    """Each head's weight-only int8 product: x [H,M,K] float, w int8 [H,N,K], scale
    fp32 [H,N] -> [H,M,N] in x.dtype, y[h] = x[h] @ (w[h] * scale[h][:, None])^T
    (float64 here; the kernels accumulate in fp32)."""
    return (x.double() @ (w.double() * scale.double()[..., None]).transpose(1, 2)).to(x.dtype)


def w8a8_linear(x, w, scale, bias=None):
    """Dynamic W8A8 linear: each row of x [M,K] is quantised as above
    (qx, sx = int8_quantize_rows(x)), then
        y[m, n] = (sum_k qx[m, k] * w[n, k]) * sx[m] * scale[n] + bias[n]
    The integer sum is exact (int32 in the kernels, K <= 131072 keeps it in range;
    float64 here); the scaling is fp32 in the kernels. Returns [M,N] in x.dtype."""
    qx, sx = int8_quantize_rows(x)
    y = (qx.double() @ w.double().T) * sx.double()[:, None] * scale.double()[None, :]
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


# fused_moe_int8(w8a8=True) quantises the activations of an expert with more than
# this many rows; fewer rows (decode) run weight-only, since their time goes to
# reading the weights, which are int8 either way.
W8A8_MIN_ROWS = 16


# The packed row layout of an int8 weight [..., N, K] (fused_moe_int8's packed=True, which
# the CPU decode kernel reads as one sequential stream, each vector 4 bytes of 16 rows;
# csrc/cpu/int8_vnni.h): rows in groups of PACK_ROWS, each group's bytes ordered chunk by
# chunk, PACK_CHUNK bytes of each of its rows in turn, then the rows' K % PACK_CHUNK tails in
# turn; the N % PACK_ROWS rows after the last group stay plain. Same shape and bytes, permuted
# within each group.
PACK_ROWS, PACK_CHUNK = 16, 4


def _pack(w, inverse):
    *lead, N, K = w.shape
    R, C = PACK_ROWS, PACK_CHUNK
    G, kc = N // R, K // C * C
    groups = w[..., :G * R, :]
    if not inverse:   # each group [R, K] -> its chunks [kc / C, R, C], then its tails [R, K - kc]
        rows = groups.reshape(*lead, G, R, K)
        main = rows[..., :kc].reshape(*lead, G, R, kc // C, C).transpose(-3, -2).reshape(*lead, G, R * kc)
        out = torch.cat([main, rows[..., kc:].reshape(*lead, G, R * (K - kc))], -1)
    else:
        flat = groups.reshape(*lead, G, R * K)
        main = flat[..., :R * kc].reshape(*lead, G, kc // C, R, C).transpose(-3, -2).reshape(*lead, G, R, kc)
        out = torch.cat([main, flat[..., R * kc:].reshape(*lead, G, R, K - kc)], -1)
    return torch.cat([out.reshape(*lead, G * R, K), w[..., G * R:, :]], -2)


def pack_rows(w):
    """w [..., N, K] -> the same weights in the packed row layout (above)."""
    return _pack(w, inverse=False)


def unpack_rows(w):
    """The inverse of pack_rows."""
    return _pack(w, inverse=True)


def fused_moe_int8(x, w_gate_up, gate_up_scale, w_down, down_scale, weights, ids, w8a8=False, packed=False):
    """fused_moe with int8 experts: w_gate_up int8 [E,2I,D] with gate_up_scale fp32
    [E,2I] (per output row), w_down int8 [E,D,I] with down_scale fp32 [E,D].
    x [T,D] float, weights [T,k], ids int32 [T,k] in [0,E). Returns [T,D] in x.dtype:
        out[t] = sum_j weights[t,j] * expert_e(x[t]),  e = ids[t,j]
    Weight-only: expert_e is swiglu_expert on the dequantised weights (float64 here).
    w8a8=True, for an expert with more than W8A8_MIN_ROWS rows: its gate/up input
    rows and its down input rows are quantised per row as in w8a8_linear
    (fp32 between the two products); other experts run weight-only. packed: both
    weights in pack_rows's layout."""
    if packed:
        w_gate_up, w_down = unpack_rows(w_gate_up), unpack_rows(w_down)
    T, D = x.shape
    out = torch.zeros(T, D, dtype=torch.float64, device=x.device)
    ids_l = ids.long()
    for e in torch.unique(ids_l).tolist():
        token_idx, slot = torch.where(ids_l == e)
        if w8a8 and token_idx.numel() > W8A8_MIN_ROWS:
            gate, up = w8a8_linear(x[token_idx].float(), w_gate_up[e], gate_up_scale[e]).chunk(2, dim=-1)
            y = w8a8_linear(F.silu(gate) * up, w_down[e], down_scale[e]).double()
        else:
            y = swiglu_expert(x[token_idx].double(), int8_dequantize_rows(w_gate_up[e], gate_up_scale[e], torch.float64),
                              int8_dequantize_rows(w_down[e], down_scale[e], torch.float64))
        out = out.index_add(0, token_idx, y * weights[token_idx, slot, None].double())
    return out.to(x.dtype)


# --------------------------------------------------------------------------
# Decode linear layers
# --------------------------------------------------------------------------

def gemv(x, w, bias=None):
    """y = x @ w^T + bias for x [M,K], w [N,K] (both fp32 or both bf16), bias [N]
    (x's dtype) or None -> [M,N] in x.dtype; per head for x [H,M,K], w [H,N,K]
    (no bias) -> [H,M,N]. The kernel accumulates in fp32 and rounds once to
    x.dtype; this oracle sums in float64, then casts once."""
    y = x.double() @ w.double().transpose(-1, -2)
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def cache_write(pool, slots, values):
    """The pool after the paged cache's store: row slots[i] replaced by values[i] (out of place)."""
    return pool.index_copy(0, slots, values)


def rms_norm(x, weight, eps: float):
    """RMSNorm over the last dim in transformers' order: normalise in fp32,
    round to x's dtype, then multiply by weight [D] (the model's composite;
    differentiable)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rope(x, cos, sin, rotary_dim: int | None = None):
    """GLM-5's interleaved RoPE on the first rotary_dim channels (all when
    None) of x [B,S,D] or [B,S,H,D], cos/sin [B,S,rotary_dim/2]: pairs (x0,x1),
    (x2,x3)... each rotated by one frequency, the result laid out
    de-interleaved (all first members, then all second members) as
    transformers does; channels past rotary_dim unchanged. Differentiable."""
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    if x.dim() == 4:
        cos, sin = cos[:, :, None], sin[:, :, None]
    x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., r:]], dim=-1)
