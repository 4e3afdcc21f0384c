"""Decode-shape timing of the CPU sparse attention forward (issue 23).

One query (B=1, S=1) with 16 heads on one MLA latent key (Hkv=1, Dk=288 =
256 latent + 32 rope, v = the first 256 channels of k), top-2048 of T keys,
fp32: the shape of every decode step's core attention. Times
torch.ops.glm5.sparse_attention_fwd at 1 thread and at 2 in one process (the
head split only acts with more threads than query blocks), and checks that
both give bit-identical out and lse. Run it against another build by putting
that build's repository first on PYTHONPATH. --layers N cycles through N
separate caches per timed call, as a decode step does through its layers, so
the selected rows come from DRAM rather than from the previous call's L2/L3.

    python bench/sparse_decode_bench.py [--depths 4096,16384] [--reps 200]
"""
import argparse
import statistics
import time

import torch

import glm5_ops  # noqa: F401  (registers torch.ops.glm5)


def decode_inputs(T, topk=2048, Hq=16, Dk=288, Dv=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, Hq, Dk, generator=g)
    k = torch.randn(1, T, 1, Dk, generator=g)
    idx = torch.randperm(T, generator=g)[:topk].sort().values.to(torch.int32).view(1, 1, topk)
    return q, k, k[..., :Dv], idx


def time_us(fn, reps):
    for _ in range(max(5, reps // 10)):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="4096,16384", help="comma-separated key counts T")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=1, help="separate caches cycled through per call (8: cold rows)")
    args = ap.parse_args()
    op = torch.ops.glm5.sparse_attention_fwd
    for T in (int(t) for t in args.depths.split(",")):
        layers = [decode_inputs(T, args.topk, seed=i) for i in range(args.layers)]
        q, k, v, idx = layers[0]
        scale = q.shape[-1] ** -0.5
        step = [0]

        def call():  # the next layer's cache
            qq, kk, vv, ii = layers[step[0] % len(layers)]
            step[0] += 1
            return op(qq, kk, vv, ii, scale, True, None)
        flops = 2 * args.topk * q.shape[2] * (k.shape[-1] + v.shape[-1])
        results = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results[threads] = op(q, k, v, idx, scale, True, None)
            us = time_us(call, args.reps)
            print(f"T={T} topk={args.topk} layers={args.layers} threads={threads}: {us:8.1f} us  {flops / us / 1e3:6.1f} GFLOP/s")
        same = all(torch.equal(a, b) for a, b in zip(results[1], results[2]))
        print(f"T={T}: 1 vs 2 threads bit-identical out and lse: {same}")


if __name__ == "__main__":
    main()
