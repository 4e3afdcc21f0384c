"""Triton kernels for the similarity predictor (DSA lightning indexer) and top-k.

Called by glm5_ops/indexer.py with validated, contiguous inputs:

  indexer_scores(q, w, k, causal, q_start)        -> fp32  [B, S, T]
  topk_indices(scores, k, sorted)                 -> int32 [..., k]
  indexer_topk(q, w, k, topk, causal, q_start)    -> int32 [B, S, topk]

q [B,S,H,D], w [B,S,H], k [B,T,D]; q_start is None (T - S for every batch
element) or an int64 tensor [B] on the device of q. Semantics:
glm5_ops/reference.py. Works on CUDA tensors, and on CPU tensors under
TRITON_INTERPRET=1 (fp32/fp16 there: the interpreter has no bf16 math).

Only long-stable Triton features are used (tl.dot, masked tl.load/tl.store,
tl.sum/tl.max/tl.cumsum/tl.where, tl.sort, tl.debug_barrier), no shared-
memory or histogram intrinsics, meant for Triton 3.x (checked: interpreter
and sm_90 compiles with Triton 3.6 and 3.8). The scores kernel's tiles and
stages come from a shared-memory estimate (_scores_config): fp32 at D=576 or
large H x D get fewer stages or head chunks instead of an OutOfResources at
launch; a shape that fits nowhere raises NotImplementedError naming it.

Kernels:
  _indexer_scores_kernel  one program per (batch, 16 queries, key block):
                          per query an [H, BLOCK_T] tl.dot against the key
                          tile, relu and head weights in registers, head sum;
                          causally dead key blocks skip the GEMM.
  _topk_kernel            persistent, one row at a time: radix select on
                          order-preserving uint32 keys, from registers for
                          rows <= 8192, else sample -> one filter pass ->
                          registers, with a multi-pass streaming fallback.
  _sort_selected_kernel   sorted=True: bitonic sort of the chosen k (<= 4096).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks import dtype_name
from ._limits import launch_guard, smem_limit

# Upper bound on the fp32 scores workspace of indexer_topk, in elements
# (64M fp32 = 256 MiB). See indexer_topk.
WORKSPACE_ELEMS = 64 * 1024 * 1024


def _next_pow2(x: int) -> int:
    return 1 << (max(1, int(x)) - 1).bit_length()


# --------------------------------------------------------------------------
# Scores: score[b,s,t] = sum_h w[b,s,h] * relu(q[b,s,h] . k[b,t])
# --------------------------------------------------------------------------

@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, k_ptr, qs_ptr, out_ptr,
    S, T, H, D,        # problem sizes: q [B,S,H,D], k [B,T,D]
    b0, s0, NS,        # window computed by this launch: batch b0 + program_id(2), queries s0 .. s0+NS-1
    CAUSAL: tl.constexpr, HAS_QS: tl.constexpr, STORE_DEAD: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    H_CHUNK: tl.constexpr,
):
    """One program per (batch element, block of BLOCK_S queries, block of BLOCK_T keys).
    out is the window's [nb, NS, T] fp32 slab (row-major). Heads go through the
    GEMM H_CHUNK at a time (all H_PAD at once unless that does not fit in
    shared memory, see _scores_config)."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_b = tl.program_id(2)
    b = (b0 + pid_b).to(tl.int64)
    t0 = pid_t * BLOCK_T
    offs_t = t0 + tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    s_lo = pid_s * BLOCK_S                    # first query of the block, window-local
    n_here = tl.minimum(BLOCK_S, NS - s_lo)   # queries in this block
    out_blk = out_ptr + (pid_b.to(tl.int64) * NS + s_lo) * T

    # Absolute position of window query 0 (query s0 of batch element b).
    if HAS_QS:
        start = tl.load(qs_ptr + b) + s0
    else:
        start = b * 0 + (T - S + s0)   # int64
    # Last key any query of the block may see (T - 1 without causality).
    if CAUSAL:
        last_vis = start + s_lo + n_here - 1
    else:
        last_vis = start * 0 + (T - 1)   # int64, like the causal branch

    if t0 > last_vis:
        # The whole key block is in the causal future of every query here:
        # no GEMM, just -inf (or nothing, when the caller never reads it).
        if STORE_DEAD:
            neg = tl.full([BLOCK_T], float("-inf"), tl.float32)
            for i in range(0, n_here):
                tl.store(out_blk + i * T + offs_t, neg, mask=t_ok)
    else:
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < D
        # Key tile, transposed to [D, BLOCK_T] for the GEMM. k is a single
        # (MQA) head: loaded once here, it serves all heads of all queries
        # of the block. Padded rows/columns are 0 so they add nothing.
        k_rows = (b * T + offs_t).to(tl.int64) * D
        kt = tl.load(k_ptr + k_rows[None, :] + offs_d[:, None],
                     mask=d_ok[:, None] & t_ok[None, :], other=0.0)
        for i in range(0, n_here):
            row = b * S + s0 + s_lo + i                       # query (b, s) in q / w
            if H_CHUNK == H_PAD:
                sc = _head_scores(q_ptr, w_ptr, row, 0, H, D, kt, offs_d, d_ok, IEEE, H_CHUNK)
            else:   # heads in chunks: the [H_CHUNK, D_PAD] query tile bounds shared memory
                sc = tl.zeros([BLOCK_T], tl.float32)
                for h0 in range(0, H, H_CHUNK):
                    sc += _head_scores(q_ptr, w_ptr, row, h0, H, D, kt, offs_d, d_ok, IEEE, H_CHUNK)
            if CAUSAL:
                sc = tl.where(offs_t > start + s_lo + i, float("-inf"), sc)
            tl.store(out_blk + i * T + offs_t, sc, mask=t_ok)


@triton.jit
def _head_scores(q_ptr, w_ptr, row, h0, H, D, kt, offs_d, d_ok, IEEE: tl.constexpr, H_CHUNK: tl.constexpr):
    """sum over heads h0 .. h0+H_CHUNK-1 (those < H) of w[row, h] * relu(q[row, h] . kt): [BLOCK_T] fp32."""
    offs_h = h0 + tl.arange(0, H_CHUNK)
    h_ok = offs_h < H
    qt = tl.load(q_ptr + (row * H + offs_h[:, None]) * D + offs_d[None, :],
                 mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    wv = tl.load(w_ptr + row * H + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    # [H_CHUNK, BLOCK_T] per-head logits, fp32 accumulate. fp32 inputs
    # ask for true fp32 ("ieee"): the default would be TF32 on GPUs.
    if IEEE:
        logits = tl.dot(qt, kt, input_precision="ieee")
    else:
        logits = tl.dot(qt, kt)
    # ReLU and head weights in registers, then the head reduction:
    # per-head scores never leave the program. Padded heads have w = 0.
    return tl.sum(tl.maximum(logits, 0.0) * wv[:, None], axis=0)


def _scores_smem(D_PAD: int, H_CHUNK: int, BLOCK_T: int, item: int, stages: int) -> int:
    """Shared memory of _indexer_scores_kernel, estimated: the key tile
    [D_PAD, BLOCK_T], the query tile [H_CHUNK, D_PAD] in num_stages - 1 buffers
    (num_stages with 16-bit wgmma operands, H_CHUNK >= 64: the GEMM reads its A
    operand from shared memory), at least one, and <= 8 KiB of reduction scratch.
    Calibrated on sm_90 compiles (triton 3.6, fp32/bf16, H 8-512, D 64-1024,
    1-3 stages): within 8 KiB above the measured metadata.shared everywhere."""
    kt = D_PAD * BLOCK_T * item
    qt = H_CHUNK * D_PAD * item
    wgmma = item == 2 and H_CHUNK >= 64
    return kt + max(1, stages if wgmma else stages - 1) * qt + 8 * 1024


def _scores_config(D: int, H: int, dtype: torch.dtype, smem: int) -> dict:
    """Tiles of _indexer_scores_kernel that fit `smem` bytes of shared memory:
    the default tiles with 3 stages when they fit (every GLM-5 shape: bf16
    H=32, D=128 needs ~49 KB), else fewer stages, then the heads in chunks
    (H_CHUNK < H_PAD), then narrower key blocks."""
    H_PAD = max(16, _next_pow2(H))   # tl.dot wants every dimension >= 16
    D_PAD = max(16, _next_pow2(D))
    # Key tile of D_PAD x BLOCK_T elements: keep it around 32 KiB (fp16 D=128 -> 128 keys).
    item = torch.empty((), dtype=dtype).element_size()
    bt = max(32, min(128, (32 * 1024) // (D_PAD * item)))
    while bt >= 16:
        hc = H_PAD
        while hc >= 16:
            for stages in (3, 2, 1):
                if _scores_smem(D_PAD, hc, bt, item, stages) <= smem:
                    return dict(H_PAD=H_PAD, D_PAD=D_PAD, H_CHUNK=hc, BLOCK_T=bt, num_stages=stages,
                                num_warps=8 if hc * bt >= 64 * 128 else 4)
            hc //= 2
        bt //= 2
    need = _scores_smem(D_PAD, 16, 16, item, 1)
    raise NotImplementedError(
        f"triton indexer_scores: q/k with D={D} (H={H}) in {dtype_name(dtype)} need "
        f"~{need} bytes of shared memory per program even with 16 heads x 16 keys, over this GPU's {smem}; "
        "use fp16/bf16 inputs or the 'cpp' backend")


_MAX_GRID_YZ = 65535
_BLOCK_S = 16   # queries per scores program: each key tile is reused this many times


def _launch_scores(q, w, k, q_start, causal, out, b0, nb, s0, ns, store_dead=True):
    """Scores of batch elements b0..b0+nb-1, queries s0..s0+ns-1 into out [nb, ns, T]."""
    B, S, H, D = q.shape
    T = k.shape[1]
    cfg = _scores_config(D, H, q.dtype, smem_limit(q.device))
    BLOCK_S = _BLOCK_S
    if triton.cdiv(ns, BLOCK_S) > _MAX_GRID_YZ:
        raise NotImplementedError(f"triton indexer_scores: S={ns} queries in one launch exceed the grid "
                                  f"limit ({_MAX_GRID_YZ * BLOCK_S}); use indexer_topk or split the queries")
    def what():
        return f"triton indexer_scores: q {tuple(q.shape)} {dtype_name(q.dtype)}, T={T} (tiles {cfg})"
    for bc in range(0, nb, _MAX_GRID_YZ):   # CUDA grid dims 1 and 2 stop at 65535
        nbc = min(_MAX_GRID_YZ, nb - bc)
        grid = (triton.cdiv(T, cfg["BLOCK_T"]), triton.cdiv(ns, BLOCK_S), nbc)
        with launch_guard(what):
            _indexer_scores_kernel[grid](
                q, w, k, q_start if q_start is not None else out, out[bc:bc + nbc],
                S, T, H, D, b0 + bc, s0, ns,
                CAUSAL=bool(causal), HAS_QS=q_start is not None, STORE_DEAD=store_dead,
                IEEE=q.dtype == torch.float32, BLOCK_S=BLOCK_S, **cfg,
            )


def indexer_scores(q, w, k, causal: bool, q_start):
    """fp32 [B,S,T]: sum_h w[b,s,h] * relu(q[b,s,h] . k[b,t]), -inf where
    causal and t > q_start[b] + s. Key blocks in the causal future of a whole
    query block are written -inf without any GEMM."""
    B, S, H, D = q.shape
    T = k.shape[1]
    out = torch.empty((B, S, T), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    _launch_scores(q, w, k, q_start, causal, out, 0, B, 0, S)
    return out


# --------------------------------------------------------------------------
# Top-k selection: one program per row, radix select on uint32 keys
# --------------------------------------------------------------------------

@triton.jit
def _radix_key(x):
    """Order-preserving uint32 key of fp32 x: unsigned order of the keys is the
    float order. Negative floats invert all bits, others set the sign bit.
    NaN and -inf map to 0, a key no finite or +inf value has (the smallest
    real key, -FLT_MAX's, is 0x00800000), so 0 means "never select"."""
    bits = x.to(tl.uint32, bitcast=True)
    # (xor with all ones rather than ~: the interpreter cannot invert a uint32)
    key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    bad = (x != x) | (x == float("-inf"))
    return tl.where(bad, tl.zeros_like(key), key)


@triton.jit
def _select_resident(keys, pos, K, out_row, BLOCK: tl.constexpr):
    """Top-K of a candidate set held in registers: keys [CAP] uint32 (0 = not
    selectable, also the padding), pos [CAP] int32 their row positions.
    Writes out_row[:K] (unordered, -1 after the real ones).

    Bitwise binary search for the K-th largest key tau (largest t with
    count(keys >= t) >= K), each step one compare + block reduction over
    registers; then keys > tau and enough keys == tau get slots from a cumsum."""
    n_valid = tl.sum((keys > 0).to(tl.int32), axis=0)
    tau = tl.full((), 0, tl.uint32)
    for i in tl.static_range(32):
        cand = tau | (tl.full((), 1, tl.uint32) << (31 - i))
        c = tl.sum((keys >= cand).to(tl.int32), axis=0)
        tau = tl.where(c >= K, cand, tau)
    few = n_valid <= K      # at most K selectable keys: take them all, pad with -1
    hi = (keys > tau) | (few & (keys > 0))
    eq = (keys == tau) & (tau > 0) & (n_valid > K)
    hi_i = hi.to(tl.int32)
    eq_i = eq.to(tl.int32)
    n_hi = tl.sum(hi_i, axis=0)
    slot = tl.where(hi, tl.cumsum(hi_i, axis=0) - 1, n_hi + tl.cumsum(eq_i, axis=0) - 1)
    tl.store(out_row + slot, pos, mask=hi | (eq & (slot < K)))
    filled = tl.minimum(n_hi + tl.sum(eq_i, axis=0), K)
    ar = tl.arange(0, BLOCK)
    for c0 in range(0, K, BLOCK):
        offs = c0 + ar
        tl.store(out_row + offs, tl.full([BLOCK], -1, tl.int32), mask=(offs >= filled) & (offs < K))


@triton.jit
def _select_streaming(x_row, n, K, out_row, BLOCK: tl.constexpr):
    """Top-K of x_row[:n] re-reading the row from memory: the fallback for
    rows whose candidates do not fit the register set (heavy ties at the
    K-th value, K > CAP, or an unlucky sample). Writes out_row[:K].

    Radix select, 4 bits per pass from the top: pass p counts, for the 16
    candidates c_j = L + j << sh, how many keys are >= c_j (a [BLOCK, 16]
    compare, reduced over the block), and keeps the largest c_j still
    reaching K. After the passes [L, L + size) holds the K-th largest key;
    `above` keys lie above it and are all taken, the rest of the K slots come
    from [L, L + size). Stops early when the range is taken whole."""
    ar = tl.arange(0, BLOCK)
    j = tl.arange(0, 16)
    ju = j.to(tl.uint32)

    L = tl.full((), 0, tl.uint32)       # low end of the range holding the K-th key
    size = tl.full((), 0, tl.uint32)    # range width (set by the passes)
    above = tl.full((), 0, tl.int32)    # keys >= L + size (all selected, < K of them)
    sh = tl.full((), 28, tl.int32)      # digit shift of the current pass
    while sh >= 0:
        cands = L + (ju << sh.to(tl.uint32))
        # While L is 0, c_0 = 0 would count every key, which is known to reach
        # K (K <= N); count the selectable keys (key >= 1) instead.
        cands = tl.where((j == 0) & (L == 0), tl.full([16], 1, tl.uint32), cands)
        cnt = tl.zeros([16], dtype=tl.int32)
        for c0 in range(0, n, BLOCK):
            offs = c0 + ar
            m = offs < n
            x = tl.load(x_row + offs, mask=m, other=float("-inf")).to(tl.float32)
            key = _radix_key(x)
            cnt += tl.sum((key[:, None] >= cands[None, :]).to(tl.int32), axis=0)
        # Largest j whose candidate still has >= K keys at or above it (j = 0
        # always qualifies: c_0 = L did in the previous pass).
        ok = (cnt >= K) | (j == 0)
        jstar = tl.max(tl.where(ok, j, 0), axis=0)
        cnt_star = tl.sum(tl.where(j == jstar, cnt, 0), axis=0)
        cnt_next = tl.sum(tl.where(j == jstar + 1, cnt, 0), axis=0)
        cnt0 = tl.sum(tl.where(j == 0, cnt, 0), axis=0)
        # At most K selectable keys in the row: take them all, pad with -1.
        few = (L == 0) & (cnt0 <= K)
        # Range [c_j*, c_j* + 2^sh) holds exactly the keys still needed: done.
        exact = cnt_star == K
        new_above = tl.where(jstar < 15, cnt_next, above)
        new_L = L + (jstar.to(tl.uint32) << sh.to(tl.uint32))
        new_size = tl.full((), 1, tl.uint32) << sh.to(tl.uint32)
        L = tl.where(few, tl.full((), 1, tl.uint32), new_L)
        size = tl.where(few, tl.full((), 0xFFFFFFFF, tl.uint32), new_size)
        above = tl.where(few, 0, new_above)
        sh = tl.where(few | exact, -4, sh - 4)

    # Write pass: keys >= L + size to slots [0, above), keys in [L, L + size)
    # to slots [above, K) in row order until full. Slots come from a running
    # count plus an in-block cumsum, so no atomics are needed.
    n_hi = tl.full((), 0, tl.int32)
    n_mid = tl.full((), 0, tl.int32)
    for c0 in range(0, n, BLOCK):
        offs = c0 + ar
        m = offs < n
        x = tl.load(x_row + offs, mask=m, other=float("-inf")).to(tl.float32)
        key = _radix_key(x)
        inr = (key >= L) & (key > 0)           # masked lanes have key 0
        d = key - L                            # no wrap: key >= L where used
        hi = inr & (d >= size)
        mid = inr & (d < size)
        hi_i = hi.to(tl.int32)
        mid_i = mid.to(tl.int32)
        hi_slot = n_hi + tl.cumsum(hi_i, axis=0) - 1
        mid_slot = above + n_mid + tl.cumsum(mid_i, axis=0) - 1
        slot = tl.where(hi, hi_slot, mid_slot)
        tl.store(out_row + slot, offs.to(tl.int32), mask=hi | (mid & (mid_slot < K)))
        n_hi += tl.sum(hi_i, axis=0)
        n_mid += tl.sum(mid_i, axis=0)
    # Rows with fewer than K selectable keys: -1 in the last slots.
    filled = above + tl.minimum(n_mid, K - above)
    for c0 in range(0, K, BLOCK):
        offs = c0 + ar
        tl.store(out_row + offs, tl.full([BLOCK], -1, tl.int32), mask=(offs >= filled) & (offs < K))


@triton.jit
def _topk_kernel(
    x_ptr, out_ptr, scratch_ptr, R, N, K,
    qs_ptr, S, s0, NS, b0,   # causal row lengths (indexer_topk): row r is query (b0 + r // NS, s0 + r % NS)
    LIMIT: tl.constexpr, HAS_QS: tl.constexpr,
    CAP: tl.constexpr, SAMPLE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Indices of the K largest of each row x[r, :N] into out[r, :K]
    (unordered), -1 after the real ones when fewer than K are selectable.
    Persistent: program p does rows p, p + G, ... (G programs), reusing its
    scratch row (CAP keys + CAP positions).

    Most rows touch memory once: rows of <= CAP keys are selected straight
    from registers. Longer rows first pick a threshold from a strided sample
    of SAMPLE keys (2048), aiming at ~1.5 K + 16 n / SAMPLE keys above it, then one
    filter pass compacts the keys at or above it into scratch; when those are
    between K and CAP, the selection runs on them in registers. Otherwise
    (heavy ties, K > CAP, a sample far off) the row takes the streaming
    radix select, which re-reads it ~9 times."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    sc_key = scratch_ptr + pid.to(tl.int64) * (2 * CAP)
    sc_pos = sc_key + CAP
    cap_ar = tl.arange(0, CAP)
    # The filter pass streams the row in FBLOCK chunks: several loads in
    # flight per thread, one cumsum per chunk.
    FBLOCK: tl.constexpr = 4 * BLOCK if 4 * BLOCK <= CAP else CAP
    far = tl.arange(0, FBLOCK)
    for r in range(pid, R, G):
        row = (pid * 0 + r).to(tl.int64)   # (r is a plain int under the interpreter)
        x_row = x_ptr + row * N
        out_row = out_ptr + row * K
        n = row * 0 + N   # int64 (an int arg equal to 1 arrives as a constexpr: no .to on it)
        if LIMIT:
            # Causal query: keys past its position are -inf; don't even read them.
            b = b0 + row // NS
            s = s0 + row % NS
            if HAS_QS:
                qpos = tl.load(qs_ptr + b) + s
            else:
                qpos = s + (N - S)
            n = tl.minimum(tl.maximum(qpos + 1, 0), n)

        if n <= CAP:
            # Short row: the whole row is the candidate set.
            m = cap_ar < n
            x = tl.load(x_row + cap_ar, mask=m, other=float("-inf")).to(tl.float32)
            _select_resident(_radix_key(x), cap_ar, K, out_row, BLOCK)
        else:
            # Threshold from a strided sample: its r_s-th largest key, r_s
            # scaled from K with 1.5x + 16 headroom so the filter keeps >= K
            # keys with overwhelming probability, yet few enough for CAP.
            sp = tl.arange(0, SAMPLE).to(tl.int64) * n // SAMPLE
            skey = _radix_key(tl.load(x_row + sp).to(tl.float32))
            r_s = tl.minimum(((row * 0 + K) * (3 * SAMPLE)) // (2 * n) + 16, SAMPLE).to(tl.int32)
            t_lo = tl.full((), 0, tl.uint32)
            for i in tl.static_range(32):
                cand = t_lo | (tl.full((), 1, tl.uint32) << (31 - i))
                c = tl.sum((skey >= cand).to(tl.int32), axis=0)
                t_lo = tl.where(c >= r_s, cand, t_lo)
            t_lo = tl.maximum(t_lo, 1)   # never admit NaN / -inf (key 0)

            # Filter pass: compact keys >= t_lo (and their positions) into scratch.
            tl.debug_barrier()   # the previous row's scratch reads are done
            n_c = tl.full((), 0, tl.int32)
            for c0 in range(0, n, FBLOCK):
                offs = c0 + far
                mk = offs < n
                key = _radix_key(tl.load(x_row + offs, mask=mk, other=float("-inf")).to(tl.float32))
                sel = key >= t_lo
                sel_i = sel.to(tl.int32)
                slot = n_c + tl.cumsum(sel_i, axis=0) - 1
                ok = sel & (slot < CAP)
                tl.store(sc_key + slot, key.to(tl.int32, bitcast=True), mask=ok)
                tl.store(sc_pos + slot, offs.to(tl.int32), mask=ok)
                n_c += tl.sum(sel_i, axis=0)
            tl.debug_barrier()   # scratch writes of all threads visible

            if (n_c >= K) & (n_c <= CAP):
                mc = cap_ar < n_c
                ckey = tl.load(sc_key + cap_ar, mask=mc, other=0).to(tl.uint32, bitcast=True)
                cpos = tl.load(sc_pos + cap_ar, mask=mc, other=-1)
                _select_resident(ckey, cpos, K, out_row, BLOCK)
            else:
                _select_streaming(x_row, n, K, out_row, BLOCK)


@triton.jit
def _sort_selected_kernel(x_ptr, idx_ptr, N, K, K_PAD: tl.constexpr):
    """Orders the K selected indices of a row by score, descending (-1 last).
    Packs (radix key << 32 | index) into uint64 and bitonic-sorts K_PAD of
    them with tl.sort; -1 slots and padding have key 0 and sink to the end."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, K_PAD)
    m = offs < K
    idx = tl.load(idx_ptr + row * K + offs, mask=m, other=-1)
    valid = idx >= 0
    x = tl.load(x_ptr + row * N + idx, mask=valid, other=float("-inf")).to(tl.float32)
    key = tl.where(valid, _radix_key(x), tl.zeros([K_PAD], tl.uint32))
    packed = (key.to(tl.uint64) << 32) | idx.to(tl.uint32, bitcast=True).to(tl.uint64)
    packed = tl.sort(packed, descending=True)
    key_s = (packed >> 32).to(tl.uint32)
    idx_s = (packed & 0xFFFFFFFF).to(tl.uint32).to(tl.int32, bitcast=True)
    idx_s = tl.where(key_s == 0, -1, idx_s)
    tl.store(idx_ptr + row * K + offs, idx_s, mask=m)


# Rows of up to _CAP_MAX keys are selected from registers; longer rows
# compact their candidates into a scratch row of that size (see _topk_kernel).
_CAP_MAX = 8192
_SAMPLE = 2048


def _launch_topk(x2d, out2d, k, limit=None):
    """x2d [R, N] -> out2d [R, k]. limit = (q_start|None, S, s0, NS, b0) gives
    each row its causal length (rows are queries of an indexer window)."""
    R, N = x2d.shape
    CAP = max(16, min(_CAP_MAX, _next_pow2(N)))
    SAMPLE = min(_SAMPLE, CAP)
    BLOCK = min(1024, CAP)
    if limit is None:
        qs, S, s0, NS, b0 = None, 1, 0, 1, 0
    else:
        qs, S, s0, NS, b0 = limit
    # Persistent grid: enough programs to fill the GPU a few times over, each
    # with its own scratch row (only needed when rows exceed CAP).
    if x2d.is_cuda:
        G = min(R, 4 * torch.cuda.get_device_properties(x2d.device).multi_processor_count)
    else:
        G = min(R, 8)
    if N > CAP:
        scratch = torch.empty((G, 2 * CAP), dtype=torch.int32, device=x2d.device)
    else:
        scratch = out2d   # never touched
    _topk_kernel[(G,)](
        x2d, out2d, scratch, R, N, k, qs if qs is not None else out2d, S, s0, NS, b0,
        LIMIT=limit is not None, HAS_QS=qs is not None, CAP=CAP, SAMPLE=SAMPLE, BLOCK=BLOCK,
        num_warps=16 if CAP >= 8192 else (8 if CAP >= 2048 else 4),
    )


_SORT_MAX = 4096   # largest k sorted by _sort_selected_kernel


def _launch_sort(x2d, out2d, k):
    R, N = x2d.shape
    K_PAD = max(16, _next_pow2(k))
    _sort_selected_kernel[(R,)](x2d, out2d, N, k, K_PAD=K_PAD,
                                num_warps=8 if K_PAD >= 1024 else 4)


def topk_indices(scores, k: int, sorted: bool):
    """int32 [..., k]: indices of the k largest entries of each row of
    scores [..., T] (fp32/fp16/bf16). NaN and -inf are never chosen, +inf is;
    rows with fewer than k selectable entries end in -1 slots; ties at the
    k-th value are broken by position (lowest first). sorted=True orders the
    slots by score, descending; otherwise the order is unspecified."""
    T = scores.shape[-1]
    lead = scores.shape[:-1]
    out = torch.empty((*lead, k), dtype=torch.int32, device=scores.device)
    if out.numel() == 0:
        return out
    x2d = scores.reshape(-1, T)
    out2d = out.view(-1, k)
    _launch_topk(x2d, out2d, k)
    if sorted and k > 1:
        if k <= _SORT_MAX:
            _launch_sort(x2d, out2d, k)
        else:
            # Beyond one program's register budget for a bitonic sort (k is
            # up to 2048 in DSA): order the chosen slots with torch instead.
            sel = out2d.long()
            vals = torch.gather(x2d, 1, sel.clamp(min=0)).float()
            vals = vals.masked_fill(sel < 0, float("-inf"))
            order = torch.sort(vals, dim=1, descending=True, stable=True).indices
            out2d.copy_(torch.gather(out2d, 1, order))
    return out


# --------------------------------------------------------------------------
# Fused selection: scores of a bounded group of queries, then their top-k
# --------------------------------------------------------------------------

def indexer_topk(q, w, k, topk: int, causal: bool, q_start):
    """int32 [B,S,topk]: topk_indices(indexer_scores(q, w, k), topk), slots
    in no particular order, -1 padding last.

    Never allocates [B,S,T]: the queries go in windows (whole batch elements
    when S*T fits, else a range of queries of one batch element) whose fp32
    scores fit a workspace of at most max(WORKSPACE_ELEMS, T) elements
    (64M fp32 = 256 MiB, or one row when T alone is larger); the scores
    kernel fills it and the top-k kernel selects from it, both on the same
    stream, so the workspace is reused window after window. Memory:
    O(B*S*topk) output + that workspace + the top-k kernel's scratch
    (4 * #SMs rows of 64 KiB, ~33 MiB on an H200). With causal=True the key blocks
    in the future of a whole query block are neither computed nor stored,
    and each top-k row reads only its visible prefix."""
    B, S, H, D = q.shape
    T = k.shape[1]
    out = torch.empty((B, S, topk), dtype=torch.int32, device=q.device)
    if out.numel() == 0:
        return out
    rows_budget = max(1, WORKSPACE_ELEMS // T)
    max_ns = _MAX_GRID_YZ * _BLOCK_S   # queries of one scores launch (grid dim 1)
    if S <= min(rows_budget, max_ns):
        nb_win, ns_win = max(1, min(B, rows_budget // S)), S
    else:
        nb_win, ns_win = 1, min(rows_budget, max_ns)
    ws = torch.empty((nb_win * ns_win, T), dtype=torch.float32, device=q.device)
    out2d = out.view(B * S, topk)
    for b0 in range(0, B, nb_win):
        nb = min(nb_win, B - b0)
        for s0 in range(0, S, ns_win):
            ns = min(ns_win, S - s0)
            rows = nb * ns
            win = ws[:rows]
            # With causal=True the top-k rows stop at their position, so the
            # dead key blocks need no -inf stores.
            _launch_scores(q, w, k, q_start, causal, win.view(nb, ns, T), b0, nb, s0, ns,
                           store_dead=not causal)
            r0 = b0 * S + s0   # windows are contiguous runs of (b, s) rows
            _launch_topk(win, out2d[r0:r0 + rows], topk,
                         limit=(q_start, S, s0, ns, b0) if causal else None)
    return out
