"""Argument checks for the Python API: every failure names the argument and
the expected shape, before any kernel runs. (On the CPU, int8_linear and
fused_moe_int8 call their C++ kernel first, whose own checks refuse the same
inputs before it computes anything; these then run for the message.)"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
INT32_MAX = 2**31 - 1   # the bound of an int argument that no size implies (kernels index with int32)


def dtype_name(d: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: how error messages name a dtype."""
    return str(d).replace("torch.", "")


def tensor(t, name: str, shape: str, rank: int | None = None, dtypes=FLOAT_DTYPES) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of shape {shape}, got {type(t).__name__}")
    if rank is not None and t.dim() != rank:
        raise ValueError(f"{name} must have shape {shape} (rank {rank}), got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(dtype_name(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {dtype_name(t.dtype)}")
    return t


def dim(t: torch.Tensor, name: str, shape: str, axis: int, expected: int, what: str) -> None:
    if t.shape[axis] != expected:
        raise ValueError(f"{name} must have shape {shape} with {what}={expected}, got shape {tuple(t.shape)}")


def nonempty(t: torch.Tensor, name: str, shape: str, axis: int, what: str) -> None:
    """The axes the ops cannot run empty (heads, head dims, keys, experts): >= 1
    (docs/OPS.md, "Degenerate shapes"); batch, query and token axes may be 0."""
    if t.shape[axis] < 1:
        raise ValueError(f"{name} must have shape {shape} with {what} >= 1, got shape {tuple(t.shape)}")


def same_device(**tensors) -> torch.device:
    devices = {n: t.device for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    (first, device), *rest = devices.items()
    for name, d in rest:
        if d != device:
            listed = ", ".join(f"{n} on {dv}" for n, dv in devices.items())
            raise ValueError(f"{name} must be on {device} like {first} (all tensors on one device), got {listed}")
    return device


def host_value_check(t: torch.Tensor) -> bool:
    """Whether a check of t's values (min/max read back to the host) runs: not
    for empty or meta tensors, nor while torch.compile traces, where the .item()
    would split the graph; the C++ kernels check the same values themselves."""
    return t.numel() > 0 and t.device.type != "meta" and not torch.compiler.is_compiling()


def int_in_range(value, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def q_start(value, B: int, device: torch.device) -> torch.Tensor | None:
    """None, an int, or an integer tensor [B] -> None or int64 tensor [B] on `device`."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.full((B,), value, dtype=torch.int64, device=device)
    tensor(value, "q_start", f"[B={B}]", rank=1, dtypes=INDEX_DTYPES)
    dim(value, "q_start", f"[B={B}]", 0, B, "B")
    if value.device != device:
        raise ValueError(f"q_start must be on {device} like q, got {value.device}")
    return value.to(torch.int64).contiguous()
