"""The fuzz suite in CI (issue 24, items 2 and 4): the fixed corpus (5,000
cases, seed 0) over every public op on every backend, every raw
torch.ops.glm5 schema and the model's entry points, each case in a worker
process. Prints the counts; fails on a crash, hang, invalid result or an
error message that breaks the convention, unless tests/fuzz/known.py lists it.
GLM5_FUZZ_CASES overrides the corpus size (for a quick local run)."""
from __future__ import annotations

import os
import time
from multiprocessing.connection import wait

import pytest

from . import known
from .cases import TARGETS, _draw
from .pool import run_cases
from .run import CI_CASES, CI_SEED, fuzz
from .verdict import message_problem, repro

CASES = int(os.environ.get("GLM5_FUZZ_CASES", CI_CASES))


@pytest.fixture(scope="module")
def report():
    return fuzz(CASES, CI_SEED)


def _listing(items, limit=15) -> str:
    lines = [f"{case['target']}: {outcome.get('problem') or outcome.get('message')}\n  {repro(case)}"
             for case, outcome in items[:limit]]
    return "\n".join(lines) + (f"\n... and {len(items) - limit} more" if len(items) > limit else "")


def test_corpus_has_no_crash_hang_or_invalid_result(report, capsys):
    with capsys.disabled():
        print("\n" + report.summary())
    assert len(report.cases) == CASES
    for kind in ("crash", "hang", "invalid"):
        found = report.failures(kind)
        assert not found, f"{len(found)} new {kind} case(s) (not in tests/fuzz/known.py):\n" + _listing(found)


def test_corpus_reaches_every_target_and_backend(report):
    assert {c["target"] for c in report.cases} == set(TARGETS)
    backends = {c["backend"] for c in report.cases if c["target"].startswith("glm5_ops.")}
    assert backends == {"cpp", "reference", "triton"}
    ran = {c["target"] for c, o in zip(report.cases, report.outcomes) if o["status"] == "ok"}
    assert ran == set(TARGETS), f"targets that never returned a result: {sorted(set(TARGETS) - ran)}"


def test_error_messages_name_the_argument_expected_and_given(report):
    """Every error of a case that broke one argument names that argument and
    says what was expected and what was given (issue 24 item 4)."""
    sampled = [(c, o) for c, o in zip(report.cases, report.outcomes) if o["status"] == "error" and c["perturbed"]]
    assert len(sampled) >= 500, f"only {len(sampled)} errors from perturbed arguments: the sample is too small"
    bad = report.failures("message")
    assert not bad, f"{len(bad)} error(s) break the message convention:\n" + _listing(bad)


def test_known_entries_still_reproduce(report):
    """An entry of known.py that the corpus no longer hits is fixed: delete it."""
    hit = set()
    for kind in ("crash", "hang", "invalid", "message"):
        for case, outcome in report.failures(kind, include_known=True):
            k = known.match(kind, case, outcome)
            if k is not None:
                hit.add(k.note)
    hit |= {known.match("hang", c, {}).note for c, o in zip(report.cases, report.outcomes)
            if o["status"] == "skipped"}
    sanitized = "asan" in os.environ.get("LD_PRELOAD", "")
    stale = [k.note for k in known.KNOWN if k.note not in hit and (sanitized or not k.sanitizer_only)]
    assert not stale, "known.py lists findings the corpus no longer hits (fixed? delete them):\n" + "\n".join(stale)


def test_pool_survives_a_crash_a_hang_and_an_error(monkeypatch):
    monkeypatch.setenv("GLM5_FUZZ_TIME_SCALE", "0.3")   # a 3 s bound for the hang
    cases = [{"target": f"selftest.{t}", "backend": "cpp"} for t in ("ok", "crash", "hang", "error", "ok")]
    outcomes = run_cases(cases, workers=2)
    assert [o["status"] for o in outcomes] == ["ok", "crash", "hang", "error", "ok"]
    assert outcomes[1]["message"] == "killed by SIGABRT"
    assert outcomes[3]["type"] == "ZeroDivisionError"
    assert message_problem({"perturbed": None}, outcomes[3]) == "raises ZeroDivisionError, not ValueError/TypeError"


def test_a_paused_run_is_not_a_hang(monkeypatch):
    """A run paused as a whole (SIGSTOP, a suspended machine) resumes with its
    deadlines moved by the pause: the runner's clock jumps 100 s while a case
    is in flight, past its 3 s bound, and the 1.5 s cases still count as ok."""
    import sys
    import types
    pool = sys.modules[run_cases.__module__]
    monkeypatch.setenv("GLM5_FUZZ_TIME_SCALE", "0.3")
    clock = {"offset": 0.0, "waits": 0}
    monkeypatch.setattr(pool, "time", types.SimpleNamespace(
        monotonic=lambda: time.monotonic() + clock["offset"]))

    def paused_wait(conns, timeout):
        clock["waits"] += 1
        if clock["waits"] == 2:          # the first case is in flight: all of us stop for 100 s
            clock["offset"] += 100.0
            return []                    # and the wait wakes up with nothing, its time long over
        return wait(conns, timeout)
    monkeypatch.setattr(pool, "wait", paused_wait)
    outcomes = run_cases([{"target": "selftest.slow", "backend": "cpp"}] * 2, workers=1)
    assert [o["status"] for o in outcomes] == ["ok"] * 2
    assert clock["waits"] >= 3


def test_the_corpus_is_fixed():
    """The same seed draws the same cases (the cache under build/ aside)."""
    first = _draw(40, CI_SEED, None)
    assert first == _draw(40, CI_SEED, None)
    assert first != _draw(40, CI_SEED + 1, None)


@pytest.mark.parametrize("message, problem", [
    ("topk must be in [1, 8], got 9", None),
    ("expected topk >= 1, got 0", None),
    ("topk must be at least 1", "does not say what was given (got ...)"),
    ("q must have shape [B,S,H,D], got shape (1,)", "does not name 'topk'"),
    ("topk is 9, got 9", "does not say what was expected (must/expected)"),
])
def test_message_convention(message, problem):
    case = {"perturbed": "topk"}
    assert message_problem(case, {"status": "error", "type": "ValueError", "message": message}) == problem
