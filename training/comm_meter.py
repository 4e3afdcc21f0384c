"""Counts and times the torch.distributed collectives a block calls.

    with CommMeter() as comm:
        trainer.step(x, y)
    comm.counts["reduce_scatter"], comm.seconds

It wraps torch.distributed's collective functions by name while active
(FSDP2, the pipeline schedules and expert parallelism call them through the
module, so the wrappers see every call), and the lab's own all-gather and
reduce-scatter for FSDP2 on gloo (training/cpu_collectives.py), each counted
once whatever broadcasts or reduces it is made of. A collective that calls another one
(reduce_scatter_single -> reduce_scatter_tensor on some releases) counts
once, under the outer name's family. DTensor's tensor-parallel collectives
go through torch.distributed._functional_collectives and are not seen. On
gloo a collective returns when it is done, so `seconds` is the time spent
communicating; an async op (NCCL, isend) counts only its issue time.
"""
from __future__ import annotations

import collections
import functools
import importlib
import time

import torch.distributed as dist

# torch.distributed name -> family counted under (names differ across torch 2.11-2.14)
FAMILIES = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "all_gather": "all_gather", "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast", "batch_isend_irecv": "p2p",
}
# The lab's own collectives (FSDP2's on gloo, built from broadcasts and reduces): module, name -> family
LAB_FAMILIES = {("training.cpu_collectives", "all_gather_into"): "all_gather",
                ("training.cpu_collectives", "reduce_scatter_into"): "reduce_scatter"}
GRADIENT_FAMILIES = ("reduce_scatter", "all_reduce")   # what data parallelism synchronises gradients with


class CommMeter:
    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.seconds = 0.0
        self._saved: dict = {}
        self._depth = 0

    def _wrap(self, family: str, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.counts[family] += 1
                self._depth -= 1
        return counted

    def gradient_collectives(self) -> int:
        return sum(self.counts[f] for f in GRADIENT_FAMILIES)

    def __enter__(self):
        if self._saved:
            raise RuntimeError("CommMeter is already active")
        targets = [(dist, name, family) for name, family in FAMILIES.items()]
        targets += [(importlib.import_module(mod), name, family) for (mod, name), family in LAB_FAMILIES.items()]
        for module, name, family in targets:
            fn = getattr(module, name, None)
            if fn is not None:
                self._saved[(module, name)] = fn
                setattr(module, name, self._wrap(family, fn))
        return self

    def __exit__(self, *exc):
        for (module, name), fn in self._saved.items():
            setattr(module, name, fn)
        self._saved = {}
        return False
