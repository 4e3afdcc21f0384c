"""Speed side by side (issue 23, item 2): prefill and decode tokens/s of ours and
llama.cpp on one checkpoint, each ratio from one run.

The checkpoint and its GGUFs (F32 and Q8_0) are written once into the llama.cpp
work folder (`prepared_models`) and reused by every later run, so a run measures
and nothing else, and runs on different days compare the same weights.
Pairs: ours fp32 against llama.cpp F32; ours int8 weight-only against Q8_0 twice:
"int8" with the lab's default skip list (fp32 LM head), and "int8_head" with the LM head
int8 too, which is what Q8_0 quantises (it keeps only the router and the indexer's
weights_proj in F32, as DEFAULT_SKIP does): the like-for-like pair.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from .build import LlamaCpp, LlamaCppUnavailable, _log

GGUF_TYPE = {"fp32": "f32", "int8": "q8_0", "int8_head": "q8_0"}    # our precision -> llama.cpp's
LLAMA_LABEL = {"fp32": "F32", "int8": "Q8_0", "int8_head": "Q8_0"}
PRECISIONS = tuple(GGUF_TYPE)
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ours_speed.py")
# llama-bench's warm-up repeats the whole prompt run: above this many tokens it is
# skipped (a 16,384-token warm-up would cost minutes; one-time costs are <1% of such a run).
WARMUP_MAX_PROMPT = 4096


def prepared_models(lc: LlamaCpp, config, name: str, precisions) -> dict:
    """{"ckpt": folder, "ckpt_int8": ..., "fp32": f32.gguf, "int8": q8_0.gguf, ...} under
    the llama.cpp work folder, written when absent (a `.done` file marks each complete)."""
    from .checkpoint import write_checkpoint
    from .convert import convert_to_gguf
    folder = os.path.join(os.path.dirname(lc.build_dir), "models", name)
    ckpt = os.path.join(folder, "ckpt")
    if not os.path.exists(ckpt + ".done"):
        _log(f"writing a random {name} checkpoint with transformers into {ckpt} (once)")
        write_checkpoint(config, ckpt)
        open(ckpt + ".done", "w").close()
    out = {"ckpt": ckpt}
    for p in precisions:
        if p != "fp32":
            out[f"ckpt_{p}"] = _int8_checkpoint(ckpt, folder, p)
    for p in precisions:
        gguf = os.path.join(folder, f"model-{GGUF_TYPE[p]}.gguf")
        if not os.path.exists(gguf + ".done"):
            convert_to_gguf(lc, ckpt, gguf, GGUF_TYPE[p])
            open(gguf + ".done", "w").close()
        out[p] = gguf
    os.sync()           # else the page cache writes these back in the middle of a measurement
    return out


def int8_skip(precision: str) -> tuple[str, ...]:
    """The skip list of our int8 model for `precision`: DEFAULT_SKIP, or it less the LM head."""
    from models.glm5.quantization import DEFAULT_SKIP
    if precision not in ("int8", "int8_head"):
        raise ValueError(f"not an int8 precision: {precision!r}")
    return DEFAULT_SKIP if precision == "int8" else tuple(p for p in DEFAULT_SKIP if p != "lm_head")


def _int8_checkpoint(ckpt: str, folder: str, precision: str) -> str:
    """Our int8 weight-only model (models.glm5.quantize with int8_skip(precision)), saved
    once: quantising at load would add minutes to every run."""
    path = os.path.join(folder, "ckpt-" + precision.replace("_", "-"))
    if not os.path.exists(path + ".done"):
        import torch

        from models.glm5 import GLM5ForCausalLM, quantize, save_quantized
        skip = int8_skip(precision)
        _log(f"quantising {ckpt} to int8 weight-only (skip {skip}) into {path} (once)")
        with torch.no_grad():
            model = GLM5ForCausalLM.from_pretrained(ckpt, verbose=False)
            save_quantized(quantize(model, "int8_weight_only", skip=skip), path)
        open(path + ".done", "w").close()
    return path


def llama_bench_cmd(lc: LlamaCpp, gguf: str, task: str, n: int, threads: int, steps: int) -> list[str]:
    """llama-bench with its defaults (F16 KV cache, flash attention auto, ubatch 512):
    pp{n} for prefill, tg{steps} @ d{n} for decode."""
    cmd = [lc.bench_bin, "-m", gguf, "-t", str(threads), "-r", "1", "-o", "json", "--progress"]
    if task == "prefill":
        cmd += ["-p", str(n), "-n", "0"] + (["--no-warmup"] if n > WARMUP_MAX_PROMPT else [])
    else:
        cmd += ["-p", "0", "-n", str(steps), "-d", str(n)]
    return cmd


def run_llama_bench(lc: LlamaCpp, cmd: list[str]) -> dict:
    """One llama-bench test; its progress lines pass through, its JSON record comes back."""
    print(f"[speed] {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env={**os.environ, "LD_LIBRARY_PATH": lc.lib_dir})
    err_tail = []
    for line in proc.stderr:
        err_tail = (err_tail + [line])[-40:]
        if line.startswith("llama-bench: benchmark"):
            print(f"[speed]   {line.rstrip()}", flush=True)
    out = proc.stdout.read()
    if proc.wait() != 0:
        raise LlamaCppUnavailable(f"llama-bench failed (exit {proc.returncode}): {''.join(err_tail)[-2000:]}")
    records = json.loads(out)
    if len(records) != 1:
        raise RuntimeError(f"expected one llama-bench record, got {len(records)}")
    return records[0]


def run_ours(ckpt: str, precision: str, task: str, n: int, steps: int, chunk: int, threads: int,
             compile: bool = False) -> dict:
    cmd = [sys.executable, CHILD, ckpt, precision, task, str(n), str(steps), str(chunk)] + \
        (["compile"] if compile and task == "decode" else [])
    print(f"[speed] ours {precision} {task} {n}: OMP_NUM_THREADS={threads} {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if proc.returncode != 0:
        raise RuntimeError(f"ours {precision} {task} {n} failed (exit {proc.returncode}); its stderr is above")
    return json.loads(proc.stdout.strip().splitlines()[-1])


ENGINES = ("llama.cpp", "ours")


def run_speed(lc: LlamaCpp, models: dict, *, precisions, prefill, depths, threads: int, steps: int,
              chunk: int, engines=ENGINES, compile: bool = False, repeat: int = 1) -> list[dict]:
    """Rows {engine, precision, task, n, tok_s, rep, ...}: for each (precision, task, n),
    llama.cpp then ours, back to back, `repeat` times over (the engines alternate, so a slow
    minute of this shared host falls on both; the report takes each engine's median).
    engines: both (the default), or one, for sizes where one engine alone fills a quiet run
    (llama.cpp at 16,384 tokens: about 8 minutes).
    compile: our decode steps through model.compile_decode() (prefill stays eager)."""
    if not engines or any(e not in ENGINES for e in engines):
        raise ValueError(f"engines must be a non-empty subset of {ENGINES}, got {engines!r}")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be an integer >= 1, got {repeat!r}")
    rows, t_start = [], time.time()
    plan = [(p, "prefill", n, r) for p in precisions for n in prefill for r in range(repeat)] + \
           [(p, "decode", n, r) for p in precisions for n in depths for r in range(repeat)]
    for i, (precision, task, n, rep) in enumerate(plan):
        print(f"[speed] ({i + 1}/{len(plan)}, {time.time() - t_start:.0f} s in) {task} "
              f"{'at depth ' if task == 'decode' else ''}{n}, {precision}"
              f"{f', repeat {rep + 1}/{repeat}' if repeat > 1 else ''}", flush=True)
        if "llama.cpp" in engines:
            cmd = llama_bench_cmd(lc, models[precision], task, n, threads, steps)
            rec = run_llama_bench(lc, cmd)
            rows.append({"engine": "llama.cpp", "precision": precision, "task": task, "n": n, "tok_s": rec["avg_ts"],
                         "rep": rep,
                         "type": LLAMA_LABEL[precision],
                         "command": " ".join(cmd[1:]).replace(models[precision], "GGUF"),
                         "flash_attn": rec.get("flash_attn"), "type_k": rec.get("type_k"),
                         "build_commit": rec.get("build_commit")})
            print(f"[speed]   llama.cpp {LLAMA_LABEL[precision]}: {rows[-1]['tok_s']:.2f} tok/s", flush=True)
        if "ours" in engines:
            r = run_ours(models["ckpt" if precision == "fp32" else f"ckpt_{precision}"], precision, task, n, steps, chunk,
                         threads, compile)
            rows.append({**r, "chunk": chunk, "rep": rep})
            print(f"[speed]   ours {precision}: {r['tok_s']:.2f} tok/s", flush=True)
    return rows
