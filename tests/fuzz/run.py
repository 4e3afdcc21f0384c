"""Generate a seeded corpus and run it in the worker pool: the one entry point
of the CI test (test_fuzz.py), the CLI (__main__.py) and the sanitizer job."""
from __future__ import annotations

import sys
import time

from . import known
from .cases import corpus
from .pool import run_cases
from .verdict import Report

CI_CASES, CI_SEED = 5000, 0


def fuzz(cases: int = CI_CASES, seed: int = CI_SEED, *, workers: int = 2, threads: int = 1, targets=None,
         log=sys.stderr) -> Report:
    t0 = time.perf_counter()
    drawn = corpus(cases, seed, targets)
    print(f"fuzz: drew {len(drawn)} cases (seed {seed}) in {time.perf_counter() - t0:.0f} s", file=log, flush=True)
    outcomes = [None] * len(drawn)
    run = []
    for i, case in enumerate(drawn):
        if known.match("hang", case, {}) is not None:   # a known hang costs its whole time bound: not run
            outcomes[i] = {"status": "skipped"}
        else:
            run.append(i)
    step = max(len(run) // 10, 1)

    def progress(done, case, outcome):
        if done % step == 0 or outcome["status"] in ("crash", "hang"):
            extra = f" ({outcome['status']}: {case['target']}: {outcome['message']})" \
                if outcome["status"] in ("crash", "hang") else ""
            print(f"fuzz: {done}/{len(run)} run, {time.perf_counter() - t0:.0f} s{extra}", file=log, flush=True)

    for i, outcome in zip(run, run_cases([drawn[i] for i in run], workers=workers, threads=threads,
                                         progress=progress)):
        outcomes[i] = outcome
    return Report(drawn, outcomes, time.perf_counter() - t0, seed)
