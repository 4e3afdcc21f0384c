"""This machine's ceilings, measured once per run: the matmul peak (a large
sgemm, or bf16 on a GPU) and the memory bandwidth (a large copy). Benchmarks
report the fraction of these their kernels reach."""
from __future__ import annotations

import functools
import time

import torch


def _best_seconds(fn, repeat=5):
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


@functools.lru_cache(maxsize=None)
def matmul_gflops(device: str = "cpu", dtype: torch.dtype = torch.float32, n: int = 2048) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _best_seconds(lambda: a @ b) / 1e9


@functools.lru_cache(maxsize=None)
def bandwidth_gbs(device: str = "cpu", mib: int = 512) -> float:
    """Copy bandwidth, counting bytes read plus bytes written."""
    src = torch.randn(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src)) / 1e9
