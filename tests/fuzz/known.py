"""Known findings: failures the fuzz corpus hits today, each waiting for a fix
(issue 24). test_fuzz.py fails on any crash, hang, invalid result or
unconventional error message NOT matched here. Delete an entry when its fix
lands (the test then checks that the case is clean); never add one to make a
new failure pass without filing it.

Each entry: kind (crash | hang | invalid | message), a regex on the case's
target, and a predicate on the case (spec.py's JSON) and its outcome.
Known hangs are not run (each would cost the time bound).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Known:
    kind: str
    target: str
    when: Callable[[dict, dict], bool]
    note: str
    sanitizer_only: bool = False   # seen only under scripts/sanitize.sh (ASan/UBSan reports)


def shape(case: dict, i: int) -> list:
    """The shape of the case's i-th positional tensor argument ([] if not a tensor)."""
    a = case["args"][i] if i < len(case["args"]) else None
    return a["tensor"]["shape"] if isinstance(a, dict) and "tensor" in a else []


def zero_dim(i: int, *dims):
    """Predicate: positional tensor i has a 0 in one of `dims`."""
    return lambda case, outcome: any(len(shape(case, i)) > d and shape(case, i)[d] == 0 for d in dims)


def _mask_block_size(case: dict) -> int:
    mask = case["args"][3] if len(case["args"]) > 3 else None
    size = mask["tuple"][2] if isinstance(mask, dict) and "tuple" in mask else 0
    return size if isinstance(size, int) else 0


def says(pattern: str, kind: str | None = None):
    """Predicate: the error's message matches `pattern` (and its type is `kind`)."""
    return lambda case, outcome: (re.search(pattern, outcome.get("message", "")) is not None
                                  and (kind is None or outcome.get("type") == kind))


def perturbed(name: str, pattern: str = ""):
    return lambda case, outcome: case.get("perturbed") == name and re.search(pattern, outcome.get("message", ""))


RAW = r"torch\.ops\.glm5\..*"
SPARSE_FWD = r"glm5_ops\.sparse_attention(\.backward)?|torch\.ops\.glm5\.sparse_attention_fwd"

KNOWN: list[Known] = [
    # --- crashes and hangs (issue 24's three, found again, plus B = 0) ---
    Known("crash", r"glm5_ops\.indexer_topk|torch\.ops\.glm5\.indexer_topk", zero_dim(0, 0, 1),
          "indexer_topk with B = 0 or S = 0 queries dies with SIGFPE (CPU kernel divides by zero)"),
    Known("hang", SPARSE_FWD, lambda c, o: c["backend"] == "cpp" and zero_dim(0, 3)(c, o),
          "sparse_attention (cpp) with head dim Dk = 0 never returns"),
    Known("hang", r"torch\.ops\.glm5\.sparse_attention_bwd", zero_dim(1, 3),
          "sparse_attention_bwd with head dim Dk = 0 never returns"),
    Known("message", r"glm5_ops\.(block_)?sparse_attention(\.backward)?", says("division by zero", "ZeroDivisionError"),
          "sparse_attention / block_sparse_attention with Dk = 0 and scale=None: bare ZeroDivisionError (1/sqrt(0))"),
    # --- error type: the C++ checks raise RuntimeError (TORCH_CHECK), not ValueError/TypeError ---
    Known("message", RAW, lambda c, o: o.get("problem", "").startswith("raises RuntimeError"),
          "raw torch.ops.glm5 checks use TORCH_CHECK (RuntimeError); TORCH_CHECK_VALUE/_TYPE would give ValueError/TypeError"),
    Known("message", r"glm5_ops\.(block_)?sparse_attention(\.backward)?", says("must have unit stride", "RuntimeError"),
          "public sparse attention passes k/v with a non-unit head-dim stride (size-1 or empty dims) to the kernel: "
          "RuntimeError 'k and v must have unit stride'"),
    Known("message", r"glm5_ops\.moe_combine", says("cannot reshape tensor of 0 elements", "RuntimeError"),
          "moe_combine (reference) with k = 0 slots: RuntimeError from a reshape in reference.py"),
    Known("crash", r"glm5_ops\.moe_dispatch|torch\.ops\.glm5\.moe_dispatch", zero_dim(0, 1),
          "UBSan: moe_dispatch with D = 0 passes a null pointer to memcpy/memset (csrc/cpu/moe.cpp:272)",
          sanitizer_only=True),
    Known("crash", r"glm5_ops\.block_sparse_attention(\.backward)?", lambda c, o: _mask_block_size(c) >= 2**30,
          "ASan: block_sparse_attention with block_size near 2^31 or 2^63 asks operator new for more than the "
          "sanitizer's cap (out-of-memory report; the normal build raises MemoryError, listed below)",
          sanitizer_only=True),
    Known("message", r"glm5_ops\..*|model\..*", says("bad_alloc|enforce fail at alloc_cpu|can't allocate memory"),
          "unbounded allocations from one huge int: moe_dispatch num_experts (offsets [E+1]), block_sparse_attention "
          "block_size (the mask expanded), model max_tokens / page_size (the cache): MemoryError / allocator "
          "RuntimeError instead of a check"),
    Known("hang", r"torch\.ops\.glm5\.moe_dispatch", lambda c, o: isinstance(c["args"][3], int) and c["args"][3] >= 2**30,
          "raw moe_dispatch does not bound align: align near 2^31 allocates and zero-fills ~E*align rows (> 10 s)"),
    Known("message", r"glm5_ops\.block_sparse_attention(\.backward)?", says(r"^kv_indices: the first kv_num_blocks"),
          "block_sparse_attention: 'kv_indices: the first kv_num_blocks entries ... must be in [0, Kb)' has no 'got'"),
    Known("message", r"glm5_ops\.(block_topk_mask|(block_)?sparse_attention(\.backward)?)",
          says(r"^the kv heads of k \(Hkv=\d+\) must divide"),
          "attention: 'the kv heads of k (Hkv=..) must divide the query heads of q' has no 'got'"),
    # --- messages missing the argument, the expectation or the given value ---
    Known("message", r"glm5_ops\.(quantize_groupwise|dequantize)", says("must divide the last dimension"),
          "quantize_groupwise / dequantize: 'group_size=N must divide the last dimension of x/shape' has no 'got'"),
    Known("message", r"glm5_ops\.dequantize", perturbed("shape", "invalid literal for int"),
          "dequantize: shape=['x'] gives int()'s 'invalid literal' ValueError, not naming shape"),
    Known("message", r"model\..*", says("^cache full"),
          "PagedCache: 'cache full: N + S tokens exceed max_tokens=M' says neither must nor got"),
    Known("message", r"model\..*", lambda c, o: c.get("perturbed") in ("max_tokens", "page_size", "batch", "chunk",
                                                                          "top_k", "logits_to_keep")
          and re.search("not supported between|failed to unpack|slice indices must be", o.get("message", "")),
          "model: max_tokens, page_size, batch (new_cache), chunk (prefill), top_k (generate) and logits_to_keep "
          "(forward) are not type-checked: a str/float/None fails deep inside ('<' not supported, empty() unpack, "
          "slice indices)"),
    Known("message", r"model\..*", lambda c, o: c.get("perturbed") in ("input_ids", "prompt")
          and re.search("too many values to unpack|has no attribute 'shape'", o.get("message", "")),
          "model: input_ids (or the prompt) of the wrong rank or type fail before _check_ids (unpack / AttributeError)"),
]


def match(kind: str, case: dict, outcome: dict) -> Known | None:
    for k in KNOWN:
        if k.kind == kind and re.fullmatch(k.target, case["target"]) and k.when(case, outcome):
            return k
    return None
