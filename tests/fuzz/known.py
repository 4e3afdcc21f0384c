"""Known findings: failures the fuzz corpus hits today, each waiting for a fix
(issue 24). test_fuzz.py fails on any crash, hang, invalid result or
unconventional error message NOT matched here. Delete an entry when its fix
lands (the test then checks that the case is clean); never add one to make a
new failure pass without filing it.

Each entry: kind (crash | hang | invalid | message), a regex on the case's
target, and a predicate on the case (spec.py's JSON) and its outcome.
Known hangs are not run (each would cost the time bound).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Known:
    kind: str
    target: str
    when: Callable[[dict, dict], bool]
    note: str
    sanitizer_only: bool = False   # seen only under scripts/sanitize.sh (ASan/UBSan reports)


def shape(case: dict, i: int) -> list:
    """The shape of the case's i-th positional tensor argument ([] if not a tensor)."""
    a = case["args"][i] if i < len(case["args"]) else None
    return a["tensor"]["shape"] if isinstance(a, dict) and "tensor" in a else []


def zero_dim(i: int, *dims):
    """Predicate: positional tensor i has a 0 in one of `dims`."""
    return lambda case, outcome: any(len(shape(case, i)) > d and shape(case, i)[d] == 0 for d in dims)


def says(pattern: str, kind: str | None = None):
    """Predicate: the error's message matches `pattern` (and its type is `kind`)."""
    return lambda case, outcome: (re.search(pattern, outcome.get("message", "")) is not None
                                  and (kind is None or outcome.get("type") == kind))


def perturbed(name: str, pattern: str = ""):
    return lambda case, outcome: case.get("perturbed") == name and re.search(pattern, outcome.get("message", ""))


# Empty: every finding of issue 24 is fixed (each with a regression test in
# tests/test_bad_input.py, tests/test_degenerate_shapes.py or tests/test_model.py).
# A new entry reads like
#   Known("crash", r"glm5_ops\.indexer_topk", zero_dim(0, 0, 1), "indexer_topk with B = 0 dies with SIGFPE")
#   Known("message", r"model\..*", says("^cache full"), "PagedCache: 'cache full' says neither must nor got")
# Issue 20's int8 ops (found when they joined the table; their files belong to another
# branch, so each is reported there rather than fixed here):
KNOWN: list[Known] = [
]


def match(kind: str, case: dict, outcome: dict) -> Known | None:
    for k in KNOWN:
        if k.kind == kind and re.fullmatch(k.target, case["target"]) and k.when(case, outcome):
            return k
    return None
