"""Linear layers at decode: a matrix-vector kernel for few rows, and the one
function the model's linear layers call.

    y = glm5_ops.gemv(x, w, bias)      x [..., K], w [N, K] (both fp32 or both bf16), bias [N] or None
    y = glm5_ops.gemv_heads(x, w)      x [H, M, K], w [H, N, K] -> [H, M, N]: y[h] = x[h] @ w[h]^T
    y = glm5_ops.linear_heads(x, w)    the same by torch.matmul where gemv_heads does not apply
    y = glm5_ops.linear(x, w, bias)    F.linear's contract; takes gemv where plan.py says it is faster

gemv: y = x @ w^T + bias in x.dtype, fp32 accumulation (glm5_ops/reference.py
is the spec). Each row's result is the same whatever the other rows are (the
kernel has one accumulator chain per (row, output) pair: csrc/cpu/gemv_tiles.h).
Backends: "cpp" (CPU: csrc/cpu/gemv.cpp) and "reference"; no CUDA or Triton
kernel (NotImplementedError names the op). Inference only: no autograd.

linear() runs gemv only for plain CPU tensors (no tensor subclass such as
DTensor, none requiring grad while autograd records) of a dtype gemv takes,
with at most plan.gemv_max_rows(dtype) rows, on the "cpp" backend; everything
else is F.linear, unchanged (training, FSDP/TP, CUDA, prefill).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import _checks as check
from . import plan, reference
from ._backend import _C, cpp_ops, cpu_inference_kernel_applies, dispatch, register_op

GEMV_DTYPES = (torch.float32, torch.bfloat16)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] and w [N, K], both fp32 or both bf16, bias [N] of x's dtype or
    None -> x @ w^T + bias, [..., N] in x.dtype (fp32 accumulation). Inference only."""
    check.tensor(x, "x", "[..., K]", dtypes=GEMV_DTYPES)
    if x.dim() == 0:
        raise ValueError("x must have shape [..., K] (rank >= 1), got a 0-d tensor")
    K = x.shape[-1]
    check.tensor(w, "w", f"[N, K={K}]", rank=2, dtypes=GEMV_DTYPES)
    check.dim(w, "w", f"[N, K={K}]", 1, K, "K")
    if w.dtype != x.dtype:
        raise TypeError(f"w must have the dtype of x ({check.dtype_name(x.dtype)}), got {check.dtype_name(w.dtype)}")
    N = w.shape[0]
    if bias is not None:
        check.tensor(bias, "bias", f"[N={N}]", rank=1, dtypes=(x.dtype,))
        check.dim(bias, "bias", f"[N={N}]", 0, N, "N")
    device = check.same_device(x=x, w=w, bias=bias)
    x2, w2 = x.detach().reshape(math.prod(x.shape[:-1]), K).contiguous(), w.detach().contiguous()
    b2 = None if bias is None else bias.detach().contiguous()
    y = dispatch("gemv", device, {
        "cpp": lambda: cpp_ops().gemv(x2, w2, b2),
        "reference": lambda: reference.gemv(x2, w2, b2),
    })
    return y.reshape(*x.shape[:-1], N)


def gemv_heads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [H, M, K] and w [H, N, K], both fp32 or both bf16 -> [H, M, N] in x.dtype,
    y[h] = x[h] @ w[h]^T (fp32 accumulation): one call for every head's small
    product (MLA's W_UK and W_UV at decode). w's rows must be contiguous or it
    is copied; its heads may be any distance apart (a strided view of a larger
    weight is read in place). Inference only."""
    check.tensor(x, "x", "[H, M, K]", rank=3, dtypes=GEMV_DTYPES)
    H, M, K = x.shape
    check.tensor(w, "w", f"[H={H}, N, K={K}]", rank=3, dtypes=GEMV_DTYPES)
    check.dim(w, "w", f"[H={H}, N, K={K}]", 0, H, "H")
    check.dim(w, "w", f"[H={H}, N, K={K}]", 2, K, "K")
    if w.dtype != x.dtype:
        raise TypeError(f"w must have the dtype of x ({check.dtype_name(x.dtype)}), got {check.dtype_name(w.dtype)}")
    device = check.same_device(x=x, w=w)
    x, w = x.detach().contiguous(), w.detach()
    return dispatch("gemv", device, {
        "cpp": lambda: _gemv_heads_kernel(x, w),
        "reference": lambda: reference.gemv(x, w),
    })


def linear_heads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [H, M, K] @ w[h]^T per head -> [H, M, N]: gemv_heads where takes_gemv(x, w) says so, else torch.matmul."""
    if takes_gemv(x, w):
        return _gemv_heads_kernel(x, w)
    return torch.matmul(x, w.transpose(-1, -2))


def _gemv_heads_kernel(x, w):
    """The C++ kernel for inputs takes_gemv accepted (shapes: the kernel checks them)."""
    return cpp_ops().gemv.default(x.contiguous(), w, None)


def takes_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether linear(x, w, bias) runs the gemv kernel (see the module docstring);
    with w [H, N, K], whether gemv_heads(x [H, M, K], w) should (M rows a head)."""
    if not cpu_inference_kernel_applies(x, w, bias) or x.dim() == 0 or w.dim() not in (2, 3):
        return False
    if x.dtype not in GEMV_DTYPES or w.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return False
    rows = x.shape[-2] if w.dim() == 3 and x.dim() == 3 else x.numel() // max(x.shape[-1], 1)
    return plan.gemv_is_faster(rows, x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias), computed by the gemv kernel where takes_gemv says so."""
    if takes_gemv(x, w, bias):
        return _gemv_kernel(x, w, bias)
    return F.linear(x, w, bias)


def _gemv_kernel(x, w, bias):
    """The C++ kernel for inputs takes_gemv accepted. It has checked all that
    gemv() checks but the shapes, which the kernel checks itself: skipping
    gemv()'s checks, detaches and backend table saves ~15 us per call, and a
    decode step makes 65 of them."""
    y = cpp_ops().gemv.default(x.reshape(-1, x.shape[-1]), w, bias)
    return y.view(*x.shape[:-1], w.shape[0])


def _gemv_fake(x, w, bias):
    return x.new_empty((*x.shape[:-1], w.shape[-2]))


if _C is not None:
    register_op("gemv", _gemv_fake, namespaces=("glm5",))
