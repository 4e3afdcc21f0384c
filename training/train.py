"""Byte-level LM training on the Python standard library's own .py files, under
an activation-memory policy. One policy per process, so peak RSS is that
policy's own.

    python -m training.train --policy full --steps 300
    python -m training.train --policy none --dim 256 --ffn 704 --seq 1024 --batch 16 --steps 4

Prints progress, then: saved-for-backward bytes of a training step (SavedTensorMeter,
first step), peak resident memory (ru_maxrss), median step time, final loss
(train: mean of the last 20 steps; val: fixed held-out batches). --json writes all of it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sysconfig
import time

import torch

from glm5_ops.compress import SavedTensorMeter
from training.byte_lm import ByteLM, ByteLMConfig
from training.memory_policy import MemoryPolicy, apply_memory_policy


def stdlib_py_files(package: str | None = None, exclude=(), skip_dirs=("site-packages", "__pycache__")) -> list[str]:
    """The standard library's .py files in sorted path order: all of them, or one
    package's; `exclude` drops top-level packages and modules by name, `skip_dirs`
    directories of those names at any depth."""
    root = sysconfig.get_paths()["stdlib"]
    top = os.path.join(root, package) if package else root
    paths = []
    for dirpath, dirnames, filenames in os.walk(top):
        rel = os.path.relpath(dirpath, root).split(os.sep)
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not (dirpath == root and d in exclude))
        if package is None and rel[0] in exclude:
            continue
        paths += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")
                  and not (dirpath == root and f[:-3] in exclude)]
    return sorted(paths)


def load_corpus(max_bytes: int) -> torch.Tensor:
    """The stdlib's .py files in sorted path order, concatenated, up to max_bytes: uint8 [N]."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for p in stdlib_py_files():
        with open(p, "rb") as f:
            b = f.read()
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    data = b"\n".join(chunks)[:max_bytes]
    if len(data) < 1 << 16:
        raise RuntimeError(f"found only {len(data)} bytes of .py source under {root}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def batch(data: torch.Tensor, B: int, S: int, gen: torch.Generator):
    starts = torch.randint(0, data.numel() - S - 1, (B,), generator=gen)
    rows = torch.stack([data[s:s + S + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def rss_mib(peak: bool = True) -> float:
    if peak:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="none",
                   help="none | compress8 | compress4 | compress2 | recompute | full, or a per-layer spec "
                        "such as '0-1:c8+norm+act,2-3:c4' (training/memory_policy.py)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=352)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--corpus-mib", type=float, default=8.0)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--meter-table", action="store_true", help="print saved bytes by op")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    data = load_corpus(int(a.corpus_mib * 2**20))
    split = int(data.numel() * 0.95)
    train, val = data[:split], data[split:]
    cfg = ByteLMConfig(dim=a.dim, n_layers=a.layers, n_heads=a.heads, ffn=a.ffn, seq_len=a.seq)
    model = ByteLM(cfg)
    policy = MemoryPolicy.parse(a.policy, cfg.n_layers, a.group_size)
    meter = SavedTensorMeter(params=model)
    apply_memory_policy(model, policy, meter=meter)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / a.warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, a.steps) / a.steps))))
    gen = torch.Generator().manual_seed(a.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[train] policy {a.policy} ({policy.describe()}); {n_params / 1e6:.2f}M params; "
          f"{train.numel() / 2**20:.1f} MiB of stdlib source; batch {a.batch}x{a.seq}; "
          f"{torch.get_num_threads()} threads", flush=True)
    rss_start = rss_mib(peak=False)
    losses, times = [], []
    for step in range(a.steps):
        x, y = batch(train, a.batch, a.seq, gen)
        t0 = time.perf_counter()
        if step == 0:  # the meter adds a little Python work per op: first step only
            meter.reset()
            with meter:
                loss = model(x, y)
        else:
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if step % a.log_every == 0 or step == a.steps - 1:
            print(f"[train] step {step:4d}  loss {losses[-1]:.4f}  {times[-1] * 1e3:.0f} ms  "
                  f"peak RSS {rss_mib():.0f} MiB", flush=True)
    model.eval()
    egen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        val_loss = statistics.fmean(model(*batch(val, a.batch, a.seq, egen)).item() for _ in range(a.eval_batches))
    timed = times[2:] if len(times) > 3 else times[1:] or times
    out = dict(policy=a.policy, describe=policy.describe(), config=vars(a), params=n_params,
               saved_bytes=meter.saved_bytes, logical_bytes=meter.logical_bytes, by_op=meter.by_op(),
               peak_rss_mib=rss_mib(), rss_before_training_mib=rss_start,
               step_ms=statistics.median(timed) * 1e3, step_ms_all=[t * 1e3 for t in times],
               final_train_loss=statistics.fmean(losses[-20:]), val_loss=val_loss, losses=losses)
    if a.meter_table:
        print(meter.table())
    print(f"[train] saved for backward: {meter.saved_bytes / 2**20:.1f} MiB held "
          f"({meter.logical_bytes / 2**20:.1f} MiB uncompressed); peak RSS {out['peak_rss_mib']:.0f} MiB "
          f"(RSS before training {rss_start:.0f} MiB); step {out['step_ms']:.0f} ms (median); "
          f"final loss {out['final_train_loss']:.4f} train (last 20), {val_loss:.4f} val", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
