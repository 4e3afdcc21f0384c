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


def shape(case: dict, i: int) -> list:
    """The shape of the case's i-th positional tensor argument ([] if not a tensor)."""
    a = case["args"][i] if i < len(case["args"]) else None
    return a["tensor"]["shape"] if isinstance(a, dict) and "tensor" in a else []


def zero_dim(i: int, *dims):
    """Predicate: positional tensor i has a 0 in one of `dims`."""
    return lambda case, outcome: any(len(shape(case, i)) > d and shape(case, i)[d] == 0 for d in dims)


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
    Known("message", r"glm5_ops\.fused_moe\.backward", says("does not require grad", "RuntimeError"),
          "fused_moe (reference) with T = 0 returns an output that is not differentiable"),
    Known("message", r"glm5_ops\.moe_dispatch", says("bad_alloc", "MemoryError"),
          "moe_dispatch with a huge num_experts allocates offsets [num_experts+1] unchecked: MemoryError std::bad_alloc"),
    # --- messages missing the argument, the expectation or the given value ---
    Known("message", r"glm5_ops\.quantize_groupwise", perturbed("group_size", "must divide the last dimension"),
          "quantize_groupwise: 'group_size=N must divide the last dimension of x' has no 'got'"),
    Known("message", r"glm5_ops\.topk_indices", perturbed("scores", r"^k must be in"),
          "topk_indices: a scores rank change reported as k out of range (names k, not scores)"),
    # --- the model's entry points ---
    Known("message", r"model\..*", says("enforce fail at alloc_cpu|can't allocate memory"),
          "model.new_cache / generate: a huge max_tokens or page_size reaches torch.empty (allocation RuntimeError)"),
    Known("message", r"model\..*", perturbed("max_tokens", "not supported between|failed to unpack|cache full"),
          "model: max_tokens / the cache are not type-checked ('<' not supported, empty() unpack) and 'cache full' "
          "says neither must nor got"),
    Known("message", r"model\..*", perturbed("page_size", "not supported between|failed to unpack"),
          "PagedCache: page_size is not type-checked"),
    Known("message", r"model\..*", perturbed("chunk", "not supported between"),
          "model.prefill: chunk is not type-checked"),
    Known("message", r"model\.speculative_generate|model\.generate", perturbed("prefill_chunk", r"^chunk must"),
          "generate / speculative_generate: a bad prefill_chunk is reported as 'chunk'"),
    Known("message", r"model\..*", perturbed("input_ids", "too many values to unpack|has no attribute 'shape'"),
          "model: input_ids of the wrong rank or type fail before _check_ids (unpack / AttributeError)"),
    Known("message", r"model\.generate", perturbed("max_new_tokens", "exceeds max_position_embeddings"),
          "generate: 'prompt + max_new_tokens exceeds max_position_embeddings' says neither must nor got"),
]


def match(kind: str, case: dict, outcome: dict) -> Known | None:
    for k in KNOWN:
        if k.kind == kind and re.fullmatch(k.target, case["target"]) and k.when(case, outcome):
            return k
    return None
