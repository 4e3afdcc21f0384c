"""The kernels' cost model, beside the kernels: which form MLA attends in,
and when a linear layer runs the matrix-vector kernel (`gemv_is_faster`).

MLA attends absorbed (every head over the one latent+rope key per token: MQA
with Dk = kv_lora + rope) or expanded (per-head K/V from kv_b_proj: one kv head
per query head, Dk = nope + rope). Which costs less is a property of the
kernel that runs it, so the rule lives here, not in the model:

- Many queries over every causal key (dense prefill, or DSA while its
  selection is every visible key): expanded, 3.4x fewer FLOPs per pair, for
  T x kv_lora x H x (nope + v) to expand (`EXPANDED_MIN_QUERIES`).
- DSA over a selection that still covers much of the context: expanded only
  on the C++ CPU kernel, which then runs each query block's span on lane
  tiles (`dsa_expanded_is_cheaper`). The lane threshold and rate are read
  from the kernel itself (`cpu_lane_costs`, csrc/cpu/lane_costs.h): the
  choice made here and the kernel's cannot disagree.
"""
from __future__ import annotations

import torch

from ._backend import cpp_ops, current_backend

# Dense attention with at least this many queries per call expands K/V per
# head (the cheaper form for prefill); fewer (decode) attend absorbed.
EXPANDED_MIN_QUERIES = 64


def _on_cpu_kernels(device: torch.device) -> bool:
    """Whether attention on `device` runs the C++ CPU kernels this cost model describes."""
    return device.type == "cpu" and current_backend(device) == "cpp"


def cpu_lane_costs(group: int, queries: int) -> tuple[float, float]:
    """The CPU sparse-attention kernel's (lane_rate, min_density) for head
    group `group` (query heads per kv head) and `queries` per call: lane tiles'
    rate relative to the gathered path, and the fraction of its span's
    (query, key) pairs a 64-query block must select to run on lane tiles
    (> 1: never; GLM5_SPARSE_LANE_BLOCKS=always|never forces 0 or 2)."""
    lane_rate, min_density = cpp_ops().cpu_lane_costs(group, queries)
    return lane_rate, min_density


def every_key_on_block_sparse(device: torch.device) -> bool:
    """Causal attention over every key in the expanded form: on the CPU the
    block-sparse kernel over every causal key block (no zero-padding of v, as
    SDPA's flash kernel needs: ~20% less time at 2K tokens); elsewhere SDPA."""
    return _on_cpu_kernels(device)


def dsa_expanded_is_cheaper(device: torch.device, S: int, q_start: int, topk: int, *, kv_lora: int, nope: int,
                            rope: int, v_dim: int) -> bool:
    """Whether DSA over S queries at q_start (each selecting up to topk keys)
    costs less in the expanded form. Absorbed, each selected (query, key,
    head) costs kv_lora + rope + kv_lora FMAs (544 in the small preset, 1088
    in GLM-5), plus the W_UK / W_UV products per query. Expanded, nope + rope
    + v (160 / 512), but the CPU kernel then runs each query block's whole span
    of keys on lane tiles (with one head per kv head, once the block selected
    more than the kernel's lane threshold of its span; below it the form would
    gather at the slowest rate, so it is not taken), and every visible key's
    latent is expanded first. The expanded form wins while the selection
    covers most visible keys: an 8K-token prefill at top-2048 takes it for
    positions 2K-6K. Other kernels attend absorbed."""
    if not _on_cpu_kernels(device):
        return False
    lane_rate, min_density = cpu_lane_costs(1, S)
    first, last = q_start + 1, q_start + S                      # query s sees q_start + s + 1 keys
    visible = (first + last) * S / 2                           # causal (query, key) pairs
    below = max(0, min(last, topk) - first + 1)                 # queries seeing <= topk keys
    selected = (first + first + below - 1) * below / 2 + topk * (S - below)
    if selected < min_density * visible:
        return False
    absorbed = selected * (2 * kv_lora + rope) + S * kv_lora * (nope + v_dim)
    expanded = visible * (nope + rope + v_dim) / lane_rate
    return expanded + last * kv_lora * (nope + v_dim) < absorbed


# Linear layers: the gemv kernel (csrc/cpu/gemv.cpp) streams the weight once per
# call and multiplies it into every row; the BLAS GEMM behind F.linear packs
# and blocks for reuse, which wins once there are enough rows to reuse the
# weight (compute-bound) and loses below that (bench/gemv_bench.py measures
# both on the small preset's shapes; bench/RESULTS.md, "Decode linear layers").
GEMV_MAX_ROWS = {torch.float32: 32, torch.bfloat16: 4}   # measured: bench/RESULTS.md, rows sweep


def gemv_is_faster(rows: int, dtype: torch.dtype) -> bool:
    """Whether a CPU linear layer over `rows` rows of `dtype` runs faster as gemv than as F.linear."""
    return 0 < rows <= GEMV_MAX_ROWS.get(dtype, 0)
