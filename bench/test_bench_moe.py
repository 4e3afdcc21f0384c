"""MoE routing, dispatch and combine: moe_route vs the reference router (the
torch-op chain transformers runs), dispatch+combine vs an argsort-based
permute / index_add un-permute. One pytest-benchmark group per op and shape,
ours and the baseline side by side; FLOPs and bytes counted.

    GLM5_BUILD_CUDA=0 python -m pytest bench/test_bench_moe.py --benchmark-json=moe.json
"""
import pytest
import torch

import glm5_ops
from conftest import DEVICE
from glm5_ops import moe, reference

# GLM-5's router: 256 experts in 8 groups, 4 groups kept, top-8, scaling 2.5.
ROUTER = dict(E=256, n_group=8, topk_group=4, top_k=8, routed_scaling_factor=2.5)
ROUTE_SHAPES = [(4096, 1024), (512, 6144)]  # (T, D); D=6144 is GLM-5's hidden size
PERMUTE = dict(T=4096, k=8, D=1024, E=256)


def _run(benchmark, fn, rounds):
    benchmark.pedantic(fn, rounds=rounds, warmup_rounds=1, iterations=1)


def _route_args():
    return dict(top_k=ROUTER["top_k"], n_group=ROUTER["n_group"], topk_group=ROUTER["topk_group"],
                routed_scaling_factor=ROUTER["routed_scaling_factor"], norm_topk_prob=True)


@pytest.mark.parametrize("impl", ["ours", "baseline", "sgemm"])
@pytest.mark.parametrize("T,D", ROUTE_SHAPES, ids=[f"T{t}-D{d}" for t, d in ROUTE_SHAPES])
def test_moe_route(benchmark, T, D, impl):
    E = ROUTER["E"]
    benchmark.group = f"moe_route T={T} E={E} D={D} groups 8/4 top-8 fp32"
    torch.manual_seed(0)
    h = torch.randn(T, D, device=DEVICE)
    gate_w = torch.randn(E, D, device=DEVICE) * D ** -0.5
    bias = torch.randn(E, device=DEVICE) * 0.05

    def ours():
        with glm5_ops.use_backend("cpp"):
            return moe.moe_route(h, gate_w, bias, **_route_args())

    fns = {"ours": ours, "baseline": lambda: reference.moe_route(h, gate_w, bias, **_route_args()),
           "sgemm": lambda: torch.mm(h, gate_w.t())}
    names = {"ours": "glm5 moe_route (sgemm + fused per-token selection)",
             "baseline": "reference router (HF GlmMoeDsaTopkRouter ops: linear, sigmoid, topk x3, scatter)",
             "sgemm": "the logits sgemm alone (bound)"}
    benchmark.extra_info.update(role={"ours": "ours", "baseline": "baseline"}.get(impl, "variant"), impl=names[impl],
                                flops=2 * T * E * D, bytes=4 * (T * D + E * D) + 8 * T * ROUTER["top_k"],
                                ceiling="matmul")
    _run(benchmark, fns[impl], rounds=10)


def _permute_inputs(T, k, D, E):
    torch.manual_seed(0)
    x = torch.randn(T, D, device=DEVICE)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(device=DEVICE, dtype=torch.int32)
    weights = torch.rand(T, k, device=DEVICE)
    return x, ids, weights


def argsort_dispatch(x, ids, num_experts):
    """The common torch permute (HF/torchtitan style): stable argsort of the
    flattened ids, bincount offsets, index_select of the token rows."""
    k = ids.shape[1]
    flat = ids.reshape(-1).long()
    order = flat.argsort(stable=True)
    offsets = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0)
    token = order // k
    return x.index_select(0, token), order, token, offsets


def argsort_combine(y_sorted, order, token, weights, T):
    """The matching un-permute: scale each row by its weight, index_add into the tokens."""
    out = torch.zeros(T, y_sorted.shape[1], dtype=y_sorted.dtype, device=y_sorted.device)
    return out.index_add_(0, token, y_sorted * weights.reshape(-1)[order, None])


@pytest.mark.parametrize("impl", ["ours", "ours-align64", "baseline", "reference"])
def test_moe_dispatch_combine(benchmark, impl):
    c = PERMUTE
    T, k, D, E = c["T"], c["k"], c["D"], c["E"]
    benchmark.group = f"moe_dispatch+moe_combine T={T} k={k} D={D} E={E} fp32"
    x, ids, weights = _permute_inputs(**c)

    def ours(align):
        def fn():
            with glm5_ops.use_backend("cpp"):
                xs, plan = moe.moe_dispatch(x, ids, E, align=align)
                return moe.moe_combine(xs, plan, weights)  # identity experts: y_sorted = x_sorted
        return fn

    def baseline():
        xs, order, token, _ = argsort_dispatch(x, ids, E)
        return argsort_combine(xs, order, token, weights, T)

    def ref():
        xs, plan = reference.moe_dispatch(x, ids, E)
        return reference.moe_combine(xs, plan, weights)

    fns = {"ours": ours(1), "ours-align64": ours(64), "baseline": baseline, "reference": ref}
    names = {"ours": "glm5 moe_dispatch + moe_combine (counting sort, gather)",
             "ours-align64": "glm5, segments padded to 64 rows",
             "baseline": "argsort + index_select, index_add un-permute", "reference": "reference oracles"}
    N = T * k
    benchmark.extra_info.update(role={"ours": "ours", "baseline": "baseline"}.get(impl, "variant"), impl=names[impl],
                                bytes=4 * D * (T + N) * 2 + 4 * T * k * 3, ceiling="bandwidth")
    _run(benchmark, fns[impl], rounds=10)


@pytest.mark.parametrize("impl", ["ours", "baseline"])
@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_moe_permute_parts(benchmark, op, impl):
    c = PERMUTE
    T, k, D, E = c["T"], c["k"], c["D"], c["E"]
    benchmark.group = f"moe_{op} T={T} k={k} D={D} E={E} fp32"
    x, ids, weights = _permute_inputs(**c)
    xs, order, token, _ = argsort_dispatch(x, ids, E)
    with glm5_ops.use_backend("cpp"):
        _, plan = moe.moe_dispatch(x, ids, E)

    def run_ours():
        with glm5_ops.use_backend("cpp"):
            return moe.moe_dispatch(x, ids, E) if op == "dispatch" else moe.moe_combine(xs, plan, weights)

    def run_base():
        return argsort_dispatch(x, ids, E) if op == "dispatch" else argsort_combine(xs, order, token, weights, T)

    N = T * k
    benchmark.extra_info.update(role=impl, impl=("glm5 moe_" + op) if impl == "ours" else
                                ("argsort + index_select" if op == "dispatch" else "index_add un-permute"),
                                bytes=4 * D * (T + N) + 4 * T * k * 2, ceiling="bandwidth")
    _run(benchmark, run_ours if impl == "ours" else run_base, rounds=10)
