"""Runs cases in worker processes, so a crash or a hang costs a worker, never
the runner. The parent only sends JSON cases and reads outcomes: it runs no
kernel. Workers come from a "forkserver" that has imported torch, glm5_ops
and the model (so a replacement starts in milliseconds) but has run nothing,
so no OpenMP state is ever forked.

A worker that dies is recorded as a crash (with its exit code or signal), one
that exceeds the case's time bound as a hang (it is killed); either way the
case is kept and the worker replaced.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import wait

from . import worker

# Seconds a case may take, scaled by GLM5_FUZZ_TIME_SCALE (the sanitizer job
# sets it: ASan runs kernels a few times slower). Triton's interpreter and the
# model's generate loops are slower by nature.
BASE_TIMEOUT, SLOW_TIMEOUT = 10.0, 60.0
STARTUP_TIMEOUT = 300.0      # a worker's own start (imports, the forkserver's first fork)
# The runner wakes at least this often; when it wakes much later than it asked
# to, the whole run was paused (SIGSTOP, a suspended machine) and every
# deadline moves by the pause, so a paused case is not called a hang.
POLL, PAUSE_SLACK = 1.0, 2.0


def time_bound(case: dict) -> float:
    scale = float(os.environ.get("GLM5_FUZZ_TIME_SCALE", "1"))
    slow = case.get("backend") == "triton" or case["target"].startswith("model.")
    return scale * (SLOW_TIMEOUT if slow else BASE_TIMEOUT)


def _describe_exit(code) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class _Worker:
    """One worker process. It says "ready" once set up; a case's time bound
    starts only then, so a slow start on a loaded machine is not a hang."""

    def __init__(self, ctx, threads: int):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker.main, args=(child, threads), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.case = self.index = None
        self.deadline = time.monotonic() + STARTUP_TIMEOUT

    def send(self, index: int, case: dict):
        self.index, self.case = index, case
        self.deadline = time.monotonic() + time_bound(case)
        self.conn.send(case)

    def stop(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def _outcome(w: _Worker, ready: list):
    """The finished case's outcome, "started" for a worker that became ready,
    "failed start" for one that died or stalled starting, or None (still busy)."""
    if w.conn in ready:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            w.proc.join(5)
            if not w.ready:
                return "failed start"
            return {"status": "crash", "message": _describe_exit(w.proc.exitcode)}
        if not w.ready:
            w.ready = True
            return "started"
        return msg
    if time.monotonic() > w.deadline:
        if not w.ready:
            return "failed start"
        return {"status": "hang", "message": f"no result within {time_bound(w.case):.0f} s"}
    return None


def run_cases(cases: list, *, workers: int = 2, threads: int = 1, progress=None) -> list:
    """Outcome dicts, one per case and in order (targets.run_case's, or
    {"status": "crash"|"hang", "message": ...})."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([worker.__name__])
    pool = [_Worker(ctx, threads) for _ in range(max(1, min(workers, len(cases))))]
    results: list = [None] * len(cases)
    todo = iter(enumerate(cases))
    done = failed_starts = 0
    try:
        while done < len(cases):
            for w in pool:
                if w.ready and w.case is None:
                    nxt = next(todo, None)
                    if nxt is not None:
                        w.send(*nxt)
            waiting = [w for w in pool if w.case is not None or not w.ready]
            timeout = min(POLL, max(0.0, min(w.deadline for w in waiting) - time.monotonic()))
            asked = time.monotonic()
            ready = wait([w.conn for w in waiting], timeout)
            paused = time.monotonic() - asked - timeout
            if paused > PAUSE_SLACK:
                for w in pool:
                    w.deadline += paused
            for i, w in enumerate(pool):
                outcome = _outcome(w, ready) if w in waiting else None
                if outcome is None or outcome == "started":
                    continue
                if outcome == "failed start":
                    failed_starts += 1
                    if failed_starts > 10 + len(cases) // 100:
                        raise RuntimeError(f"fuzz workers keep failing to start ({failed_starts} times)")
                    w.stop()
                    pool[i] = _Worker(ctx, threads)
                    continue
                results[w.index] = outcome
                done += 1
                if progress:
                    progress(done, w.case, outcome)
                if outcome["status"] in ("crash", "hang"):
                    w.stop()
                    pool[i] = _Worker(ctx, threads)
                else:
                    w.case = None
    finally:
        for w in pool:
            w.stop()
    return results
