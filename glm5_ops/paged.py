"""The paged cache's store: cache_write(pool, slots, values), pool[slots[i]] = values[i] in place.

One op (glm5::cache_write, csrc/cpu/cache_write.cpp) on every device, so that
torch.compile sees a mutation of the pool it can keep in place; written as an
index_copy_ into a view of the pool, the compiled decode step copied the whole
cache twice per layer (models/glm5/cache.py). The C++ op checks its arguments
and names them; the "reference" backend checks the same in Python, then runs
reference.cache_write's rule in place.
"""
from __future__ import annotations

import torch

from . import _checks as check
from . import reference
from ._backend import _C, cpp_ops, dispatch


def cache_write(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """pool [P, D] (written in place), slots int64 [N] rows of pool, values [N, D] in pool's dtype."""
    if not isinstance(pool, torch.Tensor):   # its device picks the backend
        raise TypeError(f"pool must be a tensor [P, D], got {type(pool).__name__}")

    def in_place_reference():
        _check_args(pool, slots, values)   # the C++ op checks the same itself: not twice on the hot path
        pool.copy_(reference.cache_write(pool, slots, values))
    return dispatch("cache_write", pool.device, {
        "cpp": lambda: cpp_ops().cache_write(pool, slots, values),
        "triton": lambda: cpp_ops().cache_write(pool, slots, values),   # data movement: no Triton kernel to have
        "reference": in_place_reference,
    })


def _check_args(pool, slots, values) -> None:
    """csrc/cpu/cache_write.cpp's checks, for the reference backend, whose index_copy would not name them."""
    check.tensor(pool, "pool", "[P, D]", rank=2, dtypes=None)
    P, D = pool.shape
    if torch._debug_has_internal_overlap(pool) == 1:
        raise ValueError(f"pool must be writable row by row (no two elements in one memory location), "
                         f"got strides {pool.stride()}")
    check.tensor(slots, "slots", "[N]", rank=1, dtypes=(torch.int64,))
    N = slots.shape[0]
    check.tensor(values, "values", f"[N={N}, D={D}]", rank=2, dtypes=None)
    if values.dtype != pool.dtype:
        raise TypeError(f"values must have pool's dtype ({check.dtype_name(pool.dtype)}), "
                        f"got {check.dtype_name(values.dtype)}")
    check.dim(values, "values", f"[N={N}, D={D}]", 0, N, "N")
    check.dim(values, "values", f"[N={N}, D={D}]", 1, D, "D")
    device = check.same_device(pool=pool, slots=slots, values=values)
    if device.type == "cpu" and check.host_value_check(slots):   # on a GPU: index_copy_'s device assert
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= P:
            raise ValueError(f"slots must hold rows of pool in [0, P={P}), got values in [{lo}, {hi}]")


def _cache_write_fake(pool, slots, values):
    return None


if _C is not None:
    torch.library.register_fake("glm5::cache_write", _cache_write_fake)
