"""GLM-5 side by side with llama.cpp (issue 23): agreement of logits and speed.

llama.cpp is fetched from the package registry (llama-cpp-python's sdist vendors
it) and built in a work folder outside the repository, once (bench/llamacpp/build.py).
One random-weight checkpoint is written by transformers with the lab's GLM
tokenizer, converted to an F32 GGUF by llama.cpp's converter, and read by all
three engines. Exits 2 with the reason when llama.cpp cannot be built here.

    python bench/llamacpp_compare.py agreement                    # tiny-sized, ~1 min
    python bench/llamacpp_compare.py agreement --preset small --index-topk 256 --lengths 200,700
    python bench/llamacpp_compare.py prepare                      # checkpoint + F32/Q8_0 GGUFs, once
    python bench/llamacpp_compare.py speed --prefill 512 --depths 0   # fp32 vs F32 and int8 vs Q8_0
    python bench/llamacpp_report.py                               # table into RESULTS.md, plot

Speed runs are split one command per size (bench/RESULTS.md lists them) so that each
stays short enough to run on a quiet machine; every ratio comes from one run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from llamacpp.build import LlamaCppUnavailable, build  # noqa: E402

# llama.cpp's GLM_DSA rotates indexer q/k by a Hadamard matrix of at least 64x64,
# so index_head_dim must be a multiple of 64 (tiny's 16 fails a GGML_ASSERT there).
AGREEMENT_TINY = dict(index_head_dim=64)


def agreement_metrics(a: np.ndarray, ref: np.ndarray) -> dict:
    """Top-1 agreement fraction, worst and median relative difference (max |a - ref|
    over the vocabulary, divided by the largest |ref|) and the fraction of positions
    within 1e-3 of [positions, vocab] logits. Near-ties in the discrete choices (the
    indexer's top-k, the router's experts) flip at a few positions between any two
    fp32 implementations, so the worst case alone says little; the fraction says how many.
    first_off: the first position off by more than 1e-3 (-1: none). A flip at position p
    changes p's keys and values in every later layer, so every position after it differs
    too: the positions within 1e-3 are mostly those before first_off."""
    a, ref = np.asarray(a, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if a.shape != ref.shape or a.ndim != 2:
        raise ValueError(f"logits must be two [positions, vocab] arrays of one shape, got {a.shape} and {ref.shape}")
    scale = np.abs(ref).max()
    if scale == 0:
        raise ValueError("reference logits are all zero")
    rel = np.abs(a - ref).max(-1) / scale
    off = np.flatnonzero(rel > 1e-3)
    return {"top1": float((a.argmax(-1) == ref.argmax(-1)).mean()), "worst_rel": float(rel.max()),
            "median_rel": float(np.median(rel)), "within_1e-3": float((rel <= 1e-3).mean()),
            "first_off": int(off[0]) if off.size else -1}


def _config(preset_name: str, index_topk: int | None):
    from models.glm5 import preset
    config = preset(preset_name)
    changes = dict(AGREEMENT_TINY) if preset_name == "tiny" else {}
    if index_topk:
        changes["index_topk"] = index_topk
    config = config.replace(**changes)
    if config.index_head_dim % 64:
        raise ValueError(f"llama.cpp needs index_head_dim % 64 == 0; preset {preset_name!r} has {config.index_head_dim}")
    return config


def _prepare(lc, config, work: str) -> tuple[str, str]:
    from llamacpp.checkpoint import write_checkpoint
    from llamacpp.convert import convert_to_gguf
    ckpt = os.path.join(work, "ckpt")
    print(f"[compare] writing a random checkpoint ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"index_topk {config.index_topk}) with transformers", flush=True)
    write_checkpoint(config, ckpt)
    return ckpt, convert_to_gguf(lc, ckpt, os.path.join(work, "model-f32.gguf"), "f32")


def run_agreement(lc, args) -> list[dict]:
    import transformers

    from llamacpp.logits import llamacpp_logits
    from models.glm5 import GLM5ForCausalLM
    config = _config(args.preset, args.index_topk)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        ckpt, gguf = _prepare(lc, config, work)
        ours = GLM5ForCausalLM.from_pretrained(ckpt, verbose=False).eval()
        hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        for n in args.lengths:
            ids = torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
            print(f"[compare] {n} tokens (index_topk {config.index_topk}): llama.cpp ...", flush=True)
            lcpp = llamacpp_logits(lc, gguf, ids[0].numpy(), threads=args.threads, flash_attn=args.flash_attn)
            print("[compare]   ours, transformers ...", flush=True)
            with torch.no_grad():
                mine = ours(ids)[0].float().numpy()
                theirs = hf(ids).logits[0].float().numpy()
            for pair, a, ref in (("llama.cpp vs transformers", lcpp, theirs), ("llama.cpp vs ours", lcpp, mine),
                                 ("ours vs transformers", mine, theirs)):
                rows.append({"tokens": n, "index_topk": config.index_topk, "pair": pair, **agreement_metrics(a, ref)})
                print(f"[compare]   {rows[-1]}", flush=True)
    print("\n| tokens | index_topk | pair | top-1 agrees | positions within 1e-3 | first position off | "
          "worst rel. diff | median rel. diff |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['index_topk']} | {r['pair']} | {r['top1']:.4f} | {r['within_1e-3']:.4f} | "
              f"{r['first_off'] if r['first_off'] >= 0 else '-'} | {r['worst_rel']:.2e} | "
              f"{r['median_rel']:.2e} |")
    return rows


def _speed_models(lc, args) -> dict:
    from llamacpp.speed import prepared_models
    config = _config(args.preset, args.index_topk)
    name = f"{args.preset}-topk{config.index_topk}-seed0"
    return prepared_models(lc, config, name, args.precision)


def run_speed(lc, args) -> dict:
    """Measures, prints the table, and returns the run's record (rows plus what ran where)."""
    from llamacpp.speed import run_speed as measure_speed
    from llamacpp_report import speed_table
    models = _speed_models(lc, args)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    rows = measure_speed(lc, models, precisions=args.precision, prefill=args.prefill, depths=args.depths,
                         threads=args.threads, steps=args.decode_steps, chunk=args.chunk, engines=args.engine,
                         compile=args.compile, repeat=args.repeat)
    record = {"started": started, "command": " ".join(["python", "bench/llamacpp_compare.py", *sys.argv[1:]]),
              "preset": args.preset, "threads": args.threads, "torch": torch.__version__,
              "cpu": _cpu_name(), "rows": rows}
    try:
        print("\n" + speed_table(rows))
    except Exception as e:      # the rows are measured: a table bug must not lose them (main writes them next)
        print(f"[compare] could not print the table ({type(e).__name__}: {e}); the rows are in the JSON", flush=True)
    return record


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def _precisions(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    from llamacpp.speed import PRECISIONS
    bad = [v for v in values if v not in PRECISIONS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(PRECISIONS)}; got {text!r}")
    return values


def _engines(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in ("llama.cpp", "ours") for v in values):
        raise argparse.ArgumentTypeError(f"expected llama.cpp, ours or llama.cpp,ours; got {text!r}")
    return values


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("agreement", "speed", "prepare", "build"),
                    help="prepare: build llama.cpp and write the speed checkpoint and GGUFs (untimed, once)")
    ap.add_argument("--preset", default=None, help="tiny (agreement default) or small (speed default)")
    ap.add_argument("--index-topk", type=int, help="override the preset's index_topk (a config value, not a weight)")
    ap.add_argument("--lengths", type=_ints, default=[12, 40], help="agreement prompt lengths (tiny: index_topk 16)")
    ap.add_argument("--prefill", type=_ints, default=[512], help="speed: prefill sizes (llama-bench pp)")
    ap.add_argument("--depths", type=_ints, default=[0], help="speed: decode depths (llama-bench tg @ d)")
    ap.add_argument("--precision", type=_precisions, default=["fp32", "int8"],
                    help="speed: fp32 (against llama.cpp F32), int8 (weight-only, default skip list, against "
                         "Q8_0), int8_head (the LM head int8 too, as Q8_0 does: the like-for-like pair)")
    ap.add_argument("--engine", type=_engines, default=["llama.cpp", "ours"],
                    help="speed: llama.cpp,ours (default: both, back to back) or one of them, for a size where "
                         "one engine alone fills a quiet run")
    ap.add_argument("--decode-steps", type=int, default=128, help="speed: tokens per decode run (tg128)")
    ap.add_argument("--chunk", type=int, default=2048, help="our prefill chunk")
    ap.add_argument("--compile", action="store_true",
                    help="speed: our decode steps through model.compile_decode() (torch.compile; prefill stays eager)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="speed: measure each point this many times, the engines alternating; the report "
                         "gives each engine's median (this host's speed swings by up to 1.8x minute to minute)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flash-attn", type=int, default=0, choices=(-1, 0, 1), help="llama.cpp logits (agreement)")
    ap.add_argument("--llamacpp-home", help="work folder for llama.cpp's source and build (default: "
                    "$GLM5_LLAMACPP_HOME or ~/.cache/glm5-lab/llamacpp)")
    ap.add_argument("--json", help="write the results here (speed default: runs/llamacpp-speed/<time>.json)")
    args = ap.parse_args(argv)
    for name in ("threads", "decode_steps", "chunk", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.preset = args.preset or ("tiny" if args.what == "agreement" else "small")
    try:
        lc = build(args.llamacpp_home)
        if args.what == "build":
            return 0
        if args.what == "prepare":
            print(f"[compare] prepared: {_speed_models(lc, args)}", flush=True)
            return 0
        torch.set_num_threads(args.threads)
        result = run_agreement(lc, args) if args.what == "agreement" else run_speed(lc, args)
    except LlamaCppUnavailable as e:
        print(f"[compare] llama.cpp unavailable: {e}", file=sys.stderr, flush=True)
        return 2
    path = args.json or (os.path.join(ROOT, "runs", "llamacpp-speed", time.strftime("%Y%m%d-%H%M%S") + ".json")
                         if args.what == "speed" else None)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"[compare] results -> {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
