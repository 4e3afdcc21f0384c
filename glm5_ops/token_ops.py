"""Per-token layers: RMSNorm and GLM-5's RoPE, each one kernel at inference.

    y = glm5_ops.rms_norm(x, weight, eps)              x [..., D], weight [D] of x's dtype
    y = glm5_ops.rope(x, cos, sin, rotary_dim=None)    x [B,S,D] or [B,S,H,D], cos/sin [B,S,rotary_dim/2]

The contract is the composite each replaces (glm5_ops/reference.py's
rms_norm and rope, which the model ran before): RMSNorm normalises in fp32,
rounds to x's dtype, then multiplies by the weight; RoPE rotates interleaved
pairs of the first rotary_dim channels and lays them out de-interleaved.

Why a kernel: a decode step runs 33 RMSNorms and ~24 RoPEs of a few KB each.
As torch composites they are 6 and ~11 dispatches a call (~10 and ~15 us of
framework time on this project's CPUs for well under a microsecond of
arithmetic); csrc/cpu/token_ops.cpp does each in one. RoPE's kernel equals the
composite bit for bit; RMSNorm's differs in the order of the sum of squares
(fp32, a few ulp). Both compute each row from that row alone.

Like linear(), the kernel runs only for plain CPU tensors (no subclass such
as DTensor), none requiring grad while autograd records, on the "cpp"
backend; everything else (training, FSDP/TP, CUDA) runs the composite.
Under torch.compile the kernel stays an opaque op: tracing the composite
instead, for inductor to fuse, measured no faster in a compiled decode step
(bench/RESULTS.md, "Compiled decode, 2026-12-06").
"""
from __future__ import annotations

import math

import torch

from . import _checks as check
from . import reference
from ._backend import _C, cpp_ops, cpu_inference_kernel_applies, register_op


def takes_kernel(*tensors) -> bool:
    """Whether rms_norm / rope given these tensors run the C++ kernel (see the module docstring)."""
    return cpu_inference_kernel_applies(*tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * to_dtype(x * rsqrt(mean(x^2) + eps)) over x's last dim, normalised in fp32."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if takes_kernel(x, weight) and weight.dtype == x.dtype:
        return cpp_ops().rms_norm.default(x, weight, eps)     # the kernel checks the tensors itself
    check.tensor(x, "x", "[..., D]")
    if x.dim() == 0:
        raise ValueError("x must have shape [..., D] (rank >= 1), got a 0-d tensor")
    D = x.shape[-1]
    check.tensor(weight, "weight", f"[D={D}]", rank=1)
    check.dim(weight, "weight", f"[D={D}]", 0, D, "D")
    check.same_device(x=x, weight=weight)
    return reference.rms_norm(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None) -> torch.Tensor:
    """GLM-5's interleaved RoPE of x's first rotary_dim channels (all when None), de-interleaved out."""
    check.tensor(x, "x", "[B,S,D] or [B,S,H,D]")
    if x.dim() not in (3, 4):
        raise ValueError(f"x must have shape [B,S,D] or [B,S,H,D], got shape {tuple(x.shape)}")
    rotary_dim = x.shape[-1] if rotary_dim is None else check.int_in_range(rotary_dim, "rotary_dim", 0, check.INT32_MAX)
    if takes_kernel(x, cos, sin) and cos.dtype == sin.dtype == x.dtype:
        return cpp_ops().rope.default(x, cos, sin, rotary_dim)   # the kernel checks cos and sin itself
    B, S, D = x.shape[0], x.shape[1], x.shape[-1]
    if rotary_dim % 2 or rotary_dim > D:
        raise ValueError(f"rotary_dim must be even and in [0, D={D}], got {rotary_dim}")
    shape = f"[B={B},S={S},rotary_dim/2={rotary_dim // 2}]"
    for name, t in (("cos", cos), ("sin", sin)):
        check.tensor(t, name, shape, rank=3)
        if tuple(t.shape) != (B, S, rotary_dim // 2):
            raise ValueError(f"{name} must have shape {shape}, got shape {tuple(t.shape)}")
    check.same_device(x=x, cos=cos, sin=sin)
    return reference.rope(x, cos, sin, rotary_dim)


def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x)


def _rope_fake(x, cos, sin, rotary_dim):
    return x.new_empty(x.shape)


if _C is not None:
    register_op("rms_norm", _rms_norm_fake, namespaces=("glm5",))
    register_op("rope", _rope_fake, namespaces=("glm5",))
