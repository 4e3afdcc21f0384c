"""Crash and resume: glm5-lab train under torchrun killed with SIGKILL at a
random moment (during a step, or during an asynchronous save), then resumed
with --resume; the losses from the resumed step on must be bit-identical to
an uninterrupted run's on the same mesh, and the resume must start from the
newest checkpoint that was complete when the run died (never an unfinished one).

    python scripts/crash_resume.py --trials 10 --nproc 4          # dp_shard 2 x tp 2
    python scripts/crash_resume.py --trials 2 --nproc 2 --steps 6   # what the CI test runs

Trials alternate: "step" kills at a uniformly random time after the first
step; "save" sets GLM5_CKPT_WRITE_DELAY_S so each process holds its written
data unfinished for a while, waits until a save is under way (a step
directory with data files and no manifest) and kills within that window.
Exit status 1 when any trial differs.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from training.checkpoint import MANIFEST, complete_checkpoints  # noqa: E402

MESHES = {1: [], 2: ["--dp-shard", "2"], 4: ["--dp-shard", "2", "--tp", "2"]}
SAVE_WINDOW_S = 1.5


def train_cmd(nproc: int, out: str, steps: int, every: int, resume: bool) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    flags = ["--preset", "tiny", "--seq", "32", "--batch", "4", "--corpus-mib", "0.1", "--eval-batches", "0",
             "--threads", "1", "--device", "cpu", "--no-checkpoint", "--steps", str(steps),
             "--checkpoint-every", str(every), "--async-save", "--out", out, *MESHES[nproc]]
    return [*launcher, "-m", "profiling", "train", *flags, *(["--resume", out] if resume else [])]


def _env(delay: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}
    env.pop("GLM5_CKPT_WRITE_DELAY_S", None)
    if delay:
        env["GLM5_CKPT_WRITE_DELAY_S"] = str(SAVE_WINDOW_S)
    return env


def losses(out: str) -> dict[int, float]:
    """step -> loss, the rows after the last resume marker winning."""
    rows = {}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "loss" in row:
                rows[row["step"]] = row["loss"]
    return rows


def run_to_end(cmd: list[str], env: dict, timeout: float = 600) -> None:
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def _save_under_way(root: str) -> bool:
    """A save is being written and an earlier one is complete (so the kill tests a resume, not a restart)."""
    if not complete_checkpoints(root):
        return False
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith("step_") and not os.path.exists(os.path.join(path, MANIFEST)) and \
                any(f.endswith(".distcp") for f in os.listdir(path)):
            return True
    return False


def descendants(pid: int) -> list[int]:
    """Every process below pid (torchrun starts its workers in sessions of their own, so killing
    torchrun's process group does not reach them)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL pid and every process below it, the workers first (as a machine failure would)."""
    for p in [*reversed(descendants(pid)), pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def killed_run(cmd: list[str], out: str, mode: str, rng: random.Random, train_s: float,
               timeout: float = 300) -> float:
    """Starts the run, SIGKILLs its whole process group at a random moment; the seconds it ran."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(mode == "save"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    t0, metrics, root = time.time(), os.path.join(out, "metrics.jsonl"), os.path.join(out, "ckpt")
    try:
        while not os.path.exists(metrics) or os.path.getsize(metrics) == 0:   # the first step is done
            if proc.poll() is not None or time.time() - t0 > timeout:
                raise RuntimeError(f"the run ended (status {proc.returncode}) before its first step")
            time.sleep(0.05)
        if mode == "step":
            time.sleep(rng.uniform(0.0, train_s))
        else:
            while not _save_under_way(root):
                if proc.poll() is not None or time.time() - t0 > timeout:
                    raise RuntimeError("the run ended before a save was under way")
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, SAVE_WINDOW_S * 0.8))
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
        proc.wait()
    return time.time() - t0


def trial(i: int, args, reference: dict[int, float], workdir: str, rng: random.Random) -> dict:
    out = os.path.join(workdir, f"trial{i}")
    mode = ("save", "step")[i % 2]
    ran_s = killed_run(train_cmd(args.nproc, out, args.steps, args.every, False), out, mode, rng, args.train_s)
    done = complete_checkpoints(os.path.join(out, "ckpt"))
    newest = done[-1][0] if done else None
    unfinished = [n for n in os.listdir(os.path.join(out, "ckpt"))
                  if n.startswith("step_") and not os.path.exists(os.path.join(out, "ckpt", n, MANIFEST))] \
        if os.path.isdir(os.path.join(out, "ckpt")) else []
    run_to_end(train_cmd(args.nproc, out, args.steps, args.every, newest is not None), _env(False))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        markers = [json.loads(line)["resumed_from"] for line in f if "resumed_from" in line]
    got = losses(out)
    resumed = markers[-1] if markers else 0
    same = all(got[s] == reference[s] for s in range(resumed, args.steps))
    ok = same and resumed == (newest or 0) and set(got) >= set(range(resumed, args.steps))
    result = dict(trial=i, mode=mode, killed_after_s=round(ran_s, 2), newest_complete=newest,
                  unfinished_at_kill=unfinished, resumed_from=resumed, bit_identical=same, ok=ok)
    print(f"[crash] trial {i} ({mode}): killed after {ran_s:.1f} s, unfinished {unfinished or 'none'}, resumed "
          f"from step {resumed} (newest complete {newest}), losses {'bit-identical' if same else 'DIFFER'}",
          flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--nproc", type=int, choices=sorted(MESHES), default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="default: a temporary directory, removed at the end")
    p.add_argument("--json", default=None, help="write the trials' results here")
    args = p.parse_args(argv)
    if args.trials < 1 or args.steps < 2 * args.every:
        p.error("--trials must be >= 1 and --steps at least 2 x --every")
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or tmp
        t0 = time.time()
        ref_out = os.path.join(workdir, "reference")
        run_to_end(train_cmd(args.nproc, ref_out, args.steps, args.every, False), _env(False))
        reference = losses(ref_out)
        with open(os.path.join(ref_out, "metrics.jsonl")) as f:
            # a "step" kill lands uniformly within the time the steps after the first take
            args.train_s = sum(json.loads(line)["step_s"] for line in f if '"step_s"' in line) * 0.9
        print(f"[crash] uninterrupted run: {args.steps} steps in {time.time() - t0:.0f} s", flush=True)
        results = [trial(i, args, reference, workdir, rng) for i in range(args.trials)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    bad = [r["trial"] for r in results if not r["ok"]]
    print(f"[crash] {args.trials - len(bad)} of {args.trials} trials resumed bit-identically"
          + (f"; failed: {bad}" if bad else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
