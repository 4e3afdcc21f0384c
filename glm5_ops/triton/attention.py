"""Triton kernels for sparse attention: token-level (DSA) and block-sparse,
and the block-level predictor (block_topk_mask).

Called by glm5_ops/attention.py with validated inputs (the first four as the
kernels of the glm5_triton:: ops):

  sparse_attention_fwd(q, k, v, indices, scale, causal, q_start)               -> (out, lse)
  sparse_attention_bwd(dout, q, k, v, indices, out, lse, scale, causal, q_start) -> (dq, dk, dv)
  block_sparse_attention_fwd(q, k, v, kv_num_blocks, kv_indices, block_size, scale, causal, q_start)
  block_sparse_attention_bwd(dout, q, k, v, kv_num_blocks, kv_indices, out, lse, block_size, scale,
                             causal, q_start)
  block_topk_mask(q, k, block_size, topk_blocks, causal, sink_blocks, local_blocks, pooling, q_start)

q [B,S,Hq,Dk] contiguous; k [B,T,Hkv,Dk] and v [B,T,Hkv,Dv] with unit stride
along D and any other strides (v may be the view k[..., :Dv], MLA's absorbed
form); indices int32 [B,S,topk]; q_start None (T - S) or int64 [B]. The
block mask is kv_num_blocks int32 [B,Hq,Qb], kv_indices int32 [B,Hq,Qb,W].
Semantics: glm5_ops/reference.py. Works on CUDA tensors and on CPU tensors
under TRITON_INTERPRET=1 (fp32/fp16 there: the interpreter has no bf16 math).

Design (FlashAttention-style: online softmax in fp32 with exp2, nothing of
size [S, T] is ever stored):
  _sparse_fwd_kernel    one program per (query, kv head, block of 16-64 of its
                        G query heads): loops over the query's topk slots in
                        tiles of BLOCK_N gathered key rows; each gathered row
                        serves all heads of the program through one [heads, keys]
                        tl.dot (FlashMLA's sparse-prefill idea). G is padded to a
                        power of two >= 16 with masked rows so tl.dot works for
                        any head count (MQA, GQA 4/16, MLA's 64+).
  _sparse_bwd_kernel    same walk; recomputes P from lse, delta = rowsum(dO*O)
                        in the program; dq stays in registers; dk/dv are
                        scattered with fp32 atomics: a key is chosen by an
                        unknown set of queries, and inverting a per-token
                        selection (CSR of size S*topk) costs more than atomics.
  _block_fwd_kernel     one program per (query tile, query head, batch): loops
                        over the selected key blocks of its query block in tiles
                        of BLOCK_N keys; token-level causal mask inside blocks.
  _block_dq_kernel      dq (and delta, saved for the next kernel), same walk.
  _block_dkdv_kernel    dk/dv per (key tile, kv head, batch) from the TRANSPOSED
                        mask (for each key block, the (head, query block) pairs
                        that selected it; built with torch ops, it is only
                        [Qb, Kb] per head): accumulates over all G heads of its
                        kv head in registers, deterministic and with no atomic
                        contention (GQA would make G*Qb programs hit the same
                        rows) and no fp32 scratch buffers.
  _pool_kernel / _block_score_kernel
                        block_topk_mask's pooled block means (or Quest's per-block
                        min/max) and the [Qb, Kb] block scores per head, in
                        Triton; the per-row selection (mandatory sink/local
                        blocks, top-k of the rest, ascending order) is done with
                        torch ops on those scores, following the reference step
                        by step (ties may be broken differently).
What the kernels share is written once, as @triton.jit helpers (inlined):
_sparse_queries / _block_queries (a program's query rows and q tile),
_sparse_tile / _block_tile (the next gathered or block key tile, its value
tile and q.k^T, both through _qk_tile) for the forward and the dq walks,
_softmax_step / _store_out_lse for both forwards, _probs (P from lse) and
_dout_delta for the backwards, _load_split / _store_split (Dk's two chunks).

Head dims: Dk is split into a power-of-two main chunk and a padded tail
(576 = 512 + 64, 192 = 128 + 64, FlashMLA's split), so no tile is padded to
1024; Dv is padded to a power of two. When v is a view of the first Dv
columns of k and Dv equals the main chunk, the key tile is reused as the value
tile (one gather instead of two, as in FlashMLA).
fp32 inputs use true fp32 dots (input_precision="ieee"), not TF32. In the
backward, the products with P and dS (dV, dQ, dK) stay fp32 for every input
dtype (the other operand is upcast): rounding P/dS to fp16/bf16 for the tensor
cores, as FlashAttention does, gave gradients up to ~2.1x the reference's own
low-precision error on small shapes, over the issue's 2x bound. On a GPU this
makes the low-precision backward's second half run at fp32 speed: the place
to win back (tf32x3, or bf16 with a split-precision correction) once timed.

Status on GPUs: every kernel compiles for sm_90 (Triton 3.6 and 3.8, bf16 and
fp32); tile sizes come from ptxas' register/spill report (see _sparse_config),
and the forward kernels shrink them when a shared-memory estimate says they
would not fit (fp32 with Dk/Dv near 1024, see _fit_fwd); a kernel that still
does not fit raises NotImplementedError naming the shape at launch. Not
yet run or timed on a GPU. Known costs: the Dk = 576 backward kernels spill a
few hundred bytes per thread, and fp32 (ieee) dots spill heavily at
Dk >= 192 (correct, slow; bf16/fp16 is the GPU path). The block-sparse
backward syncs once (the width of the transposed mask).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .._checks import dtype_name
from ._limits import launch_guard, smem_limit

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, acc=None, IEEE: tl.constexpr = False):
    """tl.dot, in true fp32 (input_precision="ieee") when IEEE, else the default
    (tensor cores for fp16/bf16 operands)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


_MAX_GRID_YZ = 65535   # CUDA grid dims 1 and 2


def _next_pow2(x: int) -> int:
    return 1 << (max(1, int(x)) - 1).bit_length()


def _split_d(D: int):
    """(DK1, DK2): a power-of-two main chunk and a padded tail (0 when none)."""
    main = max(16, 1 << (max(1, D).bit_length() - 1))
    rest = D - main
    return main, (max(16, _next_pow2(rest)) if rest > 0 else 0)


def _v_from_k(k, v, DK1, DV) -> bool:
    """v is k[..., :Dv] (same storage, strides, start) and fits in k's main chunk."""
    return (v.data_ptr() == k.data_ptr() and v.stride()[:3] == k.stride()[:3]
            and DV == DK1 and v.shape[3] <= DK1)


# Tile sizes. Chosen from an sm_90 compile of every kernel (bf16, ptxas
# register / spill report; no GPU was available to time them): the largest
# tiles that compile without spilling, or with the least spilling for
# Dk = 576. fp32 dots keep the same tiles (shared memory still fits).
# The gathered tiles are loaded through per-element pointers, which cost
# registers: 8 warps beat 4 on the big tiles.

def _sparse_config(Dk: int, Dv: int, G: int, bwd: bool) -> dict:
    """Token-level kernels: BLOCK_H heads of a kv group x BLOCK_N gathered keys."""
    DK1, DK2 = _split_d(Dk)
    DV = max(16, _next_pow2(Dv))
    big = max(DK1 + DK2, DV) >= 512              # MLA's 576 / 512
    BLOCK_H = min(64, max(16, _next_pow2(G)))
    if bwd:   # dq [BLOCK_H, Dk] and the dk/dv partials [BLOCK_N, D] live in registers
        BLOCK_H = 16 if big else min(BLOCK_H, 32)
        BLOCK_N = 16 if big or BLOCK_H == 32 else 32
        num_warps, num_stages = (4 if big else 8), 1   # atomics in the loop: no deep pipelining
    elif big:
        BLOCK_H, BLOCK_N, num_warps, num_stages = min(BLOCK_H, 32), 32, 8, 2
    else:
        BLOCK_N = 64 if BLOCK_H == 64 else 32
        num_warps, num_stages = (8 if BLOCK_H == 64 else 4), 2
    return dict(DK1=DK1, DK2=DK2, DV=DV, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, num_warps=num_warps,
                num_stages=num_stages)


# Shared memory of the forward kernels, estimated from their tiles (bytes): the query
# rows [BLOCK_H|BLOCK_M, Dk], the key tile [BLOCK_N, Dk], the value tile [BLOCK_N, Dv]
# (none when it is the key tile), the fp32 scores [rows, BLOCK_N] and 4 KiB of scratch.
# An upper bound on sm_90 compiles (triton 3.6): sparse forward within ~4 KiB of the
# measured metadata.shared (fp32 and bf16, Dk 96-1024, Dv 512-1024); block forward
# within 4 KiB to 2x (not every tile is staged there). Only used to pick smaller
# tiles: fp32 with Dk/Dv >= 576 (sparse, Dv=1024) or 768 (block) needs them on an
# H100/H200. The backward kernels already run at the smallest tiles (16 x 16); one
# that still does not fit (bf16 Dk = Dv = 1024 sparse backward: 263 KB) raises
# NotImplementedError at launch (launch_guard), naming the shape.

def _fwd_smem(rows: int, BLOCK_N: int, DK: int, DV: int, item: int, v_from_k: bool) -> int:
    return item * (rows * DK + BLOCK_N * DK + (0 if v_from_k else BLOCK_N * DV)) + rows * BLOCK_N * 4 + 4096


def _fit_fwd(cfg: dict, rows_key: str, item: int, v_from_k: bool, smem: int) -> dict:
    """Halve BLOCK_N, then the query rows (>= 16 each) until the forward's estimate fits `smem`."""
    cfg = dict(cfg)
    DK, DV = cfg["DK1"] + cfg["DK2"], cfg["DV"]
    while _fwd_smem(cfg[rows_key], cfg["BLOCK_N"], DK, DV, item, v_from_k) > smem:
        if cfg["BLOCK_N"] > 16:
            cfg["BLOCK_N"] //= 2
        elif cfg[rows_key] > 16:
            cfg[rows_key] //= 2
        else:
            break   # the smallest tiles: launch_guard names the shape if they do not fit either
    return cfg


def _block_config(Dk: int, Dv: int, bs: int, kind: str) -> dict:
    """Block-sparse kernels (kind "fwd", "dq" or "dkdv"): BLOCK_M queries x BLOCK_N keys."""
    DK1, DK2 = _split_d(Dk)
    DV = max(16, _next_pow2(Dv))
    dmax = max(DK1 + DK2, DV)
    if kind == "fwd":
        BLOCK_M, BLOCK_N, num_stages = (32 if dmax >= 512 else 64), 32, 2
    elif kind == "dq":
        BLOCK_M, BLOCK_N, num_stages = 16, (16 if dmax >= 512 else 32), 1
    else:   # dkdv: accumulators [BLOCK_N, Dk + Dv]
        BLOCK_M, BLOCK_N, num_stages = 16, (16 if dmax >= 192 else 32), 1
    fit = max(16, _next_pow2(bs))                # no tile wider than a (small) block
    return dict(DK1=DK1, DK2=DK2, DV=DV, BLOCK_M=min(BLOCK_M, fit), BLOCK_N=min(BLOCK_N, fit), num_warps=8,
                num_stages=num_stages)


# --------------------------------------------------------------------------
# Tiles shared by the kernels (inlined by Triton: no cost at run time)
# --------------------------------------------------------------------------

@triton.jit
def _load_split(rows, ok, D, DK1: tl.constexpr, DK2: tl.constexpr):
    """The rows [R, D] at the pointers `rows` (zeros where not ok), as the
    power-of-two main chunk [R, DK1] and the tail [R, DK2] of _split_d. Without
    a tail (DK2 == 0) the second value repeats the first: callers never use it."""
    d1 = tl.arange(0, DK1)
    x1 = tl.load(rows[:, None] + d1[None, :], mask=ok[:, None] & (d1 < D)[None, :], other=0.0)
    if DK2 > 0:
        d2 = DK1 + tl.arange(0, DK2)
        x2 = tl.load(rows[:, None] + d2[None, :], mask=ok[:, None] & (d2 < D)[None, :], other=0.0)
    else:
        x2 = x1
    return x1, x2


@triton.jit
def _store_split(rows, ok, x1, x2, D, DK1: tl.constexpr, DK2: tl.constexpr):
    """Stores _load_split's two chunks, cast to the pointers' dtype."""
    d1 = tl.arange(0, DK1)
    tl.store(rows[:, None] + d1[None, :], x1, mask=ok[:, None] & (d1 < D)[None, :])
    if DK2 > 0:
        d2 = DK1 + tl.arange(0, DK2)
        tl.store(rows[:, None] + d2[None, :], x2, mask=ok[:, None] & (d2 < D)[None, :])


@triton.jit
def _start(qs_ptr, b, S, T, HAS_QS: tl.constexpr):
    """Absolute position of batch b's query 0."""
    if HAS_QS:
        return tl.load(qs_ptr + b)
    else:
        return T - S


@triton.jit
def _qk_tile(q1, q2, k_rows, v_rows, ok, Dk, Dv, IEEE: tl.constexpr, V_FROM_K: tl.constexpr,
             DK1: tl.constexpr, DK2: tl.constexpr, DV: tl.constexpr):
    """Loads the key rows k_rows and value rows v_rows [BLOCK_N] (zeros where not
    ok): (q . k^T fp32 [rows, BLOCK_N], unscaled; the key chunks k1, k2; the
    value tile, the key tile itself when v = k[..., :Dv])."""
    k1, k2 = _load_split(k_rows, ok, Dk, DK1, DK2)
    qk = _dot(q1, tl.trans(k1), IEEE=IEEE)
    if DK2 > 0:
        qk = _dot(q2, tl.trans(k2), qk, IEEE=IEEE)
    if V_FROM_K:
        vt = k1
    else:
        vt, _ = _load_split(v_rows, ok, Dv, DV, 0)
    return qk, k1, k2, vt


@triton.jit
def _softmax_step(qk, m_i, l_i, acc, vt, IEEE: tl.constexpr):
    """One online-softmax step of the forward kernels: scores qk in the exp2
    domain, -inf where masked. Returns the new (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # no -inf - -inf on empty rows
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = tl.dot(p, vt, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _store_out_lse(out_rows, lse_ptrs, ok, acc, m_i, l_i, Dv, DV: tl.constexpr):
    """out = acc / l, lse = natural log of the normaliser; a row with no key
    gets zeros and lse = -inf."""
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    _store_split(out_rows, ok, out, out, Dv, DV, 0)
    lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptrs, lse, mask=ok)


@triton.jit
def _dout_delta(do_rows, o_rows, ok, Dv, DV: tl.constexpr):
    """(dO tile, delta = rowsum(dO * O) in fp32) of the backward kernels."""
    do, _ = _load_split(do_rows, ok, Dv, DV, 0)
    o, _ = _load_split(o_rows, ok, Dv, DV, 0)
    return do, tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)


@triton.jit
def _probs(qk, ok, qk_scale, lse):
    """P = exp(scale * qk - lse), recomputed from the forward's lse; 0 where
    not ok and in rows with no key (exp2(s - +inf) = 0 for lse = -inf)."""
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    return tl.exp2(tl.where(ok, qk * qk_scale, float("-inf")) - lse2[:, None])


# --------------------------------------------------------------------------
# Token-level sparse attention
# --------------------------------------------------------------------------

@triton.jit
def _sparse_queries(q_ptr, qs_ptr, S, T, Hq, G, Dk, HAS_QS: tl.constexpr, BLOCK_H: tl.constexpr,
                    DK1: tl.constexpr, DK2: tl.constexpr):
    """Program (query row = b * S + s, kv head, block of BLOCK_H of its G query
    heads): (row, kv head, b, the heads' rows of [B*S*Hq] and mask, q chunks, position)."""
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    b = row // S
    offs_g = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_g < G
    stat = row * Hq + (kvh * G + offs_g).to(tl.int64)
    q1, q2 = _load_split(q_ptr + stat * Dk, h_ok, Dk, DK1, DK2)
    pos = _start(qs_ptr, b, S, T, HAS_QS) + row % S
    return row, kvh, b, stat, h_ok, q1, q2, pos


@triton.jit
def _sparse_tile(q1, q2, idx_ptr, row, n0, TOPK, pos, k_base, v_base, sk_t, sv_t, Dk, Dv,
                 CAUSAL: tl.constexpr, IEEE: tl.constexpr, V_FROM_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 DK1: tl.constexpr, DK2: tl.constexpr, DV: tl.constexpr):
    """Slots n0 .. n0 + BLOCK_N of query row's selection, gathered: (qk, ok,
    key positions t64, k1, k2, v tile); see _qk_tile."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    t = tl.load(idx_ptr + row * TOPK + offs_n, mask=offs_n < TOPK, other=-1)
    ok = t >= 0
    if CAUSAL:
        ok = ok & (t <= pos)
    t64 = tl.where(ok, t, 0).to(tl.int64)
    qk, k1, k2, vt = _qk_tile(q1, q2, k_base + t64 * sk_t, v_base + t64 * sv_t, ok, Dk, Dv,
                              IEEE, V_FROM_K, DK1, DK2, DV)
    return qk, ok, t64, k1, k2, vt


@triton.jit
def _sparse_fwd_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, qs_ptr, out_ptr, lse_ptr,
    S, T, Hq, G, TOPK, Dk, Dv,
    sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    qk_scale,                                   # scale * log2(e): exp2 domain
    CAUSAL: tl.constexpr, HAS_QS: tl.constexpr, V_FROM_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr, DV: tl.constexpr,
):
    row, kvh, b, stat, h_ok, q1, q2, pos = _sparse_queries(q_ptr, qs_ptr, S, T, Hq, G, Dk, HAS_QS, BLOCK_H,
                                                           DK1, DK2)
    k_base = k_ptr + b * sk_b + kvh * sk_h
    v_base = v_ptr + b * sv_b + kvh * sv_h
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV], tl.float32)
    for n0 in range(0, TOPK, BLOCK_N):
        qk, ok, _, _, _, vt = _sparse_tile(q1, q2, idx_ptr, row, n0, TOPK, pos, k_base, v_base, sk_t, sv_t, Dk,
                                           Dv, CAUSAL, IEEE, V_FROM_K, BLOCK_N, DK1, DK2, DV)
        m_i, l_i, acc = _softmax_step(tl.where(ok[None, :], qk * qk_scale, float("-inf")), m_i, l_i, acc, vt, IEEE)
    _store_out_lse(out_ptr + stat * Dv, lse_ptr + stat, h_ok, acc, m_i, l_i, Dv, DV)


@triton.jit
def _sparse_bwd_kernel(
    do_ptr, q_ptr, k_ptr, v_ptr, idx_ptr, qs_ptr, o_ptr, lse_ptr, dq_ptr, dk_ptr, dv_ptr,
    S, T, Hq, Hkv, G, TOPK, Dk, Dv,
    sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    scale, qk_scale,
    CAUSAL: tl.constexpr, HAS_QS: tl.constexpr, V_FROM_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr, DV: tl.constexpr,
):
    """dk_ptr / dv_ptr: fp32 [B,T,Hkv,Dk|Dv] contiguous, zeroed, added to atomically."""
    row, kvh, b, stat, h_ok, q1, q2, pos = _sparse_queries(q_ptr, qs_ptr, S, T, Hq, G, Dk, HAS_QS, BLOCK_H,
                                                           DK1, DK2)
    dq1 = tl.zeros([BLOCK_H, DK1], tl.float32)
    dq2 = dq1                                   # the tail's, replaced when there is one
    if DK2 > 0:
        dq2 = tl.zeros([BLOCK_H, DK2], tl.float32)
    do, delta = _dout_delta(do_ptr + stat * Dv, o_ptr + stat * Dv, h_ok, Dv, DV)
    lse = tl.load(lse_ptr + stat, mask=h_ok, other=float("-inf"))   # padded heads: P = 0
    k_base = k_ptr + b * sk_b + kvh * sk_h
    v_base = v_ptr + b * sv_b + kvh * sv_h
    dk_base = dk_ptr + (b * T * Hkv + kvh) * Dk
    dv_base = dv_ptr + (b * T * Hkv + kvh) * Dv
    d1 = tl.arange(0, DK1)
    dv = tl.arange(0, DV)

    for n0 in range(0, TOPK, BLOCK_N):
        qk, ok, t64, k1, k2, vt = _sparse_tile(q1, q2, idx_ptr, row, n0, TOPK, pos, k_base, v_base, sk_t, sv_t,
                                               Dk, Dv, CAUSAL, IEEE, V_FROM_K, BLOCK_N, DK1, DK2, DV)
        p = _probs(qk, ok[None, :], qk_scale, lse)                  # [H, N] fp32
        dkv_ok = ok[:, None]
        dv_part = tl.dot(tl.trans(p), do.to(tl.float32), input_precision="ieee")
        dp = _dot(do, tl.trans(vt), IEEE=IEEE)
        tl.atomic_add(dv_base + (t64 * Hkv * Dv)[:, None] + dv[None, :], dv_part,
                      mask=dkv_ok & (dv < Dv)[None, :], sem="relaxed")
        ds = p * (dp - delta[:, None])                  # dL/d(score), up to the scale
        dk_rows = dk_base + t64 * Hkv * Dk
        dq1 = tl.dot(ds, k1.to(tl.float32), dq1, input_precision="ieee")
        dk1 = tl.dot(tl.trans(ds), q1.to(tl.float32), input_precision="ieee")
        tl.atomic_add(dk_rows[:, None] + d1[None, :], dk1 * scale, mask=dkv_ok & (d1 < Dk)[None, :], sem="relaxed")
        if DK2 > 0:
            d2 = DK1 + tl.arange(0, DK2)
            dq2 = tl.dot(ds, k2.to(tl.float32), dq2, input_precision="ieee")
            dk2 = tl.dot(tl.trans(ds), q2.to(tl.float32), input_precision="ieee")
            tl.atomic_add(dk_rows[:, None] + d2[None, :], dk2 * scale, mask=dkv_ok & (d2 < Dk)[None, :],
                          sem="relaxed")
    _store_split(dq_ptr + stat * Dk, h_ok, dq1 * scale, dq2 * scale, Dk, DK1, DK2)


def _what(op: str, q, k, v) -> str:
    return (f"triton {op}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} in "
            f"{dtype_name(q.dtype)} does not fit one program on this GPU (use bf16/fp16 "
            "or smaller head dims, or the 'cpp' backend)")


def _empty_outputs(q, v):
    B, S, Hq, _ = q.shape
    out = torch.zeros(B, S, Hq, v.shape[3], dtype=q.dtype, device=q.device)
    return out, torch.full((B, S, Hq), float("-inf"), dtype=torch.float32, device=q.device)


def _sparse_grid(B, S, Hkv, G, BLOCK_H):
    nh = triton.cdiv(G, BLOCK_H)
    if Hkv > _MAX_GRID_YZ or nh > _MAX_GRID_YZ:
        raise NotImplementedError(f"triton sparse_attention: Hkv={Hkv} kv heads exceed the grid limit")
    return (B * S, Hkv, nh)


def sparse_attention_fwd(q, k, v, indices, scale: float, causal: bool, q_start):
    B, S, Hq, Dk = q.shape
    T, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    TOPK = indices.shape[2]
    cfg = _sparse_config(Dk, Dv, G, bwd=False)
    v_from_k = _v_from_k(k, v, cfg["DK1"], cfg["DV"])
    cfg = _fit_fwd(cfg, "BLOCK_H", q.element_size(), v_from_k, smem_limit(q.device))
    out = torch.empty(B, S, Hq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, S, Hq, dtype=torch.float32, device=q.device)
    if B * S * Hq == 0:
        return _empty_outputs(q, v)
    with launch_guard(lambda: _what("sparse_attention forward", q, k, v)):
        _sparse_fwd_kernel[_sparse_grid(B, S, Hkv, G, cfg["BLOCK_H"])](
            q, k, v, indices, q_start if q_start is not None else indices, out, lse,
            S, T, Hq, G, TOPK, Dk, Dv,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            scale * LOG2E,
            CAUSAL=bool(causal), HAS_QS=q_start is not None, V_FROM_K=v_from_k,
            IEEE=q.dtype == torch.float32, **cfg,
        )
    return out, lse


def sparse_attention_bwd(dout, q, k, v, indices, out, lse, scale, causal, q_start):
    B, S, Hq, Dk = q.shape
    T, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    TOPK = indices.shape[2]
    cfg = _sparse_config(Dk, Dv, G, bwd=True)
    dq = torch.empty_like(q)
    # New fp32 buffers (never views of k/v, even when v views k: autograd adds dk and dv).
    dk = torch.zeros(B, T, Hkv, Dk, dtype=torch.float32, device=q.device)
    dv = torch.zeros(B, T, Hkv, Dv, dtype=torch.float32, device=q.device)
    if B * S * Hq > 0:
        with launch_guard(lambda: _what("sparse_attention backward", q, k, v)):
            _sparse_bwd_kernel[_sparse_grid(B, S, Hkv, G, cfg["BLOCK_H"])](
                dout.contiguous(), q, k, v, indices, q_start if q_start is not None else indices,
                out.contiguous(), lse.contiguous(), dq, dk, dv,
                S, T, Hq, Hkv, G, TOPK, Dk, Dv,
                k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                scale, scale * LOG2E,
                CAUSAL=bool(causal), HAS_QS=q_start is not None,
                V_FROM_K=_v_from_k(k, v, cfg["DK1"], cfg["DV"]), IEEE=q.dtype == torch.float32, **cfg,
            )
    else:
        dq.zero_()
    return dq, dk.to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------
# Block-sparse attention
# --------------------------------------------------------------------------

@triton.jit
def _block_queries(q_ptr, qs_ptr, S, T, Hq, BS, MT, Dk, HAS_QS: tl.constexpr, CAUSAL: tl.constexpr,
                   BLOCK_M: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr):
    """Program (query tile, head h, batch b) of the forward and dq kernels; query
    block i = tile // MT holds MT tiles of BLOCK_M queries. Returns (h, b, i,
    the queries' rows of [B*S*Hq] and mask, q chunks, positions, and the last
    key position any of them sees: later key tiles are skipped)."""
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    i = pid // MT
    s_lo = i * BS + (pid % MT) * BLOCK_M
    offs_s = s_lo + tl.arange(0, BLOCK_M)
    s_ok = offs_s < tl.minimum((i + 1) * BS, S)
    stat = (b * S + offs_s) * Hq + h
    q1, q2 = _load_split(q_ptr + stat * Dk, s_ok, Dk, DK1, DK2)
    start = _start(qs_ptr, b, S, T, HAS_QS)
    if CAUSAL:
        horizon = start + tl.minimum(s_lo + BLOCK_M, S) - 1
    else:
        horizon = T
    return h, b, i, stat, s_ok, q1, q2, start + offs_s, horizon


@triton.jit
def _block_tile(q1, q2, j, n0, pos, k_base, v_base, sk_t, sv_t, T, BS, Dk, Dv,
                CAUSAL: tl.constexpr, IEEE: tl.constexpr, V_FROM_K: tl.constexpr, BLOCK_N: tl.constexpr,
                DK1: tl.constexpr, DK2: tl.constexpr, DV: tl.constexpr):
    """Keys n0 .. n0 + BLOCK_N of key block j against the queries at positions
    pos: (qk, ok [M, N] with the token-level causal mask, k1, k2, v tile)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_t = j * BS + offs_n
    t_ok = (offs_n < BS) & (offs_t < T)
    qk, k1, k2, vt = _qk_tile(q1, q2, k_base + offs_t * sk_t, v_base + offs_t * sv_t, t_ok, Dk, Dv,
                              IEEE, V_FROM_K, DK1, DK2, DV)
    ok = t_ok[None, :]
    if CAUSAL:
        ok = ok & (offs_t[None, :] <= pos[:, None])
    return qk, ok, k1, k2, vt


@triton.jit
def _block_fwd_kernel(
    q_ptr, k_ptr, v_ptr, num_ptr, kvi_ptr, qs_ptr, out_ptr, lse_ptr,
    S, T, Hq, G, Qb, W, BS, MT, Dk, Dv,
    sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    qk_scale,
    CAUSAL: tl.constexpr, HAS_QS: tl.constexpr, V_FROM_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr, DV: tl.constexpr,
):
    h, b, i, stat, s_ok, q1, q2, pos, horizon = _block_queries(q_ptr, qs_ptr, S, T, Hq, BS, MT, Dk, HAS_QS, CAUSAL,
                                                               BLOCK_M, DK1, DK2)
    k_base = k_ptr + b * sk_b + (h // G) * sk_h
    v_base = v_ptr + b * sv_b + (h // G) * sv_h
    row = (b * Hq + h) * Qb + i
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    for jj in range(0, tl.load(num_ptr + row)):
        j = tl.load(kvi_ptr + row * W + jj).to(tl.int64)
        for n0 in range(0, BS, BLOCK_N):
            if j * BS + n0 <= horizon:
                qk, ok, _, _, vt = _block_tile(q1, q2, j, n0, pos, k_base, v_base, sk_t, sv_t, T, BS, Dk, Dv,
                                               CAUSAL, IEEE, V_FROM_K, BLOCK_N, DK1, DK2, DV)
                m_i, l_i, acc = _softmax_step(tl.where(ok, qk * qk_scale, float("-inf")), m_i, l_i, acc, vt, IEEE)
    _store_out_lse(out_ptr + stat * Dv, lse_ptr + stat, s_ok, acc, m_i, l_i, Dv, DV)


@triton.jit
def _block_dq_kernel(
    do_ptr, q_ptr, k_ptr, v_ptr, num_ptr, kvi_ptr, qs_ptr, o_ptr, lse_ptr, dq_ptr, delta_ptr,
    S, T, Hq, G, Qb, W, BS, MT, Dk, Dv,
    sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    scale, qk_scale,
    CAUSAL: tl.constexpr, HAS_QS: tl.constexpr, V_FROM_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr, DV: tl.constexpr,
):
    """dq for the queries of _block_fwd_kernel's program; also stores delta =
    rowsum(dO * O) (fp32 [B,S,Hq]) for _block_dkdv_kernel."""
    h, b, i, stat, s_ok, q1, q2, pos, horizon = _block_queries(q_ptr, qs_ptr, S, T, Hq, BS, MT, Dk, HAS_QS, CAUSAL,
                                                               BLOCK_M, DK1, DK2)
    dq1 = tl.zeros([BLOCK_M, DK1], tl.float32)
    dq2 = dq1                                   # the tail's, replaced when there is one
    if DK2 > 0:
        dq2 = tl.zeros([BLOCK_M, DK2], tl.float32)
    do, delta = _dout_delta(do_ptr + stat * Dv, o_ptr + stat * Dv, s_ok, Dv, DV)
    tl.store(delta_ptr + stat, delta, mask=s_ok)
    lse = tl.load(lse_ptr + stat, mask=s_ok, other=float("-inf"))
    k_base = k_ptr + b * sk_b + (h // G) * sk_h
    v_base = v_ptr + b * sv_b + (h // G) * sv_h
    row = (b * Hq + h) * Qb + i
    for jj in range(0, tl.load(num_ptr + row)):
        j = tl.load(kvi_ptr + row * W + jj).to(tl.int64)
        for n0 in range(0, BS, BLOCK_N):
            if j * BS + n0 <= horizon:
                qk, ok, k1, k2, vt = _block_tile(q1, q2, j, n0, pos, k_base, v_base, sk_t, sv_t, T, BS, Dk, Dv,
                                                 CAUSAL, IEEE, V_FROM_K, BLOCK_N, DK1, DK2, DV)
                p = _probs(qk, ok, qk_scale, lse)
                ds = p * (_dot(do, tl.trans(vt), IEEE=IEEE) - delta[:, None])
                dq1 = tl.dot(ds, k1.to(tl.float32), dq1, input_precision="ieee")
                if DK2 > 0:
                    dq2 = tl.dot(ds, k2.to(tl.float32), dq2, input_precision="ieee")
    _store_split(dq_ptr + stat * Dk, s_ok, dq1 * scale, dq2 * scale, Dk, DK1, DK2)


@triton.jit
def _block_dkdv_kernel(
    do_ptr, q_ptr, k_ptr, v_ptr, qnum_ptr, qidx_ptr, qs_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    S, T, Hq, Hkv, G, Qb, Kb, WQ, BS, NT, Dk, Dv,
    sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    scale, qk_scale,
    CAUSAL: tl.constexpr, HAS_QS: tl.constexpr, V_FROM_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr, DV: tl.constexpr,
):
    """Program (key tile, kv head, batch); key block j = tile // NT. Walks the
    transposed mask: qidx[b,kvh,j,:qnum] lists e = g * Qb + i for every head
    g of the group and query block i that selected key block j. dk/dv: new
    contiguous [B,T,Hkv,D] tensors in k/v's dtype."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    j = pid // NT
    t_lo = j * BS + (pid % NT) * BLOCK_N
    offs_t = t_lo + tl.arange(0, BLOCK_N)
    t_ok = offs_t < tl.minimum((j + 1) * BS, T)
    k1, k2 = _load_split(k_ptr + b * sk_b + kvh * sk_h + offs_t.to(tl.int64) * sk_t, t_ok, Dk, DK1, DK2)
    dk1 = tl.zeros([BLOCK_N, DK1], tl.float32)
    dk2 = dk1                                   # the tail's, replaced when there is one
    if DK2 > 0:
        dk2 = tl.zeros([BLOCK_N, DK2], tl.float32)
    if V_FROM_K:
        vt = k1
    else:
        vt, _v_tail = _load_split(v_ptr + b * sv_b + kvh * sv_h + offs_t.to(tl.int64) * sv_t, t_ok, Dv, DV, 0)
    dv_acc = tl.zeros([BLOCK_N, DV], tl.float32)
    start = _start(qs_ptr, b, S, T, HAS_QS)
    row = (b * Hkv + kvh) * Kb + j
    nq = tl.load(qnum_ptr + row)
    for ee in range(0, nq):
        e = tl.load(qidx_ptr + row * WQ + ee)
        h = kvh * G + e // Qb
        i = e % Qb
        for m0 in range(0, BS, BLOCK_M):
            s_lo = i * BS + m0
            if CAUSAL:   # a query tile whose latest query precedes the key tile sees none of it
                q_last = start + tl.minimum(s_lo + BLOCK_M, S) - 1
            else:
                q_last = t_lo
            if q_last >= t_lo:
                offs_m = m0 + tl.arange(0, BLOCK_M)
                offs_s = i * BS + offs_m
                s_ok = (offs_m < BS) & (offs_s < S)
                stat = (b * S + offs_s) * Hq + h
                q1, q2 = _load_split(q_ptr + stat * Dk, s_ok, Dk, DK1, DK2)
                qk = _dot(q1, tl.trans(k1), IEEE=IEEE)
                if DK2 > 0:
                    qk = _dot(q2, tl.trans(k2), qk, IEEE=IEEE)
                ok = t_ok[None, :] & s_ok[:, None]
                if CAUSAL:
                    ok = ok & (offs_t[None, :] <= (start + offs_s)[:, None])
                p = _probs(qk, ok, qk_scale, tl.load(lse_ptr + stat, mask=s_ok, other=float("-inf")))   # [M, N]
                delta = tl.load(delta_ptr + stat, mask=s_ok, other=0.0)
                # not `do, _`: a name the loop carries ([BLOCK_N] rows above) cannot change
                # shape inside a branch; compiled Triton refuses it, the interpreter does not
                do, _do_tail = _load_split(do_ptr + stat * Dv, s_ok, Dv, DV, 0)
                dv_acc = tl.dot(tl.trans(p), do.to(tl.float32), dv_acc, input_precision="ieee")
                ds = p * (_dot(do, tl.trans(vt), IEEE=IEEE) - delta[:, None])
                dk1 = tl.dot(tl.trans(ds), q1.to(tl.float32), dk1, input_precision="ieee")
                if DK2 > 0:
                    dk2 = tl.dot(tl.trans(ds), q2.to(tl.float32), dk2, input_precision="ieee")
    out_rows = (b * T + offs_t) * Hkv + kvh
    _store_split(dk_ptr + out_rows * Dk, t_ok, dk1 * scale, dk2 * scale, Dk, DK1, DK2)
    _store_split(dv_ptr + out_rows * Dv, t_ok, dv_acc, dv_acc, Dv, DV, 0)


def _block_cfg(q, k, v, bs: int, kind: str) -> dict:
    B, Hq = q.shape[0], q.shape[2]
    if Hq > _MAX_GRID_YZ or B > _MAX_GRID_YZ:
        raise NotImplementedError(f"triton block_sparse_attention: B={B} or Hq={Hq} exceeds the grid limit")
    cfg = _block_config(q.shape[3], v.shape[3], bs, kind)
    v_from_k = _v_from_k(k, v, cfg["DK1"], cfg["DV"])
    if kind == "fwd":
        cfg = _fit_fwd(cfg, "BLOCK_M", q.element_size(), v_from_k, smem_limit(q.device))
    return dict(cfg, V_FROM_K=v_from_k, IEEE=q.dtype == torch.float32)


def block_sparse_attention_fwd(q, k, v, kv_num_blocks, kv_indices, block_size: int, scale, causal, q_start):
    B, S, Hq, Dk = q.shape
    T, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    if B * S * Hq == 0:
        return _empty_outputs(q, v)
    bs = int(block_size)
    Qb = triton.cdiv(S, bs)
    cfg = _block_cfg(q, k, v, bs, "fwd")
    MT = triton.cdiv(bs, cfg["BLOCK_M"])
    out = torch.empty(B, S, Hq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, S, Hq, dtype=torch.float32, device=q.device)
    with launch_guard(lambda: _what("block_sparse_attention forward", q, k, v)):
        _block_fwd_kernel[(Qb * MT, Hq, B)](
            q, k, v, kv_num_blocks, kv_indices, q_start if q_start is not None else kv_num_blocks, out, lse,
            S, T, Hq, Hq // Hkv, Qb, kv_indices.shape[3], bs, MT, Dk, Dv,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            scale * LOG2E, CAUSAL=bool(causal), HAS_QS=q_start is not None, **cfg,
        )
    return out, lse


def _transposed_mask(kv_num_blocks, kv_indices, Hkv: int, Kb: int):
    """For each (b, kv head, key block j): the entries g * Qb + i (g the head
    within the kv head's group, i a query block) whose row selects j, ascending.
    Returns (q_num int32 [B,Hkv,Kb], q_idx int32 [B,Hkv,Kb,WQ]); [Qb, Kb] per head
    of booleans, cheap next to the attention."""
    B, Hq, Qb, W = kv_indices.shape
    G = Hq // Hkv
    used = torch.arange(W, device=kv_indices.device) < kv_num_blocks[..., None]
    target = torch.where(used, kv_indices.long(), Kb)
    blocks = torch.zeros(B, Hq, Qb, Kb + 1, dtype=torch.bool, device=kv_indices.device)
    blocks.scatter_(-1, target, True)
    bt = blocks[..., :Kb].reshape(B, Hkv, G * Qb, Kb).transpose(2, 3)        # [B,Hkv,Kb,G*Qb]
    q_num = bt.sum(-1, dtype=torch.int32)
    width = max(1, int(q_num.max())) if q_num.numel() else 1
    col = torch.arange(G * Qb, dtype=torch.int32, device=bt.device)
    keyed = torch.where(bt, col, torch.full_like(col, G * Qb))
    q_idx = keyed.sort(-1).values[..., :width].contiguous()
    return q_num.contiguous(), q_idx


def block_sparse_attention_bwd(dout, q, k, v, kv_num_blocks, kv_indices, out, lse, block_size, scale, causal,
                               q_start):
    B, S, Hq, Dk = q.shape
    T, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    bs = int(block_size)
    G = Hq // Hkv
    dq = torch.empty_like(q)
    dk = torch.empty(B, T, Hkv, Dk, dtype=k.dtype, device=k.device)
    dv = torch.empty(B, T, Hkv, Dv, dtype=v.dtype, device=v.device)
    if B * S * Hq == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    Qb, Kb = triton.cdiv(S, bs), triton.cdiv(T, bs)
    qs = q_start if q_start is not None else kv_num_blocks
    strides = (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))
    dout, out = dout.contiguous(), out.contiguous()
    delta = torch.empty(B, S, Hq, dtype=torch.float32, device=q.device)
    cfg = _block_cfg(q, k, v, bs, "dq")
    MT = triton.cdiv(bs, cfg["BLOCK_M"])
    with launch_guard(lambda: _what("block_sparse_attention backward (dq)", q, k, v)):
        _block_dq_kernel[(Qb * MT, Hq, B)](
            dout, q, k, v, kv_num_blocks, kv_indices, qs, out, lse, dq, delta,
            S, T, Hq, G, Qb, kv_indices.shape[3], bs, MT, Dk, Dv, *strides,
            scale, scale * LOG2E, CAUSAL=bool(causal), HAS_QS=q_start is not None, **cfg,
        )
    q_num, q_idx = _transposed_mask(kv_num_blocks, kv_indices, Hkv, Kb)
    cfg = _block_cfg(q, k, v, bs, "dkdv")
    NT = triton.cdiv(bs, cfg["BLOCK_N"])
    with launch_guard(lambda: _what("block_sparse_attention backward (dk, dv)", q, k, v)):
        _block_dkdv_kernel[(Kb * NT, Hkv, B)](
            dout, q, k, v, q_num, q_idx, qs, lse, delta, dk, dv,
            S, T, Hq, Hkv, G, Qb, Kb, q_idx.shape[3], bs, NT, Dk, Dv, *strides,
            scale, scale * LOG2E, CAUSAL=bool(causal), HAS_QS=q_start is not None, **cfg,
        )
    return dq, dk, dv


# --------------------------------------------------------------------------
# Block-level predictor
# --------------------------------------------------------------------------

@triton.jit
def _pool_kernel(x_ptr, mean_ptr, min_ptr, max_ptr, N, H, D, BS, NB,
                 MINMAX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """x [B,N,H,D] -> per block of BS rows (last one partial), fp32 [B,NB,H,D]:
    the mean, or (MINMAX) the per-channel min and max."""
    pid = tl.program_id(0).to(tl.int64)         # b * NB + block
    h = tl.program_id(1)
    b = pid // NB
    blk = pid % NB
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    r_lo = blk * BS
    r_end = tl.minimum(r_lo + BS, N)
    acc = tl.zeros([BLOCK_D], tl.float32)
    mn = tl.full([BLOCK_D], float("inf"), tl.float32)
    mx = tl.full([BLOCK_D], float("-inf"), tl.float32)
    for r0 in range(r_lo, r_end, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        m = (offs_r < r_end)[:, None] & d_ok[None, :]
        x = tl.load(x_ptr + ((b * N + offs_r) * H + h)[:, None] * D + offs_d[None, :], mask=m, other=0.0)
        x = x.to(tl.float32)
        if MINMAX:
            mx = tl.maximum(mx, tl.max(tl.where(m, x, float("-inf")), 0))
            mn = tl.minimum(mn, tl.min(tl.where(m, x, float("inf")), 0))
        else:
            acc += tl.sum(x, 0)
    out = (pid * H + h) * D + offs_d
    if MINMAX:
        tl.store(min_ptr + out, mn, mask=d_ok)
        tl.store(max_ptr + out, mx, mask=d_ok)
    else:
        tl.store(mean_ptr + out, acc / (r_end - r_lo).to(tl.float32), mask=d_ok)


@triton.jit
def _block_score_kernel(qbar_ptr, a_ptr, c_ptr, score_ptr, Qb, Kb, H, Hkv, G, D,
                        MINMAX: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    """score [B,H,Qb,Kb] fp32 = qbar . kbar (a = kbar), or (MINMAX, a = kmin,
    c = kmax) sum_d max(qbar_d * kmin_d, qbar_d * kmax_d). qbar [B,Qb,H,D],
    a and c [B,Kb,Hkv,D], fp32."""
    offs_i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    i_ok = offs_i < Qb
    kvh = h // G
    q_rows = ((b * Qb + offs_i) * H + h) * D
    for j0 in range(0, Kb, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        j_ok = offs_j < Kb
        k_rows = ((b * Kb + offs_j) * Hkv + kvh) * D
        acc = tl.zeros([BLOCK_I, BLOCK_J], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_ok = offs_d < D
            qb = tl.load(qbar_ptr + q_rows[:, None] + offs_d[None, :], mask=i_ok[:, None] & d_ok[None, :], other=0.0)
            mk = j_ok[:, None] & d_ok[None, :]
            ka = tl.load(a_ptr + k_rows[:, None] + offs_d[None, :], mask=mk, other=0.0)
            if MINMAX:
                # max(a*m, a*M) with m <= M is a*M for a >= 0 and a*m for a < 0
                kc = tl.load(c_ptr + k_rows[:, None] + offs_d[None, :], mask=mk, other=0.0)
                acc = tl.dot(tl.maximum(qb, 0.0), tl.trans(kc), acc, input_precision="ieee")
                acc = tl.dot(tl.minimum(qb, 0.0), tl.trans(ka), acc, input_precision="ieee")
            else:
                acc = tl.dot(qb, tl.trans(ka), acc, input_precision="ieee")
        tl.store(score_ptr + ((b * H + h) * Qb + offs_i)[:, None] * Kb + offs_j[None, :], acc,
                 mask=i_ok[:, None] & j_ok[None, :])


def _pool(x, bs: int, minmax: bool):
    B, N, H, D = x.shape
    NB = triton.cdiv(N, bs)
    BLOCK_D = min(128, max(16, _next_pow2(D)))
    BLOCK_R = min(64, max(16, _next_pow2(bs)))
    outs = [torch.empty(B, NB, H, D, dtype=torch.float32, device=x.device) for _ in range(2 if minmax else 1)]
    mean, mn, mx = (None, *outs) if minmax else (outs[0], None, None)
    dummy = outs[0]
    _pool_kernel[(B * NB, H, triton.cdiv(D, BLOCK_D))](
        x, mean if mean is not None else dummy, mn if mn is not None else dummy, mx if mx is not None else dummy,
        N, H, D, bs, NB, MINMAX=minmax, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D)
    return outs


def block_topk_mask(q, k, block_size, topk_blocks, causal, sink_blocks, local_blocks, pooling: str, q_start):
    """Block scores in Triton (_pool_kernel, _block_score_kernel); the per-row
    selection with torch ops, the reference's steps with torch.topk in place
    of a full sort (ties may be broken differently)."""
    B, S, H, D = q.shape
    T, Hkv = k.shape[1], k.shape[2]
    bs = int(block_size)
    Qb, Kb = triton.cdiv(S, bs), triton.cdiv(T, bs)
    width = min(Kb, sink_blocks + local_blocks + topk_blocks)
    dev = q.device
    if B * H * Qb == 0:
        return (torch.zeros(B, H, Qb, dtype=torch.int32, device=dev),
                torch.zeros(B, H, Qb, width, dtype=torch.int32, device=dev))
    if H > _MAX_GRID_YZ or B > _MAX_GRID_YZ:
        raise NotImplementedError(f"triton block_topk_mask: B={B} or H={H} exceeds the grid limit")
    minmax = pooling == "minmax"
    (qbar,) = _pool(q, bs, False)
    kpool = _pool(k, bs, minmax)                     # [kbar] or [kmin, kmax]
    score = torch.empty(B, H, Qb, Kb, dtype=torch.float32, device=dev)
    BLOCK_I = BLOCK_J = 16
    _block_score_kernel[(triton.cdiv(Qb, BLOCK_I), H, B)](
        qbar, kpool[0], kpool[-1], score, Qb, Kb, H, Hkv, H // Hkv, D,
        MINMAX=minmax, BLOCK_I=BLOCK_I, BLOCK_J=BLOCK_J, BLOCK_D=min(64, max(16, _next_pow2(D))))

    # Selection (reference.block_topk_mask's definitions).
    pos = reference.query_positions(B, S, T, q_start, dev)                 # [B,S]
    last_row = torch.clamp((torch.arange(Qb, device=dev) + 1) * bs, max=S) - 1
    diag = torch.div(pos[:, last_row], bs, rounding_mode="floor").clamp(max=Kb - 1)[:, :, None]
    j = torch.arange(Kb, device=dev)[None, None, :]
    allowed = (j <= diag) if causal else torch.ones(B, Qb, Kb, dtype=torch.bool, device=dev)
    mandatory = ((j < sink_blocks) | ((j <= diag) & (j > diag - local_blocks))) & allowed   # [B,Qb,Kb]
    cand = (allowed & ~mandatory)[:, None].expand(B, H, Qb, Kb)
    blocks = mandatory[:, None].expand(B, H, Qb, Kb)
    kk = min(topk_blocks, Kb)
    if kk > 0:
        keyed = score.masked_fill(~cand, float("-inf"))
        top = keyed.topk(kk, dim=-1, sorted=True).indices                 # best first
        # The first min(topk_blocks, #candidates) of them: never a non-candidate.
        take = cand.sum(-1, keepdim=True).clamp(max=kk)
        chosen = torch.zeros_like(cand).scatter_(-1, top, torch.arange(kk, device=dev).expand_as(top) < take)
        blocks = blocks | chosen
    # Same format as the reference: blocks ascending, then 0 padding.
    return reference._blocks_to_ordered(blocks, width=width)
