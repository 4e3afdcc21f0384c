"""`glm5-lab bench-serve`: the serving benchmark, vLLM's `bench serve` metrics
(TTFT, TPOT, ITL, E2EL, throughputs) for the lab's Engine.

    glm5-lab bench-serve --offline --preset tiny --dataset random --num-prompts 32 --request-rate 4
    glm5-lab bench-serve --offline --dataset prefix_repetition --enable-prefix-caching
    glm5-lab bench-serve --offline --dataset prefix_repetition --prefix-repetition-distinct   # 0% hit rate

--offline drives the Engine in this process (serving/benchmark.py); an HTTP
mode will reuse serving/bench_metrics.py. Writes result.json (metrics,
config, engine stats, per-request timings), result.txt (the table) and
latency.png (TTFT and ITL distributions) under --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

from .args import (UsageError, add_quantization_arg, check_quantization, nonnegative_int, positive_float,
                   positive_int, quantize_for)

DEFAULT_PRESETS = ("tiny", "small")     # the full-size presets do not fit one machine's serving run


def length_range(text: str) -> tuple[int, int] | int:
    """'128' -> 128 (a centre for --random-range-ratio); '32-1024' -> (32, 1024)."""
    lo, sep, hi = text.partition("-")
    try:
        values = [int(lo)] + ([int(hi)] if sep else [])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a length N or a range LO-HI, got {text!r}") from None
    if any(v < 1 for v in values) or (sep and values[0] > values[1]):
        raise argparse.ArgumentTypeError(f"expected positive lengths with LO <= HI, got {text!r}")
    return tuple(values) if sep else values[0]


def ratio(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {v}")
    return v


def percentiles(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated percentiles like 50,90,99, got {text!r}") from None
    if not values or any(not 0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"expected percentiles in [0, 100], got {text!r}")
    return values


def add_parser(subparsers):
    from models.glm5.attention_modes import ATTENTION_MODES, DEFAULT_ATTENTION
    from serving.datasets import DATASETS

    p = subparsers.add_parser("bench-serve", help="serving benchmark: TTFT, TPOT, ITL, throughput (vLLM's metrics)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--offline", action="store_true", help="drive the Engine in this process")
    p.add_argument("--base-url", "--url", metavar="URL",
                   help="benchmark a running OpenAI-compatible server instead (profiling/bench_serve_http.py)")
    p.add_argument("--model", help="with --base-url: the model id (default: the server's first)")
    p.add_argument("--max-concurrency", type=positive_int, help="with --base-url: requests in flight at most")
    p.add_argument("--api-key", default=os.environ.get("GLM5_LAB_API_KEY"), help="with --base-url: a bearer token")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=DEFAULT_PRESETS, help="configuration preset (default tiny)")
    src.add_argument("--checkpoint", metavar="DIR", help="an HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--attn", choices=sorted(ATTENTION_MODES), default=DEFAULT_ATTENTION)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    add_quantization_arg(p)
    g = p.add_argument_group("workload (vLLM's dataset flags; defaults scaled down for a CPU)")
    g.add_argument("--dataset", choices=DATASETS, default="random")
    g.add_argument("--num-prompts", type=positive_int, default=32)
    g.add_argument("--random-input-len", type=length_range, default=(32, 512), metavar="N|LO-HI",
                   help="prompt lengths, uniform over LO-HI or N*(1 +- range ratio) (default 32-512)")
    g.add_argument("--random-output-len", type=length_range, default=(8, 64), metavar="N|LO-HI",
                   help="output lengths (max_tokens), as above (default 8-64)")
    g.add_argument("--random-range-ratio", type=ratio, default=0.0,
                   help="with a single N: lengths uniform over [N(1-r), N(1+r)]")
    g.add_argument("--prefix-repetition-prefix-len", type=positive_int, default=128)
    g.add_argument("--prefix-repetition-suffix-len", type=positive_int, default=32)
    g.add_argument("--prefix-repetition-num-prefixes", type=positive_int, default=4)
    g.add_argument("--prefix-repetition-output-len", type=positive_int, default=16)
    g.add_argument("--prefix-repetition-distinct", action="store_true",
                   help="every request its own prefix (same lengths): the 0%% hit-rate baseline")
    g.add_argument("--request-rate", type=positive_float, default=float("inf"),
                   help="requests per second (default inf: all at once)")
    g.add_argument("--burstiness", type=positive_float, default=1.0,
                   help="gamma shape of the arrival intervals: 1 = Poisson, < 1 burstier")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (vLLM's bench default)")
    g.add_argument("--num-warmups", type=nonnegative_int, default=1,
                   help="untimed requests first (random tokens, so the prefix cache learns nothing)")
    g.add_argument("--metric-percentiles", type=percentiles, default=[99.0], metavar="P1,P2",
                   help="percentiles reported (default 99)")
    g.add_argument("--seed", type=int, default=0)
    e = p.add_argument_group("engine")
    e.add_argument("--max-num-seqs", type=positive_int, default=32)
    e.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    kv = e.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-memory", metavar="SIZE", help="cache memory, e.g. 2GiB (the engine's default if unset)")
    kv.add_argument("--num-pages", type=positive_int, help="cache size in pages instead of bytes")
    e.add_argument("--page-size", type=positive_int, default=64)
    e.add_argument("--enable-prefix-caching", action="store_true")
    e.add_argument("--speculative", action="store_true", help="MTP drafts for greedy requests (docs/SERVING.md)")
    e.add_argument("--policy", choices=["continuous", "static", "static_unpadded"], default="continuous")
    e.add_argument("--long-prefill-token-threshold", type=nonnegative_int, default=0)
    p.add_argument("--out", metavar="DIR", help="output folder (default runs/bench-serve-<dataset>-<time>)")
    p.set_defaults(parser=p)
    return p


def _lengths(value, ratio_: float) -> tuple[int, int]:
    if isinstance(value, tuple):
        return value
    return max(1, int(value * (1 - ratio_))), int(value * (1 + ratio_))


def _check(args) -> None:
    if args.offline == bool(args.base_url):
        raise UsageError("bench-serve needs --offline (the engine in this process) or --base-url URL "
                         "(a running server), one of them")
    if args.base_url and args.quantization:
        raise UsageError("--quantization applies to --offline (the engine in this process); a server is quantised "
                         "where it starts: glm5-lab serve --quantization ...")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.random_range_ratio and isinstance(args.random_input_len, tuple) and \
            isinstance(args.random_output_len, tuple):
        raise UsageError("--random-range-ratio applies to a single length N, not to LO-HI ranges")


def max_request_tokens(args) -> int:
    if args.dataset == "random":
        return _lengths(args.random_input_len, args.random_range_ratio)[1] + \
            _lengths(args.random_output_len, args.random_range_ratio)[1]
    return args.prefix_repetition_prefix_len + args.prefix_repetition_suffix_len + args.prefix_repetition_output_len


def make_requests(args, vocab_size: int):
    from serving import datasets

    if args.dataset == "random":
        return datasets.random_requests(
            args.num_prompts, input_len=_lengths(args.random_input_len, args.random_range_ratio),
            output_len=_lengths(args.random_output_len, args.random_range_ratio), vocab_size=vocab_size,
            seed=args.seed)
    return datasets.prefix_repetition_requests(
        args.num_prompts, prefix_len=args.prefix_repetition_prefix_len, suffix_len=args.prefix_repetition_suffix_len,
        num_prefixes=args.prefix_repetition_num_prefixes, output_len=args.prefix_repetition_output_len,
        vocab_size=vocab_size, seed=args.seed, distinct_prefixes=args.prefix_repetition_distinct)


def engine_kwargs(args) -> dict:
    kw = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              page_size=args.page_size, enable_prefix_caching=args.enable_prefix_caching, policy=args.policy,
              long_prefill_token_threshold=args.long_prefill_token_threshold, speculative=args.speculative)
    if args.kv_cache_memory is not None:
        kw["kv_cache_memory"] = args.kv_cache_memory
    if args.num_pages is not None:
        kw["num_pages"] = args.num_pages
    return kw


def warm_up(engine, requests, num: int, vocab_size: int, seed: int) -> None:
    """Untimed requests the first prompt's length, random tokens (nothing the dataset shares)."""
    import numpy as np

    from serving.params import SamplingParams

    rng = np.random.default_rng(seed + 1_000_003)
    for i in range(num):
        ids = rng.integers(0, vocab_size, size=requests[0].prompt_len).tolist()
        engine.add_request(f"warmup-{i}", ids, SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()


def bench_and_report(engine, requests, *, out_dir: str, config: dict, request_rate: float, burstiness: float = 1.0,
                     seed: int = 0, temperature: float = 0.0, metric_percentiles=(99.0,),
                     progress: bool = True) -> dict:
    """Runs the benchmark on `engine` (anything with Engine's add_request/step/
    has_unfinished_requests/stats), prints the table, writes result.json,
    result.txt and latency.png under out_dir; returns the result dict."""
    from serving.bench_metrics import compute_metrics, format_table
    from serving.benchmark import run_offline

    distribution = "Poisson process" if burstiness == 1.0 else "Gamma distribution"
    print(f"Traffic request rate: {request_rate}\nBurstiness factor: {burstiness} ({distribution})", flush=True)
    t0 = time.perf_counter()
    records = run_offline(engine, requests, request_rate=request_rate, seed=seed, burstiness=burstiness,
                          temperature=temperature, progress=progress)
    duration = time.perf_counter() - t0          # vLLM's: the wall clock of the whole run
    metrics = compute_metrics(records, duration_s=duration, percentiles=metric_percentiles)
    stats = dict(engine.stats())
    table = format_table(metrics, extra={k: float(v) if isinstance(v, float) else v for k, v in stats.items()})
    print(table, flush=True)
    result = {"date": time.strftime("%Y%m%d-%H%M%S"), "config": config, "engine_stats": stats, **metrics,
              "input_lens": [r.prompt_len for r in records], "output_lens": [r.output_len for r in records],
              "ttfts": [r.ttft if r.success else None for r in records],
              "itls": [r.itl for r in records], "finish_reasons": [r.finish_reason for r in records],
              "num_cached_tokens": [r.num_cached_tokens for r in records]}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out_dir, "result.txt"), "w") as f:
        f.write(table + "\n")
    latency_plot(records, os.path.join(out_dir, "latency.png"), title=config.get("title", "bench-serve"))
    print(f"[glm5-lab bench-serve] wrote {out_dir}/result.json, result.txt, latency.png", flush=True)
    return result


def latency_plot(records, path: str, title: str) -> None:
    """Two CDFs: TTFT per request and ITL per token gap, in ms, with p50 / p99 marked."""
    import matplotlib

    matplotlib.use("Agg")   # files only: no display on a CI or GPU box
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in records if r.success]
    series = (("TTFT", [r.ttft * 1e3 for r in ok]), ("ITL", [x * 1e3 for r in ok for x in r.itl]))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, (name, values) in zip(axes, series):
        if values:
            v = np.sort(np.asarray(values))
            ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post")
            for q, style in ((50, ":"), (99, "--")):
                ax.axvline(np.percentile(v, q), color="gray", linestyle=style, label=f"p{q} {np.percentile(v, q):.1f}")
            ax.legend(loc="lower right", fontsize=8)
        else:
            ax.text(0.5, 0.5, f"no {name} values", ha="center", transform=ax.transAxes)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of " + ("requests" if name == "TTFT" else "token gaps"))
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    import torch

    from . import profile_cmd

    _check(args)
    if args.base_url:
        from . import bench_serve_http
        return bench_serve_http.run(args)
    device = profile_cmd._device(args)
    dtype = profile_cmd.DTYPES[args.dtype] if args.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    cfg = profile_cmd._config(args)
    need = max_request_tokens(args)
    if need > cfg.max_position_embeddings:
        raise UsageError(f"the longest request ({need} prompt + output tokens) exceeds the model's "
                         f"max_position_embeddings ({cfg.max_position_embeddings}); shorten the dataset's lengths")
    model_name = args.checkpoint or args.preset or "tiny"
    check_quantization(args, device)
    profile_cmd._check_fits(cfg, device, dtype, model_name)
    try:
        from serving.engine import Engine
    except ImportError as e:
        raise UsageError(f"--offline needs serving.engine, which this checkout cannot import ({e})") from None
    from models.glm5 import GLM5ForCausalLM

    print(f"[glm5-lab bench-serve] building {model_name} (attn={args.attn}) on {device}, {dtype}", flush=True)
    torch.manual_seed(args.seed)
    if args.checkpoint:
        model = GLM5ForCausalLM.from_pretrained(args.checkpoint, attn=args.attn)
    else:
        model = GLM5ForCausalLM(cfg, attn=args.attn)
    model = model.to(device=device, dtype=dtype).eval()
    quantization = quantize_for(args, model, device)
    try:
        engine = Engine(model, **engine_kwargs(args))
    except (ValueError, TypeError) as e:
        raise UsageError(f"engine arguments: {e}") from None
    requests = make_requests(args, cfg.vocab_size)
    if args.num_warmups:
        print(f"[glm5-lab bench-serve] {args.num_warmups} warm-up request(s)", flush=True)
        warm_up(engine, requests, args.num_warmups, cfg.vocab_size, args.seed)
    stem = os.path.basename(model_name.rstrip("/"))
    out = args.out or os.path.join("runs", f"bench-serve-{args.dataset}-{time.strftime('%Y%m%d-%H%M%S')}")
    config = {k: v for k, v in vars(args).items() if k not in ("parser",)}
    config.update(model=stem, device=str(device), dtype=str(dtype).replace("torch.", ""), quantization=quantization,
                  title=f"{stem} {args.attn} {args.dataset}" + (f" {quantization}" if quantization else "")
                  + f", {args.num_prompts} prompts at {args.request_rate} req/s")
    bench_and_report(engine, requests, out_dir=out, config=config, request_rate=args.request_rate,
                     burstiness=args.burstiness, seed=args.seed, temperature=args.temperature,
                     metric_percentiles=args.metric_percentiles)
    return 0
