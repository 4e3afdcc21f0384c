"""Predictor and selection: topk_indices vs torch.topk, indexer_topk and
indexer_scores vs the unfused chain. One pytest-benchmark group per op and
shape, ours and the baseline side by side; FLOPs and bytes counted."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import glm5_ops
from baselines import unfused_indexer_topk
from conftest import DEVICE

TOPK_SHAPES = [(64, 32768, 2048), (1, 131072, 2048), (8, 262144, 2048), (4096, 4096, 256)]
# The acceptance shape: B=1, S=1024, T=16384, H=8, D=64, topk=1024.
INDEXER = dict(B=1, S=1024, T=16384, H=8, D=64, topk=1024)


def _run(benchmark, fn, rounds):
    benchmark.pedantic(fn, rounds=rounds, warmup_rounds=1, iterations=1)


@pytest.mark.parametrize("impl", ["ours", "baseline"])
@pytest.mark.parametrize("rows,T,k", TOPK_SHAPES, ids=[f"{r}x{t}-k{k}" for r, t, k in TOPK_SHAPES])
def test_topk(benchmark, rows, T, k, impl):
    benchmark.group = f"topk_indices {rows}x{T} k={k}"
    x = torch.randn(rows, T, device=DEVICE)
    benchmark.extra_info.update(role=impl, impl="glm5 topk_indices" if impl == "ours" else "torch.topk(sorted=False)",
                                bytes=x.numel() * 4 + rows * k * 4, ceiling="bandwidth")
    fn = (lambda: glm5_ops.topk_indices(x, k)) if impl == "ours" else (lambda: torch.topk(x, k, sorted=False))
    _run(benchmark, fn, rounds=20)


def _indexer_inputs(B, S, T, H, D, **_):
    torch.manual_seed(0)
    return (torch.randn(B, S, H, D, device=DEVICE), torch.randn(B, S, H, device=DEVICE).abs(),
            torch.randn(B, T, D, device=DEVICE))


def _indexer_counts(B, S, T, H, D, topk):
    flops = 2 * B * S * T * H * D  # causal with q_start = T - S: nearly every key is visible
    bytes_ = 4 * (B * S * H * D + B * S * H + B * T * D) + 4 * B * S * topk
    return dict(flops=flops, bytes=bytes_, ceiling="matmul")


@pytest.mark.parametrize("impl", ["fused", "scores+topk", "baseline"])
def test_indexer_topk(benchmark, impl):
    c = INDEXER
    benchmark.group = "indexer_topk B={B} S={S} T={T} H={H} D={D} topk={topk}".format(**c)
    q, w, k = _indexer_inputs(**c)
    fns = {"fused": lambda: glm5_ops.indexer_topk(q, w, k, c["topk"]),
           "scores+topk": lambda: glm5_ops.topk_indices(glm5_ops.indexer_scores(q, w, k), c["topk"]),
           "baseline": lambda: unfused_indexer_topk(q, w, k, c["topk"])}
    names = {"fused": "glm5 indexer_topk (fused, streaming)", "scores+topk": "glm5 indexer_scores + topk_indices",
             "baseline": "einsum->relu->weight->sum->mask->torch.topk"}
    benchmark.extra_info.update(role="ours" if impl == "fused" else ("baseline" if impl == "baseline" else "variant"),
                                impl=names[impl], **_indexer_counts(**c))
    _run(benchmark, fns[impl], rounds=3)


PEAK_PROBE = textwrap.dedent("""
    import json, sys, torch, glm5_ops
    from glm5_ops.memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    sys.path.insert(0, {bench!r})
    from baselines import unfused_indexer_topk
    c = json.loads(sys.argv[1]); impl = sys.argv[2]
    torch.manual_seed(0)
    q = torch.randn(c["B"], c["S"], c["H"], c["D"]); w = torch.randn(c["B"], c["S"], c["H"]).abs()
    k = torch.randn(c["B"], c["T"], c["D"])
    glm5_ops.indexer_topk(q[:, :2], w[:, :2], k[:, :64], 8)  # load everything before measuring
    assert reset_peak_rss(), "cannot reset the peak RSS (/proc/self/clear_refs)"
    before = current_rss_bytes()
    if impl == "fused":
        glm5_ops.indexer_topk(q, w, k, c["topk"])
    else:
        unfused_indexer_topk(q, w, k, c["topk"])
    print(json.dumps({{"peak_increase_mib": (peak_rss_bytes() - before) / 2**20}}))
""")


@pytest.mark.skipif(DEVICE != "cpu", reason="peak resident memory is the CPU measure")
def test_indexer_peak_memory(record_property):
    """Peak resident memory added by one call, each in a fresh process."""
    probe = PEAK_PROBE.format(bench=os.path.dirname(__file__))
    peaks = {}
    for impl in ("fused", "baseline"):
        out = subprocess.run([sys.executable, "-c", probe, json.dumps(INDEXER), impl], capture_output=True,
                             text=True, check=True)
        peaks[impl] = json.loads(out.stdout.strip().splitlines()[-1])["peak_increase_mib"]
    print(f"\nindexer_topk peak RSS increase: fused {peaks['fused']:.0f} MiB, unfused chain "
          f"{peaks['baseline']:.0f} MiB ({peaks['fused'] / peaks['baseline']:.3f} of it)")
    record_property("peak_mib", peaks)
    assert peaks["fused"] <= peaks["baseline"] / 4
