"""Decode linear layers on the CPU: how close to the memory bandwidth each
kernel streams the weights (bench/RESULTS.md, "Decode linear layers").

    python bench/gemv_bench.py --threads 2 [--skip-model] [--only moe]

1. Read bandwidth: W.sum() over the same fp32 weight sets the kernels read.
2. M=1 on the small preset's real shapes and the shapes of issue 23's probe:
   F.linear and glm5_ops.gemv in fp32 and bf16, glm5_ops.int8_linear; GB/s of
   the weight bytes (int8: codes + scales) and the fraction of (1). Several
   weight sets are cycled so no call finds its weights in the 32 MiB L3.
3. Rows sweep (the threshold in glm5_ops/plan.py): F.linear vs gemv, M = 1..32.
4. fused_moe_int8 decode, T = 1, 4, 16: GB/s of the chosen experts' int8 bytes, a fresh
   routing each call, cycled past twice the L3; the experts in plain rows and, where the
   model keeps them so (glm5_ops.int8.packed_experts_pay), packed, the two alternating.
   --by-bandwidth SECONDS: many short rounds instead, grouped by the round's sum.
5. Model: decode tokens/s of the preset at --context tokens, batch 1, fp32 / bf16 /
   int8_weight_only (DEFAULT_SKIP) and "int8 +head" (the LM head int8 too, the
   other key layers kept), with the linear layers on F.linear ("before": plan's
   GEMV_MAX_ROWS emptied) and on gemv ("after"), all in this one run. With
   --compile, each model's eager gemv steps against its compile_decode() steps
   (F.linear left out: the plan's rows are read while tracing, so toggling them
   would recompile).
Pages: (2) and (3) read their weight sets from torch's allocator (4 KiB pages), each
kernel and its sum alike; (4), its bandwidth sum and (5) from huge pages, as the lab's
models keep their weights (glm5_ops/memory.py).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import glm5_ops  # noqa: E402
from glm5_ops import plan  # noqa: E402
from glm5_ops.int8 import pack_rows, packed_experts_pay  # noqa: E402
from glm5_ops.memory import on_huge_pages, weights_on_huge_pages  # noqa: E402
from models.glm5 import DEFAULT_SKIP, GLM5ForCausalLM, preset, quantize  # noqa: E402

L3 = 32 * 2**20


def median_time(fn, reps, rounds=5):
    fn()
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        ts.append((time.perf_counter() - t0) / reps)
    return statistics.median(ts)


def cycling(fn, items):
    state = [0]

    def run():
        state[0] = (state[0] + 1) % len(items)
        return fn(items[state[0]])
    return run


def shapes(c):
    real = {"q_a_proj": (c.q_lora_rank, c.hidden_size),
            "q_b_proj": (c.num_attention_heads * c.qk_head_dim, c.q_lora_rank),
            "kv_a_proj": (c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size),
            "o_proj": (c.hidden_size, c.num_attention_heads * c.v_head_dim),
            "mlp gate/up": (c.intermediate_size, c.hidden_size), "mlp down": (c.hidden_size, c.intermediate_size),
            "lm_head": (c.vocab_size, c.hidden_size)}
    probe = {"probe": (6144, 2048), "probe ": (2048, 6144), "probe  ": (16384, 1024), "probe   ": (75776, 1024)}
    return {**real, **probe}


def bench_ops(a):
    c = preset(a.preset)
    print("| layer | N x K | sum GB/s | F.linear fp32 | gemv fp32 | F.linear bf16 | gemv bf16 | int8_linear |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (N, K) in shapes(c).items():
        copies = max(2, 2 * L3 // (N * K * 4) + 1)
        wf = [torch.randn(N, K) * K ** -0.5 for _ in range(copies)]
        wb = [w.bfloat16() for w in wf]
        wq = [glm5_ops.quantize_int8(w) for w in wf]
        x, xb = torch.randn(1, K), torch.randn(1, K).bfloat16()
        reps = max(3, int(2e8 // (N * K * 4)))
        t = {"sum": median_time(cycling(lambda w: w.sum(), wf), reps),
             "lin32": median_time(cycling(lambda w: F.linear(x, w), wf), reps),
             "gemv32": median_time(cycling(lambda w: glm5_ops.gemv(x, w), wf), reps),
             "lin16": median_time(cycling(lambda w: F.linear(xb, w), wb), reps),
             "gemv16": median_time(cycling(lambda w: glm5_ops.gemv(xb, w), wb), reps),
             "int8": median_time(cycling(lambda q: glm5_ops.int8_linear(x, *q), wq), reps)}
        bw = N * K * 4 / t["sum"] / 1e9
        nbytes = {"lin32": N * K * 4, "gemv32": N * K * 4, "lin16": N * K * 2, "gemv16": N * K * 2,
                  "int8": N * K + N * 4}
        cells = [f"{nbytes[k] / t[k] / 1e9:.1f} ({nbytes[k] / t[k] / 1e9 / bw:.0%})" for k in nbytes]
        print(f"| {name.strip()} | {N}x{K} | {bw:.1f} | " + " | ".join(cells) + " |", flush=True)
        del wf, wb, wq


def bench_rows(a):
    c = preset(a.preset)
    N, K = c.intermediate_size, c.hidden_size
    print(f"\nrows sweep [{N}x{K}], us per call (F.linear / gemv):")
    print("| M | fp32 F.linear | fp32 gemv | bf16 F.linear | bf16 gemv |\n|---|---|---|---|---|")
    copies = 2 * L3 // (N * K * 4) + 1
    wf = [torch.randn(N, K) * K ** -0.5 for _ in range(copies)]
    wb = [w.bfloat16() for w in wf]
    for M in (1, 2, 4, 8, 12, 16, 24, 32):
        x = torch.randn(M, K)
        xb = x.bfloat16()
        ts = [median_time(cycling(f, ws), 20) * 1e6 for f, ws in
              ((lambda w: F.linear(x, w), wf), (lambda w: glm5_ops.gemv(x, w), wf),
               (lambda w: F.linear(xb, w), wb), (lambda w: glm5_ops.gemv(xb, w), wb))]
        print(f"| {M} | " + " | ".join(f"{v:.0f}" for v in ts) + " |", flush=True)


def bench_moe(a, bw):
    """bw(): the read bandwidth now, GB/s."""
    c = preset(a.preset)
    E, I, D, k = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size, c.num_experts_per_tok
    layouts = {"plain": []}
    if packed_experts_pay(torch.device("cpu"), D, I):
        layouts["packed"] = []
    for _ in range(sum(t == "sparse" for t in c.mlp_layer_types)):
        wgu, sgu = glm5_ops.quantize_int8(torch.randn(E, 2 * I, D) * D ** -0.5)
        wd, sd = glm5_ops.quantize_int8(torch.randn(E, D, I) * I ** -0.5)
        for name, layers in layouts.items():   # as the model keeps its experts: on huge pages
            pack = pack_rows if name == "packed" else (lambda w: w)
            layers.append(tuple(map(on_huge_pages, (pack(wgu), sgu, pack(wd), sd))))
    expert_bytes = 3 * I * D + 4 * (2 * I + D)
    for T in (1, 4, 16):
        per_call = min(E, T * k) * expert_bytes
        calls = routings(T, E, k, len(layouts["plain"]), expert_bytes)
        x, w = torch.randn(T, D), torch.rand(T, k)
        n_exp = statistics.mean(n for _, _, n in calls)
        nbytes = n_exp * expert_bytes
        reps = max(len(calls), int(2e8 // per_call))
        runs = {name: cycling(lambda c_, L=layers, p=name == "packed": glm5_ops.fused_moe_int8(
            x, *L[c_[0]], w, c_[1], packed=p), calls) for name, layers in layouts.items()}
        # The host's bandwidth drifts (24-60 GB/s for the same sum within minutes), so
        # each round measures it right before the kernels: the fraction is per round.
        if a.by_bandwidth:
            _moe_by_bandwidth(a, T, runs, nbytes, bw)
            continue
        ts, fracs, bws = {n: [] for n in runs}, {n: [] for n in runs}, []
        for r in range(a.rounds):
            bw_r = bw()
            bws.append(bw_r)
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):   # alternating order
                t = median_time(runs[name], reps, rounds=1)
                ts[name].append(t), fracs[name].append(nbytes / t / 1e9 / bw_r)
        for name in runs:
            t = statistics.median(ts[name])
            print(f"fused_moe_int8 T={T} {name} ({n_exp:.1f} experts, {len(calls)} routings cycled): "
                  f"{t * 1e6:.0f} us, {nbytes / t / 1e9:.1f} GB/s, {statistics.median(fracs[name]):.0%} of the "
                  f"bandwidth measured before each of {a.rounds} rounds (median; {min(fracs[name]):.0%}-"
                  f"{max(fracs[name]):.0%}; bandwidth {min(bws):.1f}-{max(bws):.1f} GB/s)", flush=True)
        if "packed" in ts:
            wins = sum(p < q for p, q in zip(ts["packed"], ts["plain"]))
            print(f"  packed / plain: {statistics.median(ts['plain']) / statistics.median(ts['packed']):.2f}x, "
                  f"packed faster in {wins} of {a.rounds} rounds", flush=True)


def routings(T, E, k, n_layers, expert_bytes):
    """[(layer, ids [T,k] int32, distinct experts)]: every call routes afresh (new ids, layers
    in turn), and enough calls that the experts they touch exceed twice the L3: with one
    fixed routing the 6 layers' chosen experts at T=1 (27.6 MB) nearly fit the 32 MiB L3."""
    g = torch.Generator().manual_seed(T)
    calls = []
    while not calls or len(calls) < n_layers or sum(n for _, _, n in calls) * expert_bytes < 2 * L3:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
        calls.append((len(calls) % n_layers, ids, int(ids.unique().numel())))
    return calls


def _moe_by_bandwidth(a, T, runs, nbytes, bw):
    """--by-bandwidth: short rounds (the sum, then each layout) for that many seconds,
    medians grouped by the round's sum: this host's bandwidth is bimodal (30-36 or
    50-64 GB/s, switching within minutes), so a fraction means something only beside
    the sum of its own round."""
    rows, end = [], time.perf_counter() + a.by_bandwidth
    reps = max(24, int(3e7 // nbytes))
    while time.perf_counter() < end:
        r = {"sum": bw()}
        for name in (list(runs) if len(rows) % 2 == 0 else list(runs)[::-1]):
            r[name] = nbytes / median_time(runs[name], reps, rounds=1) / 1e9
        rows.append(r)
    for fast in (False, True):
        sel = [r for r in rows if (r["sum"] >= a.fast_sum) == fast]
        if not sel:
            continue
        line = (f"fused_moe_int8 T={T}, {len(sel)} rounds with the sum {'>=' if fast else '<'} {a.fast_sum:g} GB/s "
                f"(median {statistics.median(r['sum'] for r in sel):.1f}):")
        for name in runs:
            line += (f" {name} {statistics.median(r[name] for r in sel):.1f} GB/s "
                     f"({statistics.median(r[name] / r['sum'] for r in sel):.0%})")
        print(line, flush=True)


def bench_model(a):
    torch.manual_seed(0)
    c = preset(a.preset)
    fp32 = GLM5ForCausalLM(c, attn="dsa").eval()
    models = {"fp32": fp32, "bf16": copy.deepcopy(fp32).to(torch.bfloat16),
              "int8": quantize(copy.deepcopy(fp32), "int8_weight_only"),
              # What the fp32 LM head of DEFAULT_SKIP costs: 131 MB of the small preset's step.
              "int8 +head": quantize(copy.deepcopy(fp32), "int8_weight_only",
                                     skip=tuple(s for s in DEFAULT_SKIP if s != "lm_head"))}
    for m in models.values():      # deepcopy and .to() leave 4 KiB pages; the lab's models are placed
        weights_on_huge_pages(m)
    ids = torch.randint(0, c.vocab_size, (1, a.context + a.steps + 2))
    caches = {}
    with torch.inference_mode():   # as the engine decodes: no autograd work per op
        for n, m in models.items():
            caches[n] = m.new_cache(1, a.context + a.steps + 8)
            m.prefill(ids[:, :a.context], caches[n])
        rows = dict(plan.GEMV_MAX_ROWS)
        compiled = {n: m.compile_decode()._decode_layers for n, m in models.items()} if a.compile else {}

        def decode(n, on, compile=False):
            def run():
                plan.GEMV_MAX_ROWS.clear()
                plan.GEMV_MAX_ROWS.update(rows if on else {})
                models[n]._decode_layers = compiled[n] if compile else None
                caches[n].truncate(a.context)
                for s in range(a.steps):
                    models[n](ids[:, a.context + s:a.context + s + 1], caches[n])
            return run
        if a.compile:   # the first call of each compiled variant compiles (untimed: each round runs f twice)
            fns = {f"{n} {'compiled' if c else 'gemv'}": decode(n, True, c) for n in models for c in (False, True)}
        else:
            fns = {f"{n} {'gemv' if on else 'F.linear'}": decode(n, on) for n in models for on in (False, True)}
        per = {k: [] for k in fns}
        for _ in range(a.rounds):
            for k, f in fns.items():
                f()
                t0 = time.perf_counter()
                f()
                per[k].append(a.steps / (time.perf_counter() - t0))
        plan.GEMV_MAX_ROWS.update(rows)
    tok = {k: statistics.median(v) for k, v in per.items()}
    print(f"\ndecode tok/s, {a.preset}, batch 1, {a.context}-token context, {a.steps} steps x {a.rounds} rounds:")
    for k, v in tok.items():
        print(f"  {k}: {v:.2f}")
    if a.compile:
        print("  " + "; ".join(f"{n} compiled / eager {tok[f'{n} compiled'] / tok[f'{n} gemv']:.2f}x" for n in models))
        for q in ("int8", "int8 +head"):
            print(f"  compiled: {q} / fp32 {tok[f'{q} compiled'] / tok['fp32 compiled']:.2f}x; {q} / bf16 "
                  f"{tok[f'{q} compiled'] / tok['bf16 compiled']:.2f}x")
        return
    f = tok["fp32 gemv"]
    print(f"  fp32 gemv / F.linear {f / tok['fp32 F.linear']:.2f}x; bf16 {tok['bf16 gemv'] / tok['bf16 F.linear']:.2f}x; "
          f"int8 / fp32 (both gemv) {tok['int8 gemv'] / f:.2f}x; int8 / bf16 {tok['int8 gemv'] / tok['bf16 gemv']:.2f}x; "
          f"int8 +head / fp32 {tok['int8 +head gemv'] / f:.2f}x")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--compile", action="store_true", help="model: eager against compile_decode() (see 5.)")
    p.add_argument("--skip-ops", action="store_true")
    p.add_argument("--by-bandwidth", type=float, default=0, metavar="SECONDS",
                   help="moe: short rounds for SECONDS per T, medians grouped by the round's sum (see 4.)")
    p.add_argument("--fast-sum", type=float, default=42, metavar="GB/S",
                   help="--by-bandwidth: rounds whose sum reads at least this are the fast group")
    p.add_argument("--only", choices=("ops", "rows", "moe", "model"), action="append",
                   help="run only these parts (repeatable; default: all but what --skip-* leaves out)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    big = on_huge_pages(torch.randn(64 * 2**20))   # the ceiling read as the weights are: on huge pages

    def read_bandwidth():
        return big.nbytes / median_time(lambda: big.sum(), 3) / 1e9
    print(f"read bandwidth (fp32 sum of 256 MiB): {read_bandwidth():.1f} GB/s\n")
    parts = set(a.only or ())
    if not parts:
        parts = ({"ops", "rows", "moe"} if not a.skip_ops else set()) | ({"model"} if not a.skip_model else set())
    for name, fn in (("ops", bench_ops), ("rows", bench_rows), ("moe", lambda a_: bench_moe(a_, read_bandwidth)),
                     ("model", bench_model)):
        if name in parts:
            fn(a)


if __name__ == "__main__":
    main()
