"""GLM5ForCausalLM against transformers' GlmMoeDsaForCausalLM on this CPU:
prefill time and peak memory, decode tokens per second, same weights, fp32.

Each measurement runs in a fresh process (peak RSS is per process), on one
checkpoint written once by transformers (`--preset small` by default, random
weights with std 1/sqrt(fan_in)). Ratios are taken within one run.

    python bench/model_vs_transformers.py --prefill 8192 --decode-context 8192 --big-prefill 32768
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def write_checkpoint(preset_name: str, path: str, seed: int = 0, **changes) -> None:
    import transformers

    from models.glm5 import preset
    config = preset(preset_name).replace(**changes)
    torch.manual_seed(seed)
    hf = transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(**config.to_hf_dict()))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    hf.save_pretrained(path)


def _tokens(n: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(1))


def measure(impl: str, task: str, ckpt: str, n: int, steps: int, chunk: int) -> dict:
    """Runs in the child: one (impl, task) measurement, returns seconds and peak RSS."""
    from glm5_ops.memory import peak_rss_bytes, reset_peak_rss
    torch.set_grad_enabled(False)
    if impl == "ours":
        from models.glm5 import GLM5ForCausalLM
        model = GLM5ForCausalLM.from_pretrained(ckpt, verbose=False)
    else:
        import transformers
        model = transformers.GlmMoeDsaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = _tokens(n, model.config.vocab_size)
    reset_peak_rss()
    base = peak_rss_bytes()
    t0 = time.perf_counter()
    if impl == "ours":
        cache = model.new_cache(1, n + steps + 1)
        logits, _ = model.prefill(ids, cache, chunk=chunk)
    else:
        from transformers import DynamicCache
        cache = DynamicCache(config=model.config)
        logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    prefill_s = time.perf_counter() - t0
    result = {"impl": impl, "task": task, "n": n, "prefill_s": prefill_s,
              "prefill_peak_bytes": peak_rss_bytes() - base, "process_peak_bytes": peak_rss_bytes()}
    if task == "decode":
        nxt = logits.argmax(-1)[:, None]
        t0 = time.perf_counter()
        for _ in range(steps):
            if impl == "ours":
                logits = model(nxt, cache)[:, -1]
            else:
                logits = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1]
            nxt = logits.argmax(-1)[:, None]
        result["decode_tok_s"] = steps / (time.perf_counter() - t0)
    return result


def run_child(*args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *map(str, args)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout)[-600:], "args": args}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prefill", type=int, default=8192, help="0: skip")
    ap.add_argument("--decode-context", type=int, default=8192, help="0: skip")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--big-prefill", type=int, default=32768, help="ours only (0: skip)")
    ap.add_argument("--chunk", type=int, default=2048, help="our prefill chunk")
    ap.add_argument("--index-topk", type=int, help="override the preset's index_topk (a runtime choice, "
                    "not a weight: both sides read it from config.json)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        impl, task, ckpt, n, steps, chunk = args.child
        print(json.dumps(measure(impl, task, ckpt, int(n), int(steps), int(chunk))))
        return 0
    results = []
    with tempfile.TemporaryDirectory() as ckpt:
        changes = {"index_topk": args.index_topk} if args.index_topk else {}
        print(f"[bench] writing a random {args.preset} checkpoint {changes or ''}", flush=True)
        write_checkpoint(args.preset, ckpt, **changes)
        # Flush the new checkpoint to disk now: else the kernel writes its ~1.6 GB back
        # (30 s after the write) in the middle of the first measurement, ours.
        os.sync()
        impls = ["ours"] + ([] if args.skip_transformers else ["transformers"])
        plan = [(impl, "prefill", args.prefill, 0) for impl in impls if args.prefill]
        plan += [(impl, "decode", args.decode_context, args.decode_steps) for impl in impls
                 if args.decode_context and args.decode_steps]
        if args.big_prefill:
            plan.append(("ours", "prefill", args.big_prefill, 0))
        for impl, task, n, steps in plan:
            print(f"[bench] {impl} {task} n={n} ...", flush=True)
            r = run_child(impl, task, ckpt, n, steps, args.chunk)
            print(f"[bench]   {r}", flush=True)
            results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print_table(results)
    return 0


def print_table(results) -> None:
    def find(impl, task, n):
        return next((r for r in results if r.get("impl") == impl and r.get("task") == task and r.get("n") == n), None)
    gib = 2.0 ** 30
    print("\n| measurement | ours | transformers | ratio |\n|---|---|---|---|")
    for r in results:
        if r.get("impl") != "ours" or "error" in r:
            continue
        other = find("transformers", r["task"], r["n"])
        if r["task"] == "prefill":
            row = f"| prefill {r['n']} tokens: time | {r['prefill_s']:.2f} s |"
            row += f" {other['prefill_s']:.2f} s | {other['prefill_s'] / r['prefill_s']:.1f}x faster |" if other \
                else " - | - |"
            print(row)
            mem = f"| prefill {r['n']} tokens: peak RSS added | {r['prefill_peak_bytes'] / gib:.2f} GiB " \
                  f"(process {r['process_peak_bytes'] / gib:.2f}) |"
            mem += (f" {other['prefill_peak_bytes'] / gib:.2f} GiB | "
                    f"{r['prefill_peak_bytes'] / max(other['prefill_peak_bytes'], 1):.3f} of it |") if other \
                else " - | - |"
            print(mem)
        else:
            row = f"| decode at {r['n']} context: tokens/s | {r['decode_tok_s']:.2f} |"
            row += f" {other['decode_tok_s']:.2f} | {r['decode_tok_s'] / other['decode_tok_s']:.1f}x |" if other \
                else " - | - |"
            print(row)
    for r in results:
        if "error" in r:
            print(f"error in {r['args'][:2]}: {r['error']}")


if __name__ == "__main__":
    sys.exit(main())
