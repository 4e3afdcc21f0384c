"""Triton kernels for group-wise activation quantisation.

Called by glm5_ops/compress.py with validated, contiguous inputs:

  quantize_groupwise(x, bits, group_size, stochastic, seed) -> (packed uint8 [N*bits/8], scale fp32 [G], zero fp32 [G])
  dequantize(packed, scale, zero, bits, group_size, shape, dtype) -> dtype [shape]

Layout and semantics: glm5_ops/reference.py (bit for bit for deterministic
rounding). Stochastic rounding draws u from the same counter-based hash as
the C++/CUDA kernels (csrc/quantize_common.h), so all three agree exactly for
a given seed. Each program handles ROWS groups; a group is viewed as
[NB bytes, PER codes a byte], so packing is a shift and a sum over the last
axis. Works on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_M32 = 0xFFFFFFFF


def _hash32_py(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    x ^= x >> 16
    return x


def seed_key(seed: int) -> int:
    """The per-call key of csrc/quantize_common.h (seed_key), as a uint32."""
    s = seed & ((1 << 64) - 1)
    return _hash32_py((s & _M32) ^ _hash32_py((s >> 32) ^ 0x9E3779B9))


def _as_i32(u: int) -> int:
    return u - (1 << 32) if u >= (1 << 31) else u


@triton.jit
def _hash32(x):
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


def _shape(group_size: int, bits: int):
    per = 8 // bits
    nb = triton.next_power_of_2(group_size // per)
    rows = max(1, min(64, 4096 // (nb * per)))
    return per, nb, rows


# key_i32 is a runtime value: without do_not_specialize Triton would compile a
# kernel per "== 1" / "% 16 == 0" class of keys, and a key equal to 1 arrives
# as a constexpr, on which the bitcast below does not compile.
@triton.jit(do_not_specialize=["key_i32"])
def _quantize_kernel(x_ptr, packed_ptr, scale_ptr, zero_ptr, G, key_i32,
                     GS: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, NB: tl.constexpr,
                     ROWS: tl.constexpr, STOCHASTIC: tl.constexpr):
    LEVELS: tl.constexpr = (1 << BITS) - 1
    g = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)          # [ROWS]
    b = tl.arange(0, NB)                                                  # byte within the group
    k = tl.arange(0, PER)                                                 # code within the byte
    g_ok = g < G
    b_ok = b < GS // PER
    n = g[:, None, None] * GS + b[None, :, None] * PER + k[None, None, :]  # [ROWS, NB, PER] element index
    ok = g_ok[:, None, None] & b_ok[None, :, None]
    x = tl.load(x_ptr + n, mask=ok, other=0.0).to(tl.float32)
    lo = tl.min(tl.min(tl.where(ok, x, float("inf")), axis=2), axis=1)    # [ROWS]
    hi = tl.max(tl.max(tl.where(ok, x, float("-inf")), axis=2), axis=1)
    sc = tl.math.div_rn(hi - lo, LEVELS * 1.0)
    has_range = sc > 0.0
    v = tl.math.div_rn(x - lo[:, None, None], tl.where(has_range, sc, 1.0)[:, None, None])
    if STOCHASTIC:
        key = key_i32.to(tl.uint32, bitcast=True)
        hk = _hash32((n >> 32).to(tl.uint32) ^ key)
        h = _hash32(_hash32((n & 0xFFFFFFFF).to(tl.uint32) + hk) ^ key)
        u = (h >> 8).to(tl.int32).to(tl.float32) * (1.0 / 16777216.0)
        q = tl.floor(v + u)
    else:
        q = (v + 8388608.0) - 8388608.0  # round half to even for 0 <= v < 2^23
    q = tl.minimum(tl.maximum(q, 0.0), LEVELS * 1.0)
    q = tl.where(has_range[:, None, None], q, 0.0).to(tl.int32)
    byte = tl.sum(q << (k * BITS)[None, None, :], axis=2).to(tl.uint8)      # [ROWS, NB]
    tl.store(packed_ptr + g[:, None] * (GS // PER) + b[None, :], byte, mask=g_ok[:, None] & b_ok[None, :])
    tl.store(scale_ptr + g, sc, mask=g_ok)
    tl.store(zero_ptr + g, lo, mask=g_ok)


@triton.jit
def _dequantize_kernel(packed_ptr, scale_ptr, zero_ptr, out_ptr, G,
                       GS: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, NB: tl.constexpr,
                       ROWS: tl.constexpr):
    MASK: tl.constexpr = (1 << BITS) - 1
    g = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    b = tl.arange(0, NB)
    k = tl.arange(0, PER)
    g_ok = g < G
    ok2 = g_ok[:, None] & (b < GS // PER)[None, :]
    byte = tl.load(packed_ptr + g[:, None] * (GS // PER) + b[None, :], mask=ok2, other=0).to(tl.int32)
    q = ((byte[:, :, None] >> (k * BITS)[None, None, :]) & MASK).to(tl.float32)
    sc = tl.load(scale_ptr + g, mask=g_ok, other=0.0)
    lo = tl.load(zero_ptr + g, mask=g_ok, other=0.0)
    x = lo[:, None, None] + q * sc[:, None, None]
    n = g[:, None, None] * GS + b[None, :, None] * PER + k[None, None, :]
    tl.store(out_ptr + n, x.to(out_ptr.dtype.element_ty), mask=ok2[:, :, None])


def quantize_groupwise(x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int):
    numel = x.numel()
    G = numel // group_size
    packed = torch.empty(numel * bits // 8, dtype=torch.uint8, device=x.device)
    scale = torch.empty(G, dtype=torch.float32, device=x.device)
    zero = torch.empty(G, dtype=torch.float32, device=x.device)
    if G == 0:
        return packed, scale, zero
    per, nb, rows = _shape(group_size, bits)
    _quantize_kernel[(triton.cdiv(G, rows),)](
        x, packed, scale, zero, G, _as_i32(seed_key(seed)),
        GS=group_size, BITS=bits, PER=per, NB=nb, ROWS=rows, STOCHASTIC=bool(stochastic))
    return packed, scale, zero


def dequantize(packed, scale, zero, bits: int, group_size: int, shape, dtype: torch.dtype):
    out = torch.empty(tuple(shape), dtype=dtype, device=packed.device)
    G = out.numel() // group_size
    if G == 0:
        return out
    per, nb, rows = _shape(group_size, bits)
    _dequantize_kernel[(triton.cdiv(G, rows),)](packed, scale, zero, out, G,
                                                GS=group_size, BITS=bits, PER=per, NB=nb, ROWS=rows)
    return out
