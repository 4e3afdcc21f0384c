"""The test phase of bench/device_run.py: tests/ cut into pytest shards (one per
file; the files whose tests are parametrised by backend, one per backend), each
a plain `python -m pytest` process, and their results read back per shard."""
from __future__ import annotations

import fnmatch
import glob
import json
import os
import sys

from device_jobs import BENCH, ROOT, Job

# Files split by the backend fixture's parameter: the Triton part of each is a
# cold-cache compile of many kernels, which should not serialise behind the rest.
# -k matches the parameter id ("[cpp-...]") and the test name; the three
# expressions partition the file.
BY_BACKEND = {"cpp": "cpp", "triton": "triton and not cpp", "other": "not cpp and not triton"}
SPLIT = ("test_attention.py", "test_indexer.py", "test_topk.py", "test_moe.py", "test_moe_fused.py",
         "test_compress.py", "test_device_*.py")
# Shards that never call the C++/CUDA kernels start while the extension builds:
# these Triton files, and the Triton part of these split files.
# The attention and MoE Triton tests also call C++ ops (the first device run,
# 2026-12-06, failed them all with "glm5_ops._C is not built"): they wait.
NO_BUILD_FILES = ("test_triton_indexer.py", "test_triton_moe.py")
NO_BUILD_TRITON_PARTS = ("test_indexer.py", "test_topk.py", "test_device_indexer.py", "test_device_topk.py")
# Rough cost, for starting the longest first (Triton compiles dominate on a cold cache).
HEAVY = {"test_triton_attention.py": 10, "test_attention.py": 8, "test_device_attention.py": 8, "test_model.py": 6,
         "test_triton_moe.py": 6, "test_indexer.py": 6, "test_device_moe.py": 5, "test_moe_fused.py": 5}


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def shards(pattern: str, out_dir: str, limit_s: float, pytest_args: list, threads: int = 1,
           exclude=()) -> list:
    """One Job per shard of the test files matching `pattern` (globs relative to the
    repo root, comma-separated) and none of the file-name globs in `exclude`; each shard's torch gets
    `threads` CPU threads (the cores over the shards)."""
    os.makedirs(out_dir, exist_ok=True)
    jobs = []
    paths = {p for pat in pattern.split(",") for p in glob.glob(os.path.join(ROOT, pat.strip()))}
    for path in sorted(paths):
        name = os.path.basename(path)
        if _matches(name, exclude):
            continue
        parts = BY_BACKEND.items() if _matches(name, SPLIT) else [("", None)]
        for part, expr in parts:
            label = name[:-3] + (f"[{part}]" if part else "")
            results = os.path.join(out_dir, label + ".jsonl")
            cmd = [sys.executable, "-m", "pytest", os.path.relpath(path, ROOT), "-q", "-rfE", "-p", "no:cacheprovider",
                   "-p", "pytest_results", *(["-k", expr] if expr else []), *pytest_args]
            env = {"GLM5_PYTEST_RESULTS": results, "OMP_NUM_THREADS": str(threads),
                   "PYTHONPATH": os.pathsep.join(p for p in (BENCH, os.environ.get("PYTHONPATH")) if p)}
            weight = HEAVY.get(name, 1) * (2 if part == "triton" else 1)
            needs_build = not (name in NO_BUILD_FILES or (part == "triton" and name in NO_BUILD_TRITON_PARTS))
            job = Job(label, cmd, os.path.join(out_dir, label + ".log"), limit_s=limit_s, env=env,
                      needs_build=needs_build, weight=weight, nice=True)
            job.results = results
            if os.path.exists(results):
                os.unlink(results)
            jobs.append(job)
    return jobs


def shard_results(job) -> dict:
    """passed / failed / error / skipped counts and the failures of one shard."""
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    failures = []
    if os.path.exists(job.results):
        with open(job.results) as f:
            for line in f:
                r = json.loads(line)
                counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
                if r["outcome"] in ("failed", "error"):
                    failures.append(f"{r['nodeid']} ({r['when']}): {r['message'].splitlines()[0] if r['message'] else ''}")
    # pytest exits 5 when -k deselects every test of a file: nothing to run, not a failure.
    clean = job.end in ("ok", "exit 5") or (job.end == "exit 1" and failures)
    if not clean:
        failures.append(f"{job.name}: {job.end} after {job.wall:.0f}s (crash, hang or time limit: the tests after "
                        f"its last result are missing; see {os.path.relpath(job.log_path, ROOT)})")
    end = "no test selected" if job.end == "exit 5" else job.end
    return {"shard": job.name, "seconds": round(job.wall, 1), "end": end, **counts, "failures": failures}


def markdown(results: list) -> str:
    lines = ["| shard | passed | failed | errors | skipped | s | end |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        lines.append(f"| {r['shard']} | {r['passed']} | {r['failed']} | {r['error']} | {r['skipped']} | "
                     f"{r['seconds']:.0f} | {r['end']} |")
    fails = [f for r in results for f in r["failures"]]
    total = {k: sum(r[k] for r in results) for k in ("passed", "failed", "error", "skipped")}
    head = (f"tests: {total['passed']} passed, {total['failed']} failed, {total['error']} errors, "
            f"{total['skipped']} skipped in {len(results)} shards")
    return "\n".join([head, ""] + lines + ([""] + [f"- FAIL {f}" for f in fails[:60]] if fails else []) +
                     ([f"- ... and {len(fails) - 60} more (see the JSON)"] if len(fails) > 60 else []))
