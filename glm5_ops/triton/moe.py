"""Triton kernels for the Mixture-of-Experts layer (router, grouped SwiGLU experts).

Called by glm5_ops/moe.py with validated, contiguous inputs, as the kernels
of the glm5_triton:: ops:

  moe_route(h[T,D], gate_w[E,D], bias[E], top_k, n_group, topk_group,
            routed_scaling_factor, norm_topk_prob)         -> (weights fp32[T,k], ids int32[T,k])
  fused_moe_fwd(x[T,D], w_gate_up[E,2I,D], w_down[E,D,I], weights fp32[T,k], ids int32[T,k])
                                                           -> out[T,D] in x.dtype
  fused_moe_bwd(dout, x, w_gate_up, w_down, weights, ids)  -> (dx, dw_gate_up, dw_down, dweights fp32)

HF layout: rows 0..I-1 of w_gate_up[e] are the gate, rows I..2I-1 the up
projection; y_e(x) = (silu(x Wg^T) * (x Wu^T)) Wd^T and
out[t] = sum_j weights[t,j] * y_{ids[t,j]}(x[t]). Semantics: glm5_ops/reference.py.
x, w_gate_up and w_down share one dtype (fp32, fp16 or bf16); every GEMM
accumulates in fp32, fp32 inputs multiply in true fp32 ("ieee", not TF32).

Design (vLLM / SGLang fused_moe, ScatterMoE's gather-on-load):
  _align        counting sort of the T*k (token, slot) pairs by expert, each
                expert's segment padded to BLOCK_M rows (moe_align_block_size):
                two Triton kernels (per-chunk histograms; a stable in-chunk rank
                + scatter) and a few torch ops on the [chunks, E] histogram
                (cumsums, searchsorted). No host sync: buffers are sized for the
                worst case T*k + E*(BLOCK_M-1) rows and programs past the real
                row count exit at once.
  _gate_up      grouped GEMM, one program per (M block, N block of I): reads the
                block's expert from expert_ids, gathers x rows by token (no
                permuted copy of x), computes the gate and up tiles together and
                writes silu(gate) * up (the SwiGLU fused in the epilogue).
  _down         grouped GEMM h @ Wd^T; stores each row at its (token, slot)
                position of a [T, k, D] buffer (scatter on store, no atomics).
  _combine      out[t] = sum_j weights[t,j] * y[t,j] in fp32 (deterministic).
  backward      _bwd_h recomputes gate/up and dh = (w * dout) Wd in one pass
                over D, fuses the SwiGLU backward and dweights (= (dout Wd) . h);
                _down-like _bwd_dx GEMM into per-pair rows + _combine (unit
                weights) for dx; _expert_wgrad, one program per (expert, M, N)
                tile summing over the expert's rows, for dW_gate_up and dW_down
                (experts without tokens write zeros).
Under TRITON_INTERPRET=1 the kernels run on CPU tensors (fp32/fp16 only).
Only long-stable Triton features are used (tl.dot, masked loads/stores,
reductions, tl.reshape), for Triton 3.6+.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks import dtype_name
from ._limits import launch_guard

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INT_MIN = tl.constexpr(-2147483648)  # a jit global must be a constexpr
# Widest router (experts padded per group to powers of two): the [BLOCK_T, EP] fp32
# scores live in registers and the weight tile in shared memory (see moe_route).
_ROUTE_MAX_EP = 2048


def _next_pow2(x: int) -> int:
    return 1 << (max(1, int(x)) - 1).bit_length()


def _interpreted(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _prec(dtype: torch.dtype) -> str:
    """tl.dot input precision: true fp32 for fp32 operands (the default would
    be TF32 on GPUs); "tf32", the default, changes nothing for 16-bit operands."""
    return "ieee" if dtype == torch.float32 else "tf32"


# --------------------------------------------------------------------------
# Router
# --------------------------------------------------------------------------

@triton.jit
def _okey(x):
    """Order-preserving int32 key of fp32 x (signed order = float order), an
    involution: _okey(_okey(x) bitcast) gives the bits back. -inf maps above
    INT_MIN, so INT_MIN can mean "not selectable" (taken, padding, other group)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _okey_inv(k):
    return tl.where(k < 0, k ^ 0x7FFFFFFF, k).to(tl.float32, bitcast=True)


@triton.jit
def _route_kernel(
    h_ptr, w_ptr, b_ptr, wout_ptr, iout_ptr,
    T, D, PER_G, N_GROUP, TOPK_GROUP, TOP_K, scale,
    NORM: tl.constexpr, GROUP_LIMITED: tl.constexpr, CAST_F32: tl.constexpr, PREC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, G_PAD: tl.constexpr, P_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
):
    """One program per BLOCK_T tokens. Column c of the [BLOCK_T, G_PAD*P_PAD]
    tile is expert (c // P_PAD) * PER_G + c % P_PAD (group-major, padded), so
    the group stage is a reshape to [BLOCK_T, G_PAD, P_PAD]; the column order
    is the expert order, so "lowest column" breaks ties toward the lower id."""
    EP: tl.constexpr = G_PAD * P_PAD
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    col = tl.arange(0, EP)
    g = col // P_PAD
    p = col % P_PAD
    e_ok = (g < N_GROUP) & (p < PER_G)
    expert = g * PER_G + p
    offs_k = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + offs_t.to(tl.int64)[:, None] * D
    w_cols = w_ptr + expert.to(tl.int64)[None, :] * D
    acc = tl.zeros([BLOCK_T, EP], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_ok = (k0 + offs_k) < D
        a = tl.load(h_rows + (k0 + offs_k)[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + (k0 + offs_k)[:, None], mask=k_ok[:, None] & e_ok[None, :], other=0.0)
        if CAST_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    scores = 1.0 / (1.0 + tl.exp(-acc))
    bias = tl.load(b_ptr + expert, mask=e_ok, other=0.0).to(tl.float32)
    choice = scores + bias[None, :]
    choice = tl.where(choice != choice, float("-inf"), choice)   # NaN never beats a number
    key = tl.where(e_ok[None, :], _okey(choice), _INT_MIN)

    if GROUP_LIMITED:
        # Group score = sum of the group's two largest choices (a repeated
        # maximum counts twice, as topk(2) does); keep the TOPK_GROUP best.
        key3 = tl.reshape(key, [BLOCK_T, G_PAD, P_PAD])
        p3 = tl.reshape(p, [1, G_PAD, P_PAD])
        m1 = tl.max(key3, axis=2)
        i1 = tl.min(tl.where(key3 == m1[:, :, None], p3, P_PAD), axis=2)
        m2 = tl.max(tl.where(p3 == i1[:, :, None], _INT_MIN, key3), axis=2)
        gscore = _okey_inv(m1) + _okey_inv(m2)
        gidx = tl.arange(0, G_PAD)[None, :]
        gkey = tl.where(gidx < N_GROUP, _okey(gscore), _INT_MIN)
        keep = tl.zeros([BLOCK_T, G_PAD], dtype=tl.int32)
        for _gi in range(TOPK_GROUP):
            gm = tl.max(gkey, axis=1)
            gi = tl.min(tl.where(gkey == gm[:, None], gidx, G_PAD), axis=1)
            hit = gidx == gi[:, None]
            keep = tl.where(hit, 1, keep)
            gkey = tl.where(hit, _INT_MIN, gkey)
        key3 = tl.where(keep[:, :, None] != 0, key3, _INT_MIN)
        key = tl.reshape(key3, [BLOCK_T, EP])

    # top_k by repeated arg-max (top_k is small); slot j = j-th largest choice.
    jcol = tl.arange(0, K_PAD)[None, :]
    wsel = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    isel = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    for j in range(TOP_K):
        m = tl.max(key, axis=1)
        c = tl.min(tl.where(key == m[:, None], col[None, :], EP), axis=1)
        hit = col[None, :] == c[:, None]
        s = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        wsel = tl.where(jcol == j, s[:, None], wsel)
        isel = tl.where(jcol == j, ((c // P_PAD) * PER_G + c % P_PAD)[:, None], isel)
        key = tl.where(hit, _INT_MIN, key)
    if NORM:
        wsel = wsel / (tl.sum(wsel, axis=1)[:, None] + 1e-20)
    wsel = wsel * scale
    out_mask = t_ok[:, None] & (jcol < TOP_K)
    out_off = offs_t.to(tl.int64)[:, None] * TOP_K + jcol
    tl.store(wout_ptr + out_off, wsel, mask=out_mask)
    tl.store(iout_ptr + out_off, isel, mask=out_mask)


def moe_route(h, gate_w, bias, top_k: int, n_group: int, topk_group: int,
              routed_scaling_factor: float, norm_topk_prob: bool):
    """(weights fp32 [T, top_k], ids int32 [T, top_k]); ids by decreasing
    biased score, equal scores: lower expert id first (as the "cpp" backend)."""
    T, D = h.shape
    E = gate_w.shape[0]
    per_g = E // n_group
    G_PAD, P_PAD = _next_pow2(n_group), _next_pow2(per_g)
    EP = G_PAD * P_PAD
    if EP > _ROUTE_MAX_EP:
        raise NotImplementedError(f"triton moe_route holds all experts of a token in one tile: "
                                  f"E={E} (padded to {EP} with n_group={n_group}) is over {_ROUTE_MAX_EP}")
    weights = torch.empty((T, top_k), dtype=torch.float32, device=h.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=h.device)
    if T == 0:
        return weights, ids
    same16 = h.dtype == gate_w.dtype and h.dtype in (torch.float16, torch.bfloat16)
    if _interpreted(h):
        BLOCK_T, BLOCK_K, warps = 16, 32, 4
    else:  # the [BLOCK_T, EP] fp32 tile lives in registers (and the group stage reshapes it)
        BLOCK_T = 32 if EP <= 256 else 16
        BLOCK_K = 64 if same16 else 32
        warps = 4 if BLOCK_T * EP <= 8192 else 8
    BLOCK_K = min(BLOCK_K, max(16, _next_pow2(D)))
    # Shared memory: the gate-weight tile [BLOCK_K, EP] is pipelined over the D loop
    # (num_stages - 1 buffers). Up to EP = 512 three stages fit (bf16 E=512: 135 KB on
    # sm_90); wider routers take two stages and a BLOCK_K that keeps one tile <= 64 KiB
    # (E=1024 and 2048: ~66 KB), under the 227 KiB of an H100/H200.
    stages = 3
    if EP > 512:
        item = 2 if same16 else 4
        stages, BLOCK_K = 2, max(16, min(BLOCK_K, (64 * 1024) // (EP * item)))
    with launch_guard(lambda: f"triton moe_route: h {tuple(h.shape)} {dtype_name(h.dtype)}, "
                              f"E={E}, n_group={n_group}, top_k={top_k}"):
        _route_kernel[(triton.cdiv(T, BLOCK_T),)](
            h, gate_w, bias, weights, ids,
            T, D, per_g, n_group, topk_group, top_k, float(routed_scaling_factor),
            NORM=bool(norm_topk_prob), GROUP_LIMITED=topk_group < n_group, CAST_F32=not same16,
            PREC="tf32" if same16 else "ieee", BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K, G_PAD=G_PAD, P_PAD=P_PAD,
            K_PAD=max(2, _next_pow2(top_k)), num_warps=warps, num_stages=stages,
        )
    return weights, ids


# --------------------------------------------------------------------------
# Alignment: counting sort of the (token, slot) pairs by expert
# --------------------------------------------------------------------------

@triton.jit
def _align_hist_kernel(ids_ptr, hist_ptr, P, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """hist[c, e] = number of pairs p in chunk c (pairs c*CHUNK ..) with ids[p] == e."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
    for e0 in range(0, E, BLOCK_E):
        cols = e0 + tl.arange(0, BLOCK_E)
        cnt = tl.sum((e[:, None] == cols[None, :]).to(tl.int32), axis=0)
        tl.store(hist_ptr + c.to(tl.int64) * E + cols, cnt, mask=cols < E)


@triton.jit
def _align_scatter_kernel(ids_ptr, base_ptr, sorted_ptr, P, E, CHUNK: tl.constexpr):
    """Pair p of chunk c goes to row base[c, ids[p]] + (number of earlier pairs
    of the chunk with the same expert): stable, so each expert's rows are in
    (token, slot) order. sorted[row] = p."""
    c = tl.program_id(0)
    i = tl.arange(0, CHUNK)
    offs = c * CHUNK + i
    ok = offs < P
    e = tl.load(ids_ptr + offs, mask=ok, other=-1)
    same_before = (e[:, None] == e[None, :]) & (i[None, :] < i[:, None])
    rank = tl.sum(same_before.to(tl.int32), axis=1)
    base = tl.load(base_ptr + c.to(tl.int64) * E + e, mask=ok, other=0)
    tl.store(sorted_ptr + base + rank, offs, mask=ok)


class _Plan:
    """The block-aligned permutation of the pairs (vLLM's moe_align_block_size):
    sorted_pairs int32 [rows_max]: pair index t*k + j of each sorted row, P for padding
    expert_ids   int32 [rows_max / BLOCK_M]: expert of each M block (E past the end)
    num_rows     int32 [1]: rows in use (sum of the padded segments)
    seg_start, seg_end int32 [E]: each expert's padded segment of rows; counts int32 [E]: its rows."""

    def __init__(self, ids: torch.Tensor, E: int, block_m: int):
        dev = ids.device
        T, k = ids.shape
        P = T * k
        self.P, self.block_m = P, block_m
        flat = ids.reshape(-1)
        chunk = 128 if P >= 128 else max(16, _next_pow2(P))
        n_chunks = triton.cdiv(P, chunk)
        hist = torch.empty((n_chunks, E), dtype=torch.int32, device=dev)
        _align_hist_kernel[(n_chunks,)](flat, hist, P, E, CHUNK=chunk, BLOCK_E=min(64, _next_pow2(E)))
        counts = hist.sum(0, dtype=torch.int32)
        padded = (counts + (block_m - 1)) // block_m * block_m
        seg_end = torch.cumsum(padded, 0, dtype=torch.int32)
        seg_start = seg_end - padded
        # Chunk c writes expert e's pairs after those of the chunks before it.
        base = (seg_start[None, :] + torch.cumsum(hist, 0, dtype=torch.int32) - hist).contiguous()
        rows_max = P + E * (block_m - 1)
        rows_max = triton.cdiv(rows_max, block_m) * block_m
        self.sorted_pairs = torch.full((rows_max,), P, dtype=torch.int32, device=dev)
        _align_scatter_kernel[(n_chunks,)](flat, base, self.sorted_pairs, P, E, CHUNK=chunk)
        block_rows = torch.arange(0, rows_max, block_m, dtype=torch.int32, device=dev)
        self.expert_ids = torch.searchsorted(seg_end, block_rows, right=True).to(torch.int32)
        self.num_rows = seg_end[-1:].contiguous()
        self.seg_start, self.seg_end, self.counts = seg_start, seg_end, counts
        self.rows_max = rows_max
        self.m_blocks = rows_max // block_m


# --------------------------------------------------------------------------
# Grouped GEMMs
# --------------------------------------------------------------------------

@triton.jit
def _tile_ids(pid, m_blocks, n_blocks, GROUP_M: tl.constexpr):
    """Grouped launch order: GROUP_M M blocks walk the N blocks together, so
    consecutive programs share the weight tiles and the gathered rows in L2."""
    per_group = GROUP_M * n_blocks
    first_m = (pid // per_group) * GROUP_M
    size = tl.minimum(m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size
    pid_n = (pid % per_group) // size
    return pid_m, pid_n


@triton.jit
def _silu_parts(g):
    sig = 1.0 / (1.0 + tl.exp(-g))
    return sig, g * sig


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ptr, expert_ptr, nrows_ptr,
    P, TOPK, D, I, m_blocks,
    PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """h[r, n] = silu(x[tok(r)] . Wg[e, n]) * (x[tok(r)] . Wu[e, n]) for the
    sorted rows r of one M block (expert e) and one block of n in [0, I)."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), m_blocks, tl.cdiv(I, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(nrows_ptr):
        return
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < P
    tok = (pair // TOPK).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * D + offs_k[None, :]
    wg_ptrs = w_ptr + e * (2 * I) * D + offs_n.to(tl.int64)[None, :] * D + offs_k[:, None]
    wu_ptrs = wg_ptrs + I * D
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_ok = (k0 + offs_k) < D
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        bmask = k_ok[:, None] & n_ok[None, :]
        acc_g = tl.dot(a, tl.load(wg_ptrs, mask=bmask, other=0.0), acc_g, input_precision=PREC)
        acc_u = tl.dot(a, tl.load(wu_ptrs, mask=bmask, other=0.0), acc_u, input_precision=PREC)
        a_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    _, silu = _silu_parts(acc_g)
    h = silu * acc_u
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * I + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _rows_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ptr, expert_ptr, nrows_ptr,
    P, N, K, w_sn, w_sk, w_se, m_blocks,
    PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """out[pair(r), n] = sum_k a[r, k] * W[e, n, k] for the sorted rows r of one
    M block (a in sorted-row order, [rows, K]); W[e, n, k] at
    w_ptr + e*w_se + n*w_sn + k*w_sk. Rows land at their (token, slot)
    position of out [P, N] (scatter on store, each pair written once).
    Forward: a = h, W = w_down (N = D, K = I). Backward dx: a = [da | db],
    W = w_gate_up read transposed (N = D, K = 2I)."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(nrows_ptr):
        return
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < P
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + e * w_se + offs_n.to(tl.int64)[None, :] * w_sn + offs_k.to(tl.int64)[:, None] * w_sk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * w_sk
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, K, D, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t, d] = sum_j w[t, j] * y[t*K + j, d] (w = 1 without HAS_W), fp32, slots in order."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(K):
        y = tl.load(y_ptr + (t * K + j) * D + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_W:
            y = y * tl.load(w_ptr + t * K + j)
        acc += y
    tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _combine(y, weights, T, k, D, out_dtype):
    out = torch.empty((T, D), dtype=out_dtype, device=y.device)
    if T == 0 or D == 0:
        return out
    BLOCK_D = min(1024, max(16, _next_pow2(D)))
    _combine_kernel[(T, triton.cdiv(D, BLOCK_D))](y, weights if weights is not None else y, out, k, D,
                                                  HAS_W=weights is not None, BLOCK_D=BLOCK_D,
                                                  num_warps=4)
    return out


# --------------------------------------------------------------------------
# Backward kernels
# --------------------------------------------------------------------------

@triton.jit
def _bwd_h_kernel(
    x_ptr, dout_ptr, wgu_ptr, wd_ptr, wts_ptr, h_ptr, dgu_ptr, dwp_ptr,
    sorted_ptr, expert_ptr, nrows_ptr,
    P, TOPK, D, I, m_blocks, n_blocks,
    PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One pass over D per (M block, N block of I) recomputes gate a and up b
    (x Wg^T, x Wu^T) and dhu = dout Wd (unscaled), then:
      h = silu(a) b;  dh = w dhu;  da = dh b silu'(a);  db = dh silu(a)
      dwp[pair, pid_n] = sum_n dhu * h   (dweights = dout . y = dhu . h, summed later)
    h and [da | db] are stored in sorted-row order for the dW / dx GEMMs."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), m_blocks, n_blocks, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(nrows_ptr):
        return
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < P
    tok = (pair // TOPK).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * D + offs_k[None, :]
    g_ptrs = dout_ptr + tok[:, None] * D + offs_k[None, :]
    wg_ptrs = wgu_ptr + e * (2 * I) * D + offs_n.to(tl.int64)[None, :] * D + offs_k[:, None]
    wu_ptrs = wg_ptrs + I * D
    wd_ptrs = wd_ptr + e * D * I + offs_k.to(tl.int64)[:, None] * I + offs_n[None, :]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_d = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_ok = (k0 + offs_k) < D
        amask = valid[:, None] & k_ok[None, :]
        bmask = k_ok[:, None] & n_ok[None, :]
        xa = tl.load(x_ptrs, mask=amask, other=0.0)
        acc_g = tl.dot(xa, tl.load(wg_ptrs, mask=bmask, other=0.0), acc_g, input_precision=PREC)
        acc_u = tl.dot(xa, tl.load(wu_ptrs, mask=bmask, other=0.0), acc_u, input_precision=PREC)
        ga = tl.load(g_ptrs, mask=amask, other=0.0)
        acc_d = tl.dot(ga, tl.load(wd_ptrs, mask=bmask, other=0.0), acc_d, input_precision=PREC)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
        wd_ptrs += BLOCK_K * I
    sig, silu = _silu_parts(acc_g)
    h = silu * acc_u
    dw_part = tl.sum(acc_d * h, axis=1)
    tl.store(dwp_ptr + pair.to(tl.int64) * n_blocks + pid_n, dw_part, mask=valid)
    w = tl.load(wts_ptr + pair, mask=valid, other=0.0)
    dh = acc_d * w[:, None]
    da = dh * acc_u * (sig * (1.0 + acc_g * (1.0 - sig)))
    db = dh * silu
    m2 = valid[:, None] & n_ok[None, :]
    r64 = rows.to(tl.int64)[:, None]
    tl.store(h_ptr + r64 * I + offs_n[None, :], h.to(h_ptr.dtype.element_ty), mask=m2)
    tl.store(dgu_ptr + r64 * (2 * I) + offs_n[None, :], da.to(dgu_ptr.dtype.element_ty), mask=m2)
    tl.store(dgu_ptr + r64 * (2 * I) + I + offs_n[None, :], db.to(dgu_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _expert_wgrad_kernel(
    a_ptr, b_ptr, wts_ptr, out_ptr, sorted_ptr, seg_start_ptr, seg_end_ptr,
    P, TOPK, M, N, lda, ldb, m_blocks, n_blocks,
    A_GATHER: tl.constexpr, A_SCALE: tl.constexpr, B_GATHER: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """out[e, m, n] = sum over the sorted rows r of expert e of A[r, m] * B[r, n].
    A row r is a_ptr[tok(r)] (A_GATHER, scaled by weights[pair(r)] with
    A_SCALE) or a_ptr[r]; B likewise. Experts without rows write zeros.
    dW_gate_up: A = [da | db] (M = 2I), B = x gathered (N = D).
    dW_down:    A = dout gathered * weight (M = D), B = h (N = I)."""
    pid = tl.program_id(0)
    e = pid // (m_blocks * n_blocks)
    rest = pid % (m_blocks * n_blocks)
    pid_m = rest // n_blocks
    pid_n = rest % n_blocks
    r0 = tl.load(seg_start_ptr + e)
    r1 = tl.load(seg_end_ptr + e)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for rb in range(r0, r1, BLOCK_R):
        rows = rb + offs_r
        pair = tl.load(sorted_ptr + rows, mask=rows < r1, other=P)
        valid = pair < P
        tok = (pair // TOPK).to(tl.int64)
        if A_GATHER:
            arow = tok
        else:
            arow = rows.to(tl.int64)
        if B_GATHER:
            brow = tok
        else:
            brow = rows.to(tl.int64)
        at = tl.load(a_ptr + arow[None, :] * lda + offs_m[:, None], mask=m_ok[:, None] & valid[None, :], other=0.0)
        if A_SCALE:
            wv = tl.load(wts_ptr + pair, mask=valid, other=0.0)
            at = (at.to(tl.float32) * wv[None, :]).to(a_ptr.dtype.element_ty)
        b = tl.load(b_ptr + brow[:, None] * ldb + offs_n[None, :], mask=valid[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(at, b, acc, input_precision=PREC)
    out_off = e.to(tl.int64) * M * N + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------
# Configuration and entry points
# --------------------------------------------------------------------------

def _config(dtype: torch.dtype, interpreted: bool, rows_per_expert: float) -> dict:
    """Tile sizes. Under the interpreter: the smallest tiles tl.dot allows (the
    cost is per program instruction, not per FLOP). On GPUs: BLOCK_M follows
    the average rows per expert (vLLM: decode pads 8 real rows to 64, so pick
    small M blocks for few tokens), 16-bit tiles sized for Hopper's wgmma;
    true-fp32 tiles are smaller (no tensor cores, more registers)."""
    if interpreted:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        bm = 32 if rows_per_expert <= 32 else 64
        return dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2)
    if rows_per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    if rows_per_expert <= 48:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=4)
    if rows_per_expert <= 160:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def _launch_kw(cfg: dict) -> dict:
    return dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _check_dtypes(x, w_gate_up, w_down):
    if x.dtype not in _FLOATS:
        raise NotImplementedError(f"triton fused_moe supports fp32, fp16 and bf16, got x of dtype {x.dtype}")
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(f"triton fused_moe needs x, w_gate_up and w_down in one dtype, got {x.dtype}, "
                         f"{w_gate_up.dtype} and {w_down.dtype}")


def _setup(x, w_gate_up, ids):
    ids = ids.to(torch.int32).contiguous()   # no-ops for what glm5_ops.moe passes
    T, D = x.shape
    E, I2, _ = w_gate_up.shape
    k = ids.shape[1]
    cfg = _config(x.dtype, _interpreted(x), T * k / max(E, 1))
    plan = _Plan(ids, E, cfg["BLOCK_M"])
    return T, D, E, I2 // 2, k, cfg, plan


def _mix(weights):
    return weights.to(torch.float32).contiguous()


def fused_moe_fwd(x, w_gate_up, w_down, weights, ids):
    """out [T, D] in x.dtype: sum_j weights[t,j] * SwiGLU expert ids[t,j] of x[t]."""
    _check_dtypes(x, w_gate_up, w_down)
    if x.numel() == 0 or ids.numel() == 0:
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    T, D, E, I, k, cfg, plan = _setup(x, w_gate_up, ids)
    prec = _prec(x.dtype)
    kw = _launch_kw(cfg)
    y = torch.empty((plan.P, D), dtype=x.dtype, device=x.device)
    if I == 0:   # no hidden units: every expert outputs 0
        return _combine(y.zero_(), _mix(weights), T, k, D, x.dtype)
    h = torch.empty((plan.rows_max, I), dtype=x.dtype, device=x.device)
    grid = (plan.m_blocks * triton.cdiv(I, cfg["BLOCK_N"]),)
    _gate_up_kernel[grid](x, w_gate_up, h, plan.sorted_pairs, plan.expert_ids, plan.num_rows,
                          plan.P, k, D, I, plan.m_blocks, PREC=prec, **kw)
    # y[t, j] = expert ids[t, j] of x[t], unweighted, in x.dtype (HF rounds each
    # expert's output to x.dtype too); the combine weights and sums in fp32.
    grid = (plan.m_blocks * triton.cdiv(D, cfg["BLOCK_N"]),)
    _rows_gemm_kernel[grid](h, w_down, y, plan.sorted_pairs, plan.expert_ids, plan.num_rows,
                            plan.P, D, I, I, 1, D * I, plan.m_blocks, PREC=prec, **kw)
    return _combine(y, _mix(weights), T, k, D, x.dtype)


def fused_moe_bwd(dout, x, w_gate_up, w_down, weights, ids):
    """(dx [T,D] x.dtype, dw_gate_up [E,2I,D], dw_down [E,D,I] in the weights'
    dtype, dweights fp32 [T,k]); gate/up recomputed, nothing saved from forward."""
    _check_dtypes(x, w_gate_up, w_down)
    if dout.dtype != x.dtype:
        dout = dout.to(x.dtype)
    dev = x.device
    T, D = x.shape
    I = w_down.shape[2]
    if x.numel() == 0 or ids.numel() == 0 or I == 0:
        return (torch.zeros_like(x), torch.zeros_like(w_gate_up), torch.zeros_like(w_down),
                torch.zeros(ids.shape, dtype=torch.float32, device=dev))
    T, D, E, I, k, cfg, plan = _setup(x, w_gate_up, ids)
    weights = _mix(weights)
    dwgu = torch.empty_like(w_gate_up)
    dwd = torch.empty_like(w_down)
    prec = _prec(x.dtype)
    kw = _launch_kw(cfg)
    BN = cfg["BLOCK_N"]
    # _bwd_h holds three [BLOCK_M, BLOCK_N] fp32 accumulators: narrower N tiles on GPUs.
    hkw = dict(kw, BLOCK_N=min(BN, 64)) if not _interpreted(x) else kw
    n_blocks_i = triton.cdiv(I, hkw["BLOCK_N"])
    h = torch.empty((plan.rows_max, I), dtype=x.dtype, device=dev)
    dgu = torch.empty((plan.rows_max, 2 * I), dtype=x.dtype, device=dev)
    dwp = torch.empty((plan.P, n_blocks_i), dtype=torch.float32, device=dev)
    _bwd_h_kernel[(plan.m_blocks * n_blocks_i,)](
        x, dout, w_gate_up, w_down, weights, h, dgu, dwp,
        plan.sorted_pairs, plan.expert_ids, plan.num_rows,
        plan.P, k, D, I, plan.m_blocks, n_blocks_i, PREC=prec, **hkw)
    dweights = dwp.sum(1).reshape(T, k)

    # dx: per-pair rows [da | db] @ W_gate_up[e] (W read as [n=D, k=2I] with
    # strides (1, D)), kept in fp32 before the unit-weight combine over slots.
    dx_pairs = torch.empty((plan.P, D), dtype=torch.float32, device=dev)
    _rows_gemm_kernel[(plan.m_blocks * triton.cdiv(D, BN),)](
        dgu, w_gate_up, dx_pairs, plan.sorted_pairs, plan.expert_ids, plan.num_rows,
        plan.P, D, 2 * I, 1, D, 2 * I * D, plan.m_blocks, PREC=prec, **kw)
    dx = _combine(dx_pairs, None, T, k, D, x.dtype)

    # Weight gradients: per expert, sum over its rows (K = rows of the segment).
    wcfg = dict(BLOCK_M=cfg["BLOCK_N"], BLOCK_N=cfg["BLOCK_N"],
                BLOCK_R=16 if _interpreted(x) else (32 if x.dtype == torch.float32 else 64),
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    common = (plan.sorted_pairs, plan.seg_start, plan.seg_end, plan.P, k)
    mb, nb = triton.cdiv(2 * I, wcfg["BLOCK_M"]), triton.cdiv(D, wcfg["BLOCK_N"])
    _expert_wgrad_kernel[(E * mb * nb,)](dgu, x, weights, dwgu, *common, 2 * I, D, 2 * I, D, mb, nb,
                                         A_GATHER=False, A_SCALE=False, B_GATHER=True, PREC=prec, **wcfg)
    mb, nb = triton.cdiv(D, wcfg["BLOCK_M"]), triton.cdiv(I, wcfg["BLOCK_N"])
    _expert_wgrad_kernel[(E * mb * nb,)](dout, h, weights, dwd, *common, D, I, D, I, mb, nb,
                                         A_GATHER=True, A_SCALE=True, B_GATHER=False, PREC=prec, **wcfg)
    return dx, dwgu, dwd, dweights
