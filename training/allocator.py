"""glibc's malloc for training: give freed tensors' memory back to the system.

PyTorch's CPU tensors come from malloc. glibc serves a request above its mmap
threshold with a mapping of its own, unmapped when freed; below it, from its
heaps, which keep freed memory for reuse. The threshold starts at 128 KiB and
rises (to at most 32 MiB) each time a mapped block is freed, so after the
first training step most tensors come from the heaps, and what a step frees
stays resident: the `small` preset kept 880 MiB free in one process and
~350 MiB in each of 4 FSDP2 processes (bench/train_distributed.py memory
--trace, "heap free"). A fixed threshold ends the rise: tensors of 64 KiB and
more are mapped, and their memory returns when they are freed.

    set_mmap_threshold(64 * 1024)     # Trainer does this (mmap_threshold=None leaves malloc alone)

Equivalent to MALLOC_MMAP_THRESHOLD_=65536 in the environment. Affects
allocations made after the call, in the whole process.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3        # glibc's malloc.h
MAX_MMAP_THRESHOLD = 32 * 2**20   # glibc's HEAP_MAX_SIZE / 2 on 64-bit: mallopt refuses more


def set_mmap_threshold(nbytes: int) -> None:
    """Fixes glibc's mmap threshold at `nbytes` (and stops its dynamic rise)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"mmap_threshold must be an int of bytes in [0, {MAX_MMAP_THRESHOLD}], got {nbytes!r}")
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        raise OSError("mmap_threshold needs glibc's mallopt (pass mmap_threshold=None on another C library)")
    if libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)) != 1:
        raise OSError(f"glibc's mallopt refused M_MMAP_THRESHOLD={nbytes}")
