"""A pytest plugin (-p pytest_results, with bench/ on PYTHONPATH) that appends one
JSON line per test outcome to $GLM5_PYTEST_RESULTS as each test ends, so a shard
killed at its time limit still reports every test it finished."""
import json
import os


def _append(nodeid: str, outcome: str, when: str, seconds: float, report) -> None:
    message = ""
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr)
    with open(os.environ["GLM5_PYTEST_RESULTS"], "a") as f:
        f.write(json.dumps({"nodeid": nodeid, "outcome": outcome, "when": when, "seconds": round(seconds, 3),
                            "message": message[:500]}) + "\n")


def pytest_runtest_logreport(report):
    # A test's outcome: its call phase, or the setup / teardown phase that failed or skipped it.
    if "GLM5_PYTEST_RESULTS" not in os.environ or not (report.when == "call" or report.outcome != "passed"):
        return
    outcome = report.outcome if report.when == "call" or report.outcome == "skipped" else "error"
    _append(report.nodeid, outcome, report.when, report.duration, report)


def pytest_collectreport(report):
    """A file that does not import is an error, not a shard with no tests."""
    if "GLM5_PYTEST_RESULTS" in os.environ and report.failed:
        _append(report.nodeid, "error", "collect", 0.0, report)
