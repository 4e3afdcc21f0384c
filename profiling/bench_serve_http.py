"""`glm5-lab bench-serve --base-url URL`: the serving benchmark against a running
OpenAI-compatible server (ours or vLLM's), same datasets, metrics, table and
files as --offline (serving/http_bench.py does the requests).

    glm5-lab serve --preset small --enable-prefix-caching &
    glm5-lab bench-serve --base-url http://127.0.0.1:8000/v1 --dataset prefix_repetition --num-prompts 64 --request-rate 8

The prompts are token ids drawn for --preset/--checkpoint's vocabulary (the
server's model: pass the same one).
"""
from __future__ import annotations

import asyncio
import json
import os
import time

from .args import UsageError


def run(args) -> int:
    from serving.bench_metrics import compute_metrics, format_table
    from serving.http_bench import run_http, served_model

    from . import bench_serve_cmd, profile_cmd

    base = args.base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    cfg = profile_cmd._config(args)
    requests = bench_serve_cmd.make_requests(args, cfg.vocab_size)
    try:
        model = args.model or asyncio.run(served_model(base, args.api_key))
    except Exception as e:
        raise UsageError(f"--base-url {args.base_url}: GET /v1/models failed ({type(e).__name__}: {e})") from None
    print(f"[glm5-lab bench-serve] {len(requests)} requests to {base} (model {model}), "
          f"rate {args.request_rate}, max concurrency {args.max_concurrency or 'unbounded'}", flush=True)
    records, duration = asyncio.run(run_http(base, model, requests, request_rate=args.request_rate,
                                             burstiness=args.burstiness, seed=args.seed,
                                             temperature=args.temperature, max_concurrency=args.max_concurrency,
                                             api_key=args.api_key))
    failed = [r.error for r in records if r.error]
    if failed:
        print(f"[glm5-lab bench-serve] {len(failed)} request(s) failed, first: {failed[0]}", flush=True)
    metrics = compute_metrics(records, duration_s=duration, percentiles=args.metric_percentiles)
    table = format_table(metrics, extra={"base_url": base, "max_concurrency": args.max_concurrency or "inf"})
    print(table, flush=True)
    out = args.out or os.path.join("runs", f"bench-serve-http-{args.dataset}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("parser", "api_key")}
    config.update(model=model, title=f"{model} over HTTP, {args.dataset}, {args.num_prompts} prompts at "
                                     f"{args.request_rate} req/s")
    result = {"date": time.strftime("%Y%m%d-%H%M%S"), "config": config, **metrics,
              "input_lens": [r.prompt_len for r in records], "output_lens": [r.output_len for r in records],
              "ttfts": [r.ttft if r.success else None for r in records], "itls": [r.itl for r in records],
              "finish_reasons": [r.finish_reason for r in records], "errors": [r.error for r in records],
              "num_cached_tokens": [r.num_cached_tokens for r in records]}
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out, "result.txt"), "w") as f:
        f.write(table + "\n")
    bench_serve_cmd.latency_plot(records, os.path.join(out, "latency.png"), title=config["title"])
    print(f"[glm5-lab bench-serve] wrote {out}/result.json, result.txt, latency.png", flush=True)
    return 0 if not failed else 1
