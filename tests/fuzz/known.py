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


def shape(case: dict, i: int) -> list:
    """The shape of the case's i-th positional tensor argument ([] if not a tensor)."""
    a = case["args"][i] if i < len(case["args"]) else None
    return a["tensor"]["shape"] if isinstance(a, dict) and "tensor" in a else []


def _any_zero(case: dict, i: int, dims) -> bool:
    s = shape(case, i)
    return any(len(s) > d and s[d] == 0 for d in dims)


KNOWN: list[Known] = [
]


def match(kind: str, case: dict, outcome: dict) -> Known | None:
    for k in KNOWN:
        if k.kind == kind and re.fullmatch(k.target, case["target"]) and k.when(case, outcome):
            return k
    return None
