"""A fuzz worker: receives JSON cases on a pipe, answers each with its outcome
(targets.run_case). Importing this module imports everything a case needs,
so the forkserver that preloads it hands out ready workers."""
from __future__ import annotations

import os
import resource
import sys

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():   # Triton cases run on CPU tensors through its interpreter
        os.environ["TRITON_INTERPRET"] = "1"

from . import targets  # noqa: E402

MEMORY_GIB = float(os.environ.get("GLM5_FUZZ_MEMORY_GIB", "16"))


def limit_memory(gib: float) -> None:
    """Caps the worker's address space, so a case that asks for a huge buffer
    gets an allocation error instead of the machine's OOM killer. Not under
    ASan, whose shadow memory needs terabytes of address space (the sanitizer
    job bounds allocations with ASAN_OPTIONS=max_allocation_size_mb)."""
    if "asan" in os.environ.get("LD_PRELOAD", "") or sys.platform != "linux":
        return
    limit = int(gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main(conn, threads: int) -> None:
    targets.torch.set_num_threads(threads)
    limit_memory(MEMORY_GIB)
    conn.send("ready")
    while True:
        try:
            case = conn.recv()
        except EOFError:
            return
        conn.send(targets.run_case(case))
