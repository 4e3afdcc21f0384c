"""python -m tests.fuzz [--cases N] [--seed S] [--workers W] [--findings FILE]

Runs N cases drawn from seed S (default: the CI corpus, 5000 cases, seed 0),
prints the counts, writes the findings grouped by op (with reproducers) to
FILE, and exits 1 on a crash, hang or invalid result that tests/fuzz/known.py
does not list."""
from __future__ import annotations

import argparse
import sys

from .run import CI_CASES, CI_SEED, fuzz
from .verdict import repro


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.splitlines()[2])
    p.add_argument("--cases", type=int, default=CI_CASES)
    p.add_argument("--seed", type=int, default=CI_SEED)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--target", action="append", help="only these targets (repeatable), e.g. glm5_ops.topk_indices")
    p.add_argument("--findings", help="write the findings, grouped by op, to this markdown file")
    a = p.parse_args(argv)
    report = fuzz(a.cases, a.seed, workers=a.workers, threads=a.threads, targets=a.target)
    print(report.summary(), flush=True)
    if a.findings:
        with open(a.findings, "w") as f:
            f.write(report.findings_markdown() + "\n")
    bad = {k: report.failures(k) for k in ("crash", "hang", "invalid")}
    for kind, items in bad.items():
        for case, outcome in items[:20]:
            print(f"{kind}: {case['target']}: {outcome.get('message')}\n  {repro(case)}")
    return 1 if any(bad.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
