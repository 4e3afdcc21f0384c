"""`glm5-lab bench`: the pytest-benchmark suite in bench/ (every op family,
ours against its dense baseline in one group), printed as one table per
family, saved as JSON under runs/, and compared against a saved run.

    glm5-lab bench                               # all families; JSON -> runs/bench-<time>.json
    glm5-lab bench --filter moe_route --compare runs/bench-old.json   # exit 1 when a median got slower
    glm5-lab bench --load runs/bench-new.json --compare runs/bench-old.json   # tables of a saved run
    glm5-lab bench --gpu-suite [--suite-args=--quick]   # bench/device_run.py on a CUDA machine

The tables and the comparison are bench/report.py's (also a script there).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time

from .args import UsageError, positive_float

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


def bench_report():
    """bench/report.py as a module (bench/ is a folder of suites, not a package)."""
    spec = importlib.util.spec_from_file_location("glm5_bench_report", os.path.join(BENCH, "report.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add_parser(subparsers):
    p = subparsers.add_parser("bench", help="benchmark every op family against its baseline; flag regressions",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--filter", metavar="EXPR",
                   help="pytest -k expression selecting benchmarks (e.g. 'moe and not bwd')")
    p.add_argument("--compare", metavar="RUN.json", help="a saved run: flag benchmarks slower than it by > threshold")
    p.add_argument("--threshold", type=positive_float, default=0.10,
                   help="slowdown of the median that counts as a regression (default 0.10 = 10%%)")
    p.add_argument("--out", metavar="JSON", help="where to save this run (default runs/bench-<time>.json)")
    p.add_argument("--load", metavar="RUN.json", help="print (and --compare) a saved run instead of running the suite")
    p.add_argument("--gpu-suite", action="store_true", help="run bench/device_run.py instead: build, tests/ on the GPU, timings (needs a CUDA device)")
    p.add_argument("--suite-args", default="", metavar="ARGS",
                   help="arguments for bench/device_run.py, written --suite-args=\"--quick --only attention\"")
    p.set_defaults(parser=p)
    return p


def _check(args) -> None:
    if args.gpu_suite:
        clash = [f for f in ("filter", "compare", "load", "out") if getattr(args, f)]
        if clash:
            raise UsageError(f"--gpu-suite runs bench/device_run.py; --{clash[0]} applies to the pytest suite")
    elif args.suite_args:
        raise UsageError("--suite-args only goes with --gpu-suite")
    if args.load and (args.filter or args.out):
        raise UsageError("--load prints a saved run; --filter and --out apply to a new run")
    for flag in ("compare", "load"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            raise UsageError(f"--{flag}: no such file: {path}")


def run_gpu_suite(suite_args: str) -> int:
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--gpu-suite: no CUDA device is available (torch.cuda.is_available() is False); the run "
                         "tests and times the CUDA and Triton kernels. For a CPU dry run of its flow: "
                         "python bench/device_run.py --device cpu --quick")
    cmd = [sys.executable, os.path.join(BENCH, "device_run.py"), *shlex.split(suite_args)]
    print("[glm5-lab bench] " + shlex.join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


def run_suite(filter_expr: str | None, out: str) -> int:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "bench", "-q", "-p", "no:cacheprovider",
           f"--benchmark-json={os.path.abspath(out)}", "--benchmark-columns=median,iqr,rounds"]
    if filter_expr:
        cmd += ["-k", filter_expr]
    print("[glm5-lab bench] " + shlex.join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    if rc == 5:
        raise UsageError(f"--filter {filter_expr!r}: no benchmark matches")
    return rc


def run(args) -> int:
    _check(args)
    if args.gpu_suite:
        return run_gpu_suite(args.suite_args)
    path = args.load
    if not path:
        path = args.out or os.path.join(ROOT, "runs", f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json")
        rc = run_suite(args.filter, path)
        if rc != 0:
            print(f"[glm5-lab bench] pytest failed (exit {rc}); see its output above", file=sys.stderr)
            return rc
    report = bench_report()
    with open(path) as f:
        data = json.load(f)
    rows = report.rows_from_json(data)
    print(report.family_tables(rows, data.get("machine_info", {}).get("glm5_ceilings")))
    if not args.load:
        print(f"[glm5-lab bench] JSON -> {path}")
    if args.compare:
        with open(args.compare) as f:
            text, regressed = report.compare_report(rows, report.rows_from_json(json.load(f)), args.threshold,
                                                    args.compare)
        print(text)
        return 1 if regressed else 0
    return 0
