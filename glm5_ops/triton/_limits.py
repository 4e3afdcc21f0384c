"""Shared-memory budget of one Triton program, and a clear error when a launch
still does not fit.

Triton compares a kernel's shared memory (metadata.shared) with the device's
opt-in limit at the first launch and raises OutOfResources. The wrappers pick
num_stages / tile sizes from estimates checked against that limit (each
estimate is calibrated on an sm_90 compile with triton 3.6, see the callers),
and `launch_guard` turns an OutOfResources the estimate missed into a
NotImplementedError that names the op and the shape.
"""
from __future__ import annotations

import contextlib
import functools

import torch

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover - a triton without it
    class OutOfResources(Exception):
        pass

# sm_90 (H100/H200): 227 KiB of shared memory per block (opt-in); Triton's limit.
SM90_SMEM = 232_448


@functools.lru_cache(maxsize=None)
def _cuda_smem(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or SM90_SMEM)


def smem_limit(device: torch.device) -> int:
    """Bytes of shared memory one program may use on `device`. CPU tensors
    (the interpreter) get the sm_90 figure, so a CPU run picks the tiles an
    H100/H200 would."""
    if device.type == "cuda":
        return _cuda_smem(device.index if device.index is not None else torch.cuda.current_device())
    return SM90_SMEM


@contextlib.contextmanager
def launch_guard(what):
    """Re-raise Triton's OutOfResources (shared memory or registers, raised at
    the first launch of a compiled kernel, before it runs) as a
    NotImplementedError naming `what` (the op and the shape; a string, or a
    function that makes it, called only then)."""
    try:
        yield
    except OutOfResources as e:
        raise NotImplementedError(f"{what() if callable(what) else what}: {e}") from e
