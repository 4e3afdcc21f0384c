"""Runs one case (worker side): builds its arguments, calls the target, and
checks what a result must satisfy whatever the input (indices in range,
finite attention outputs for finite inputs). Returns a JSON outcome:
  {"status": "ok"} | {"status": "invalid", "message": ...}
  | {"status": "error", "type": "ValueError", "message": ..., "where": "file:line"}
A crash or a hang never returns: the pool (pool.py) sees the worker die or time out.
"""
from __future__ import annotations

import os
import time
import traceback

import torch

import glm5_ops
from models.glm5 import GLM5ForCausalLM, preset
from models.glm5.generate import generate, speculative_generate

from .model_ops import MAX_POS
from .spec import build_call

# Test-only targets: prove the pool reports a dead or stuck worker (test_fuzz.py).
SELFTEST = {"selftest.ok": lambda: None, "selftest.crash": lambda: os.abort(),
            "selftest.hang": lambda: time.sleep(3600),
            "selftest.slow": lambda: time.sleep(1.5), "selftest.error": lambda: 1 // 0}

_models: dict = {}


def model(attn: str) -> GLM5ForCausalLM:
    """The tiny preset with a short max_position_embeddings, one per attention mode, seeded."""
    if attn not in _models:
        torch.manual_seed(0)
        _models[attn] = GLM5ForCausalLM(preset("tiny").replace(max_position_embeddings=MAX_POS), attn=attn).eval()
    return _models[attn]


def _cache(m, ids, max_tokens):
    """The cache a caller would make for ids: of ids' batch, or of batch 1 when
    ids has none to give (not a tensor, or a batch of 0). new_cache(0, ...) is
    refused naming `batch` (tests/test_model.py): here the case broke ids, so
    the model's own check of ids is what it must meet."""
    B = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() else 1
    return None if max_tokens is None else m.new_cache(max(B, 1), max_tokens)


def _run_model(entry: str, args, kw):
    m = model(kw.pop("attn"))
    with torch.no_grad():
        if entry == "forward":
            ids = args[0]
            return m(ids, _cache(m, ids, kw.pop("max_tokens")), **kw)
        if entry == "decode":
            prompt, ids = args
            cache = _cache(m, prompt, kw.pop("max_tokens"))
            m.prefill(prompt, cache)
            return m(ids, cache)
        if entry == "prefill":
            ids = args[0]
            return m.prefill(ids, _cache(m, ids, kw.pop("max_tokens")), **kw)
        if entry == "generate":
            return generate(m, *args, **kw)
        if entry == "speculative_generate":
            return speculative_generate(m, *args, **kw)
        if entry == "new_cache":
            return m.new_cache(*args, **kw)
    raise ValueError(f"unknown model entry point {entry!r}")


def _with_grad(args, kwargs):
    """Float tensors become leaves that require grad (detach keeps their layout)."""
    def leaf(x):
        return x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
    return [leaf(a) for a in args], {k: leaf(v) for k, v in kwargs.items()}


def call(case: dict):
    target = case["target"]
    if target in SELFTEST:
        return SELFTEST[target]()
    args, kwargs = build_call(case)
    if target.startswith("model."):
        with glm5_ops.use_backend(case["backend"]):
            return _run_model(target[len("model."):], args, kwargs)
    if target.startswith("torch.ops.glm5."):
        return getattr(torch.ops.glm5, target[len("torch.ops.glm5."):])(*args, **kwargs)
    name = target[len("glm5_ops."):]
    backward = name.endswith(".backward")
    fn = getattr(glm5_ops, name.removesuffix(".backward"))
    with glm5_ops.use_backend(case["backend"]):
        if not backward:
            return fn(*args, **kwargs)
        args, kwargs = _with_grad(args, kwargs)
        out = fn(*args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        first.float().sum().backward()
        return out


# ------------------------------------------------------------- validation --

def _finite_inputs(case) -> bool:
    if case.get("mutation") == "bad_float":    # scale=inf/-1/1e308: no promise about the output
        return False
    specs = [a for a in list(case["args"]) + list(case["kwargs"].values()) if isinstance(a, dict) and "tensor" in a]
    return all(s["tensor"]["fill"] in ("randn", "zeros") or not s["tensor"]["dtype"].startswith(("float", "bfloat"))
               for s in specs)


def _in_range(t: torch.Tensor, lo: int, hi: int, what: str):
    if t.numel() and (int(t.min()) < lo or int(t.max()) >= hi):
        return f"{what} outside [{lo}, {hi}): values in [{int(t.min())}, {int(t.max())}]"
    return None


def invalid(case: dict, result) -> str | None:
    """Why `result` cannot be right for this case's input, or None."""
    op = case["target"].split(".")[-1]
    if op == "backward":
        return None
    args, kwargs = build_call(case)   # the same tensors again (seeded): cheap at fuzz sizes
    if op == "topk_indices":
        return _in_range(result, -1, args[0].shape[-1], "topk_indices entries")
    if op == "indexer_topk":
        return _in_range(result, -1, args[2].shape[1], "indexer_topk entries")
    if op == "moe_route":
        return _in_range(result[1], 0, args[1].shape[0], "moe_route ids")
    if op == "block_topk_mask":
        num, idx = result[0], result[1]
        Kb = -(-args[1].shape[1] // (result[2] if len(result) > 2 else args[2]))
        return _in_range(idx, 0, max(Kb, 1), "kv_indices") or _in_range(num, 0, idx.shape[-1] + 1, "kv_num_blocks")
    if op in ("quantize_int8", "int8_quantize_rows"):
        q, scale = result
        if args[0].is_floating_point() and bool(torch.isfinite(args[0]).all()):
            bad = scale.numel() and not bool((torch.isfinite(scale) & (scale >= 0)).all())
            return _in_range(q, -127, 128, "int8 codes") or ("scales not finite and >= 0 for finite x" if bad else None)
        return None
    if op in ("int8_linear", "w8a8_linear", "int8_linear_heads", "fused_moe_int8"):
        # fp32 x: nothing a finite input does can overflow fp32 at fuzz sizes
        if _finite_inputs(case) and args[0].dtype == torch.float32 and result.numel() \
                and not bool(torch.isfinite(result).all()):
            return f"{op} output has NaN/inf for finite inputs"
        return None
    if op in ("sparse_attention", "sparse_attention_fwd", "block_sparse_attention", "block_sparse_attention_fwd"):
        out = result[0]
        if _finite_inputs(case) and out.numel() and not bool(torch.isfinite(out).all()):
            return "attention output has NaN/inf for finite inputs"
    return None


def _where(exc: BaseException) -> str:
    """The innermost frame of the lab's own code (or the last one) that raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if "/glm5_ops/" in f.filename or "/models/" in f.filename] or frames[-1:]
    return f"{os.path.relpath(own[-1].filename)}:{own[-1].lineno}" if own else "?"


def run_case(case: dict) -> dict:
    t0 = time.perf_counter()
    try:
        result = call(case)
        why = invalid(case, result) if not case["target"].startswith(("model.", "selftest.")) else None
        out = {"status": "invalid", "message": why} if why else {"status": "ok"}
    except Exception as e:  # noqa: BLE001 - classifying every exception is the point
        out = {"status": "error", "type": type(e).__name__, "message": str(e)[:600], "where": _where(e)}
    out["seconds"] = round(time.perf_counter() - t0, 4)
    return out
