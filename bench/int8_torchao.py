"""The lab's INT8 against torchao's, side by side in one run (issue 20, item 3).

    python bench/int8_torchao.py --out runs/int8_torchao.json
    python bench/int8_torchao.py --load runs/int8_quality/model.pt --out ...   # reuse a trained model

torchao (`pip install glm5-kernel-lab[bench]`) is applied as users apply it:
`quantize_(model, Int8WeightOnlyConfig())` and
`quantize_(model, Int8DynamicActivationInt8WeightConfig())`, with a filter_fn
that keeps the lab's DEFAULT_SKIP layers and kv_b_proj in fp32 (TORCHAO_SKIP), so
the same nn.Linear layers are int8 on both sides in the "linears only" rows.
kv_b_proj stays out because MLA reads its weight as the matrices W_UK/W_UV (a
view of it), which torchao's Int8Tensor does not support (`aten.view` raises
NotImplementedError); the lab's own int8 kv_b_proj goes through int8_linear_heads. torchao quantises nn.Linear only: the routed experts
are 3-D parameters of one module that the lab's fused_moe op reads, and what
happens when torchao is pointed at them is probed and printed (`experts`).
So the like-for-like rows are "ours, linears only" against torchao; "ours"
(the experts int8 too) is what the lab ships.

1. Speed, the `--preset` model with random weights (speed does not depend on
   them), eager: decode tokens/s at batch 1 after a `--context`-token prefill,
   and the time of a `--prefill`-token prefill. Variants interleaved within
   each round, medians over `--rounds` (bench/int8_bench.py's timer).
2. Quality, the byte-level GLM-5 trained on the stdlib (bench/int8_quality.py's
   model and held-out rows): held-out loss of every variant.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.int8_bench import (LINEARS_ONLY, TORCHAO_SKIP, interleaved, placed_alike,  # noqa: E402
                              torchao_quantizer, write_results)
from bench.int8_quality import add_model_args, loss_of, trained_model_and_rows  # noqa: E402
from models.glm5 import GLM5ForCausalLM, preset, quantize  # noqa: E402
from models.glm5.moe import Experts  # noqa: E402
from models.glm5.quantization import skipped, weight_bytes  # noqa: E402



def log(msg):
    print(f"[int8-torchao] {msg}", flush=True)


def torchao_api():
    """torchao's quantize_ and its two int8 configs; a clear error when it is missing."""
    tao = torchao_quantizer()
    if isinstance(tao, str):
        raise SystemExit(f"torchao is needed for this comparison (pip install glm5-kernel-lab[bench]): {tao}")
    quantize_, wo, w8a8 = tao
    return quantize_, {"wo": wo, "w8a8": w8a8}


def torchao_quantized(model, kind: str):
    """A copy of model with torchao's int8 config `kind` ("wo" | "w8a8") on every
    nn.Linear outside TORCHAO_SKIP."""
    quantize_, configs = torchao_api()
    m = copy.deepcopy(model)
    quantize_(m, configs[kind],
              filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear) and not skipped(fqn, TORCHAO_SKIP))
    return m


def variants(model) -> dict:
    """name -> model. Ours in w8a8 mode runs decode-size calls weight-only
    (Int8Linear, fused_moe_int8); torchao's dynamic config quantises every call. All on
    huge pages alike (placed_alike)."""
    return {name: placed_alike(m) for name, m in {
        "fp32": model,
        "ours int8_weight_only": quantize(copy.deepcopy(model), "int8_weight_only"),
        "ours int8_weight_only, linears only": quantize(copy.deepcopy(model), "int8_weight_only", LINEARS_ONLY),
        "torchao Int8WeightOnlyConfig": torchao_quantized(model, "wo"),
        "ours w8a8": quantize(copy.deepcopy(model), "w8a8"),
        "ours w8a8, linears only": quantize(copy.deepcopy(model), "w8a8", LINEARS_ONLY),
        "torchao Int8DynamicActivationInt8WeightConfig": torchao_quantized(model, "w8a8"),
    }.items()}


def probe_experts(model) -> dict:
    """What torchao does with the routed experts (3-D parameters, not nn.Linear):
    quantize_ on the Experts module, then its Int8Tensor on the 3-D weights run
    through the model. Returns what each step gave (an error is the finding)."""
    quantize_, configs = torchao_api()
    from torchao.quantization.quant_api import _int8_weight_only_transform
    out = {}
    m = copy.deepcopy(model)
    try:
        quantize_(m, configs["wo"], filter_fn=lambda mod, fqn: isinstance(mod, Experts))
        out["quantize_ on Experts"] = "ok"
    except Exception as e:  # noqa: BLE001 - the error is what is reported
        out["quantize_ on Experts"] = f"{type(e).__name__}: {e}"
    m = copy.deepcopy(model)
    try:
        for mod in m.modules():
            if isinstance(mod, Experts):
                for name in ("gate_up_proj", "down_proj"):
                    _int8_weight_only_transform(mod, configs["wo"], parameter_name=name)
        out["Int8Tensor on the 3-D expert weights"] = "ok"
        with torch.no_grad():
            m(torch.randint(0, m.config.vocab_size, (1, 8)))
        out["forward with them"] = "ok"
    except Exception as e:  # noqa: BLE001
        out["forward with them"] = f"{type(e).__name__}: {str(e)[:300]}"
    for k, v in out.items():
        log(f"torchao experts probe: {k}: {v}")
    return out


@torch.no_grad()
def bench_speed(a) -> dict:
    torch.manual_seed(0)
    config = preset(a.preset)
    log(f"building {a.preset} (fp32, attn={a.attn}) and its int8 variants")
    models = variants(GLM5ForCausalLM(config, attn=a.attn).eval())
    res = {"experts": probe_experts(models["fp32"]),
           "weight_MiB": {k: weight_bytes(m)["total"] / 2**20 for k, m in models.items()}}
    log("weight MiB: " + ", ".join(f"{k} {v:.0f}" for k, v in res["weight_MiB"].items()))

    ids = torch.randint(0, config.vocab_size, (1, max(a.context + a.decode_steps, a.prefill) + 1))
    log(f"prefill {a.context} tokens into an fp32 cache (every variant decodes from it)")
    cache = models["fp32"].new_cache(1, a.context + a.decode_steps + 8)
    models["fp32"].prefill(ids[:, :a.context], cache)

    def decode(m):
        def run():
            cache.truncate(a.context)
            for s in range(a.decode_steps):
                m(ids[:, a.context + s:a.context + s + 1], cache)
        return run

    log(f"decode, batch 1: {a.decode_steps} steps per sample, {a.rounds} rounds")
    ts = interleaved({n: decode(m) for n, m in models.items()}, reps=1, rounds=a.rounds)
    res["decode_tok_s"] = {n: a.decode_steps / t for n, t in ts.items()}
    log("decode tokens/s: " + ", ".join(f"{k} {v:.2f}" for k, v in res["decode_tok_s"].items()))

    x = ids[:, :a.prefill]
    log(f"prefill of {a.prefill} tokens, {a.rounds} rounds")
    ts = interleaved({n: (lambda m=m: m(x, logits_to_keep=1)) for n, m in models.items()}, reps=1, rounds=a.rounds)
    res["prefill_s"] = ts
    log("prefill s: " + ", ".join(f"{k} {v:.2f}" for k, v in ts.items()))
    return res


def bench_quality(a) -> dict:
    model, rows = trained_model_and_rows(a)
    res = {}
    for name, m in variants(model).items():
        res[name] = loss_of(m, rows)
        log(f"held-out loss {name}: {res[name]:.4f}")
    return res


def table(res: dict) -> str:
    s, q = res.get("speed"), res.get("quality")
    names = list((s or {}).get("decode_tok_s") or q)
    lines = ["| variant | decode tok/s | vs fp32 | prefill s | fp32 / this | held-out loss | vs fp32 |",
             "|---|---|---|---|---|---|---|"]
    for n in names:
        cells = [n]
        if s:
            d, p = s["decode_tok_s"], s["prefill_s"]
            cells += [f"{d[n]:.2f}", f"{d[n] / d['fp32']:.2f}", f"{p[n]:.2f}", f"{p['fp32'] / p[n]:.2f}"]
        else:
            cells += ["", "", "", ""]
        cells += [f"{q[n]:.4f}", f"{100 * (q[n] / q['fp32'] - 1):+.3f}%"] if q else ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--attn", default="dsa")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-quality", action="store_true")
    add_model_args(p)
    p.set_defaults(steps=150, seq=128)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torchao_api()
    import torchao
    log(f"torch {torch.__version__}, torchao {torchao.__version__}, {torch.get_num_threads()} threads")
    res = {"args": vars(a), "torch": torch.__version__, "torchao": torchao.__version__}
    if not a.skip_speed:
        res["speed"] = bench_speed(a)
    if not a.skip_quality:
        res["quality"] = bench_quality(a)
    print(table(res), flush=True)
    write_results(res, a.out, log)
    return res


if __name__ == "__main__":
    main()
