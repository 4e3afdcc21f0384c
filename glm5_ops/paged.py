"""The paged cache's store: cache_write(pool, slots, values), pool[slots[i]] = values[i] in place.

One op (glm5::cache_write, csrc/cpu/cache_write.cpp) on every device, so that
torch.compile sees a mutation of the pool it can keep in place; written as an
index_copy_ into a view of the pool, the compiled decode step copied the whole
cache twice per layer (models/glm5/cache.py). The C++ op checks its arguments
and names them. The "reference" backend runs reference.cache_write's rule in place.
"""
from __future__ import annotations

import torch

from . import reference
from ._backend import _C, cpp_ops, dispatch


def cache_write(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """pool [P, D] (written in place), slots int64 [N] rows of pool, values [N, D] in pool's dtype."""
    def in_place_reference():
        pool.copy_(reference.cache_write(pool, slots, values))
    return dispatch("cache_write", pool.device, {
        "cpp": lambda: cpp_ops().cache_write(pool, slots, values),
        "triton": lambda: cpp_ops().cache_write(pool, slots, values),   # data movement: no Triton kernel to have
        "reference": in_place_reference,
    })


def _cache_write_fake(pool, slots, values):
    return None


if _C is not None:
    torch.library.register_fake("glm5::cache_write", _cache_write_fake)
