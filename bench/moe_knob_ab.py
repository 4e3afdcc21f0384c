"""fused_moe_int8 decode under environment-variable variants, alternated in one process.

This host's read bandwidth drifts (30-65 GB/s for the same sum within minutes), so two
builds timed in turn differ by more than most kernel changes do. The way round it: a
scratch copy of the repository whose C++ reads a knob (`std::getenv("GLM5_AB_...")`, set
per call), built once, and this script alternating the variants round by round in one
process, each round's bandwidth sum measured beside it. Each variant is a comma-separated
list of VAR=value ("-": no GLM5_AB_* variable set); the first is the baseline.

    PYTHONPATH=/tmp/scratch python bench/moe_knob_ab.py --seconds 30 GLM5_AB_EVEN=1 -

prints, per T, the medians of each variant's GB/s (and fraction of the round's sum) and of
each variant's ratio to the baseline, with how many rounds it was faster. Experts as
the model keeps them: the `small` preset's MoE layers on huge pages, packed where
`packed_experts_pay` (VNNI), routings cycled past twice the L3 (cold).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from gemv_bench import median_time, routings  # first: gemv_bench puts the repository on sys.path
import glm5_ops
from glm5_ops.int8 import pack_rows, packed_experts_pay
from glm5_ops.memory import on_huge_pages
from models.glm5 import preset

PREFIX = "GLM5_AB_"


def set_variant(variant: str) -> None:
    for key in [k for k in os.environ if k.startswith(PREFIX)]:
        del os.environ[key]
    if variant != "-":
        for item in variant.split(","):
            key, _, value = item.partition("=")
            if not key.startswith(PREFIX) or not value:
                raise ValueError(f"a variant is '-' or {PREFIX}NAME=value[,...], got {item!r}")
            os.environ[key] = value


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", nargs="+", help=f"'-' or {PREFIX}NAME=value[,...]; the first is the baseline")
    p.add_argument("--seconds", type=float, default=30, help="rounds for this long at each T")
    p.add_argument("--T", default="1,4,16", help="token counts, comma-separated")
    p.add_argument("--preset", default="small")
    p.add_argument("--layers", type=int, default=0, help="MoE layers (0: the preset's)")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    for v in a.variants:
        set_variant(v)   # a malformed variant fails here, before minutes of setup
    torch.set_num_threads(a.threads)
    c = preset(a.preset)
    E, I, D, k = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size, c.num_experts_per_tok
    n_layers = a.layers or sum(t == "sparse" for t in c.mlp_layer_types)
    packed = packed_experts_pay(torch.device("cpu"), D, I)
    pack = pack_rows if packed else (lambda t: t)
    layers = []
    for _ in range(n_layers):
        wgu, sgu = glm5_ops.quantize_int8(torch.randn(E, 2 * I, D) * D ** -0.5)
        wd, sd = glm5_ops.quantize_int8(torch.randn(E, D, I) * I ** -0.5)
        layers.append(tuple(map(on_huge_pages, (pack(wgu), sgu, pack(wd), sd))))
    expert_bytes = 3 * I * D + 4 * (2 * I + D)
    big = on_huge_pages(torch.randn(64 * 2**20))

    def bandwidth() -> float:
        return big.nbytes / min(median_time(lambda: big.sum(), 1, rounds=1) for _ in range(3)) / 1e9

    for T in (int(t) for t in a.T.split(",")):
        calls = routings(T, E, k, n_layers, expert_bytes)
        x, w = torch.randn(T, D), torch.rand(T, k)
        nbytes = statistics.mean(n for _, _, n in calls) * expert_bytes
        reps = max(24, int(3e7 // nbytes))

        def gbs() -> float:
            t = time.perf_counter()
            for i in range(reps):
                layer, ids, _ = calls[i % len(calls)]
                glm5_ops.fused_moe_int8(x, *layers[layer], w, ids, packed=packed)
            return nbytes * reps / (time.perf_counter() - t) / 1e9

        rows, end = [], time.perf_counter() + a.seconds
        while time.perf_counter() < end or not rows:
            row = {"sum": bandwidth()}
            for v in (a.variants if len(rows) % 2 == 0 else a.variants[::-1]):
                set_variant(v)
                gbs()   # the first pass after a switch warms what the variant touches
                row[v] = gbs()
            rows.append(row)
        set_variant("-")
        base = a.variants[0]
        line = f"T={T}{' packed' if packed else ''}, {len(rows)} rounds, sum median {statistics.median(r['sum'] for r in rows):.1f} GB/s:"
        for v in a.variants:
            line += f"  [{v}] {statistics.median(r[v] for r in rows):.1f} GB/s " \
                    f"({statistics.median(r[v] / r['sum'] for r in rows):.0%})"
        for v in a.variants[1:]:
            faster = sum(r[v] > r[base] for r in rows)
            line += f"  {v} / {base}: {statistics.median(r[v] / r[base] for r in rows):.3f}x " \
                    f"(faster in {faster} of {len(rows)})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
