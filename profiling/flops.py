"""FLOPs and bytes per component, counted op by op while the model runs.

OpCounter is a TorchDispatchMode: every aten op and every glm5 op (torch.ops.glm5)
passes through it. Each op is charged to the component of the innermost
range open on the thread (glm5_ops.nvtx.current_ranges); in backward, to the
component of the forward op that created the autograd node being run (the
node's sequence number, recorded in forward).

FLOPs: torch's formulas (torch.utils.flop_counter) for matmuls and attention,
and the lab's own below for the glm5 kernels and CPU SDPA. Attention counts
only visible (query, key) pairs: the causal triangle, the selected keys.
Bytes: the distinct tensors each non-view op reads and writes, summed: a lower
bound on memory traffic at op granularity (a kernel that re-reads does more).
Ops that read part of an argument are charged for that part (PARTIAL_READS):
a fused MoE for the experts some token chose, sparse attention for the
selected cache rows, a gather for the gathered rows, so that a decode step's
bytes are what it must read and not every expert's weights or the whole cache.

It also keeps the arguments of the first sparse or block-sparse attention
call in a chosen layer, for the attention-recall measurement.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from glm5_ops import nvtx

from .components import OTHER, innermost_component


def causal_pairs(S: int, T: int) -> int:
    """Visible (query, key) pairs when the S queries are the last S of T positions."""
    return sum(max(0, min(T, T - S + s + 1)) for s in range(S))


def _bind(func, args, kwargs) -> dict:
    """Schema argument name -> value, defaults filled in."""
    out = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _sdpa_fwd(a) -> int:
    q, k, v = a["query"], a["key"], a["value"]          # [B,H,S,D], [B,Hk,T,D], [B,Hk,T,Dv]
    B, H, S, D = q.shape
    T, Dv = k.shape[-2], v.shape[-1]
    mask = a.get("attn_mask")
    if isinstance(mask, torch.Tensor):  # the pairs the mask lets through (bool, or additive -inf)
        keep = mask if mask.dtype == torch.bool else mask > float("-inf")
        pairs = int(keep.expand(B, H, S, T).sum())
    else:
        pairs = B * H * (causal_pairs(S, T) if a.get("is_causal") else S * T)
    return 2 * pairs * (D + Dv)


def _sdpa_bwd(a) -> int:
    # recompute scores, dP = dO V^T, dQ, dK, dV: 2.5x the forward's two matmuls
    return _sdpa_fwd(a) * 5 // 2


def _index_pairs(indices) -> int:
    return int((indices >= 0).sum())


def _indexer(a) -> int:
    B, S, H, D = a["q"].shape
    T = a["k"].shape[1]
    pairs = B * (causal_pairs(S, T) if a["causal"] else S * T)
    return 2 * pairs * H * (D + 1)  # q.k per head, then the weighted head sum


def _sparse_attention(a, backward=False) -> int:
    Hq, Dk, Dv = a["q"].shape[2], a["q"].shape[3], a["v"].shape[3]
    pairs = _index_pairs(a["indices"]) * Hq
    return 2 * pairs * ((3 * Dk + 2 * Dv) if backward else (Dk + Dv))


def _block_sparse_attention(a, backward=False) -> int:
    Hq, Dk, Dv = a["q"].shape[2], a["q"].shape[3], a["v"].shape[3]
    blocks = int(a["kv_num_blocks"].sum()) * (Hq // a["kv_num_blocks"].shape[1])
    pairs = blocks * a["block_size"] ** 2
    return 2 * pairs * ((3 * Dk + 2 * Dv) if backward else (Dk + Dv))


def _fused_moe(a, backward=False) -> int:
    T, D = a["x"].shape
    k = a["ids"].shape[1]
    I = a["w_down"].shape[2]
    gemms = 2 * T * k * 3 * I * D  # gate_up [2I,D] and down [D,I] for each (token, expert)
    # backward: input and weight gradients of both GEMMs, plus the gate/up recompute
    return (2 * gemms + 2 * T * k * 2 * I * D) if backward else gemms + 2 * T * k * D


GLM5_FLOPS = {
    "glm5::indexer_scores": _indexer,
    "glm5::indexer_topk": _indexer,
    "glm5::topk_indices": lambda a: 0,
    "glm5::block_topk_mask": lambda a: 0,
    "glm5::sparse_attention_fwd": _sparse_attention,
    "glm5::sparse_attention_bwd": lambda a: _sparse_attention(a, backward=True),
    "glm5::block_sparse_attention_fwd": _block_sparse_attention,
    "glm5::block_sparse_attention_bwd": lambda a: _block_sparse_attention(a, backward=True),
    "glm5::moe_route": lambda a: 2 * a["h"].shape[0] * a["gate_w"].shape[0] * a["h"].shape[1],
    "glm5::moe_dispatch": lambda a: 0,
    "glm5::moe_combine": lambda a: 2 * a["weights"].numel() * a["y_sorted"].shape[-1],
    "glm5::fused_moe_fwd": _fused_moe,
    "glm5::fused_moe_bwd": lambda a: _fused_moe(a, backward=True),
    "glm5::int8_quantize_rows": lambda a: 0,
    "glm5::int8_linear": lambda a: 2 * a["x"].shape[0] * a["w"].shape[0] * a["w"].shape[1],
    "glm5::w8a8_linear": lambda a: 2 * a["x"].shape[0] * a["w"].shape[0] * a["w"].shape[1],
    "glm5::int8_linear_heads": lambda a: 2 * a["x"].shape[0] * a["x"].shape[1] * a["w"].shape[1] * a["w"].shape[2],
    "glm5::fused_moe_int8": _fused_moe,
    "aten::scaled_dot_product_attention": _sdpa_fwd,
    "aten::_scaled_dot_product_flash_attention_for_cpu": _sdpa_fwd,
    "aten::_scaled_dot_product_flash_attention": _sdpa_fwd,
    "aten::_scaled_dot_product_efficient_attention": _sdpa_fwd,
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_bwd,
}


def lab_op_name(func) -> str:
    """func's schema name, with the Triton kernels' namespace read as glm5's:
    glm5_triton::X has glm5::X's schema, so the same formulas count it."""
    return func._schema.name.replace("glm5_triton::", "glm5::", 1)


def op_flops(func, args, kwargs, out) -> int:
    name = lab_op_name(func)
    if name in GLM5_FLOPS:
        return int(GLM5_FLOPS[name](_bind(func, args, kwargs)))
    formula = flop_registry.get(func._overloadpacket)
    if formula is not None:
        return int(formula(*args, **kwargs, out_val=out))
    return 0


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def _distinct_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in torch.utils._pytree.tree_leaves(tensors):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)
            if key not in seen:
                seen.add(key)
                total += _tensor_bytes(t)
    return total


def _moe_bytes(a, expert_args) -> int:
    """fused_moe: of each per-expert weight [E, ...] only the experts some token chose are read."""
    E = a["w_gate_up"].shape[0]
    used = int(torch.unique(a["ids"]).numel())
    rest = {k: v for k, v in a.items() if k not in expert_args}
    return _distinct_bytes(rest) + sum(_tensor_bytes(a[k]) * used // E for k in expert_args)


def _selected_rows(indices, T: int) -> int:
    """Distinct valid key positions per batch element, summed: the cache rows a sparse attention reads."""
    total = 0
    for b in range(indices.shape[0]):
        sel = indices[b].reshape(-1)
        total += int(torch.unique(sel[(sel >= 0) & (sel < T)]).numel())
    return total


def _sparse_attention_bytes(a) -> int:
    """q, indices and the outputs whole; of k and v only the selected rows (v is often a
    view of k's first columns, then those rows are read once)."""
    k, v = a["k"], a["v"]                                   # [B,T,Hk,Dk], [B,T,Hk,Dv]
    rows = _selected_rows(a["indices"], k.shape[1])
    kv = rows * k[0, 0].numel() * k.element_size()
    if v.untyped_storage().data_ptr() != k.untyped_storage().data_ptr():
        kv += rows * v[0, 0].numel() * v.element_size()
    return kv + _distinct_bytes([a["q"], a["indices"], a.get("q_start")])


def _gather_bytes(index, out) -> int:
    """embedding / index / index_select: the gathered rows (read, then written), not the whole table."""
    return _distinct_bytes(index) + 2 * _tensor_bytes(out)


# Ops that read only part of an argument; every other op: the distinct tensors it touches.
PARTIAL_READS = {
    "glm5::fused_moe_fwd": lambda a, out: _moe_bytes(a, ("w_gate_up", "w_down")) + _tensor_bytes(out),
    "glm5::fused_moe_int8": lambda a, out: _moe_bytes(a, ("w_gate_up", "gate_up_scale", "w_down", "down_scale"))
    + _tensor_bytes(out),
    "glm5::sparse_attention_fwd": lambda a, out: _sparse_attention_bytes(a) + _distinct_bytes(out),
    "aten::embedding": lambda a, out: _gather_bytes(a["indices"], out),
    "aten::index": lambda a, out: _gather_bytes(a["indices"], out),
    "aten::index_select": lambda a, out: _gather_bytes(a["index"], out),
}


def op_bytes(func, args, kwargs, out) -> int:
    """Bytes the op must move: its distinct tensors, except that ops reading part of an
    argument (the chosen experts' weights, the selected cache rows, gathered
    embedding rows) are charged for that part only."""
    rule = PARTIAL_READS.get(lab_op_name(func))
    if rule is not None:
        return int(rule(_bind(func, args, kwargs), out))
    return _distinct_bytes((args, kwargs, out))


ATTENTION_OPS = ("glm5::sparse_attention_fwd", "glm5::block_sparse_attention_fwd")


class OpCounter(TorchDispatchMode):
    """FLOPs and bytes per component; keeps the attention arguments of
    `capture_layer`'s core attention (first call) in .attention_args."""

    def __init__(self, capture_layer: int | None = 0):
        super().__init__()
        self.flops = defaultdict(int)
        self.bytes = defaultdict(int)
        self._seq_component = {}
        self._capture = None if capture_layer is None else f"layer{capture_layer}/attn/core"
        self.attention_args = None  # (op name, {arg: value}) of the captured call

    def _component(self, args) -> str:
        ranges = nvtx.current_ranges()
        comp = innermost_component(ranges)
        node = torch._C._current_autograd_node()
        if comp is None and node is not None:  # backward: the forward op's component
            comp = self._seq_component.get(node._sequence_nr())
        if comp is not None and node is None and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in torch.utils._pytree.tree_leaves(args)):
            # the autograd node this op created (if any) has the latest sequence number
            self._seq_component.setdefault(torch.autograd._get_sequence_nr() - 1, comp)
        return comp or OTHER

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = lab_op_name(func)
        if name not in GLM5_FLOPS and func._overloadpacket not in flop_registry:
            # Composite ops (linear, einsum, matmul) reach this mode whole under
            # inference_mode: count them as the ops they decompose into.
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if func.namespace == "profiler" or func.is_view:
            return out
        comp = self._component(args)
        self.flops[comp] += op_flops(func, args, kwargs, out)
        self.bytes[comp] += op_bytes(func, args, kwargs, out)
        if self._capture and self.attention_args is None and name in ATTENTION_OPS:
            if self._capture in nvtx.current_ranges():
                # clone: the cache the keys live in changes on later steps (the mode is off in here)
                bound = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                         for k, v in _bind(func, args, kwargs).items()}
                self.attention_args = (name, bound)
        return out
