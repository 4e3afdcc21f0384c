"""The serving engine's acceptance measurements (issue 18, "must show" 4 and 5),
each ratio from one run of this script on the `small` preset:

  python bench/serving_claims.py batching        # continuous vs policy="static", random dataset
  python bench/serving_claims.py decode-scaling  # decode tok/s at 32 concurrent sequences vs 1
  python bench/serving_claims.py chunked-prefill # p99 ITL of 8 decodes with / without a 4,096-token prompt
  python bench/serving_claims.py prefix-cache    # TTFT vs hit rate; throughput at a 0% hit rate
  python bench/serving_claims.py long-context    # 8 x 16K-token sequences (dsa) within the cache budget
  python bench/serving_claims.py all

Each prints its figures and writes runs/serving-claims/<name>.json. Random
weights (the figures are about time and memory, not text): the model is
built once per run, fp32, two threads (torch's default here).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from models.glm5 import GLM5ForCausalLM, preset                      # noqa: E402
from serving import Engine, SamplingParams                            # noqa: E402
from serving.bench_metrics import compute_metrics                     # noqa: E402
from serving.benchmark import run_offline                             # noqa: E402
from serving.datasets import SampleRequest, prefix_repetition_requests, random_requests   # noqa: E402

OUT = os.path.join(ROOT, "runs", "serving-claims")


def small_model(attn="dsa"):
    torch.manual_seed(0)
    return GLM5ForCausalLM(preset("small"), attn=attn).eval()


def engine(model, **kwargs):
    kwargs.setdefault("kv_cache_memory", "2GiB")
    return Engine(model, log=False, **kwargs)


def measure(model, requests, *, rate=float("inf"), trace=False, **engine_kwargs):
    """(metrics, engine stats); with trace, the stats also hold `schedule` (each
    step's (request, start, tokens) chunks) and `page_seconds` (time inside the
    page manager, where the prefix cache's hashing and lookups run)."""
    eng = engine(model, **engine_kwargs)
    schedule, page_seconds = ([], [0.0]) if trace else (None, None)
    if trace:
        _trace_engine(eng, schedule, page_seconds)
    records = run_offline(eng, requests, request_rate=rate, progress=True)
    stats = eng.stats()
    if trace:
        stats.update(schedule=schedule, page_seconds=page_seconds[0])
    return compute_metrics(records), stats


def _trace_engine(eng, schedule: list, page_seconds: list) -> None:
    """Records every step's chunks and times the page manager's calls (instance attributes shadow the methods)."""
    bm, sched = eng.block_manager, eng.scheduler
    for name in ("get_computed_prefix", "allocate_slots", "reserve_slots", "cache_full_pages", "free"):
        def timed(*a, _f=getattr(bm, name), **k):
            t0 = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                page_seconds[0] += time.perf_counter() - t0
        setattr(bm, name, timed)

    def schedule_and_record(_f=sched.schedule):
        out = _f()
        schedule.append(tuple((c.request.request_id, c.start, c.num_tokens) for c in out.scheduled))
        return out
    sched.schedule = schedule_and_record


def batching(model, args):
    """Continuous batching against static batches on vLLM's random dataset
    (input 32-1024, output 8-256 tokens, uniform)."""
    reqs = random_requests(args.num_prompts, input_len=(32, 1024), output_len=(8, 256),
                           vocab_size=model.config.vocab_size, seed=0)
    out = {}
    for policy in ("continuous", "static", "static_unpadded"):
        print(f"[batching] policy={policy}", file=sys.stderr)
        m, s = measure(model, reqs, policy=policy, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048)
        out[policy] = {"output_throughput": m["output_throughput"], "total_token_throughput": m["total_token_throughput"],
                       "mean_ttft_ms": m["mean_ttft_ms"], "p99_itl_ms": m["p99_itl_ms"], "duration": m["duration"],
                       "slot_utilisation": s["slot_utilisation"], "padding_fraction": s["padding_fraction"],
                       "steps": s["steps"]}
    for static in ("static", "static_unpadded"):
        out[f"ratio_vs_{static}"] = out["continuous"]["output_throughput"] / out[static]["output_throughput"]
    return out


def decode_scaling(model, args):
    """Decode tokens/s with 32 sequences in flight against 1 (128-token prompts,
    prefill excluded: timed from the step after the last prefill)."""
    out, prompt = {}, 128
    for n in (1, 32):
        # a budget of every prompt at once: one prefill step, then only decodes
        eng = engine(model, max_num_seqs=n, max_num_batched_tokens=n * prompt)
        g = torch.Generator().manual_seed(n)
        for i in range(n):
            eng.add_request(f"r{i}", torch.randint(0, model.config.vocab_size, (prompt,), generator=g).tolist(),
                            SamplingParams(max_tokens=args.decode_tokens + 1, temperature=0))
        if len(eng.step()) != n:
            raise RuntimeError(f"the first step should have prefilled all {n} prompts")
        tokens, t0 = 0, time.perf_counter()
        while eng.has_unfinished_requests():
            tokens += len(eng.step())
        dt = time.perf_counter() - t0
        out[n] = {"decode_tok_s": tokens / dt, "step_ms": 1000 * dt / args.decode_tokens}
        print(f"[decode-scaling] {n} sequences: {tokens / dt:.1f} tok/s", file=sys.stderr)
    out["ratio"] = out[32]["decode_tok_s"] / out[1]["decode_tok_s"]
    return out


def chunked_prefill(model, args):
    """p99 inter-token latency of 8 running decodes, alone and while a 4,096-token
    prompt is admitted in chunks of the step's token budget."""
    out = {}
    for with_prompt in (False, True):
        eng = engine(model, max_num_seqs=9, max_num_batched_tokens=args.chunk_budget)
        g = torch.Generator().manual_seed(0)
        for i in range(8):
            eng.add_request(f"d{i}", torch.randint(0, model.config.vocab_size, (64,), generator=g).tolist(),
                            SamplingParams(max_tokens=10_000, temperature=0))
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.requests.values()):
            eng.step()
        if with_prompt:
            eng.add_request("long", torch.randint(0, model.config.vocab_size, (4096,), generator=g).tolist(),
                            SamplingParams(max_tokens=1, temperature=0))
        gaps, last = [], time.perf_counter()
        steps = 0
        while steps < args.itl_steps or (with_prompt and "long" in eng.requests):
            eng.step()
            now = time.perf_counter()
            gaps.append(now - last)
            last, steps = now, steps + 1
        gaps.sort()
        p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] * 1000
        out["with_4096_prompt" if with_prompt else "decodes_only"] = {"p99_itl_ms": p99, "steps": steps,
                                                                      "mean_itl_ms": 1000 * sum(gaps) / len(gaps)}
        print(f"[chunked-prefill] prompt={with_prompt}: p99 ITL {p99:.1f} ms over {steps} steps", file=sys.stderr)
    out["chunk_budget"] = args.chunk_budget
    out["ratio_p99"] = out["with_4096_prompt"]["p99_itl_ms"] / out["decodes_only"]["p99_itl_ms"]
    return out


def prefix_cache(model, args):
    """vLLM's prefix_repetition dataset with caching on and off (mean TTFT, hit
    rate), and every prefix distinct (0% hits) on and off (throughput). The
    requests arrive at --request-rate (Poisson, as vLLM's bench serve; the
    same arrival times for on and off), so a request's TTFT is mostly its own
    prefill rather than a wait behind every other request's (the all-at-once
    trace measures the queue: see bench/RESULTS.md)."""
    out = {"request_rate": args.request_rate}
    for distinct in (False, True):
        reqs = prefix_repetition_requests(args.num_prompts, prefix_len=512, suffix_len=64, num_prefixes=4,
                                          output_len=16, vocab_size=model.config.vocab_size, seed=0,
                                          distinct_prefixes=distinct)
        # 0% hits: all at once (saturated), where a cost of the cache's bookkeeping would show in
        # tokens/s; alternated --zero-hit-pairs times (the host drifts), the median of each kept.
        # Each run also records its schedule and its time in the page manager: equal schedules
        # and the page manager's share of the run bound the cache's cost whatever the host's noise.
        pairs = [(False, True) if i % 2 == 0 else (True, False) for i in range(args.zero_hit_pairs)]
        runs = {}
        for caching in [c for pair in pairs for c in pair] if distinct else (False, True):
            m, s = measure(model, reqs, rate=float("inf") if distinct else args.request_rate, trace=distinct,
                           enable_prefix_caching=caching, max_num_seqs=len(reqs), max_num_batched_tokens=2048)
            key = f"{'distinct' if distinct else 'shared'}_{'on' if caching else 'off'}"
            runs.setdefault(key, []).append(dict(
                mean_ttft_ms=m["mean_ttft_ms"], median_ttft_ms=m["median_ttft_ms"],
                total_token_throughput=m["total_token_throughput"], duration=m["duration"],
                hit_rate=s["prefix_cache_hit_rate"], steps=s["steps"],
                **({"page_seconds": s["page_seconds"], "schedule": s["schedule"]} if distinct else {})))
        for key, rs in runs.items():
            median = sorted(rs, key=lambda r: r["total_token_throughput"])[(len(rs) - 1) // 2]
            out[key] = {k: v for k, v in median.items() if k != "schedule"}
            out[key]["throughputs"] = [r["total_token_throughput"] for r in rs]
        if distinct:
            schedules = {tuple(r["schedule"]) for rs in runs.values() for r in rs}
            out["zero_hit_same_schedule"] = len(schedules) == 1
            out["zero_hit_page_share"] = {key: statistics.median(r["page_seconds"] / r["duration"] for r in rs)
                                          for key, rs in runs.items()}
    hit = out["shared_on"]["hit_rate"]
    out["hit_rate"] = hit
    out["ttft_reduction"] = 1 - out["shared_on"]["mean_ttft_ms"] / out["shared_off"]["mean_ttft_ms"]
    out["ttft_reduction_over_hit_rate"] = out["ttft_reduction"] / hit if hit else None
    out["zero_hit_throughput_ratio"] = (out["distinct_on"]["total_token_throughput"]
                                        / out["distinct_off"]["total_token_throughput"])
    return out


def long_context(model, args):
    """8 sequences of 16K tokens (dsa) served together from a 2 GiB pool: the
    pool, what the sequences need of it, and the process's peak memory."""
    budget = "2GiB"
    eng = engine(model, max_num_seqs=8, max_num_batched_tokens=2048, kv_cache_memory=budget)
    g = torch.Generator().manual_seed(0)
    n = args.long_tokens
    for i in range(8):
        eng.add_request(f"l{i}", torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist(),
                        SamplingParams(max_tokens=64, temperature=0))   # long enough that all 8 are resident at once
    peak_pages, t0, steps = 0, time.perf_counter(), 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        peak_pages = max(peak_pages, eng.block_manager.num_used_pages)
        if steps % 10 == 0:
            print(f"[long-context] step {steps}, {time.perf_counter() - t0:.0f} s, pages in use {peak_pages}",
                  file=sys.stderr)
    from models.glm5.cache import KVPool
    page_bytes = KVPool.bytes_per_token(model.config) * eng.pool.page_size
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"sequences": 8, "tokens_each": n + 64, "pool_bytes": eng.pool.num_pages * page_bytes,
            "peak_pages_used": peak_pages, "peak_cache_bytes": peak_pages * page_bytes,
            "num_preemptions": eng.num_preemptions, "weights_bytes": weights,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "seconds": time.perf_counter() - t0, "steps": steps}


CLAIMS = {"batching": batching, "decode-scaling": decode_scaling, "chunked-prefill": chunked_prefill,
          "prefix-cache": prefix_cache, "long-context": long_context}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("claim", nargs="+", choices=[*CLAIMS, "all"])
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--chunk-budget", type=int, default=64, help="max_num_batched_tokens for chunked-prefill")
    p.add_argument("--itl-steps", type=int, default=40)
    p.add_argument("--long-tokens", type=int, default=16384)
    p.add_argument("--request-rate", type=float, default=0.5, help="prefix-cache: requests/s (Poisson)")
    p.add_argument("--zero-hit-pairs", type=int, default=2, help="prefix-cache: on/off pairs at a 0%% hit rate")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(OUT, exist_ok=True)
    model = small_model()
    for name in CLAIMS if "all" in args.claim else args.claim:
        t0 = time.perf_counter()
        result = CLAIMS[name](model, args)
        result.update(claim=name, seconds=time.perf_counter() - t0, date=time.strftime("%Y-%m-%d %H:%M"),
                      threads=torch.get_num_threads())
        with open(os.path.join(OUT, f"{name}.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
