"""The lightning indexer at decode (one query): indexer_topk, indexer_scores and
topk_indices on the CPU, keys cycled through several sets so they come from
memory as in a model's decode step (8 layers' index keys).

    python bench/indexer_decode_bench.py [--lengths 4096,16384] [--sets 8] [--calls 200]

H=8 heads, D=64, top-2048 (the `small` preset's indexer). Prints the median
microseconds per call and the keys' megabytes per call. bench/RESULTS.md,
"indexer at decode", has the runs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import glm5_ops  # noqa: E402


def median_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[calls // 2] * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,16384", help="key counts T")
    ap.add_argument("--sets", type=int, default=8, help="key sets cycled (one per layer)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--topk", type=int, default=2048)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    g = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}, H=8, D=64, top-{args.topk}, {args.sets} key sets cycled")
    for T in (int(t) for t in args.lengths.split(",")):
        keys = [torch.randn(1, T, 64, generator=g) for _ in range(args.sets)]
        q, w = torch.randn(1, 1, 8, 64, generator=g), torch.rand(1, 1, 8, generator=g)
        turn = [0]

        def next_keys():
            turn[0] = (turn[0] + 1) % args.sets
            return keys[turn[0]]

        topk = median_us(lambda: glm5_ops.indexer_topk(q, w, next_keys(), args.topk, q_start=T - 1), args.calls)
        scores = median_us(lambda: glm5_ops.indexer_scores(q, w, next_keys(), q_start=T - 1), args.calls)
        s = glm5_ops.indexer_scores(q, w, keys[0], q_start=T - 1)
        select = median_us(lambda: glm5_ops.topk_indices(s, args.topk), args.calls)
        print(f"T={T}: indexer_topk {topk:.0f} us, indexer_scores {scores:.0f} us, topk_indices {select:.0f} us, "
              f"keys {T * 64 * 4 / 1e6:.1f} MB a call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
