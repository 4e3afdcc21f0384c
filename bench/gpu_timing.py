#!/usr/bin/env python3
"""Runs one timing module (bench/gpu_timings_<name>.py) in this process and
writes its rows as JSON; bench/device_run.py starts one such process per module,
one at a time, so each has the GPU to itself.

    python bench/gpu_timing.py attention --json out.json [--quick] [--backends cpp,triton]
                                         [--device cuda|cpu] [--only SUBSTR,...] [--warm]

A timing is the median of several calls, each after an L2 flush (zeroing a
256 MB buffer) between CUDA events; on the CPU (the dry run) wall time with
perf_counter. --warm calls each timed op of the given backends once and times
nothing: run while the tests run, it leaves Triton's JIT cache filled, so the
timing phase does not pay the cold compiles. Each timing module exposes
run(rec, backends, quick) and reads the device from rec.device.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
MODULES = ("selection", "quantize", "attention", "moe", "int8")


class Recorder:
    """Times calls and keeps their rows; the JSON file is rewritten after every
    row, so a module killed at its time limit still reports what it measured."""

    def __init__(self, device: str, json_path: str | None, only=(), warm_backends=()):
        self.device, self.json_path = device, json_path
        self.only, self.warm_backends = list(only), list(warm_backends)
        self.rows: list = []
        self.cuda = device == "cuda"
        self._flush = torch.empty(int(256e6 // 4), dtype=torch.int32, device=device) if self.cuda else None

    def log(self, msg: str) -> None:
        print(msg, flush=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def median_ms(self, fn, budget_s: float = 1.0) -> float:
        for _ in range(2):
            fn()
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        reps = int(min(50, max(3, budget_s / max(time.perf_counter() - t, 1e-5))))
        times = []
        for _ in range(reps):
            if self.cuda:
                self._flush.zero_()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return sorted(times)[len(times) // 2]

    def wanted(self, name: str) -> bool:
        return not self.only or any(o in name for o in self.only)

    def timed(self, group, impl, fn, *, flops=None, nbytes=None, base_ms=None, note=""):
        """Median ms of fn (None if it failed, was not selected, or this is a warm-up
        run); a row with TFLOP/s, GB/s and the speed-up over base_ms where given."""
        if not self.wanted(f"{group} | {impl}"):
            return None
        if self.warm_backends:
            if any(impl.startswith(be) for be in self.warm_backends):
                self._warm(group, impl, fn)
            return None
        try:
            ms = self.median_ms(fn)
        except Exception as e:  # noqa: BLE001 - one failed timing does not stop the module
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            self._add({"group": group, "impl": impl, "ms": None, "note": msg})
            self.log(f"TIME {group} | {impl}: failed ({msg})")
            return None
        row = {"group": group, "impl": impl, "ms": ms, "tflops": flops / ms / 1e9 if flops else None,
               "gbs": nbytes / ms / 1e6 if nbytes else None, "speedup": base_ms / ms if base_ms else None,
               "note": note}
        self._add(row)
        extra = [f"{row['tflops']:.1f} TFLOP/s" if row["tflops"] else "", f"{row['gbs']:.0f} GB/s" if row["gbs"] else "",
                 f"x{row['speedup']:.2f} vs baseline" if row["speedup"] else "", f"({note})" if note else ""]
        self.log(f"TIME {group} | {impl}: {ms:.4f} ms " + " ".join(x for x in extra if x))
        return ms

    def annotate(self, note: str) -> None:
        """Adds a note (a fraction of a ceiling) to the last row."""
        if self.rows and not self.warm_backends:
            self.rows[-1]["note"] = "; ".join(x for x in (self.rows[-1].get("note"), note) if x)
            self.save()
            self.log(f"    {note}")

    def target(self, name: str, value: float, goal: float, text: str, higher_is_better=True) -> None:
        """A performance target: recorded as a row whose note says met / missed."""
        met = value >= goal if higher_is_better else value <= goal
        self._add({"group": "target", "impl": name, "ms": None, "met": met,
                   "note": f"{'met' if met else 'MISSED'}: {text}"})
        self.log(f"TARGET {name}: {'met' if met else 'MISSED'} ({text})")

    def _warm(self, group, impl, fn) -> None:
        t = time.perf_counter()
        try:
            fn()
            self.sync()
            self.log(f"warm {group} | {impl}: {time.perf_counter() - t:.1f}s")
        except Exception as e:  # noqa: BLE001 - the timing run reports it
            self.log(f"warm {group} | {impl}: {type(e).__name__}: {str(e)[:200]}")

    def _add(self, row) -> None:
        self.rows.append(row)
        self.save()

    def save(self) -> None:
        if self.json_path:
            tmp = self.json_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"rows": self.rows}, f)
            os.replace(tmp, self.json_path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("module", choices=MODULES)
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--backends", default="cpp,triton")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the dry run, on each module's small CPU shapes")
    ap.add_argument("--only", default="", help="comma list: time only the cases whose 'group | impl' contains one")
    ap.add_argument("--warm", action="store_true", help="call each timed op of --backends once, time nothing")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    sys.path.insert(0, BENCH)
    backends = [b for b in args.backends.split(",") if b]
    rec = Recorder(args.device, args.json, [o for o in args.only.split(",") if o], backends if args.warm else ())
    rec.save()
    importlib.import_module(f"gpu_timings_{args.module}").run(rec, backends, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
