"""Triton kernels for the INT8 inference ops (per-row symmetric int8).

Called by glm5_ops/int8.py with validated, contiguous inputs, as the kernels
of the glm5_triton:: ops (schemas: csrc/ops.cpp; semantics: glm5_ops/reference.py):

  int8_quantize_rows(x[..., K])            -> (q int8 [..., K], scale fp32 [...])
  int8_linear(x[M,K], w int8[N,K], scale fp32[N], bias[N]?)  -> [M,N] x.dtype  (weight-only)
  int8_linear_heads(x[H,M,K], w int8[H,N,K], scale fp32[H,N]) -> [H,M,N]  (a head per grid row)
  w8a8_linear(x, w, scale, bias)          -> the same with x quantised per row, int32 sums
  fused_moe_int8(x[T,D], w_gate_up int8[E,2I,D], gate_up_scale[E,2I], w_down int8[E,D,I],
                 down_scale[E,D], weights[T,k], ids int32[T,k], w8a8) -> [T,D] x.dtype

Design:
  _quantize_rows   one program per row: a max pass, then codes; the division is
                   exact (div_rn) and rounding is half to even, done by hand
                   (floor + the remainder), so codes equal the reference's bit
                   for bit on GPUs and under the interpreter.
  _linear          a tiled GEMM. Weight-only: the int8 tile is widened to x's
                   dtype on load (integers up to 127 are exact in fp16/bf16) and
                   tl.dot accumulates in fp32; the per-output-channel scale
                   factors out of the K sum, so it multiplies once in the
                   epilogue. W8A8: tl.dot of int8 tiles into int32 (exact), then
                   * x_scale[m] * scale[n] in fp32, the reference's order.
  fused_moe_int8   the routing plan of glm5_ops/triton/moe.py (_Plan: rows sorted
                   by expert, padded per expert to BLOCK_M), then _expert_gemm
                   for gate/up (rows gathered from x by token, SwiGLU in the
                   epilogue, h in sorted-row order) and for down (rows of h,
                   scattered to their (token, slot) row of y [T*k, D] fp32), and
                   moe.py's _combine (slots summed in order, deterministic).
                   w8a8: experts with more than W8A8_MIN_ROWS rows take a second
                   launch of each GEMM on int8 activations (x quantised per token
                   once, h per row); each launch skips the other kind's blocks.
Inference only. Under TRITON_INTERPRET=1 the kernels run on CPU tensors
(fp32/fp16; the interpreter has no bf16 math).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from ..reference import W8A8_MIN_ROWS
from ._limits import launch_guard
from .moe import _FLOATS, _combine, _interpreted, _next_pow2, _Plan, _prec, _silu_parts, _tile_ids


def _check_dtype(x: torch.Tensor, op: str) -> None:
    if x.dtype not in _FLOATS:
        raise NotImplementedError(f"triton {op} supports fp32, fp16 and bf16 x, got {x.dtype}")


# --------------------------------------------------------------------------
# Per-row quantisation
# --------------------------------------------------------------------------

@triton.jit
def _round_half_even(v):
    """round(v) with ties to even (torch.round), for |v| <= 127: v - floor(v) is exact."""
    r = tl.floor(v)
    f = v - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        v = tl.load(x_ptr + row * K + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.math.div_rn(tl.max(amax, axis=0), 127.0)
    safe = tl.where(scale > 0.0, scale, 1.0)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        ok = k0 + offs < K
        v = tl.load(x_ptr + row * K + k0 + offs, mask=ok, other=0.0).to(tl.float32)
        code = _round_half_even(tl.math.div_rn(v, safe))
        code = tl.where(scale > 0.0, tl.minimum(tl.maximum(code, -127.0), 127.0), 0.0)
        tl.store(q_ptr + row * K + k0 + offs, code.to(tl.int8), mask=ok)


def int8_quantize_rows(x):
    """(q int8 [..., K], scale fp32 [...]) of floating x [..., K], the reference's codes."""
    _check_dtype(x, "int8_quantize_rows")
    K = x.shape[-1]
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    s = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rows = s.numel()
    if rows == 0:
        return q, s
    if K == 0:
        return q, s.zero_()
    block = min(1024 if not _interpreted(x) else 4096, max(16, _next_pow2(K)))
    _quantize_rows_kernel[(rows,)](x, q, s, K, BLOCK_K=block, num_warps=4)
    return q, s


# --------------------------------------------------------------------------
# Linear layers
# --------------------------------------------------------------------------

@triton.jit
def _mma(a, b, acc, A8: tl.constexpr, PREC: tl.constexpr):
    """acc += a @ b: int8 x int8 into int32 (A8), else b widened to a's dtype, fp32 sums."""
    if A8:   # out_dtype named: Triton 3.6 asserts it equals acc's dtype (3.8 infers it)
        return tl.dot(a, b, acc, out_dtype=tl.int32)
    else:
        return tl.dot(a, b.to(a.dtype), acc, input_precision=PREC)


@triton.jit
def _linear_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, w_head, s_head,
                   A8: tl.constexpr, HAS_BIAS: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One (M block, N block) tile of head program_id(2) (one head without heads):
    head h's x, y at h*M*K, h*M*N; its w, scale w_head, s_head elements apart."""
    h = tl.program_id(2).to(tl.int64)
    x_ptr += h * M * K
    y_ptr += h * M * N
    w_ptr += h * w_head
    s_ptr += h * s_head
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0)
        acc = _mma(a, b, acc, A8, PREC)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = acc.to(tl.float32)
    if A8:
        y = y * tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    y = y * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _tiles(x: torch.Tensor, rows: float, a8: bool) -> dict:
    """Tile sizes: the smallest tl.dot allows under the interpreter (its cost is per
    program); on GPUs BLOCK_M follows the rows (decode: 16), int8 tiles take a longer K."""
    if _interpreted(x):
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
    bm = 16 if rows <= 16 else (32 if rows <= 48 else 64)
    if a8:
        return dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    if x.dtype == torch.float32:
        return dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)
    return dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)


def _linear(x, w, scale, bias, a8: bool):
    """x [M,K] or, with heads, x [H,M,K], w [H,N,K], scale [H,N] (rows contiguous)."""
    per_head = x.dim() == 3
    H, M, K = x.shape if per_head else (1, *x.shape)
    N = w.shape[-2]
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    if H == 0 or M == 0 or N == 0:
        return y
    if K == 0:
        return y.copy_(bias.to(x.dtype).expand(M, N)) if bias is not None else y.zero_()
    if per_head:   # rows contiguous; heads any distance apart (views of one weight)
        w = w if w.stride(-1) == 1 and w.stride(-2) == K else w.contiguous()
        scale = scale if scale.stride(-1) == 1 else scale.contiguous()
    heads = (w.stride(0), scale.stride(0)) if per_head else (0, 0)
    a, xs = int8_quantize_rows(x) if a8 else (x, scale)   # xs is not read without A8
    cfg = _tiles(x, M, a8)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]), H)
    with launch_guard(lambda: f"triton {'w8a8' if a8 else 'int8'}_linear H={H} M={M} N={N} K={K}"):
        _linear_kernel[grid](a, xs, w, scale, bias if bias is not None else scale, y, M, N, K, *heads,
                             A8=a8, HAS_BIAS=bias is not None, ACC=tl.int32 if a8 else tl.float32,
                             PREC=_prec(x.dtype), **cfg)
    return y


def int8_linear(x, w, scale, bias):
    """Weight-only: x @ (w * scale)^T + bias, fp32 accumulation, [M,N] in x.dtype."""
    _check_dtype(x, "int8_linear")
    return _linear(x, w, scale, bias, a8=False)


def int8_linear_heads(x, w, scale):
    """Each head's weight-only product: x [H,M,K], w [H,N,K], scale [H,N] -> [H,M,N] x.dtype."""
    _check_dtype(x, "int8_linear_heads")
    return _linear(x, w, scale, None, a8=False)


def w8a8_linear(x, w, scale, bias):
    """x quantised per row at run time, int8 x int8 summed in int32, scaled in fp32."""
    _check_dtype(x, "w8a8_linear")
    return _linear(x, w, scale, bias, a8=True)


# --------------------------------------------------------------------------
# fused_moe with int8 experts
# --------------------------------------------------------------------------

@triton.jit
def _expert_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, expert_ptr, nrows_ptr, heavy_ptr,
    P, TOPK, N, K, m_blocks,
    GATE_UP: tl.constexpr, A8: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One (M block of sorted rows, N block) tile of an expert's int8 projection.
    GATE_UP: a = x [T, K] gathered by token, W = w_gate_up[e] (gate rows n, up rows
    N + n), out = h [rows, N] = silu(gate) * up in sorted-row order. Otherwise a = h
    [rows, K], W = w_down[e], out = y [P, N] at each row's (token, slot) position.
    A8 launches serve the experts marked heavy (int8 a with row scales as_ptr), the
    others serve the rest: each block is computed by exactly one launch."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(nrows_ptr):
        return
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    if (tl.load(heavy_ptr + e) != 0) != A8:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < P
    a_row = (pair // TOPK).to(tl.int64) if GATE_UP else rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    W_ROWS: tl.constexpr = 2 if GATE_UP else 1
    a_ptrs = a_ptr + a_row[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + e * (W_ROWS * N) * K + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0)
        bmask = k_ok[:, None] & n_ok[None, :]
        acc = _mma(a, tl.load(w_ptrs, mask=bmask, other=0), acc, A8, PREC)
        if GATE_UP:
            acc_u = _mma(a, tl.load(w_ptrs + N * K, mask=bmask, other=0), acc_u, A8, PREC)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    row_scale = tl.load(as_ptr + a_row, mask=valid, other=0.0)[:, None] if A8 else 1.0
    ws_row = ws_ptr + e * (W_ROWS * N) + offs_n
    y = acc.to(tl.float32) * row_scale * tl.load(ws_row, mask=n_ok, other=0.0)[None, :]
    if GATE_UP:
        up = acc_u.to(tl.float32) * row_scale * tl.load(ws_row + N, mask=n_ok, other=0.0)[None, :]
        _, silu = _silu_parts(y)
        y = silu * up
        out_row = rows.to(tl.int64)
    else:
        out_row = pair.to(tl.int64)
    tl.store(out_ptr + out_row[:, None] * N + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


def _moe_tiles(x: torch.Tensor, rows_per_expert: float, a8: bool) -> dict:
    cfg = _tiles(x, rows_per_expert, a8)
    return dict(cfg, GROUP_M=1 if _interpreted(x) or rows_per_expert <= 16 else 4)


def fused_moe_int8(x, w_gate_up, gate_up_scale, w_down, down_scale, weights, ids, w8a8, packed=False):
    """out [T, D] in x.dtype: sum_j weights[t,j] * int8 SwiGLU expert ids[t,j] of x[t], fp32 sums.
    packed: the CPU kernel's row layout, unpacked here (these kernels read plain rows)."""
    _check_dtype(x, "fused_moe_int8")
    if packed:
        w_gate_up, w_down = reference.unpack_rows(w_gate_up), reference.unpack_rows(w_down)
    T, D = x.shape
    E, I2, _ = w_gate_up.shape
    I, k = I2 // 2, ids.shape[1]
    if T == 0 or k == 0 or D == 0:
        return torch.zeros((T, D), dtype=x.dtype, device=x.device)
    cfg = _moe_tiles(x, T * k / E, a8=False)
    plan = _Plan(ids.to(torch.int32).contiguous(), E, cfg["BLOCK_M"])
    y = torch.empty((plan.P, D), dtype=torch.float32, device=x.device)
    if I == 0:   # no hidden units: every expert outputs 0
        return _combine(y.zero_(), weights.float().contiguous(), T, k, D, x.dtype)
    # h keeps fp32 for fp32 x; 16-bit x multiplies in its dtype on the tensor cores.
    h = torch.empty((plan.rows_max, I), dtype=x.dtype, device=x.device)
    # Experts with more than W8A8_MIN_ROWS rows (not padded rows) multiply in int8 under w8a8.
    heavy = ((plan.counts > W8A8_MIN_ROWS) if w8a8 else torch.zeros_like(plan.counts, dtype=torch.bool)
             ).to(torch.int32)
    common = (plan.sorted_pairs, plan.expert_ids, plan.num_rows, heavy, plan.P, k)
    passes = (False, True) if w8a8 else (False,)

    def launch(a, w, ws, out, N, K, gate_up):
        """Both passes of one projection: weight-only (float a), then with w8a8 the heavy
        experts on a's per-row int8 codes; BLOCK_M stays the plan's padding."""
        a8_inputs = int8_quantize_rows(a) if w8a8 else None
        for a8 in passes:
            tiles = dict(_moe_tiles(x, T * k / E, a8), BLOCK_M=cfg["BLOCK_M"])
            src, src_scale = a8_inputs if a8 else (a, ws)   # src_scale is read only by A8 launches
            grid = (plan.m_blocks * triton.cdiv(N, tiles["BLOCK_N"]),)
            with launch_guard(lambda: f"triton fused_moe_int8 T={T} D={D} I={I} E={E} k={k}"):
                _expert_gemm_kernel[grid](src, src_scale, w, ws, out, *common, N, K, plan.m_blocks,
                                          GATE_UP=gate_up, A8=a8, ACC=tl.int32 if a8 else tl.float32,
                                          PREC=_prec(x.dtype), **tiles)

    launch(x, w_gate_up, gate_up_scale, h, I, D, True)
    launch(h, w_down, down_scale, y, D, I, False)
    return _combine(y, weights.float().contiguous(), T, k, D, x.dtype)
