"""Replays one fuzz case in this process and prints its outcome:
    python -m tests.fuzz.repro '<case json>'
(a crash or hang then happens right here, under a debugger if you like)."""
from __future__ import annotations

import json
import sys

from .targets import run_case
from .verdict import classify, message_problem


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    case = json.loads(args[0])
    outcome = run_case(case)
    kind = classify(case, outcome)
    problem = message_problem(case, outcome)
    print(json.dumps(dict(outcome, kind=kind, **({"problem": problem} if problem else {}))))
    return 0 if kind in ("ok", "clean") and problem is None else 1


if __name__ == "__main__":
    sys.exit(main())
