"""Linear layers at decode: a matrix-vector kernel for few rows, and the one
function the model's linear layers call.

    y = glm5_ops.gemv(x, w, bias)      x [..., K], w [N, K] (both fp32 or both bf16), bias [N] or None
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
from ._backend import _C, cpp_ops, current_backend, dispatch, register_op

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


def _plain(t) -> bool:
    return t is None or (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu")


def takes_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether linear(x, w, bias) runs the gemv kernel (see the module docstring)."""
    if not (_plain(x) and _plain(w) and _plain(bias)) or x.dim() == 0 or w.dim() != 2:
        return False
    if x.dtype not in GEMV_DTYPES or w.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad)):
        return False
    if current_backend(x.device) != "cpp" or _C is None:
        return False
    rows = x.numel() // max(x.shape[-1], 1)
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
    return x.new_empty((x.shape[0], w.shape[0]))


if _C is not None:
    register_op("gemv", _gemv_fake, namespaces=("glm5",))
