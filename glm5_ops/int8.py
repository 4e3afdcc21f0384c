"""INT8 inference ops: per-row symmetric quantisation, weight-only and W8A8
linears, and fused_moe with int8 expert weights.

Layouts (glm5_ops/reference.py is the spec):
  q, scale = quantize_int8(x)   x [..., K] fp32|fp16|bf16 -> q int8 [..., K], scale fp32 [...]
                                scale = max|row| / 127, q = round(x / scale) in [-127, 127]
  w int8 [N, K], scale fp32 [N]  a linear layer's weight, one scale per output channel
  int8_linear(x, w, scale, bias)  x [..., K] -> [..., N] in x.dtype: x @ (w * scale)^T + bias
  int8_linear_heads(x, w, scale)  x [H,M,K], w int8 [H,N,K], scale fp32 [H,N] -> [H,M,N]: each
                                  head's own int8_linear in one call (MLA's W_UK/W_UV at decode)
  w8a8_linear(x, w, scale, bias)  the same with x quantised per row at run time (dynamic),
                                  products summed exactly in int32 (K <= 131072)
  fused_moe_int8(x, w_gate_up, gate_up_scale, w_down, down_scale, weights, ids, w8a8=False, packed=False)
                                  w_gate_up int8 [E,2I,D] + fp32 [E,2I], w_down int8 [E,D,I] + fp32 [E,D];
                                  otherwise as glm5_ops.fused_moe. w8a8: experts with more than
                                  W8A8_MIN_ROWS rows also quantise their activations. packed: both
                                  weights in pack_rows's layout (what the CPU decode kernel reads
                                  fastest: packed_experts_pay says where)

    q, s = glm5_ops.quantize_int8(linear.weight)          # per output channel
    y = glm5_ops.int8_linear(x, q, s, linear.bias)        # decode: reads int8 weights
    y = glm5_ops.w8a8_linear(x, q, s, linear.bias)        # prefill: int8 GEMM

Inference only (no autograd). Backends: "cpp" (CPU: csrc/cpu/int8.cpp; CUDA:
csrc/cuda/int8.cu), "triton" (glm5_ops/triton/int8.py) and "reference".
models/glm5/quantization.py applies these to a model.
"""
from __future__ import annotations

import math

import torch

from . import _checks as check
from . import reference
from ._backend import _C, cpp_ops, current_backend, define_triton_ops, dispatch, register_op, triton_ops

W8A8_MIN_ROWS = reference.W8A8_MIN_ROWS
MAX_K_W8A8 = 131072   # K * 127 * 127 < 2^31: the int32 accumulator cannot overflow


def quantize_int8(x: torch.Tensor):
    """(q int8 [..., K], scale fp32 [...]): per-row symmetric int8 of floating x [..., K]."""
    check.tensor(x, "x", "[..., K]")
    if x.dim() == 0:
        raise ValueError("x must have shape [..., K] (rank >= 1, rows along the last dimension), got a 0-d tensor")
    x = x.detach().contiguous()
    return dispatch("quantize_int8", x.device, {
        "cpp": lambda: cpp_ops().int8_quantize_rows(x),
        "triton": lambda: triton_ops(x.device).int8_quantize_rows(x),
        "reference": lambda: reference.int8_quantize_rows(x),
    })


def _check_int8_weight(w, scale, name: str, shape: str, scale_name: str, scale_shape: tuple):
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be an int8 tensor of shape {shape}, got {type(w).__name__}")
    if w.dtype != torch.int8:
        raise TypeError(f"{name} must be int8 (quantize_int8's q), got {check.dtype_name(w.dtype)}")
    check.tensor(scale, scale_name, f"{list(scale_shape)} fp32", dtypes=(torch.float32,))
    if tuple(scale.shape) != scale_shape:
        raise ValueError(f"{scale_name} must have shape {list(scale_shape)} (one scale per row of {name}), "
                         f"got shape {tuple(scale.shape)}")


def _linear_args(x, w, scale, bias):
    check.tensor(x, "x", "[..., K]")
    if x.dim() == 0:
        raise ValueError("x must have shape [..., K], got a 0-d tensor")
    K = x.shape[-1]
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != K:
        raise ValueError(f"w must have shape [N, K={K}] (K of x), got "
                         f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    N = w.shape[0]
    _check_int8_weight(w, scale, "w", f"[N, K={K}]", "scale", (N,))
    if bias is not None:
        check.tensor(bias, "bias", f"[N={N}]", rank=1)
        check.dim(bias, "bias", f"[N={N}]", 0, N, "N")
    device = check.same_device(x=x, w=w, scale=scale, bias=bias)
    # An explicit row count: reshape(-1, K) cannot infer the rows when K = 0.
    x2 = x.reshape(math.prod(x.shape[:-1]), K).contiguous()
    return x2, w.contiguous(), scale.contiguous(), None if bias is None else bias.contiguous(), device


def int8_linear(x, w, scale, bias=None):
    """Weight-only int8 linear: x [..., K] float, w int8 [N,K], scale fp32 [N], bias [N]
    or None -> [..., N] in x.dtype = x @ (w * scale[:, None])^T + bias, fp32 accumulation."""
    if (_straight_to_cpu_kernel(_C_INT8_LINEAR, x, w, scale, *(() if bias is None else (bias,)))
            and x.dim() >= 1 and (bias is None or bias.dtype in check.FLOAT_DTYPES)):
        try:
            y = _C_INT8_LINEAR(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).contiguous(), w, scale, bias)
            return y.reshape(*x.shape[:-1], w.shape[0])
        except (TypeError, ValueError, IndexError, RuntimeError):
            pass   # bad input: the checks below raise the error that names the argument
    x2, w, scale, bias, device = _linear_args(x, w, scale, bias)
    y = dispatch("int8_linear", device, {
        "cpp": lambda: cpp_ops().int8_linear(x2, w, scale, bias),
        "triton": lambda: triton_ops(device).int8_linear(x2, w, scale, bias),
        "reference": lambda: reference.int8_linear(x2, w, scale, bias),
    })
    return y.reshape(*x.shape[:-1], w.shape[0])


def int8_linear_heads(x, w, scale):
    """Each head's weight-only product in one call: x [H,M,K] float, w int8 [H,N,K],
    scale fp32 [H,N] -> [H,M,N] in x.dtype, y[h] = x[h] @ (w[h] * scale[h][:, None])^T,
    fp32 accumulation. w's and scale's heads may be any distance apart (views of one
    int8 kv_b_proj are read in place); rows are made contiguous when they are not."""
    check.tensor(x, "x", "[H, M, K]", rank=3)
    H, M, K = x.shape
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.shape[0] != H or w.shape[2] != K:
        raise ValueError(f"w must have shape [H={H}, N, K={K}] (H and K of x), got "
                         f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    _check_int8_weight(w, scale, "w", f"[H={H}, N, K={K}]", "scale", tuple(w.shape[:2]))
    device = check.same_device(x=x, w=w, scale=scale)
    x = x.detach().contiguous()
    return dispatch("int8_linear_heads", device, {
        "cpp": lambda: cpp_ops().int8_linear_heads(x, w, scale),
        "triton": lambda: triton_ops(device).int8_linear_heads(x, w, scale),
        "reference": lambda: reference.int8_linear_heads(x, w, scale),
    })


def w8a8_linear(x, w, scale, bias=None):
    """Dynamic W8A8 linear: each row of x [..., K] quantised per row (quantize_int8) at
    run time, int8 x int8 products summed in int32, then * x_scale * scale + bias.
    -> [..., N] in x.dtype. K <= 131072 (the int32 sum cannot overflow)."""
    x2, w, scale, bias, device = _linear_args(x, w, scale, bias)
    if x2.shape[1] > MAX_K_W8A8:
        raise ValueError(f"x must have K <= {MAX_K_W8A8} for w8a8_linear (int32 accumulation), got K={x2.shape[1]}")
    y = dispatch("w8a8_linear", device, {
        "cpp": lambda: cpp_ops().w8a8_linear(x2, w, scale, bias),
        "triton": lambda: triton_ops(device).w8a8_linear(x2, w, scale, bias),
        "reference": lambda: reference.w8a8_linear(x2, w, scale, bias),
    })
    return y.reshape(*x.shape[:-1], w.shape[0])


pack_rows, unpack_rows = reference.pack_rows, reference.unpack_rows


def packed_experts_pay(device: torch.device, D: int, I: int) -> bool:
    """Whether int8 experts [E,2I,D] / [E,D,I] on `device` are better kept in the packed
    row layout: where the CPU decode kernel reads them with VNNI digits (its rows 4 side
    by side become one stream the hardware prefetcher follows; docs/INT8.md, "Packed
    expert rows"). Elsewhere the plain layout (the CUDA and Triton kernels read it)."""
    return (device.type == "cpu" and _C is not None
            and all(cpp_ops().int8_decode_kernel(n) == "vnni_digits" for n in (D, I)))


def fused_moe_int8(x, w_gate_up, gate_up_scale, w_down, down_scale, weights, ids, *, w8a8: bool = False,
                   packed: bool = False):
    """glm5_ops.fused_moe with int8 expert weights (per output row scales), inference only.

    x [T,D] float; w_gate_up int8 [E,2I,D], gate_up_scale fp32 [E,2I]; w_down int8
    [E,D,I], down_scale fp32 [E,D]; weights [T,k] float; ids int32/int64 [T,k] in [0,E).
    Returns [T,D] in x.dtype, computed in fp32. w8a8=True: an expert with more than
    W8A8_MIN_ROWS rows quantises its activations per row too (int8 GEMMs). packed=True:
    w_gate_up and w_down are in pack_rows's layout (off the CPU they are unpacked first)."""
    if (_straight_to_cpu_kernel(_C_FUSED_MOE_INT8, x, w_gate_up, gate_up_scale, w_down, down_scale, weights, ids)
            and (packed is True or packed is False) and ids.dtype == torch.int32 and weights.dtype in check.FLOAT_DTYPES):
        try:
            return _C_FUSED_MOE_INT8(x, w_gate_up, gate_up_scale, w_down, down_scale, weights, ids, bool(w8a8), packed)
        except (TypeError, ValueError, IndexError, RuntimeError):
            pass   # bad input: the checks below raise the error that names the argument
    check.tensor(x, "x", "[T,D]", rank=2)
    T, D = x.shape
    if not isinstance(w_gate_up, torch.Tensor) or w_gate_up.dim() != 3 or w_gate_up.shape[2] != D \
            or w_gate_up.shape[1] % 2 or w_gate_up.shape[0] < 1:
        raise ValueError(f"w_gate_up must have shape [E>=1, 2I, D={D}] (an even number of gate+up rows), got "
                         f"{tuple(w_gate_up.shape) if isinstance(w_gate_up, torch.Tensor) else type(w_gate_up).__name__}")
    E, I2 = w_gate_up.shape[:2]
    I = I2 // 2
    _check_int8_weight(w_gate_up, gate_up_scale, "w_gate_up", f"[E,2I,D={D}]", "gate_up_scale", (E, I2))
    if not isinstance(w_down, torch.Tensor) or tuple(w_down.shape) != (E, D, I):
        raise ValueError(f"w_down must have shape [E={E}, D={D}, I={I}] to match w_gate_up, got "
                         f"{tuple(w_down.shape) if isinstance(w_down, torch.Tensor) else type(w_down).__name__}")
    _check_int8_weight(w_down, down_scale, "w_down", f"[E={E},D={D},I={I}]", "down_scale", (E, D))
    check.tensor(ids, "ids", f"[T={T},k]", rank=2, dtypes=check.INDEX_DTYPES)
    check.dim(ids, "ids", f"[T={T},k]", 0, T, "T")
    k = ids.shape[1]
    check.tensor(weights, "weights", f"[T,k]=[{T},{k}]", rank=2, dtypes=check.FLOAT_DTYPES + (torch.float64,))
    if tuple(weights.shape) != (T, k):
        raise ValueError(f"weights must have shape [T,k]=[{T},{k}] like ids, got shape {tuple(weights.shape)}")
    device = check.same_device(x=x, w_gate_up=w_gate_up, gate_up_scale=gate_up_scale, w_down=w_down,
                               down_scale=down_scale, weights=weights, ids=ids)
    if check.host_value_check(ids):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= E:
            raise ValueError(f"ids must hold expert ids in [0, {E}) (E of w_gate_up), got values in [{lo}, {hi}]")
    if not isinstance(packed, bool):
        raise TypeError(f"packed must be a bool, got {type(packed).__name__}")
    if packed and device.type != "cpu":   # the layout is the CPU kernel's; the GPU kernels read plain rows
        w_gate_up, w_down, packed = unpack_rows(w_gate_up), unpack_rows(w_down), False
    args = (x.contiguous(), w_gate_up.contiguous(), gate_up_scale.contiguous(), w_down.contiguous(),
            down_scale.contiguous(), weights.contiguous(), ids.to(torch.int32).contiguous(), bool(w8a8), packed)
    return dispatch("fused_moe_int8", device, {
        "cpp": lambda: cpp_ops().fused_moe_int8(*args),
        "triton": lambda: triton_ops(device).fused_moe_int8(*args),
        "reference": lambda: reference.fused_moe_int8(*args),
    })


# The C++ kernels the wrappers call first on the CPU (see _straight_to_cpu_kernel).
_C_INT8_LINEAR = _C and torch.ops.glm5.int8_linear.default
_C_FUSED_MOE_INT8 = _C and torch.ops.glm5.fused_moe_int8.default
_CPU = torch.device("cpu")


def _straight_to_cpu_kernel(kernel, *tensors) -> bool:
    """Whether a call may go to the C++ CPU kernel before the wrapper's Python checks: the
    extension built, plain CPU tensors, the "cpp" backend, not while compiling (the caller
    adds what the kernel would take but the checks refuse). The kernels check every shape,
    dtype and index themselves (csrc/checks.h), so only a call one rejects runs the
    checks, for the message that names the argument. A decode step calls these ops many
    times: the checks cost 8-35 us a call, the kernel 4-130 us (bench/RESULTS.md)."""
    if kernel is None:
        return False
    for t in tensors:
        if type(t) is not torch.Tensor or not t.is_cpu:   # is_cpu: 0.07 us, device.type: 0.34 us
            return False
    return current_backend(_CPU) == "cpp" and not torch.compiler.is_compiling()


def _quantize_rows_fake(x):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _linear_fake(x, w, scale, bias):
    return x.new_empty((x.shape[0], w.shape[0]))


def _linear_heads_fake(x, w, scale):
    return x.new_empty((x.shape[0], x.shape[1], w.shape[1]))


def _fused_moe_int8_fake(x, w_gate_up, gate_up_scale, w_down, down_scale, weights, ids, w8a8, packed=False):
    return x.new_empty(x.shape)


if _C is not None:
    define_triton_ops("int8", ("int8_quantize_rows", "int8_linear", "int8_linear_heads", "w8a8_linear",
                               "fused_moe_int8"))
    register_op("int8_quantize_rows", _quantize_rows_fake)
    register_op("int8_linear", _linear_fake)
    register_op("int8_linear_heads", _linear_heads_fake)
    register_op("w8a8_linear", _linear_fake)
    register_op("fused_moe_int8", _fused_moe_int8_fake)
