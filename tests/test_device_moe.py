"""MoE at GLM-5's sizes, every backend: the router at E=1024 and 2048 experts,
fused_moe with D/I of hundreds and 253 of 256 experts idle (the CUDA kernel's
grouped-GEMM path in bf16, and its per-expert loop: GLM5_MOE_GEMM=loop), and
on a GPU GLM-5's own expert width (D=6144, I=2048) checked before it is timed
(bench/gpu_timings_moe.py). fused_moe tolerances are tests/test_moe_fused.py's:
fp32 1e-5 relative, fp16/bf16 within 2x the reference's own error."""
import pytest
import torch

import glm5_ops
from conftest import CUDA, DEVICE, LOW_PRECISION_FACTOR, big_ok, float_dtypes, fresh
from glm5_ops import reference
from test_moe_fused import NAMES, _inputs, _rel, _run


def _biased_scores(h, gate_w, bias):
    return (h.double() @ gate_w.double().T).sigmoid() + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
# Past GLM-5's 256 experts (the Triton router's two-stage weight tile), and groups of 2 experts.
@pytest.mark.parametrize("E,n_group,topk_group,top_k", [(1024, 8, 4, 8), (2048, 1, 1, 8), (2048, 16, 4, 12),
                                                        (6, 3, 2, 3)])
def test_route_many_experts(backend, poisoned, E, n_group, topk_group, top_k, dtype):
    """Checked without deciding near-ties (at E=2048 many rows have one): the chosen
    experts are distinct, in at most topk_group groups, their biased scores are the
    reference's (as a sorted list), and the weights are those of the chosen ids."""
    if dtype not in float_dtypes(backend):
        pytest.skip("the Triton interpreter has no bf16 math")
    T, D = (193 if big_ok(backend) else 9), 96
    h = fresh(T, D, dtype=dtype)
    gate_w, bias = fresh(E, D, scale=D ** -0.5).to(dtype), fresh(E, scale=0.05)
    args = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=True)
    w, ids = glm5_ops.moe_route(h, gate_w, bias, **args)
    _, ids_ref = reference.moe_route(h, gate_w, bias, **args)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (T, top_k)
    chosen = ids.long()
    assert ((chosen >= 0) & (chosen < E)).all() and (chosen.sort(-1).values.diff(dim=-1) != 0).all()
    groups = chosen // (E // n_group)
    assert all(len(set(row)) <= topk_group for row in groups.tolist())
    c = _biased_scores(h, gate_w, bias)
    got = c.gather(1, chosen).sort(-1, descending=True).values
    want = c.gather(1, ids_ref.long()).sort(-1, descending=True).values
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    s = (h.double() @ gate_w.double().T).sigmoid().gather(1, chosen)
    torch.testing.assert_close(w.double(), 2.5 * s / s.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)


# (T, D, I, E, k, kind): hundreds-wide D/I, with 253 of 256 experts idle and in a busy 8-expert layer.
CASES = [(64, 256, 128, 256, 8, "sparse"), (300, 512, 256, 8, 2, "random"), (37, 96, 40, 16, 4, "random")]
GEMM_MODES = ["default"] + (["loop"] if CUDA else [])   # GLM5_MOE_GEMM: the CUDA kernel's two GEMM paths


@pytest.mark.parametrize("mode", GEMM_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T,D,I,E,k,kind", CASES, ids=[f"T{c[0]}-D{c[1]}-I{c[2]}-E{c[3]}-k{c[4]}-{c[5]}"
                                                        for c in CASES])
def test_fused_wide_experts(backend, poisoned, monkeypatch, T, D, I, E, k, kind, dtype, mode):
    if dtype not in float_dtypes(backend):
        pytest.skip("the Triton interpreter has no bf16 math")
    if not big_ok(backend) and T * k * D * I > 2e6:
        pytest.skip("too large for the Triton interpreter (runs on the GPU)")
    if mode != "default" and backend != "cpp":
        pytest.skip("GLM5_MOE_GEMM selects a path of the CUDA kernel")
    if mode == "default":
        monkeypatch.delenv("GLM5_MOE_GEMM", raising=False)
    else:
        monkeypatch.setenv("GLM5_MOE_GEMM", mode)
    x, wgu, wd, w, ids = _inputs(T, D, I, E, k, kind, dtype, seed=T * 7 + E)
    dout = fresh(T, D, dtype=dtype)
    got = _run(glm5_ops.fused_moe, x, wgu, wd, w, ids, dout)
    truth = _run(reference.fused_moe, x.double(), wgu.double(), wd.double(), w.double(), ids, dout)
    ref = _run(reference.fused_moe, x, wgu, wd, w, ids, dout) if dtype != torch.float32 else None
    for i, name in enumerate(NAMES):
        assert got[i].dtype == (ref[i].dtype if ref is not None else torch.float32), name
        assert torch.isfinite(got[i]).all(), f"{name}: unwritten (poisoned) or non-finite entries"
        tol = 1e-5 if ref is None else LOW_PRECISION_FACTOR * _rel(ref[i], truth[i]) + 1e-6
        assert _rel(got[i], truth[i]) <= tol, f"{name}: rel err {_rel(got[i], truth[i]):.2e} > {tol:.2e}"
    idle = torch.ones(E, dtype=torch.bool, device=DEVICE)
    idle[ids.long().unique()] = False
    assert (got[2][idle] == 0).all() and (got[3][idle] == 0).all(), "idle experts must get zero gradients"


@pytest.mark.skipif(not CUDA, reason="GLM-5's expert width (19 GB of bf16 weights): GPU only")
def test_fused_glm5_width(backend):
    """T=1024 tokens, E=256, k=8, D=6144, I=2048 in bf16: the first 4 tokens
    against the reference on their experts (fp32 math on the same bf16 inputs)."""
    if backend == "reference":
        pytest.skip("the oracle itself")
    T, E, k, D, I = 1024, 256, 8, 6144, 2048
    g = torch.Generator(device=DEVICE).manual_seed(torch.seed() % 2**31)
    x = torch.randn(T, D, device=DEVICE, generator=g, dtype=torch.bfloat16)
    wgu = torch.randn(E, 2 * I, D, device=DEVICE, generator=g, dtype=torch.bfloat16) * D ** -0.5
    wd = torch.randn(E, D, I, device=DEVICE, generator=g, dtype=torch.bfloat16) * I ** -0.5
    ids = torch.rand(T, E, device=DEVICE, generator=g).topk(k, dim=-1).indices.int()
    w = torch.rand(T, k, device=DEVICE, generator=g) + 0.1
    out = glm5_ops.fused_moe(x, wgu, wd, w, ids)
    rows = slice(0, 4)
    used, local_ids = ids[rows].long().unique(return_inverse=True)   # <= 32 experts: fp32 copies fit
    want = reference.fused_moe(x[rows].float(), wgu[used].float(), wd[used].float(), w[rows], local_ids.int())
    assert _rel(out[rows], want) <= 1e-2
