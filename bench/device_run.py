#!/usr/bin/env python3
"""The device run (one GPU window): build the extension, run tests/ on the GPU
(every CUDA and Triton path: the tests' backend fixture parametrises cpp, triton
and reference), then time the benchmarks. Writes everything under --out.

    PYTHONUNBUFFERED=1 python bench/device_run.py 2>&1 | tee $OUT/device_run.log
    python bench/device_run.py --device cpu --quick       # the dry run on the CPU

On the lab's GPU machines (15 minutes a session, at most 8 files back from $OUT):

    export PYTHONUNBUFFERED=1; set -o pipefail
    timeout 470 python3 bench/device_run.py --quick --tests-phase-s 270 --out /tmp/dr \
        2>&1 | tee $OUT/device_run.log
    tar czf $OUT/dr.tgz -C /tmp/dr .

1. Build, in the background (bench/device_jobs.py): if glm5_ops._C is missing or
   has no CUDA kernels, setup.py build_ext with TORCH_CUDA_ARCH_LIST=9.0a and
   MAX_JOBS = cores, renamed into glm5_ops/ once complete; log in out/build.log.
2. Tests (bench/device_pytest.py): tests/ in shards, one plain pytest process
   per file, the files parametrised by backend cut in three (cpp / triton / the
   rest), at most --jobs at a time (default min(12, cores - 2)), heaviest first,
   each with a time limit (--shard-s) and its log and JSON-lines results in
   out/pytest/. Triton JIT-compiles each kernel specialisation on a cold cache
   (0.2-10 s of one core), which is why the shards run in parallel; the shards
   that never call the C++/CUDA kernels start during the build, niced, the others
   once it is done. Meanwhile one warm-up process per timing module calls each
   timed Triton op once (compiling it), so the timing phase finds it cached.
   No shard starts after --tests-phase-s and none runs past it.
3. Timings (bench/gpu_timing.py, bench/gpu_timings_*.py): one module at a time,
   the GPU to itself: CUDA events after an L2 flush, the median of several calls;
   the performance targets (sparse attention 300 TFLOP/s, block-sparse >= 60% of
   SDPA per computed block, fused_moe >= 50% of the bf16 matmul peak, dispatch +
   combine <= 10% of it) as rows that say met / MISSED.
4. Summary: passed / failed per shard with every failure listed, and the timings
   as a markdown table for bench/RESULTS.md, in out/device_run.md (and .json).
   The exit status is 1 when a test failed or a shard did not finish.

Expected wall time on the device (H200, 16 cores, torch 2.11+cu130, triton 3.6,
no extension, cold Triton cache): about 7-9 minutes. The build ~1.5 min (15 files
in parallel, bounded by topk.cu ~60 s); the tests ~4-5 min in all, build included
(~50 shards; Triton's cold compiles, about 1,000 core-seconds for the tests'
specialisations, spread over 12 processes; each pytest process ~5 s of start-up);
the timings ~3-4 min (five modules, tens of timed calls of at most a second each,
their Triton kernels compiled during the tests). --quick trims the timings only.
Measured on the first device run (H100, 2026-12-06, bench/RESULTS.md): build 81-90 s,
a 270 s tests phase left 9 shards at their limit (cold Triton cache; the attention
files, test_model, test_compiled_decode, test_serving_engine), timings 65 s (--quick);
353 s in all. The device image has no fastapi/uvicorn/openai: the server tests
(SERVER_TESTS) are left out where one is missing, and the log says so. Before a
device session, run
bench/triton_compile_check.py (every Triton launch of the tests compiled for sm_90
here). The dry run (--device cpu --quick) runs tests/test_device_*.py through the same
shards (the other files run on the CPU through scripts/test.sh) and the timing
modules on small CPU shapes, cpp backend: about 5 minutes on a 2-core machine.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device_jobs import BENCH, ROOT, Build, Job, log, run_jobs  # noqa: E402
from device_pytest import markdown as tests_markdown, shard_results, shards  # noqa: E402
from gpu_timing import MODULES as TIMING_MODULES  # noqa: E402

# Worst case with the tests phase's 390 s: 13 minutes, inside the device's 15 with its cold start.
TIMING_LIMIT_S = {"selection": 120, "quantize": 45, "attention": 120, "moe": 105, "int8": 90}


# The OpenAI server's tests need its packages, which the GPU image lacks.
SERVER_TESTS = ["test_server_*.py", "test_int8_serving.py"]
SERVER_PACKAGES = ("fastapi", "uvicorn", "openai")


def server_tests_to_skip() -> list:
    missing = [m for m in SERVER_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        log(f"leaving out {', '.join(SERVER_TESTS)}: {', '.join(missing)} not installed")
        return SERVER_TESTS
    return []


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the dry run (no build, tests/test_device_*.py, small timing shapes)")
    ap.add_argument("--quick", action="store_true", help="fewer timing shapes")
    ap.add_argument("--skip-build", action="store_true")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-timings", action="store_true")
    ap.add_argument("--tests", default=None,
                    help="test files to shard, globs from the repo root, comma-separated (default tests/test_*.py; CPU "
                         "tests/test_device_*.py)")
    ap.add_argument("--exclude", default="",
                    help="comma list of test file names (globs) to leave out (the server tests are left out "
                         "by themselves where fastapi, uvicorn or openai is missing)")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments for every shard, e.g. \"-k bf16\"")
    ap.add_argument("--backends", default=None, help="timed backends (default cpp,triton; CPU cpp)")
    ap.add_argument("--only", default="", help="comma list: time only the cases whose 'group | impl' contains one")
    ap.add_argument("--jobs", type=int, default=0, help="shards at a time (default CUDA min(12, cores - 2), CPU 2)")
    ap.add_argument("--shard-s", type=int, default=0, help="time limit of one shard (default 300 s; CPU 900)")
    ap.add_argument("--tests-phase-s", type=int, default=0,
                    help="no shard starts after this and none runs past it (default 390 s; CPU none)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "build", "device_run"),
                    help="output folder (default $OUT, else build/device_run)")
    return ap.parse_args()


def timing_job(module, args, backends, out_dir, warm=False) -> Job:
    name = ("warm:" if warm else "time:") + module
    path = os.path.join(out_dir, f"{name.replace(':', '_')}.json")
    cmd = [sys.executable, os.path.join(BENCH, "gpu_timing.py"), module, "--json", path, "--device", args.device,
           "--backends", ",".join(backends)] + (["--quick"] if args.quick else []) + \
        (["--only", args.only] if args.only else []) + (["--warm"] if warm else [])
    job = Job(name, cmd, os.path.join(out_dir, f"{name.replace(':', '_')}.log"), limit_s=TIMING_LIMIT_S[module],
              needs_build=not warm, weight=100 if warm else 1, echo=not warm, nice=warm)
    job.results = path
    return job


def timing_rows(job) -> list:
    try:
        with open(job.results) as f:
            rows = json.load(f)["rows"]
    except (OSError, ValueError):
        rows = []
    if job.end != "ok":
        rows.append({"group": job.name, "impl": "-", "ms": None,
                     "note": f"{job.end} after {job.wall:.0f}s: the timings after its last row are missing"})
    return rows


def timings_markdown(rows: list) -> str:
    def fmt(v, f):
        return (f % v) if v is not None else "-"
    lines = ["| case | impl | ms | TFLOP/s | GB/s | vs baseline | note |", "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['group']} | {r['impl']} | {fmt(r.get('ms'), '%.4f')} | {fmt(r.get('tflops'), '%.1f')} | "
                     f"{fmt(r.get('gbs'), '%.0f')} | {fmt(r.get('speedup'), 'x%.2f')} | {r.get('note') or ''} |")
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    cpu = args.device == "cpu"
    os.makedirs(args.out, exist_ok=True)
    import torch
    if not cpu and not torch.cuda.is_available():
        sys.exit("device_run: no CUDA device (torch.cuda.is_available() is False); the CPU dry run is --device cpu")
    ncpu = os.cpu_count() or 2
    jobs = args.jobs or (min(2, ncpu) if cpu else max(1, min(12, ncpu - 2)))
    name = torch.cuda.get_device_name() if not cpu else "cpu"
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": name, "cores": ncpu, "quick": args.quick}
    log(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}); device {name}; "
        f"{ncpu} cores; out {args.out}")
    del torch
    backends = (args.backends or ("cpp" if cpu else "cpp,triton")).split(",")
    build = None if cpu or args.skip_build else Build(args.out).start()
    t_start = time.time()

    tests = []
    if not args.skip_tests:
        pattern = args.tests or ("tests/test_device_*.py" if cpu else "tests/test_*.py")
        shard_jobs = shards(pattern, os.path.join(args.out, "pytest"), args.shard_s or (900 if cpu else 300),
                            shlex.split(args.pytest_args), threads=max(1, ncpu // jobs),
                            exclude=[p for p in args.exclude.split(",") if p] + server_tests_to_skip())
        warm = [] if cpu or args.skip_timings or "triton" not in backends else \
            [timing_job(m, args, ["triton"], args.out, warm=True) for m in TIMING_MODULES]
        phase_s = args.tests_phase_s or (None if cpu else 390)
        log(f"=== tests: {len(shard_jobs)} shards of {pattern}, {jobs} at a time"
            + (f", plus {len(warm)} Triton warm-ups of the timing modules" if warm else "")
            + (f"; the phase ends within {phase_s}s" if phase_s else ""))
        t = time.time()
        run_jobs(warm + shard_jobs, jobs, build, phase_s,
                 lambda job: tests.append(shard_results(job)) if job in shard_jobs else None)
        log(f"=== tests done in {time.time() - t:.0f}s")
    if build is not None and not build.done.is_set():
        log("waiting for the build ...")
        build.done.wait()

    rows = []
    if not args.skip_timings:
        log(f"=== timings: {len(TIMING_MODULES)} modules, one at a time, backends {','.join(backends)}")
        t = time.time()
        for module in TIMING_MODULES:
            run_jobs([timing_job(module, args, backends, args.out)], 1, build, None,
                     lambda job: rows.extend(timing_rows(job)))
        log(f"=== timings done in {time.time() - t:.0f}s")

    report = [f"## Device run: {name}, torch {meta['torch']}, {ncpu} cores, {time.time() - t_start:.0f} s", ""]
    if tests:
        report += [tests_markdown(tests), ""]
    if rows:
        report += [timings_markdown(rows), ""]
    text = "\n".join(report)
    print("\n" + text, flush=True)
    with open(os.path.join(args.out, "device_run.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "device_run.json"), "w") as f:
        json.dump({"meta": meta, "tests": tests, "timings": rows,
                   "build": None if build is None else {"ok": build.ok}}, f, indent=1)
    failed = any(r["failures"] for r in tests) or (build is not None and not build.ok)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
