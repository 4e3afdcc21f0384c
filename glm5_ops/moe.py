"""Mixture-of-Experts routing, dispatch (permute by expert) and combine (weighted un-permute).

Layouts (row-major; the calls make inputs contiguous):
  h        [T, D] (or [..., D], flattened)  fp32 | fp16 | bf16  router input
  gate_w   [E, D]        fp32 | fp16 | bf16   router weight (HF: mlp.gate.weight)
  bias     [E]           fp32 | fp16 | bf16   e_score_correction_bias (steers the choice only)
  weights  [T, k]        fp32                 mixing weights (moe_route's first output)
  ids      [T, k]        int32 (int64 accepted, converted)  expert of each (token, slot), in [0, E)
  x        [T, D]        fp32 | fp16 | bf16 | float64       activations to permute
  x_sorted [N, D]        x.dtype    rows grouped by expert; N = sum_e ceil(count_e / align) * align
  plan     MoEPlan(expert_offsets int32 [E+1], slot_token int32 [N], token_slot int32 [T, k])
             expert e owns rows [expert_offsets[e], expert_offsets[e+1]): its count_e real
             rows first, in (token, slot) order, then zero padding rows (slot_token = -1);
             token_slot[t, j] is the row that holds (t, j): x_sorted[token_slot[t, j]] == x[t].
  y_sorted [N, D]        fp32 | fp16 | bf16 | float64       expert outputs in x_sorted's row order
  out      [T, D]        y_sorted.dtype, accumulated in fp32 (float64 for float64)

moe_route returns ids by decreasing biased score (ties: lower expert id first
on "cpp"); weights are the un-biased sigmoid scores of the chosen experts,
normalised if norm_topk_prob, times routed_scaling_factor.

Autograd: moe_route's weights are differentiable in h and gate_w (ids and
the choice are not, bias gets no grad); moe_dispatch in x (backward: a
gather-sum through token_slot, i.e. moe_combine with unit weights), moe_combine in y_sorted
(scatter of weight * grad into the chosen rows, zero padding rows) and in
weights (dweights[t, j] = grad[t] . y_sorted[token_slot[t, j]]).

fused_moe (the routed-expert layer, transformers' GlmMoeDsaExperts):
  w_gate_up [E, 2I, D]   x.dtype    gate rows 0..I-1, up rows I..2I-1 (HF gate_up_proj)
  w_down    [E, D, I]    x.dtype    HF down_proj
  weights   [T, k]       fp32 | fp16 | bf16 | float64, ids [T, k] as above
  out       [T, D]       x.dtype: sum_j weights[t,j] * W_down[e] (silu(g) * u), [g; u] = W_gate_up[e] x[t]
  Differentiable in x, w_gate_up, w_down and weights (fused_moe_bwd recomputes
  the gate/up activations; nothing but the inputs is saved).

Semantics: glm5_ops/reference.py (moe_route, moe_dispatch, moe_combine, fused_moe);
argument contract and degenerate shapes: docs/OPS.md.
Backends: glm5_ops/_backend.py ("cpp", "reference"; "triton" for moe_route and
fused_moe through glm5_ops/triton/moe.py).
"""
from __future__ import annotations

import torch

from . import _checks as check
from . import reference
from ._backend import _C, cpp_ops, define_triton_ops, dispatch, register_op, triton_ops
from .moe_plan import MoEPlan


MOE_FLOAT_DTYPES = check.FLOAT_DTYPES + (torch.float64,)
_INT32_MAX = check.INT32_MAX


# moe_dispatch's bound on num_experts (csrc/checks.h states it too): the kernels keep per-expert
# counters and offsets [E+1], so one huge int must not allocate gigabytes (GLM-5 has 256 experts).
MAX_EXPERTS = 1 << 20
# moe_dispatch's bound on align: a block GEMM's row tile (GLM-5's kernels use 16..256). Each
# expert with a token pads to a multiple of align, so align alone can ask for align rows from
# one token (2^31 - 1 tried to allocate 16 GiB); bounded, x_sorted is at most MAX_ALIGN times x.
# The raw op (csrc/checks.h) states the same bound.
MAX_ALIGN = 1 << 12


def _int(value, name: str, lo: int, hi: int = _INT32_MAX) -> int:
    return check.int_in_range(value, name, lo, hi)


def _ids_in_range(ids: torch.Tensor, hi: int, name: str, what: str) -> None:
    if not check.host_value_check(ids):
        return
    lo_v, hi_v = int(ids.min()), int(ids.max())
    if lo_v < 0 or hi_v >= hi:
        raise ValueError(f"{name} must hold {what} in [0, {hi}), got values in [{lo_v}, {hi_v}]")


# ------------------------------------------------------------------ routing --

def moe_route(h, gate_w, bias, *, top_k: int, n_group: int = 1, topk_group: int = 1,
              routed_scaling_factor: float = 1.0, norm_topk_prob: bool = True):
    """GLM-5's router (transformers' GlmMoeDsaTopkRouter, DeepSeek-V3 "noaux_tc"), fused.

    Returns (weights fp32 [T, top_k], ids int32 [T, top_k]):
      scores = sigmoid(h @ gate_w^T) in fp32; choice = scores + bias
      group g = experts [g*E/n_group, (g+1)*E/n_group), scored by the sum of its top-2 choices;
      only the topk_group best groups compete; ids = top_k experts by choice (decreasing);
      weights = scores[ids], / (sum + 1e-20) if norm_topk_prob, * routed_scaling_factor."""
    check.tensor(h, "h", "[T,D]")
    if h.dim() < 2:
        raise ValueError(f"h must have shape [T,D] (rank >= 2), got shape {tuple(h.shape)}")
    h2 = h.reshape(-1, h.shape[-1])
    D = h2.shape[1]
    check.tensor(gate_w, "gate_w", f"[E,D={D}]", rank=2)
    check.dim(gate_w, "gate_w", f"[E,D={D}]", 1, D, "D")
    E = gate_w.shape[0]
    if E < 2:  # the group score sums each group's top 2
        raise ValueError(f"gate_w must have shape [E,D={D}] with E >= 2 experts, got shape {tuple(gate_w.shape)}")
    check.tensor(bias, "bias", f"[E={E}]", rank=1)
    check.dim(bias, "bias", f"[E={E}]", 0, E, "E")
    _int(n_group, "n_group", 1, E // 2)
    if E % n_group:
        raise ValueError(f"n_group must divide the E={E} experts of gate_w into groups of at least 2 experts "
                         f"(the group score sums each group's top 2), got {n_group}")
    _int(topk_group, "topk_group", 1, n_group)
    _int(top_k, "top_k", 1, topk_group * (E // n_group))
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)):
        raise TypeError(f"routed_scaling_factor must be a float, got {type(routed_scaling_factor).__name__}")
    device = check.same_device(h=h2, gate_w=gate_w, bias=bias)
    h2, gate_w, bias = h2.contiguous(), gate_w.contiguous(), bias.contiguous()
    args = dict(top_k=top_k, n_group=n_group, topk_group=topk_group,
                routed_scaling_factor=float(routed_scaling_factor), norm_topk_prob=bool(norm_topk_prob))
    return dispatch("moe_route", device, {
        "cpp": lambda: cpp_ops().moe_route(h2, gate_w, bias, top_k, n_group, topk_group,
                                           float(routed_scaling_factor), bool(norm_topk_prob)),
        "triton": lambda: triton_ops(device).moe_route(h2, gate_w, bias, top_k, n_group, topk_group,
                                                       float(routed_scaling_factor), bool(norm_topk_prob)),
        "reference": lambda: reference.moe_route(h2, gate_w, bias, **args),
    })


# ----------------------------------------------------------------- dispatch --

def moe_dispatch(x, ids, num_experts: int, *, align: int = 1):
    """Counting-sort permutation of the (token, slot) pairs by expert.

    Returns (x_sorted [N, D] in x.dtype, MoEPlan). Rows of one expert are
    contiguous, real rows in (token, slot) order, then zero padding up to a
    multiple of `align` (for block GEMM kernels; align=1: no padding, N = T*k).
    Differentiable with respect to x."""
    check.tensor(x, "x", "[T,D]", rank=2, dtypes=MOE_FLOAT_DTYPES)
    T = x.shape[0]
    check.tensor(ids, "ids", f"[T={T},k]", rank=2, dtypes=check.INDEX_DTYPES)
    check.dim(ids, "ids", f"[T={T},k]", 0, T, "T")
    _int(num_experts, "num_experts", 1, MAX_EXPERTS)
    _int(align, "align", 1, MAX_ALIGN)
    device = check.same_device(x=x, ids=ids)
    _ids_in_range(ids, num_experts, "ids", "expert ids")
    if T * ids.shape[1] + num_experts * (align - 1) > _INT32_MAX:
        raise ValueError(f"ids, num_experts and align must give T*k + num_experts*(align-1) sorted rows that fit "
                         f"int32, got T={T}, k={ids.shape[1]}, num_experts={num_experts}, align={align}")
    x, ids = x.contiguous(), ids.to(torch.int32).contiguous()

    def cpp():
        x_sorted, offsets, slot_token, token_slot = cpp_ops().moe_dispatch(x, ids, num_experts, align)
        return x_sorted, MoEPlan(offsets, slot_token, token_slot)

    return dispatch("moe_dispatch", device, {
        "cpp": cpp,
        "reference": lambda: reference.moe_dispatch(x, ids, num_experts, align=align),
    })


def moe_combine(y_sorted, plan, weights):
    """Weighted un-permute: out[t] = sum_j weights[t, j] * y_sorted[token_slot[t, j]].

    plan: the MoEPlan of moe_dispatch, or its token_slot int32 [T, k]. Returns
    [T, D] in y_sorted.dtype, accumulated in fp32 (float64 if an input is
    float64), slots summed in order; a gather (deterministic, no atomics).
    Differentiable with respect to y_sorted and weights."""
    check.tensor(y_sorted, "y_sorted", "[N,D]", rank=2, dtypes=MOE_FLOAT_DTYPES)
    if isinstance(plan, MoEPlan):
        token_slot = plan.token_slot
    elif isinstance(plan, torch.Tensor):
        token_slot = plan
    else:
        raise TypeError(f"plan must be a MoEPlan or the token_slot tensor [T,k], got {type(plan).__name__}")
    check.tensor(token_slot, "token_slot", "[T,k]", rank=2, dtypes=check.INDEX_DTYPES)
    T, k = token_slot.shape
    check.tensor(weights, "weights", f"[T,k]=[{T},{k}]", rank=2, dtypes=MOE_FLOAT_DTYPES)
    if tuple(weights.shape) != (T, k):
        raise ValueError(f"weights must have shape [T,k]=[{T},{k}] like the plan's token_slot (ids), "
                         f"got shape {tuple(weights.shape)}")
    device = check.same_device(y_sorted=y_sorted, token_slot=token_slot, weights=weights)
    _ids_in_range(token_slot, y_sorted.shape[0], "token_slot", "rows of y_sorted")
    y_sorted, weights = y_sorted.contiguous(), weights.contiguous()
    token_slot = token_slot.to(torch.int32).contiguous()
    return dispatch("moe_combine", device, {
        "cpp": lambda: cpp_ops().moe_combine(y_sorted, token_slot, weights),
        "reference": lambda: reference.moe_combine(y_sorted, token_slot, weights),
    })


# --------------------------------------------------------------- fused_moe --

def fused_moe(x, w_gate_up, w_down, weights, ids):
    """The routed experts in one call: dispatch by expert, grouped SwiGLU, weighted combine.

    x [T, D]; w_gate_up [E, 2I, D] and w_down [E, D, I] in x.dtype (HF layout);
    weights [T, k] (moe_route's mixing weights); ids int32/int64 [T, k] in [0, E).
    Returns [T, D] in x.dtype, computed in fp32 (float64 for float64):
        out[t] = sum_j weights[t, j] * swiglu_expert(x[t], w_gate_up[ids[t, j]], w_down[ids[t, j]])
    except on CUDA in fp16/bf16 above a small size, where the tensor-core GEMMs take
    16-bit inputs: gate/up, h and y (and the backward's intermediates) are rounded
    to x.dtype between them, as transformers' expert loop does.
    An expert may get no token, and a token may pick one expert twice.
    Differentiable in x, w_gate_up, w_down and weights."""
    check.tensor(x, "x", "[T,D]", rank=2, dtypes=MOE_FLOAT_DTYPES)
    T, D = x.shape
    check.tensor(w_gate_up, "w_gate_up", f"[E,2I,D={D}]", rank=3, dtypes=MOE_FLOAT_DTYPES)
    if w_gate_up.shape[2] != D or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must have shape [E,2I,D={D}] (an even number of gate+up rows), "
                         f"got shape {tuple(w_gate_up.shape)}")
    E, I = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    check.nonempty(w_gate_up, "w_gate_up", f"[E,2I,D={D}]", 0, "E")
    check.tensor(w_down, "w_down", f"[E={E},D={D},I={I}]", rank=3, dtypes=MOE_FLOAT_DTYPES)
    if tuple(w_down.shape) != (E, D, I):
        raise ValueError(f"w_down must have shape [E={E},D={D},I={I}] to match w_gate_up, "
                         f"got shape {tuple(w_down.shape)}")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if w.dtype != x.dtype:
            raise TypeError(f"{name} must have the dtype of x ({check.dtype_name(x.dtype)}), got {check.dtype_name(w.dtype)}")
    check.tensor(ids, "ids", f"[T={T},k]", rank=2, dtypes=check.INDEX_DTYPES)
    check.dim(ids, "ids", f"[T={T},k]", 0, T, "T")
    k = ids.shape[1]
    check.tensor(weights, "weights", f"[T,k]=[{T},{k}]", rank=2, dtypes=MOE_FLOAT_DTYPES)
    if tuple(weights.shape) != (T, k):
        raise ValueError(f"weights must have shape [T,k]=[{T},{k}] like ids, got shape {tuple(weights.shape)}")
    if T * k > _INT32_MAX:
        raise ValueError(f"ids must have at most 2^31-1 (token, slot) pairs T*k, got T={T}, k={k}")
    device = check.same_device(x=x, w_gate_up=w_gate_up, w_down=w_down, weights=weights, ids=ids)
    _ids_in_range(ids, E, "ids", f"expert ids of w_gate_up's E={E} experts")
    x, w_gate_up, w_down = x.contiguous(), w_gate_up.contiguous(), w_down.contiguous()
    weights, ids = weights.contiguous(), ids.to(torch.int32).contiguous()
    return dispatch("fused_moe", device, {
        "cpp": lambda: cpp_ops().fused_moe_fwd(x, w_gate_up, w_down, weights, ids),
        "triton": lambda: triton_ops(device).fused_moe_fwd(x, w_gate_up, w_down, weights, ids),
        "reference": lambda: reference.fused_moe(x, w_gate_up, w_down, weights, ids),
    })


# ------------------------------------------- register_fake and autograd --
# One mechanism on every backend: the C++ ops (glm5::) and the Triton kernels
# (glm5_triton::, same schemas) register the fakes and the autograd formulas
# below, the backward calling its own namespace's backward op; "reference"
# differentiates through the oracle.

def _acc(*tensors) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _moe_route_fake(h, gate_w, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob):
    T = h.shape[0]
    return h.new_empty((T, top_k), dtype=torch.float32), h.new_empty((T, top_k), dtype=torch.int32)


def _route_setup(ctx, inputs, output):
    h, gate_w, _bias, _top_k, _n_group, _topk_group, ctx.scale, ctx.norm = inputs
    ctx.save_for_backward(h, gate_w, output[1])
    ctx.mark_non_differentiable(output[1])


def _route_backward(ctx, grad_weights, _grad_ids):
    """weights = c * s[ids] (/ (sum_j s[ids_j] + 1e-20) if norm), s = sigmoid(h @ gate_w^T).
    The logits are recomputed (one GEMM, as in the forward) in fp32, float64 for
    float64 inputs; ids and the choice are not differentiable, bias gets no grad."""
    h, gate_w, ids = ctx.saved_tensors
    acc = _acc(h, gate_w, grad_weights)
    hf, wf, rows = h.to(acc), gate_w.to(acc), ids.long()
    s = torch.sigmoid(hf @ wf.T).gather(1, rows)                       # [T, k]
    ds = grad_weights.to(acc) * ctx.scale
    if ctx.norm:   # d(s_j / z) / ds_i = (delta_ij - s_j / z) / z, z = sum_i s_i + 1e-20
        z = s.sum(-1, keepdim=True) + 1e-20
        ds = (ds - (ds * s).sum(-1, keepdim=True) / z) / z
    dlogits = torch.zeros(h.shape[0], gate_w.shape[0], dtype=acc, device=h.device)
    dlogits.scatter_add_(1, rows, ds * s * (1 - s))
    dh = (dlogits @ wf).to(h.dtype) if ctx.needs_input_grad[0] else None
    dgate_w = (dlogits.T @ hf).to(gate_w.dtype) if ctx.needs_input_grad[1] else None
    return dh, dgate_w, None, None, None, None, None, None


def _moe_dispatch_fake(x, ids, num_experts, align):
    T, D = x.shape
    k = ids.shape[1]
    if align == 1:
        N = T * k
    else:  # the padding depends on the ids: a data-dependent row count
        N = torch.library.get_ctx().new_dynamic_size()
    return (x.new_empty((N, D)), x.new_empty((num_experts + 1,), dtype=torch.int32),
            x.new_empty((N,), dtype=torch.int32), x.new_empty((T, k), dtype=torch.int32))


def _dispatch_setup(ctx, inputs, output):
    ctx.save_for_backward(output[3])


def _dispatch_backward(ctx, grad_x_sorted, _g_offsets, _g_slot_token, _g_token_slot):
    if grad_x_sorted is None:
        return None, None, None, None
    (token_slot,) = ctx.saved_tensors
    ones = torch.ones(token_slot.shape, dtype=_acc(grad_x_sorted), device=token_slot.device)
    # dx[t] = sum_j grad[token_slot[t, j]]: combine with unit weights (exact products).
    dx = torch.ops.glm5.moe_combine(grad_x_sorted.contiguous(), token_slot, ones)
    return dx, None, None, None


def _moe_combine_fake(y_sorted, token_slot, weights):
    return y_sorted.new_empty((token_slot.shape[0], y_sorted.shape[1]))


def _combine_setup(ctx, inputs, output):
    y_sorted, token_slot, weights = inputs
    ctx.save_for_backward(y_sorted, token_slot, weights)


def _combine_backward(ctx, grad):
    y_sorted, token_slot, weights = ctx.saved_tensors
    T, k = token_slot.shape
    N, D = y_sorted.shape
    acc = _acc(y_sorted, weights, grad)
    rows = token_slot.reshape(-1).long()
    g = grad.to(acc)
    dy = dw = None
    if ctx.needs_input_grad[0]:
        # Scatter weight * grad into each (t, j)'s row; padding rows get zero.
        contrib = (weights.to(acc)[:, :, None] * g[:, None, :]).reshape(T * k, D)
        dy = torch.zeros((N, D), dtype=acc, device=grad.device).index_add(0, rows, contrib).to(y_sorted.dtype)
    if ctx.needs_input_grad[2]:
        gathered = y_sorted.to(acc).index_select(0, rows).reshape(T, k, D)
        dw = torch.bmm(gathered, g[:, :, None]).reshape(T, k).to(weights.dtype)
    return dy, None, dw


def _fused_moe_fwd_fake(x, w_gate_up, w_down, weights, ids):
    return x.new_empty(x.shape)


def _fused_moe_bwd_fake(dout, x, w_gate_up, w_down, weights, ids):
    return x.new_empty(x.shape), w_gate_up.new_empty(w_gate_up.shape), w_down.new_empty(w_down.shape), \
        weights.new_empty(weights.shape)


def _fused_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # the inputs only: the backward recomputes the activations


def _fused_backward(ops):
    def backward(ctx, grad):
        x, w_gate_up, w_down, weights, ids = ctx.saved_tensors
        dx, dwgu, dwd, dw = ops.fused_moe_bwd(grad.contiguous(), x, w_gate_up, w_down, weights, ids)
        return dx, dwgu, dwd, dw, None
    return backward


if _C is not None:
    define_triton_ops("moe", ("moe_route", "fused_moe_fwd", "fused_moe_bwd"))
    register_op("moe_route", _moe_route_fake, lambda ops: _route_backward, _route_setup)
    register_op("fused_moe_fwd", _fused_moe_fwd_fake, _fused_backward, _fused_setup)
    register_op("fused_moe_bwd", _fused_moe_bwd_fake)
    register_op("moe_dispatch", _moe_dispatch_fake, lambda ops: _dispatch_backward, _dispatch_setup,
                namespaces=("glm5",))
    register_op("moe_combine", _moe_combine_fake, lambda ops: _combine_backward, _combine_setup,
                namespaces=("glm5",))
