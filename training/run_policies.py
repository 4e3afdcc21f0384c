"""Runs training.train once per memory policy, each in a fresh process (so peak
RSS is the policy's own), and writes one markdown table.

    python -m training.run_policies --preset loss   --out runs/policies-loss.md
    python -m training.run_policies --preset memory --out runs/policies-memory.md

Presets:
  loss    300 steps of the small configuration, every policy once: the loss table
          ("recompute" is left out: recomputation is exact, its loss is the baseline's).
  memory  a configuration where saved activations dominate the baseline's peak
          (16 layers, dim 128, batch 24x512), 3 steps per run, policies interleaved
          and repeated (--repeats) because the CPU may be shared: median step time.

Every run gets MALLOC_MMAP_THRESHOLD_ (default 128 KiB) so freed tensors go back
to the OS and peak RSS follows live memory rather than glibc's heap high-water
mark (--malloc-default to leave glibc's dynamic threshold on), and
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc >= 2.35; --no-thp to leave it off):
those mmapped buffers are then backed by transparent huge pages where the kernel
allows them (transparent_hugepage "madvise" or "always"). Without it every fresh
activation buffer is faulted in 4 KiB at a time, and a policy that allocates
more buffers (packed copies, dequantised outputs) pays for that in step time,
not for its compute: on this machine 1.43x the baseline's step against 1.00x.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PRESETS = {
    "loss": dict(policies=["none", "compress8", "compress4", "compress2", "full"], repeats=1,
                 args=["--steps", "300", "--dim", "128", "--layers", "4", "--heads", "4", "--ffn", "352",
                       "--seq", "128", "--batch", "8"]),
    "memory": dict(policies=["none", "compress8", "compress4", "compress2", "recompute", "full"], repeats=2,
                   args=["--steps", "3", "--dim", "128", "--layers", "16", "--heads", "4", "--ffn", "352",
                         "--seq", "512", "--batch", "24", "--eval-batches", "1"]),
}


def run_one(policy: str, args: list[str], env: dict, workdir: str, tag: str) -> dict:
    out = os.path.join(workdir, f"{policy}-{tag}.json")
    cmd = [sys.executable, "-m", "training.train", "--policy", policy, "--json", out, "--log-every", "50", *args]
    print("[policies] " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, env=env, check=True)
    with open(out) as f:
        return json.load(f)


def table(results: dict[str, list[dict]]) -> str:
    base = results.get("none")
    b_saved = base[0]["saved_bytes"] if base else None
    b_peak = statistics.median(r["peak_rss_mib"] for r in base) if base else None
    b_step = statistics.median(r["step_ms"] for r in base) if base else None
    lines = ["| policy | layers | saved for backward MiB | vs none | peak RSS MiB | vs none | step s | vs none | "
             "final loss (train, last 20) | val loss |", "|---|---|---|---|---|---|---|---|---|---|"]
    for policy, runs in results.items():
        saved = runs[0]["saved_bytes"]
        peak = statistics.median(r["peak_rss_mib"] for r in runs)
        step = statistics.median(r["step_ms"] for r in runs)
        cut = f"{b_saved / saved:.2f}x smaller" if b_saved and policy != "none" else ""
        pcut = f"-{1 - peak / b_peak:.0%}" if b_peak and policy != "none" else ""
        sx = f"{step / b_step:.2f}x" if b_step and policy != "none" else ""
        lines.append(f"| {policy} | {runs[0]['describe']} | {saved / 2**20:.1f} | {cut} | {peak:.0f} | {pcut} | "
                     f"{step / 1e3:.3f} | {sx} | {runs[0]['final_train_loss']:.4f} | {runs[0]['val_loss']:.4f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="loss")
    p.add_argument("--policies", default=None, help="comma-separated, default: the preset's")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--mmap-threshold", type=int, default=131072)
    p.add_argument("--malloc-default", action="store_true")
    p.add_argument("--no-thp", action="store_true", help="don't ask glibc for huge pages (GLIBC_TUNABLES)")
    p.add_argument("--out", default=None, help="write the markdown table (and a .json beside it) here")
    p.add_argument("extra", nargs="*", help="extra arguments for training.train (after --)")
    a = p.parse_args(argv)
    preset = PRESETS[a.preset]
    policies = a.policies.split(",") if a.policies else preset["policies"]
    repeats = a.repeats or preset["repeats"]
    env = dict(os.environ)
    if not a.malloc_default:
        env["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)
    if not a.no_thp:
        env["GLIBC_TUNABLES"] = ":".join(filter(None, [env.get("GLIBC_TUNABLES"), "glibc.malloc.hugetlb=1"]))
    results: dict[str, list[dict]] = {pol: [] for pol in policies}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):                       # interleaved: none, c8, ..., none, c8, ...
            for pol in policies:
                results[pol].append(run_one(pol, preset["args"] + a.extra, env, tmp, str(r)))
    md = table(results)
    head = (f"preset {a.preset}: `{' '.join(preset['args'] + a.extra)}`, {repeats} interleaved run(s) per policy, "
            f"MALLOC_MMAP_THRESHOLD_={'default' if a.malloc_default else a.mmap_threshold}, "
            f"huge pages {'off' if a.no_thp else 'on (glibc.malloc.hugetlb=1)'}, "
            f"{time.time() - t0:.0f} s")
    print(head + "\n\n" + md)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(head + "\n\n" + md + "\n")
        slim = {pol: [{k: v for k, v in r.items() if k != "losses"} | {"losses_every_10": r["losses"][::10]}
                      for r in runs] for pol, runs in results.items()}
        with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
            json.dump(slim, f, indent=1)


if __name__ == "__main__":
    main()
