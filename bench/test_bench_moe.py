"""MoE routing, dispatch and combine: moe_route vs the reference router (the
torch-op chain transformers runs), dispatch+combine vs an argsort-based
permute / index_add un-permute; fused_moe (forward, forward+backward) vs
transformers' GlmMoeDsaExperts loop, the reference loop and the dense-GEMM
bound. One pytest-benchmark group per op and shape, ours and the baseline
side by side; FLOPs and bytes counted.

    GLM5_BUILD_CUDA=0 python -m pytest bench/test_bench_moe.py --benchmark-json=moe.json
    GLM5_BENCH_SMOKE=1 ...   # shrink the fused_moe shapes (E=16, D=128, I=64) to check the bench runs
"""
import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

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


# --------------------------------------------------------------- fused_moe --
# Issue 4's acceptance shape: E=128 experts, top-8, D=1024, I=512, fp32 (the seed article's 128 experts).
SMOKE = os.environ.get("GLM5_BENCH_SMOKE") == "1"
FUSED = dict(E=16, k=8, D=128, I=64) if SMOKE else dict(E=128, k=8, D=1024, I=512)
FUSED_T = [16, 256, 4096]
HAVE_HF = importlib.util.find_spec("transformers") is not None


def _hf_experts(wgu, wd):
    """transformers' GlmMoeDsaExperts (eager loop) holding the given weights."""
    from transformers import GlmMoeDsaConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaExperts
    E, I2, D = wgu.shape
    cfg = GlmMoeDsaConfig(hidden_size=D, moe_intermediate_size=I2 // 2, n_routed_experts=E,
                          num_experts_per_tok=FUSED["k"])
    cfg._experts_implementation = "eager"
    m = GlmMoeDsaExperts(cfg).to(DEVICE)
    with torch.no_grad():
        m.gate_up_proj.copy_(wgu)
        m.down_proj.copy_(wd)
    return m


def _fused_inputs(T):
    c = FUSED
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, c["D"], generator=g).to(DEVICE)
    wgu = (torch.randn(c["E"], 2 * c["I"], c["D"], generator=g) * c["D"] ** -0.5).to(DEVICE)
    wd = (torch.randn(c["E"], c["D"], c["I"], generator=g) * c["I"] ** -0.5).to(DEVICE)
    ids = torch.stack([torch.randperm(c["E"], generator=g)[:c["k"]] for _ in range(T)]).to(DEVICE)
    weights = torch.rand(T, c["k"], generator=g).to(DEVICE)
    return x, wgu, wd, weights, ids


def _fused_info(T, impl, names, passes=1):
    """FLOPs (6 T k D I per forward: gate_up 4, down 2; the backward 12 more, +4 recomputed on "cpp"),
    bytes: the chosen experts' weights read once plus x and out; at T <= 16 the weight read is the bound."""
    c = FUSED
    chosen = min(c["E"], T * c["k"])  # distinct experts touched (at most; random routing)
    flops = 6 * T * c["k"] * c["D"] * c["I"] * passes
    bytes_ = 4 * (3 * c["I"] * c["D"] * chosen + 2 * T * c["D"])
    baseline = "hf" if HAVE_HF else "reference"
    role = "ours" if impl == "ours" else ("baseline" if impl == baseline else "variant")
    return dict(role=role, impl=names[impl], flops=flops, bytes=bytes_,
                ceiling="bandwidth" if T <= 16 and passes == 1 else "matmul")


FWD_NAMES = {"ours": "glm5 fused_moe (counting sort, grouped GEMM chain, gather combine)",
             "hf": "transformers GlmMoeDsaExperts loop (eager)",
             "reference": "reference.fused_moe (the same per-expert loop)",
             "dense": "dense-GEMM bound: one [T*k,D] matmul chain, same FLOPs",
             "permute": "moe_dispatch + moe_combine alone (identity experts)"}


@pytest.mark.parametrize("impl", list(FWD_NAMES))
@pytest.mark.parametrize("T", FUSED_T, ids=[f"T{t}" for t in FUSED_T])
def test_fused_moe_forward(benchmark, T, impl):
    c = FUSED
    benchmark.group = f"fused_moe fwd T={T} E={c['E']} k={c['k']} D={c['D']} I={c['I']} fp32"
    if impl == "hf" and not HAVE_HF:
        pytest.skip("transformers is not installed (pip install --no-deps transformers==5.25.0 ...)")
    x, wgu, wd, weights, ids = _fused_inputs(T)
    ids32 = ids.to(torch.int32)
    if impl == "ours":
        def fn():
            with glm5_ops.use_backend("cpp"):
                return glm5_ops.fused_moe(x, wgu, wd, weights, ids32)
    elif impl == "hf":
        m = _hf_experts(wgu, wd)

        def fn():
            with torch.no_grad():
                return m(x, ids, weights)
    elif impl == "reference":
        def fn():
            return reference.fused_moe(x, wgu, wd, weights, ids32)
    elif impl == "dense":
        xr = x.repeat_interleave(c["k"], 0)
        w1, w2 = wgu[0], wd[0]

        def fn():
            gate, up = F.linear(xr, w1).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, w2)
    else:
        def fn():
            with glm5_ops.use_backend("cpp"):
                xs, plan = moe.moe_dispatch(x, ids32, c["E"])
                return moe.moe_combine(xs, plan, weights)
    info = _fused_info(T, impl, FWD_NAMES)
    if impl == "permute":
        info.update(flops=0, bytes=4 * c["D"] * (T + T * c["k"]) * 2, ceiling="bandwidth")
    benchmark.extra_info.update(info)
    _run(benchmark, fn, rounds=3 if T >= 4096 or impl in ("hf", "reference") else 10)


BWD_NAMES = {"ours": "glm5 fused_moe fwd+bwd (bwd recomputes gate/up)",
             "hf": "autograd through transformers GlmMoeDsaExperts loop",
             "reference": "autograd through reference.fused_moe loop",
             "dense": "dense-GEMM bound fwd+bwd (autograd through one chain)"}


@pytest.mark.parametrize("impl", list(BWD_NAMES))
@pytest.mark.parametrize("T", [16, 256], ids=["T16", "T256"])
def test_fused_moe_forward_backward(benchmark, T, impl):
    c = FUSED
    benchmark.group = f"fused_moe fwd+bwd T={T} E={c['E']} k={c['k']} D={c['D']} I={c['I']} fp32"
    if impl == "hf" and not HAVE_HF:
        pytest.skip("transformers is not installed")
    x, wgu, wd, weights, ids = _fused_inputs(T)
    dout = torch.randn_like(x)
    ids32 = ids.to(torch.int32)
    leaves = [t.clone().requires_grad_() for t in (x, wgu, wd, weights)]
    if impl == "hf":
        m = _hf_experts(wgu, wd)
        leaves[1], leaves[2] = m.gate_up_proj, m.down_proj

        def layer():
            return m(leaves[0], ids, leaves[3])
    elif impl == "dense":
        xr = x.repeat_interleave(c["k"], 0).requires_grad_()
        w1, w2 = wgu[0].clone().requires_grad_(), wd[0].clone().requires_grad_()
        leaves = [xr, w1, w2]

        def layer():
            gate, up = F.linear(xr, w1).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, w2)
        dout = torch.randn(T * c["k"], c["D"], device=DEVICE)
    else:
        fused = glm5_ops.fused_moe if impl == "ours" else reference.fused_moe

        def layer():
            with glm5_ops.use_backend("cpp"):
                return fused(leaves[0], leaves[1], leaves[2], leaves[3], ids32)

    def fn():
        for t in leaves:
            t.grad = None
        layer().backward(dout)

    benchmark.extra_info.update(_fused_info(T, impl, BWD_NAMES, passes=3))
    _run(benchmark, fn, rounds=1 if impl in ("hf", "reference") and not SMOKE else 3)
