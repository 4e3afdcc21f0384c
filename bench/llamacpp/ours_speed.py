"""Child process: our GLM-5 on one prefill or decode measurement, as llama-bench does it.

    python bench/llamacpp/ours_speed.py CKPT fp32|int8|int8_head prefill|decode N STEPS CHUNK [compile]

prefill N: tokens/s of `prefill` over N tokens into an empty paged cache.
decode N: fill the cache with N tokens (untimed, like llama-bench's depth run; N = 0
means one token, since our decode needs a context), then STEPS one-token forwards,
timed: STEPS / seconds. Before timing, a short warm-up (64-token prefill, 2 decode
steps on a throwaway cache) so that one-time costs (thread pool, first allocations)
are not charged to the measurement, as llama-bench's warm-up run does.
int8: CKPT is the int8 checkpoint `speed.prepared_models` saved (models.glm5.quantize,
"int8_weight_only", the lab's default skip list: lm_head and the embedding stay fp32);
int8_head: the same with the LM head int8 too (speed.int8_skip).
compile: decode steps through `model.compile_decode()` (torch.compile'd layers); the
compile happens in COMPILE_WARMUP untimed steps on the measured cache itself, at the
measured depth (a cache of another length or at the other side of index_topk would
leave a recompile inside the timed steps).
Prints one JSON line last.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]      # the repository (models/) and bench/ (llamacpp/)

from llamacpp.speed import PRECISIONS  # noqa: E402   (one list: the pairs speed.py runs)
WARMUP_TOKENS = 64
COMPILE_WARMUP = 3      # steps: the first compiles, the second makes the length dynamic, the third checks


def _log(msg: str) -> None:
    print(f"[ours] {msg}", file=sys.stderr, flush=True)


def load(ckpt: str, precision: str):
    from models.glm5 import GLM5ForCausalLM
    from models.glm5.quantization import QUANT_FILE
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if (precision != "fp32") != os.path.exists(os.path.join(ckpt, QUANT_FILE)):
        raise ValueError(f"ckpt {ckpt!r} does not hold a {precision} model ({QUANT_FILE} decides)")
    return GLM5ForCausalLM.from_pretrained(ckpt, verbose=False).eval()


def _tokens(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _decode(model, cache, steps: int, seed: int) -> float:
    """Seconds for `steps` one-token forwards (each computes the logits), fed random
    tokens drawn beforehand: llama-bench's tg loop (llama_decode, then the next token
    from rand(), no sampling; an argmax over the 32K logits was ~0.1 ms a step here)."""
    tokens = _tokens(steps, model.config.vocab_size, seed=seed)
    # a fresh [1, 1] tensor a step, strides (1, 1) as a sampler's: a slice of `tokens` keeps
    # its row stride (= steps, even through clone()), and Dynamo guards on it, so the
    # compiled step would recompile inside the timed loop
    ids = [torch.tensor([[t]]) for t in tokens[0].tolist()]
    t0 = time.perf_counter()
    for x in ids:
        model(x, cache)
    return time.perf_counter() - t0


def measure(ckpt: str, precision: str, task: str, n: int, steps: int, chunk: int, compile: bool = False) -> dict:
    if task not in ("prefill", "decode"):
        raise ValueError(f"task must be prefill or decode, got {task!r}")
    if n < (1 if task == "prefill" else 0) or steps < (1 if task == "decode" else 0) or chunk < 1:
        raise ValueError(f"bad sizes: n={n}, steps={steps}, chunk={chunk}")
    t0 = time.perf_counter()
    model = load(ckpt, precision)
    _log(f"{precision} model ready in {time.perf_counter() - t0:.1f} s; warm-up")
    # as the serving engine and prefill run: no autograd or version-counter work per op
    with torch.inference_mode():
        return _run(model, precision, task, n, steps, chunk, compile)


def _run(model, precision: str, task: str, n: int, steps: int, chunk: int, compile: bool) -> dict:
    vocab = model.config.vocab_size
    cache = model.new_cache(1, WARMUP_TOKENS + 3)
    model.prefill(_tokens(WARMUP_TOKENS, vocab, seed=2), cache, chunk=chunk)
    _decode(model, cache, 2, seed=3)
    del cache
    fill = max(n, 1)
    warm = COMPILE_WARMUP if compile and task == "decode" else 0
    cache = model.new_cache(1, fill + warm + steps + 1)
    _log(f"{task}: prefill {fill} tokens" + (" (the depth, untimed)" if task == "decode" else ""))
    t0 = time.perf_counter()
    model.prefill(_tokens(fill, vocab), cache, chunk=chunk)
    prefill_s = time.perf_counter() - t0
    result = {"engine": "ours", "precision": precision, "task": task, "n": n, "prefill_s": prefill_s,
              "compiled": bool(warm)}
    if task == "prefill":
        result["tok_s"] = n / prefill_s
    else:
        if warm:
            model.compile_decode()
            t0 = time.perf_counter()
            _decode(model, cache, warm, seed=4)
            _log(f"decode compiled in {warm} untimed steps, {time.perf_counter() - t0:.1f} s")
        _log(f"decode: {steps} steps at depth {fill + warm} (prefill took {prefill_s:.1f} s)")
        result.update(steps=steps, depth_filled=fill, tok_s=steps / _decode(model, cache, steps, seed=5))
    return result


if __name__ == "__main__":
    ckpt, precision, task, n, steps, chunk = sys.argv[1:7]
    if sys.argv[7:] not in ([], ["compile"]):
        sys.exit(f"the optional 7th argument must be 'compile', got {sys.argv[7:]}")
    print(json.dumps(measure(ckpt, precision, task, int(n), int(steps), int(chunk), compile=sys.argv[7:] == ["compile"])))
