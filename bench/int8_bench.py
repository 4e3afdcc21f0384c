"""INT8 benchmark on the CPU, every ratio from one run (bench/RESULTS.md, "INT8").

    python bench/int8_bench.py --preset small --context 2048 --prefill 2048 --out runs/int8_bench.json

1. Ops: memory bandwidth (a large fp32 sum), int8_linear at M=1 against fp32,
   bf16 and aten's _weight_int8pack_mm; w8a8_linear at M=2048 against fp32 and
   bf16 GEMMs; fused_moe_int8 decode (T <= 16) in GB/s of int8 expert bytes and
   as a share of the measured bandwidth.
2. Model (the preset, random weights: speed does not depend on them): decode at
   batch 1 after `--context` tokens, tokens/s, for fp32, bf16, ours
   int8_weight_only (default skip; and skip=()), torchao's Int8WeightOnlyConfig
   on the linear layers when torchao imports (otherwise aten's
   _weight_int8pack_mm on the same layers, said so in the output); prefill of
   `--prefill` tokens for fp32, bf16, ours w8a8 and int8_weight_only, torchao's
   Int8DynamicActivationInt8WeightConfig when it imports.
3. Weight bytes of each model.

Timings: median over --rounds rounds, the variants interleaved within a round,
so a busy neighbour slows them alike.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import glm5_ops  # noqa: E402
from glm5_ops.memory import on_huge_pages, weights_on_huge_pages  # noqa: E402
from models.glm5 import GLM5ForCausalLM, preset, quantize  # noqa: E402
from models.glm5.quantization import Int8Experts, Int8Linear, skipped, weight_bytes, DEFAULT_SKIP  # noqa: E402


def log(msg):
    print(f"[int8-bench] {msg}", flush=True)


def timed(fn, reps: int) -> float:
    """Median seconds of fn over reps calls, after one warm-up call."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def interleaved(fns: dict, reps: int, rounds: int) -> dict:
    """{name: median seconds}, each round timing every fn once in turn."""
    per = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            per[k].append(timed(fn, reps))
    return {k: statistics.median(v) for k, v in per.items()}


# ----------------------------------------------------------------- torchao --

# What torchao (and the aten baseline) can quantise here: MLA reads kv_b_proj's
# weight as the views W_UK/W_UV, which torchao's Int8Tensor cannot give (aten.view
# raises), so it stays fp32 on their side; our "linears only" rows skip the same.
TORCHAO_SKIP = DEFAULT_SKIP + ("*.kv_b_proj",)
LINEARS_ONLY = TORCHAO_SKIP + ("*.mlp.experts",)

def torchao_quantizer():
    """(quantize_, weight-only config, dynamic W8A8 config) or the reason torchao is unusable."""
    try:
        from torchao.quantization import (Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig,
                                          quantize_)
        return quantize_, Int8WeightOnlyConfig(), Int8DynamicActivationInt8WeightConfig()
    except Exception as e:   # not installed, or built for another torch
        return f"{type(e).__name__}: {e}"


class AtenInt8Linear(nn.Module):
    """The baseline when torchao is missing: torch.ops.aten._weight_int8pack_mm, which
    torchao's weight-only int8 lowers to on the CPU. Its scales have x's dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, s = glm5_ops.quantize_int8(linear.weight.detach())
        self.register_buffer("q", q)
        self.register_buffer("s", s)
        self.bias = linear.bias

    def forward(self, x):
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), self.q, self.s.to(x.dtype))
        y = y.reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def linear_only(model, make, skip=TORCHAO_SKIP):
    """Replaces each non-skipped nn.Linear by make(linear) (the experts stay float)."""
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear) and not skipped(name, skip):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, make(m))
    return model


def placed_alike(model):
    """model, its weights where the lab keeps its own (huge pages, glm5_ops/memory.py):
    deepcopy and .to() make fresh tensors on 4 KiB pages, and torchao's Int8Tensor holds
    plain tensors (qdata, scale) that weights_on_huge_pages does not look inside. Every
    variant placed alike keeps a comparison about the kernels, not the pages."""
    weights_on_huge_pages(model)
    for mod in model.modules():
        for p in mod._parameters.values():
            if p is not None and type(p) not in (torch.Tensor, nn.Parameter) and hasattr(p, "__tensor_flatten__"):
                for name in p.__tensor_flatten__()[0]:
                    setattr(p, name, on_huge_pages(getattr(p, name)))
    return model


def set_mode(model, mode: str):
    for m in model.modules():
        if isinstance(m, (Int8Linear, Int8Experts)):
            m.mode = mode
    return model


# --------------------------------------------------------------------- ops --

def weight_only_prefill(a, c) -> dict:
    """int8_linear at M = --prefill on the preset's linear shapes (and narrower N, where
    the digits GEMM stops paying: csrc/cpu/int8_digit_gemm.h's kDigitGemmMinN) against
    dequantise + sgemm (what int8_linear did before, and torchao's weight-only does)."""
    shapes = {(n, k_) for n, k_ in [(c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size),
                                    (c.hidden_size, c.num_attention_heads * c.v_head_dim),
                                    (c.q_lora_rank, c.hidden_size), (c.hidden_size, c.moe_intermediate_size),
                                    (2 * c.moe_intermediate_size, c.hidden_size), (64, c.hidden_size),
                                    (128, c.hidden_size), (192, c.hidden_size)]}
    out = {}
    for n, k_ in sorted(shapes):
        x = torch.randn(a.prefill, k_)
        q, s = glm5_ops.quantize_int8(torch.randn(n, k_) * k_ ** -0.5)
        ts = interleaved({"int8_linear": lambda: glm5_ops.int8_linear(x, q, s),
                          "dequantise_sgemm": lambda: torch.nn.functional.linear(x, q.float() * s[:, None])},
                         reps=2, rounds=a.rounds)
        out[f"{n}x{k_}"] = {name: t * 1e3 for name, t in ts.items()}
        kernel = torch.ops.glm5.int8_prefill_kernel(k_, n)
        log(f"weight-only prefill M={a.prefill} [{n}x{k_}] ms: int8_linear {ts['int8_linear'] * 1e3:.2f}, "
            f"dequantise+sgemm {ts['dequantise_sgemm'] * 1e3:.2f} "
            f"({ts['dequantise_sgemm'] / ts['int8_linear']:.2f}x; kernel: {kernel})")
    return out


def bench_ops(a) -> dict:
    res = {}
    big = torch.randn(64 * 2**20)       # 256 MiB
    t = timed(lambda: big.sum(), 5)
    res["bandwidth_GBps"] = big.nbytes / t / 1e9
    log(f"memory bandwidth (fp32 sum of 256 MiB): {res['bandwidth_GBps']:.1f} GB/s")
    del big

    c = preset(a.preset)
    K, N = c.hidden_size, c.intermediate_size
    # Decode reads each layer's weights once per token: the M=1 timings cycle
    # through `copies` weight sets, 2x the L3 cache in int8, so no call finds its
    # weights in cache (a model's layers are distinct weights too).
    copies = max(1, 2 * a.l3_mib * 2**20 // (N * K))
    wfs = [torch.randn(N, K) * K ** -0.5 for _ in range(copies)]
    qs = [glm5_ops.quantize_int8(w) for w in wfs]
    wbs = [w.bfloat16() for w in wfs]
    wf, (q, s), wb = wfs[0], qs[0], wbs[0]
    x1 = torch.randn(1, K)

    def cycling(fn, items):
        state = {"i": 0}

        def run():
            state["i"] = (state["i"] + 1) % len(items)
            return fn(items[state["i"]])
        return run

    ts = interleaved({
        "fp32": cycling(lambda w: torch.nn.functional.linear(x1, w), wfs),
        "bf16": cycling(lambda w: torch.nn.functional.linear(x1.bfloat16(), w), wbs),
        "int8_linear": cycling(lambda qs_: glm5_ops.int8_linear(x1, *qs_), qs),
        "aten_int8pack_fp32": cycling(lambda qs_: torch.ops.aten._weight_int8pack_mm(x1, *qs_), qs),
        "aten_int8pack_bf16": cycling(lambda qs_: torch.ops.aten._weight_int8pack_mm(x1.bfloat16(), qs_[0],
                                                                                    qs_[1].bfloat16()), qs),
    }, reps=5 * copies, rounds=a.rounds)
    res["linear_M1_us"] = {k: v * 1e6 for k, v in ts.items()}
    res["int8_linear_M1_GBps"] = q.nbytes / ts["int8_linear"] / 1e9
    log(f"linear M=1 [{N}x{K}], {copies} weight sets cycled, us: "
        + ", ".join(f"{k} {v * 1e6:.0f}" for k, v in ts.items())
        + f"; int8_linear reads {res['int8_linear_M1_GBps']:.1f} GB/s")
    del wfs, wbs

    xm = torch.randn(a.prefill, K)
    xmb = xm.bfloat16()
    ts = interleaved({
        "fp32": lambda: torch.nn.functional.linear(xm, wf),
        "bf16": lambda: torch.nn.functional.linear(xmb, wb),
        "w8a8_linear": lambda: glm5_ops.w8a8_linear(xm, q, s),
        "int8_linear": lambda: glm5_ops.int8_linear(xm, q, s),
    }, reps=2, rounds=a.rounds)
    res["linear_M_prefill_ms"] = {k: v * 1e3 for k, v in ts.items()}
    log(f"linear M={a.prefill} [{N}x{K}] ms: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in ts.items()))
    res["weight_only_prefill_ms"] = weight_only_prefill(a, c)

    E, I, D, k = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size, c.num_experts_per_tok
    # As many MoE layers as the model has, cycled: 6 x 64 experts = 288 MiB in int8, far above L3.
    layers = []
    for _ in range(sum(t == "sparse" for t in c.mlp_layer_types)):
        wgu, sgu = glm5_ops.quantize_int8(torch.randn(E, 2 * I, D) * D ** -0.5)
        wd, sd = glm5_ops.quantize_int8(torch.randn(E, D, I) * I ** -0.5)
        layers.append((wgu, sgu, wd, sd))
    fp32_layers = [(l[0].float() * l[1][..., None], l[2].float() * l[3][..., None]) for l in layers[:2]]
    res["fused_moe_decode"] = {}
    for T in (1, 4, 16):
        g = torch.Generator().manual_seed(T)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
        x = torch.randn(T, D)
        w = torch.rand(T, k)
        n_exp = int(ids.unique().numel())
        nbytes = n_exp * (3 * I * D + 4 * (2 * I + D))
        ts = interleaved({"int8": cycling(lambda l: glm5_ops.fused_moe_int8(x, *l, w, ids), layers),
                          "fp32": cycling(lambda l: glm5_ops.fused_moe(x, *l, w, ids), fp32_layers)},
                         reps=4 * len(layers), rounds=a.rounds)
        gbps = nbytes / ts["int8"] / 1e9
        res["fused_moe_decode"][T] = dict(experts=n_exp, int8_us=ts["int8"] * 1e6, fp32_us=ts["fp32"] * 1e6,
                                          int8_GBps=gbps, share_of_bandwidth=gbps / res["bandwidth_GBps"])
        log(f"fused_moe decode T={T} ({n_exp} experts): int8 {ts['int8'] * 1e6:.0f} us ({gbps:.1f} GB/s, "
            f"{gbps / res['bandwidth_GBps']:.0%} of bandwidth), fp32 {ts['fp32'] * 1e6:.0f} us")
    return res


# ------------------------------------------------------------------- model --

def bench_model(a) -> dict:
    torch.manual_seed(0)
    config = preset(a.preset)
    log(f"building {a.preset} (fp32)")
    fp32 = GLM5ForCausalLM(config, attn=a.attn).eval()
    models = {"fp32": fp32, "bf16": copy.deepcopy(fp32).to(torch.bfloat16)}
    log("quantising: ours (default skip), ours (skip=())")
    models["int8"] = quantize(copy.deepcopy(fp32), "int8_weight_only")
    models["int8_all"] = quantize(copy.deepcopy(fp32), "int8_weight_only", skip=())
    tao = torchao_quantizer()
    if isinstance(tao, str):
        log(f"torchao is not importable ({tao}); baseline: aten._weight_int8pack_mm on the same linear layers")
        models["aten_int8pack_linears"] = linear_only(copy.deepcopy(fp32), AtenInt8Linear)
    else:
        quantize_, wo_cfg, dyn_cfg = tao
        m = copy.deepcopy(fp32)
        quantize_(m, wo_cfg, filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear) and not skipped(fqn, TORCHAO_SKIP))
        models["torchao_int8_wo"] = m
        m = copy.deepcopy(fp32)
        quantize_(m, dyn_cfg, filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear) and not skipped(fqn, TORCHAO_SKIP))
        models["torchao_w8a8"] = m
    models["int8_linears_only"] = quantize(copy.deepcopy(fp32), "int8_weight_only", skip=LINEARS_ONLY)
    models = {k: placed_alike(m) for k, m in models.items()}
    res = {"torchao": "ok" if not isinstance(tao, str) else tao}
    res["weight_MiB"] = {k: weight_bytes(m)["total"] / 2**20 for k, m in models.items()}
    b = weight_bytes(models["int8"])
    res["int8_quantised_layers_MiB"] = b["int8_modules"] / 2**20
    log("weight MiB: " + ", ".join(f"{k} {v:.0f}" for k, v in res["weight_MiB"].items()))

    ids = torch.randint(0, config.vocab_size, (1, a.context + a.decode_steps + 2))
    caches = {}
    with torch.no_grad():
        for dt, m in (("fp32", fp32), ("bf16", models["bf16"])):
            log(f"prefill {a.context} tokens into a {dt} cache")
            caches[dt] = m.new_cache(1, a.context + a.decode_steps + 8)
            m.prefill(ids[:, :a.context], caches[dt])

        def decode(m, cache):
            def run():
                cache.truncate(a.context)
                with torch.inference_mode():   # as the engine decodes: no autograd work per op
                    for s in range(a.decode_steps):
                        m(ids[:, a.context + s:a.context + s + 1], cache)
            return run

        names = list(models)
        fns = {n: decode(models[n], caches["bf16" if n == "bf16" else "fp32"]) for n in names}
        log(f"decode: {a.decode_steps} steps per sample, {a.rounds} rounds over {list(fns)}")
        ts = interleaved(fns, reps=1, rounds=a.rounds)
        res["decode_tok_s"] = {n: a.decode_steps / t for n, t in ts.items()}
        log("decode tokens/s: " + ", ".join(f"{k} {v:.2f}" for k, v in res["decode_tok_s"].items()))

        w8a8 = placed_alike(set_mode(quantize(copy.deepcopy(fp32), "w8a8"), "w8a8"))
        pre = {"fp32": fp32, "bf16": models["bf16"], "w8a8": w8a8, "int8": models["int8"]}
        if not isinstance(tao, str):
            pre["torchao_w8a8"] = models["torchao_w8a8"]
        x = ids[:, :a.prefill]
        log(f"prefill {a.prefill} tokens, {a.rounds} rounds over {list(pre)}")
        ts = interleaved({n: (lambda m=m: m(x, logits_to_keep=1)) for n, m in pre.items()}, reps=1, rounds=a.rounds)
        res["prefill_s"] = ts
        log("prefill s: " + ", ".join(f"{k} {v:.2f}" for k, v in ts.items()))
    d, p = res["decode_tok_s"], res["prefill_s"]
    res["ratios"] = {"decode int8 / fp32": d["int8"] / d["fp32"], "decode int8 / bf16": d["int8"] / d["bf16"],
                     "decode int8 (skip=()) / fp32": d["int8_all"] / d["fp32"],
                     "prefill fp32 / w8a8 (speed-up)": p["fp32"] / p["w8a8"],
                     "prefill bf16 / w8a8 (speed-up)": p["bf16"] / p["w8a8"]}
    for k, v in res["ratios"].items():
        log(f"{k}: {v:.2f}x")
    return res


def write_results(res: dict, out: str | None, log=log) -> None:
    """The run's results as JSON at `out` (nothing when None)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=1, default=str))
        log(f"wrote {out}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--attn", default="dsa")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--l3-mib", type=int, default=32, help="last-level cache size, for the cache-cold op timings")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-model", action="store_true", help="ops only")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    res = {"args": vars(a), "ops": bench_ops(a)}
    if not a.skip_model:
        res["model"] = bench_model(a)
    write_results(res, a.out)
    return res


if __name__ == "__main__":
    main()
