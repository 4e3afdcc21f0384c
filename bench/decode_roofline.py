"""Why decode at 32 sequences is not 32x (or 8x) one sequence on this CPU:
FLOPs and weight bytes per engine decode step at B = 1 and B = 32, the
step's time and where it goes (per component), and the sgemm rate this
machine reaches at the step's own shapes (issue 18, "must show" 4, second
figure).

    python bench/decode_roofline.py [--steps 16] [--threads N]

Prints a table and writes runs/serving-claims/decode-roofline.json. The
model is the `small` preset, fp32, random weights, dsa (as
bench/serving_claims.py decode-scaling); prompts of 128 tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import glm5_ops.nvtx as nvtx                                           # noqa: E402
from models.glm5.accounting import active_breakdown, flops_per_token   # noqa: E402
from profiling.components import STEP_RANGE, breakdown                 # noqa: E402
from serving import Engine, SamplingParams                             # noqa: E402
from serving_claims import small_model                                 # noqa: E402

OUT = os.path.join(ROOT, "runs", "serving-claims")
PROMPT = 128


def sgemm_gflops(m: int, k: int, n: int, min_s: float = 0.3) -> float:
    """torch.mm's rate for [m,k] x [k,n] fp32 (the best of repeated timings over min_s)."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(3):
        torch.mm(a, b)
    best, spent = float("inf"), 0.0
    while spent < min_s:
        t0 = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return 2 * m * k * n / best / 1e9


def step_shapes(cfg, rows: int) -> dict:
    """The dense matmuls of one decode step with `rows` tokens: name -> (M, K, N)."""
    H = cfg.num_attention_heads
    return {"q_b_proj": (rows, cfg.q_lora_rank, H * cfg.qk_head_dim),
            "dense MLP up": (rows, cfg.hidden_size, 2 * cfg.intermediate_size),
            "o_proj": (rows, H * cfg.v_head_dim, cfg.hidden_size),
            "lm_head": (rows, cfg.hidden_size, cfg.vocab_size),
            "one expert up (rows/expert)": (max(1, round(rows * cfg.num_experts_per_tok / cfg.n_routed_experts)),
                                            cfg.hidden_size, 2 * cfg.moe_intermediate_size)}


def engine_with(model, n: int, steps: int) -> Engine:
    eng = Engine(model, max_num_seqs=n, max_num_batched_tokens=n * PROMPT, kv_cache_memory="2GiB", log=False)
    g = torch.Generator().manual_seed(n)
    for i in range(n):
        eng.add_request(f"r{i}", torch.randint(0, model.config.vocab_size, (PROMPT,), generator=g).tolist(),
                        SamplingParams(max_tokens=2 * steps + 4, temperature=0))
    if len(eng.step()) != n:                    # every prompt prefilled in one step
        raise RuntimeError(f"the first step should have prefilled all {n} prompts")
    eng.step()                                  # warm-up decode
    return eng


def measure(model, n: int, steps: int) -> dict:
    """Timed decode steps (no profiler), then profiled ones for the per-component split."""
    eng = engine_with(model, n, steps)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        assert len(eng.step()) == n
        times.append(time.perf_counter() - t0)
    model.record = True                         # routing of the next step: which experts it reads
    eng.step()
    model.record = False
    touched = [len(torch.unique(ids)) for ids in model.last_routing.values()]
    with nvtx.recording(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i in range(min(steps, 4)):
            with torch.profiler.record_function(f"{STEP_RANGE}{i}"):
                eng.step()
    split = breakdown(prof.events())
    times.sort()
    return {"step_ms_median": 1000 * times[len(times) // 2], "step_ms_min": 1000 * times[0],
            "experts_touched_per_moe_layer": touched,
            "profiled_ms": {k: v / 1000 for k, v in sorted(split.forward_us.items(), key=lambda kv: -kv[1])},
            "profiled_step_ms": split.step_us / 1000}


def weight_bytes(cfg, touched_per_layer: list[int]) -> dict:
    """fp32 weight bytes one step reads: every dense matmul weight once, each touched expert once."""
    act = active_breakdown(cfg)
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    dense = sum(act[k] for k in ("mla", "indexer", "dense_mlp", "router", "shared_experts", "lm_head"))
    return {"dense": 4 * dense, "experts": 4 * per_expert * sum(touched_per_layer)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = small_model()
    cfg = model.config
    out = {"threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    flops_tok = flops_per_token(cfg, PROMPT + args.steps, "decode", "dsa").total
    for n in (1, 32):
        print(f"[decode-roofline] {n} sequences", file=sys.stderr)
        r = measure(model, n, args.steps)
        r["gflop_per_step"] = n * flops_tok / 1e9
        r["weight_bytes_per_step"] = weight_bytes(cfg, r["experts_touched_per_moe_layer"])
        r["weight_bytes_if_read_per_sequence"] = n * sum(weight_bytes(cfg, [cfg.num_experts_per_tok] * len(
            r["experts_touched_per_moe_layer"])).values())
        r["achieved_gflops"] = r["gflop_per_step"] / (r["step_ms_median"] / 1000)
        r["sgemm_gflops_at_step_shapes"] = {name: sgemm_gflops(*mkn) for name, mkn in step_shapes(cfg, n).items()}
        out[n] = r
    out["sgemm_peak_gflops"] = max(sgemm_gflops(m, cfg.hidden_size, 2 * cfg.intermediate_size) for m in (256, 1024))
    out["ratio_tok_s_32_vs_1"] = 32 * out[1]["step_ms_median"] / out[32]["step_ms_median"]
    for n in (1, 32):
        out[n]["fraction_of_peak"] = out[n]["achieved_gflops"] / out["sgemm_peak_gflops"]
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "decode-roofline.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
