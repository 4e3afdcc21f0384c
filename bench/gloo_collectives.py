"""gloo's all-gather and reduce-scatter against training/cpu_collectives.py's
(broadcasts and reduces in place): extra resident memory during the call and
time, on 4 CPU processes, for one `small`-preset MoE layer's 216 MB.

    python bench/gloo_collectives.py [--mib 216]
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def _worker(rank, port, mib, repeats):
    from training.cpu_collectives import all_gather_into, reduce_scatter_into
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    g, n = dist.group.WORLD, mib * 2**18   # fp32 elements
    rs_native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ag_native = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    cases = {"reduce-scatter, gloo": lambda o, i: rs_native(o, i, group=g),
             "reduce-scatter, in place": lambda o, i: reduce_scatter_into(o, i, g, dist.ReduceOp.SUM),
             "all-gather, gloo": lambda o, i: ag_native(o, i, group=g),
             "all-gather, in place": lambda o, i: all_gather_into(o, i, g)}
    for name, fn in cases.items():
        rs = name.startswith("reduce")
        inp, out = torch.empty(n if rs else n // 4), torch.zeros(n // 4 if rs else n)
        times, extra = [], 0.0
        for _ in range(repeats):
            inp.fill_(rank + 1)   # resident before the call
            dist.barrier()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")      # resets VmHWM
            base, t0 = _status("VmRSS"), time.perf_counter()
            fn(out, inp)
            times.append(time.perf_counter() - t0)
            extra = max(extra, _status("VmHWM") - base)
        want = torch.full_like(out, 10.0) if rs else torch.arange(1.0, 5.0).repeat_interleave(n // 4)
        if not torch.equal(out, want):
            raise AssertionError(f"{name}: wrong result")
        if rank == 0:
            print(f"| {name} | {extra:.0f} | {min(times) * 1e3:.0f} |", flush=True)
        del inp, out
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=216, help="the unsharded buffer's size")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"| {args.mib} MiB over 4 processes | extra peak RSS MiB | best of {args.repeats} ms |\n|---|---|---|",
          flush=True)
    mp.spawn(_worker, args=(port, args.mib, args.repeats), nprocs=4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
