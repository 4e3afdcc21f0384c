"""A pool of CPU processes joined by gloo, for the parallelism tests: spawned
once (imports and process-group setup paid once), then every job runs on all
of them. A job is a function of this module (or any importable one) called
as fn(**kwargs) on each rank; run() returns the ranks' results in rank order.

A job that fails or hangs on one rank leaves the others inside a
collective: the pool then terminates every process and raises, and the
process group's own timeout bounds a collective that never completes.
"""
from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, jobs, results, timeout_s: float):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        while True:
            job = jobs.get()
            if job is None:
                dist.barrier()   # gloo: no process tears down its group while a peer still uses it
                return
            fn, kwargs = job
            try:
                results.put((rank, True, fn(**kwargs)))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class GlooPool:
    def __init__(self, world: int, *, timeout_s: float = 60.0):
        ctx = mp.get_context("spawn")
        self.world, self.timeout_s = world, timeout_s
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.jobs[r], self.results, timeout_s),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, fn, **kwargs) -> list:
        """fn(**kwargs) on every rank; the results in rank order."""
        for q in self.jobs:
            q.put((fn, kwargs))
        out, errors = [None] * self.world, []
        for _ in range(self.world):
            try:
                rank, ok, value = self.results.get(timeout=self.timeout_s * 2)
            except queue.Empty:
                self.close(force=True)
                raise TimeoutError(f"{fn.__name__}: no answer from every rank within {self.timeout_s * 2:.0f} s")
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            self.close(force=True)
            raise RuntimeError(f"{fn.__name__} failed\n" + "\n".join(errors))
        return out

    def close(self, force: bool = False):
        for p, q in zip(self.procs, self.jobs):
            if p.is_alive() and not force:
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if force else 10)
            if p.is_alive():
                p.terminate()
                p.join()
