"""Before/after timings of two checkouts of this repository, alternated in one
sitting, and their tables.

`run` executes one command in each checkout in the given order (cwd and
PYTHONPATH set to that checkout); `{out}` in the command becomes the JSON file
the run writes (model_vs_transformers.py's --json, pytest-benchmark's
--benchmark-json). `table` reads every JSON of a directory and prints medians
per side and after/before.

    python bench/ab_compare.py run --side before=CHECKOUT_A --side after=CHECKOUT_B \\
        --order before,after --out-dir runs/ab -- python bench/model_vs_transformers.py \\
        --prefill 8192 --decode-context 8192 --decode-steps 16 --big-prefill 0 --skip-transformers --json {out}
    python bench/ab_compare.py table runs/ab
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time


def run(sides: dict, order: list, out_dir: str, cmd: list) -> int:
    if not cmd or not any("{out}" in c for c in cmd):
        raise ValueError("cmd must contain {out}, the JSON path the command writes")
    unknown = [s for s in order if s not in sides]
    if unknown:
        raise ValueError(f"order names sides {unknown} that --side does not define ({sorted(sides)})")
    os.makedirs(out_dir, exist_ok=True)
    for side in order:
        stamp = time.strftime("%H%M%S", time.gmtime())
        out = os.path.abspath(os.path.join(out_dir, f"{side}-{stamp}.json"))
        if os.path.exists(out):
            raise FileExistsError(f"{out} exists: give each sitting its own --out-dir")
        env = dict(os.environ, PYTHONPATH=sides[side])
        print(f"[ab] {side} {time.strftime('%H:%M:%S', time.gmtime())} UTC -> {out}", flush=True)
        rc = subprocess.call([c.replace("{out}", out) for c in cmd], cwd=sides[side], env=env)
        if rc != 0:
            print(f"[ab] {side} exited {rc}", flush=True)
            return rc
    return 0


def _rows(path: str) -> dict:
    """name -> value of one run's JSON: network runs (a list of measurements) give
    prefill seconds and decode tokens/s; pytest-benchmark files give each
    benchmark's median (ms) and, where the group has a baseline, ours/baseline."""
    with open(path) as f:
        data = json.load(f)
    rows = {}
    if isinstance(data, list):
        for r in data:
            if "error" in r:
                raise RuntimeError(f"{path}: a measurement failed: {r['error']}")
            rows[f"{r['task']} {r['n']}: prefill (s)"] = r["prefill_s"]
            if "decode_tok_s" in r:
                rows[f"{r['task']} {r['n']}: decode (tok/s)"] = r["decode_tok_s"]
        return rows
    baseline = {b["group"]: b["stats"]["median"] for b in data["benchmarks"]
                if b["extra_info"].get("role") == "baseline"}
    for b in data["benchmarks"]:
        rows[f"{b['name']} (ms)"] = b["stats"]["median"] * 1e3
        if b["extra_info"].get("role") == "ours" and b["group"] in baseline:
            rows[f"{b['name']} / baseline"] = b["stats"]["median"] / baseline[b["group"]]
    return rows


def table(out_dir: str) -> str:
    runs = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "*.json"))):
        side = os.path.basename(path).split("-")[0]
        runs.setdefault(side, []).append(_rows(path))
    if set(runs) != {"before", "after"}:
        raise ValueError(f"{out_dir} must hold before-*.json and after-*.json runs, found sides {sorted(runs)}")
    names = list(dict.fromkeys(k for rs in runs.values() for r in rs for k in r))
    lines = ["| measurement | before (each run) | after (each run) | after/before (medians) |", "|---|---|---|---|"]
    for name in names:
        b = [r[name] for r in runs["before"] if name in r]
        a = [r[name] for r in runs["after"] if name in r]
        ratio = f"{statistics.median(a) / statistics.median(b):.3f}" if a and b else "-"
        lines.append(f"| {name} | {', '.join(f'{v:.3f}' for v in b)} | {', '.join(f'{v:.3f}' for v in a)} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("--side", action="append", required=True, help="NAME=CHECKOUT (before=..., after=...)")
    r.add_argument("--order", required=True, help="comma-separated side names, run in this order")
    r.add_argument("--out-dir", required=True)
    r.add_argument("cmd", nargs=argparse.REMAINDER)
    t = sub.add_parser("table")
    t.add_argument("out_dir")
    args = ap.parse_args(argv)
    if args.what == "table":
        print(table(args.out_dir))
        return 0
    sides = {}
    for s in args.side:
        name, sep, path = s.partition("=")
        if not sep or not os.path.isdir(path):
            raise ValueError(f"--side must be NAME=CHECKOUT with an existing directory, got {s!r}")
        sides[name] = os.path.abspath(path)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return run(sides, args.order.split(","), args.out_dir, cmd)


if __name__ == "__main__":
    sys.exit(main())
