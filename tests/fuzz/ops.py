"""What the fuzzer calls: for each op, a valid argument list drawn with
hypothesis (shapes with 0, 1 and odd sizes, every dtype the op takes,
non-contiguous and stride-0 layouts), in the order of its signature.

Each builder gets `draw` (hypothesis's) and a Dims helper, and returns a list of
Arg. The mutations in cases.py then break one argument at a time, so a builder
only has to describe valid input. `bound` on an index tensor is its exclusive
upper limit (what an out-of-range mutation goes past).

To fuzz a new op: add a builder here and its entries in PUBLIC / RAW below
(docs/FUZZING.md, "Adding an op").
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st

from .spec import tensor

FLOATS = ("float32", "float16", "bfloat16")
MOE_FLOATS = FLOATS + ("float64",)
LAYOUTS = ("contig", "contig", "contig", "noncontig", "transposed", "expanded")


@dataclass
class Arg:
    name: str          # as spelled in the signature: what an error message must name
    value: object      # JSON spec (spec.py)
    kind: str          # float_t | index_t | int8_t | none | int | float | bool | str | q_start | shape | dtype | mask
    kw: bool = False   # passed by keyword
    bound: int = 0     # index_t: exclusive upper bound of valid entries
    extra: dict = field(default_factory=dict)


class Dims:
    """Draws sizes: mostly 0-9 (hypothesis favours 0 and 1), sometimes an odd
    size past a tile edge; `small` (the Triton interpreter) caps them;
    `nonzero` keeps every size >= 1."""

    def __init__(self, draw, small: bool, nonzero: bool = False):
        self.draw, self.small, self.nonzero = draw, small, nonzero

    def __call__(self, lo: int = 0, hi: int = 9, big=(17, 33, 65)) -> int:
        if self.nonzero:   # a mutated case: only the mutation should make it invalid
            lo = max(lo, 1)
        if self.small:
            return self.draw(st.one_of(st.integers(max(lo, 1), min(hi, 5)), st.integers(lo, min(hi, 5))))
        # 0 (or lo) comes from the middle branch only: most cases keep every dim non-empty
        branches = [st.integers(max(lo, 1), hi), st.integers(lo, hi)]
        if any(b >= lo for b in big):
            branches.append(st.sampled_from([b for b in big if b >= lo]))
        return self.draw(st.one_of(*branches))


def _layout(draw) -> str:
    return draw(st.sampled_from(LAYOUTS))


def _ft(draw, name, shape, dtype, kw=False) -> Arg:
    return Arg(name, tensor(shape, dtype, "randn", _layout(draw)), "float_t", kw)


def _it(draw, name, shape, fill, bound, dtypes=("int32", "int64"), kw=False) -> Arg:
    return Arg(name, tensor(shape, draw(st.sampled_from(dtypes)), fill, _layout(draw)), "index_t", kw, bound)


def _q_start(draw, B, T, S, raw: bool) -> Arg:
    """None, an int (public API only) or an int tensor [B]; valid values keep
    query 0 at or before the last key."""
    hi = max(T - S, 0)
    choices = [st.none(), st.builds(lambda v, d: tensor([B], d, f"randint:0:{v + 1}"), st.integers(0, hi),
                                    st.sampled_from(["int32", "int64"]))]
    if not raw:
        choices.append(st.integers(0, hi))
    return Arg("q_start", draw(st.one_of(*choices)), "q_start", not raw, extra={"B": B, "T": T})


def _flag(draw, name, raw):
    return Arg(name, draw(st.booleans()), "bool", not raw)


# ------------------------------------------------------------------ indexer --

def indexer(draw, d: Dims, raw: bool, fused: bool):
    B, S, H, D, T = d(0, 3, ()), d(), d(1, 4, ()), d(0, 17), d()
    dt = draw(st.sampled_from(FLOATS))
    args = [_ft(draw, "q", [B, S, H, D], dt), _ft(draw, "w", [B, S, H], draw(st.sampled_from(FLOATS))),
            _ft(draw, "k", [B, T, D], dt)]
    if fused:
        args.append(Arg("topk", draw(st.integers(1, max(T, 1))), "int"))
    return args + [_flag(draw, "causal", raw), _q_start(draw, B, T, S, raw)]


def topk_indices(draw, d: Dims, raw: bool):
    lead = [d(0, 4, ()) for _ in range(draw(st.integers(0, 2)))]
    T = d(1, 40, big=(65, 300, 1000))
    return [_ft(draw, "scores", lead + [T], draw(st.sampled_from(FLOATS))),
            Arg("k", draw(st.integers(1, T)), "int"), Arg("sorted", draw(st.booleans()), "bool", not raw)]


# ---------------------------------------------------------------- attention --

def _qkv(draw, d: Dims):
    B, S, T, Hkv, G, Dk = d(0, 3, ()), d(), d(1), d(1, 3, ()), d(1, 3, ()), d(0, 17)
    Dv = draw(st.integers(min(Dk, 1), max(Dk, 1)))
    dt = draw(st.sampled_from(FLOATS))
    shapes = dict(B=B, S=S, T=T, Hq=Hkv * G, Hkv=Hkv, Dk=Dk, Dv=Dv, dt=dt)
    return shapes, [_ft(draw, "q", [B, S, Hkv * G, Dk], dt), _ft(draw, "k", [B, T, Hkv, Dk], dt),
                    _ft(draw, "v", [B, T, Hkv, Dv], dt)]


def _scale(draw, raw: bool) -> Arg:
    if raw:
        return Arg("scale", draw(st.floats(0.01, 4.0)), "float")
    return Arg("scale", draw(st.one_of(st.none(), st.floats(0.01, 4.0))), "float", True)


def _grads(draw, s, with_out: bool):
    """dout (and out, lse) of the attention backward schemas."""
    o = [s["B"], s["S"], s["Hq"], s["Dv"]]
    return _ft(draw, "dout", o, s["dt"]), _ft(draw, "out", o, s["dt"]), _ft(draw, "lse", o[:3], "float32")


def sparse_attention(draw, d: Dims, raw: bool, backward: bool = False):
    s, qkv = _qkv(draw, d)
    topk = d(0, 9, ())
    idx = _it(draw, "indices", [s["B"], s["S"], topk], f"rows:{s['T']}", s["T"],
              ("int32",) if raw else ("int32", "int64"))
    tail = [_scale(draw, raw), _flag(draw, "causal", raw), _q_start(draw, s["B"], s["T"], s["S"], raw)]
    if not backward:
        return qkv + [idx] + tail
    dout, out, lse = _grads(draw, s, True)
    return [dout] + qkv + [idx, out, lse] + tail


def _mask_tensors(draw, d: Dims, s, raw: bool):
    bs = draw(st.one_of(st.integers(1, 9), st.sampled_from([16, 64])))
    Qb, Kb = -(-s["S"] // bs), -(-s["T"] // bs)
    W = draw(st.integers(0, Kb + 1))
    Bm = s["B"] if raw else draw(st.sampled_from([s["B"], 1]))
    Hm = s["Hq"] if raw else draw(st.sampled_from([s["Hq"], 1]))
    dts = ("int32",) if raw else ("int32", "int64")
    num = _it(draw, "kv_num_blocks", [Bm, Hm, Qb], f"randint:0:{min(W, Kb) + 1}", min(W, Kb) + 1, dts)
    idx = _it(draw, "kv_indices", [Bm, Hm, Qb, W], f"rows:{Kb}", Kb, dts)
    return bs, num, idx


def block_sparse_attention(draw, d: Dims, raw: bool, backward: bool = False):
    s, qkv = _qkv(draw, d)
    bs, num, idx = _mask_tensors(draw, d, s, raw)
    tail = [_scale(draw, raw), _flag(draw, "causal", raw), _q_start(draw, s["B"], s["T"], s["S"], raw)]
    if not raw:
        mask = Arg("block_mask", {"tuple": [num.value, idx.value, bs]}, "mask", extra={"parts": (num, idx)})
        return qkv + [mask] + tail
    block = [num, idx]
    bs_arg = Arg("block_size", bs, "int")
    if not backward:
        return qkv + block + [bs_arg] + tail
    dout, out, lse = _grads(draw, s, True)
    return [dout] + qkv + block + [out, lse, bs_arg] + tail


def block_topk_mask(draw, d: Dims, raw: bool):
    B, S, T, Hkv, G, D = d(0, 3, ()), d(), d(), d(1, 3, ()), d(1, 3, ()), d(0, 17)
    dt = draw(st.sampled_from(FLOATS))
    ints = [Arg(n, draw(st.integers(lo, hi)), "int", not raw) for n, lo, hi in
            (("block_size", 1, 9), ("topk_blocks", 0, 4))]
    flags = [_flag(draw, "causal", raw)]
    more = [Arg(n, draw(st.integers(0, 2)), "int", not raw) for n in ("sink_blocks", "local_blocks")]
    pooling = Arg("pooling", draw(st.sampled_from(["mean", "minmax"])), "str", not raw)
    return ([_ft(draw, "q", [B, S, Hkv * G, D], dt), _ft(draw, "k", [B, T, Hkv, D], dt)] + ints + flags + more
            + [pooling, _q_start(draw, B, T, S, raw)])


# ---------------------------------------------------------------------- MoE --

def moe_route(draw, d: Dims, raw: bool):
    T, D, n_group, per = d(0, 9), d(1, 17), draw(st.integers(1, 3)), draw(st.integers(2, 4))
    E = n_group * per
    topk_group = draw(st.integers(1, n_group))
    lead = [T] if raw or draw(st.booleans()) else [draw(st.integers(0, 2)), T]
    return [_ft(draw, "h", lead + [D], draw(st.sampled_from(FLOATS))),
            _ft(draw, "gate_w", [E, D], draw(st.sampled_from(FLOATS))),
            _ft(draw, "bias", [E], draw(st.sampled_from(FLOATS))),
            Arg("top_k", draw(st.integers(1, topk_group * per)), "int", not raw),
            Arg("n_group", n_group, "int", not raw), Arg("topk_group", topk_group, "int", not raw),
            Arg("routed_scaling_factor", draw(st.sampled_from([1.0, 2.5, 0.5])), "float", not raw),
            _flag(draw, "norm_topk_prob", raw)]


def moe_dispatch(draw, d: Dims, raw: bool):
    T, D, k, E = d(0, 9), d(0, 9), d(0, 4), d(1, 9)
    return [_ft(draw, "x", [T, D], draw(st.sampled_from(MOE_FLOATS))),
            _it(draw, "ids", [T, k], f"randint:0:{E}", E), Arg("num_experts", E, "int"),
            Arg("align", draw(st.sampled_from([1, 1, 2, 3, 8])), "int", not raw)]


def moe_combine(draw, d: Dims, raw: bool):
    N, D, T, k = d(1, 12), d(0, 9), d(0, 9), d(0, 4)
    return [_ft(draw, "y_sorted", [N, D], draw(st.sampled_from(MOE_FLOATS))),
            _it(draw, "token_slot", [T, k], f"randint:0:{N}", N),
            _ft(draw, "weights", [T, k], draw(st.sampled_from(MOE_FLOATS)))]


def fused_moe(draw, d: Dims, raw: bool, backward: bool = False):
    T, D, I, E, k = d(0, 9), d(0, 9), d(0, 9), d(1, 5, ()), d(0, 3, ())
    dt = draw(st.sampled_from(MOE_FLOATS))
    ids = _it(draw, "ids", [T, k], f"randint:0:{E}", E, ("int32",) if raw else ("int32", "int64"))
    args = [_ft(draw, "x", [T, D], dt), _ft(draw, "w_gate_up", [E, 2 * I, D], dt),
            _ft(draw, "w_down", [E, D, I], dt), _ft(draw, "weights", [T, k], draw(st.sampled_from(MOE_FLOATS))),
            ids]
    return ([_ft(draw, "dout", [T, D], dt)] if backward else []) + args


# ------------------------------------------------------------- compression --

def quantize_groupwise(draw, d: Dims, raw: bool):
    bits = draw(st.sampled_from([8, 4, 2]))
    group = (8 // bits) * draw(st.integers(1, 4))
    lead = [d(0, 4, ()) for _ in range(draw(st.integers(0, 2)))]
    stochastic = draw(st.booleans())
    seed = draw(st.integers(0, 2**40)) if raw or stochastic else None
    return [_ft(draw, "x", lead + [group * d(0, 3, (16,))], draw(st.sampled_from(FLOATS))), Arg("bits", bits, "int"),
            Arg("group_size", group, "int"), Arg("stochastic", stochastic, "bool"), Arg("seed", seed, "int")]


def dequantize(draw, d: Dims, raw: bool):
    bits = draw(st.sampled_from([8, 4, 2]))
    group = (8 // bits) * draw(st.integers(1, 4))
    shape = [d(0, 4, ()) for _ in range(draw(st.integers(0, 2)))] + [group * d(0, 3, (16,))]
    numel = 1
    for s in shape:
        numel *= s
    G = numel // group
    return [Arg("packed", tensor([numel * bits // 8], "uint8", "randint:0:256", _layout(draw)), "index_t", bound=256),
            _ft(draw, "scale", [G], "float32"), _ft(draw, "zero", [G], "float32"), Arg("bits", bits, "int"),
            Arg("group_size", group, "int"), Arg("shape", shape, "shape"),
            Arg("dtype", {"dtype": draw(st.sampled_from(FLOATS))}, "dtype")]


# ------------------------------------------------------------------ linear --

def gemv(draw, d: Dims, raw: bool):
    M, K, N = d(0, 9), d(0, 9, (17, 33, 65)), d(0, 9, (17,))
    dt = draw(st.sampled_from(["float32", "bfloat16"]))
    if raw and draw(st.booleans()):   # the per-head form (gemv_heads' op call): no bias
        H = d(0, 5)
        return [_ft(draw, "x", [H, M, K], dt), _ft(draw, "w", [H, N, K], dt), Arg("bias", None, "none")]
    return [_ft(draw, "x", [M, K], dt), _ft(draw, "w", [N, K], dt), _ft(draw, "bias", [N], dt)]


def gemv_heads(draw, d: Dims, raw: bool):
    H, M, K, N = d(0, 5), d(0, 9), d(0, 9, (17, 33, 65)), d(0, 9, (17,))
    dt = draw(st.sampled_from(["float32", "bfloat16"]))
    return [_ft(draw, "x", [H, M, K], dt), _ft(draw, "w", [H, N, K], dt)]


# --------------------------------------------------------------- token ops --

def rms_norm(draw, d: Dims, raw: bool):
    lead = [d(0, 4, (17,)) for _ in range(draw(st.integers(0, 2)))]
    D, dt = d(0, 40, (65, 129)), draw(st.sampled_from(FLOATS))
    wdt = dt if raw else draw(st.sampled_from([dt, dt, "float32"]))    # the public API promotes like torch
    return [_ft(draw, "x", lead + [D], dt), _ft(draw, "weight", [D], wdt),
            Arg("eps", draw(st.sampled_from([0.0, 1e-6, 1e-5, 0.1])), "float")]


def rope(draw, d: Dims, raw: bool):
    B, S, half = d(0, 4, ()), d(0, 9, (17,)), d(0, 8, (16, 32))
    D = 2 * half + d(0, 3, ())
    heads = [d(1, 5, (16,))] if draw(st.booleans()) else []
    dt = draw(st.sampled_from(FLOATS))
    return [_ft(draw, "x", [B, S] + heads + [D], dt), _ft(draw, "cos", [B, S, half], dt),
            _ft(draw, "sin", [B, S, half], dt), Arg("rotary_dim", 2 * half, "int")]


# --------------------------------------------------------------------- INT8 --

def _i8(draw, name, shape) -> Arg:
    """An int8 weight as quantize_int8 makes them: values in [-127, 127]."""
    return Arg(name, tensor(shape, "int8", "randint:-127:128", _layout(draw)), "int8_t")


def quantize_int8(draw, d: Dims, raw: bool):
    lead = [d(0, 4, ()) for _ in range(draw(st.integers(0, 2)))]
    return [_ft(draw, "x", lead + [d(0, 40, (65, 129))], draw(st.sampled_from(FLOATS)))]


def int8_linear(draw, d: Dims, raw: bool):
    """x [..., K] (raw: [M, K]; M past W8A8_MIN_ROWS = 16 reaches the GEMM paths), w int8 [N, K],
    scale fp32 [N], bias [N] or None."""
    lead = [d(0, 20, (17, 33))] if raw else [d(0, 4, (17, 33)) for _ in range(draw(st.integers(0, 2)))]
    K, N = d(0, 40, (65,)), d(0, 40, (65,))
    dt = draw(st.sampled_from(FLOATS))
    bias = Arg("bias", None, "none")
    if draw(st.booleans()):
        bias = _ft(draw, "bias", [N], draw(st.sampled_from([dt, dt, "float32"])))
    return [_ft(draw, "x", lead + [K], dt), _i8(draw, "w", [N, K]), _ft(draw, "scale", [N], "float32"), bias]


def int8_linear_heads(draw, d: Dims, raw: bool):
    """x [H, M, K] (M past 16 reaches the model's dequantised path too), w int8 [H, N, K], scale fp32 [H, N]."""
    H, M, K, N = d(0, 5), d(0, 9, (17,)), d(0, 9, (65, 257)), d(0, 9, (17,))
    return [_ft(draw, "x", [H, M, K], draw(st.sampled_from(FLOATS))), _i8(draw, "w", [H, N, K]),
            _ft(draw, "scale", [H, N], "float32")]


def fused_moe_int8(draw, d: Dims, raw: bool):
    """T up to 33 rows, so with w8a8 an expert can get more than W8A8_MIN_ROWS rows (int8 GEMMs)."""
    T, D, I, E, k = d(0, 9, (17, 33)), d(0, 9), d(0, 9), d(1, 5, ()), d(0, 3, ())
    dt = draw(st.sampled_from(FLOATS))
    ids = _it(draw, "ids", [T, k], f"randint:0:{E}", E, ("int32",) if raw else ("int32", "int64"))
    return [_ft(draw, "x", [T, D], dt), _i8(draw, "w_gate_up", [E, 2 * I, D]),
            _ft(draw, "gate_up_scale", [E, 2 * I], "float32"), _i8(draw, "w_down", [E, D, I]),
            _ft(draw, "down_scale", [E, D], "float32"),
            _ft(draw, "weights", [T, k], draw(st.sampled_from(MOE_FLOATS))), ids,
            Arg("w8a8", draw(st.booleans()), "bool", not raw)]


# -------------------------------------------------------------- paged cache --

def cache_write(draw, d: Dims, raw: bool):
    """pool [P, D] written in place (any layout but stride 0, which makes rows share memory),
    slots int64 [N] rows of pool (repeats allowed: one of the writes lands), values [N, D]
    in pool's dtype."""
    P, D, N = d(1, 12), d(0, 9), d(0, 9, ())
    dt = draw(st.sampled_from(MOE_FLOATS))
    pool = Arg("pool", tensor([P, D], dt, "randn", draw(st.sampled_from(LAYOUTS[:-1]))), "float_t")
    return [pool, _it(draw, "slots", [N], f"randint:0:{P}", P, ("int64",)), _ft(draw, "values", [N, D], dt)]


def _fix(builder, **bound):
    return lambda draw, d, raw: builder(draw, d, raw, **bound)


# name -> (builder, backends that implement it; the others must raise NotImplementedError)
PUBLIC = {
    "indexer_scores": (_fix(indexer, fused=False), ("cpp", "reference", "triton")),
    "indexer_topk": (_fix(indexer, fused=True), ("cpp", "reference", "triton")),
    "topk_indices": (topk_indices, ("cpp", "reference", "triton")),
    "sparse_attention": (sparse_attention, ("cpp", "reference", "triton")),
    "block_topk_mask": (block_topk_mask, ("cpp", "reference", "triton")),
    "block_sparse_attention": (block_sparse_attention, ("cpp", "reference", "triton")),
    "moe_route": (moe_route, ("cpp", "reference", "triton")),
    "moe_dispatch": (moe_dispatch, ("cpp", "reference")),
    "moe_combine": (moe_combine, ("cpp", "reference")),
    "fused_moe": (fused_moe, ("cpp", "reference", "triton")),
    "quantize_groupwise": (quantize_groupwise, ("cpp", "reference", "triton")),
    "dequantize": (dequantize, ("cpp", "reference", "triton")),
    "gemv": (gemv, ("cpp", "reference")),
    "gemv_heads": (gemv_heads, ("cpp", "reference")),
    "rms_norm": (rms_norm, ("cpp", "reference", "triton")),    # torch's composite where no kernel runs
    "rope": (rope, ("cpp", "reference", "triton")),
    "quantize_int8": (quantize_int8, ("cpp", "reference", "triton")),
    "int8_linear": (int8_linear, ("cpp", "reference", "triton")),
    "w8a8_linear": (int8_linear, ("cpp", "reference", "triton")),
    "int8_linear_heads": (int8_linear_heads, ("cpp", "reference", "triton")),
    "fused_moe_int8": (fused_moe_int8, ("cpp", "reference", "triton")),
    "cache_write": (cache_write, ("cpp", "reference", "triton")),   # triton: the one C++ op (data movement)
}
# The differentiable ops, run forward then backward through autograd.
BACKWARD = ("sparse_attention", "block_sparse_attention", "fused_moe")

RAW = {
    "indexer_scores": _fix(indexer, fused=False),
    "indexer_topk": _fix(indexer, fused=True),
    "topk_indices": topk_indices,
    "block_topk_mask": block_topk_mask,
    "sparse_attention_fwd": sparse_attention,
    "sparse_attention_bwd": _fix(sparse_attention, backward=True),
    "block_sparse_attention_fwd": block_sparse_attention,
    "block_sparse_attention_bwd": _fix(block_sparse_attention, backward=True),
    "moe_route": moe_route,
    "moe_dispatch": moe_dispatch,
    "moe_combine": moe_combine,
    "fused_moe_fwd": fused_moe,
    "fused_moe_bwd": _fix(fused_moe, backward=True),
    "quantize_groupwise": quantize_groupwise,
    "dequantize": dequantize,
    "gemv": gemv,
    "rms_norm": rms_norm,
    "rope": rope,
    "int8_quantize_rows": quantize_int8,
    "int8_linear": int8_linear,
    "w8a8_linear": int8_linear,
    "int8_linear_heads": int8_linear_heads,
    "fused_moe_int8": fused_moe_int8,
    "cache_write": cache_write,
}
