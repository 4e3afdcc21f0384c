"""glm5_ops/triton/moe.py called directly (router, block alignment, fused
experts forward and backward) vs glm5_ops/reference.py on fresh random inputs.

Under the interpreter (no GPU) the shapes stay tiny: the cost is per Triton
program, so E=256 cases use a handful of tokens (each touched expert is one
program per tile)."""
import pytest
import torch

pytest.importorskip("triton")

from conftest import DEVICE, INTERPRETED, LOW_PRECISION_FACTOR, fresh  # noqa: E402
from glm5_ops import reference  # noqa: E402
from glm5_ops._backend import triton_module  # noqa: E402

tm = triton_module("moe", DEVICE)
LOW = [torch.float16] + ([] if INTERPRETED else [torch.bfloat16])  # no bf16 math in the interpreter


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------ router --

# (E, n_group, topk_group, top_k): GLM-5, flat 256 / 128 with 12 active, top-1,
# grouped mid-size, groups of 2 and groups that are not a power of two.
ROUTES = [(256, 8, 4, 8), (256, 1, 1, 12), (128, 1, 1, 12), (16, 1, 1, 1), (64, 4, 2, 6), (8, 4, 1, 2),
          (6, 3, 2, 3), (40, 5, 3, 10)]


def _tied_rows(h, gate_w, bias, n_group, topk_group, top_k, eps=1e-5):
    """Rows whose choice is decided by a gap below eps (in float64): a group
    boundary, the top_k boundary, or the order of two chosen experts. fp32
    rounding may legitimately decide those either way."""
    T = h.shape[0]
    s = (h.double() @ gate_w.double().T).sigmoid()
    c = s + bias.double()
    g = c.view(T, n_group, -1).topk(2, dim=-1).values.sum(-1)
    tie = torch.zeros(T, dtype=torch.bool, device=h.device)
    if topk_group < n_group:
        gs = g.sort(-1, descending=True)
        tie |= (gs.values[:, topk_group - 1] - gs.values[:, topk_group]) < eps
        keep = torch.zeros_like(g, dtype=torch.bool).scatter_(1, gs.indices[:, :topk_group], True)
        c = c.masked_fill(~keep.repeat_interleave(c.shape[1] // n_group, dim=1), float("-inf"))
    cs = c.sort(-1, descending=True).values[:, :top_k + 1]
    tie |= ((cs[:, :-1] - cs[:, 1:]) < eps).any(1)
    return tie, c


@pytest.mark.parametrize("E,n_group,topk_group,top_k", ROUTES)
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                    (torch.float16, torch.float32)] +
                         ([] if INTERPRETED else [(torch.bfloat16, torch.bfloat16)]))
def test_route(poisoned, E, n_group, topk_group, top_k, dtypes):
    hdt, wdt = dtypes
    for T, D, norm, scale in [(1, 64, True, 2.5), (67, 45, False, 1.0)]:
        seed = T * 1000 + E
        h = fresh(T, D, dtype=hdt, seed=seed)
        gate_w = fresh(E, D, dtype=wdt, seed=seed + 1, scale=D ** -0.5)
        bias = fresh(E, seed=seed + 2, scale=0.05)
        w, ids = tm.moe_route(h, gate_w, bias, top_k, n_group, topk_group, scale, norm)
        w_ref, ids_ref = reference.moe_route(h, gate_w, bias, top_k=top_k, n_group=n_group,
                                             topk_group=topk_group, routed_scaling_factor=scale,
                                             norm_topk_prob=norm)
        assert w.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (T, top_k)
        assert torch.isfinite(w).all()
        tie, choice = _tied_rows(h, gate_w, bias, n_group, topk_group, top_k)
        assert tie.float().mean() < 0.2, "too many near-ties: the check would prove little"
        ok = ~tie
        # Same experts in the same order (decreasing biased score) wherever no near-tie decides.
        assert torch.equal(ids[ok], ids_ref[ok])
        torch.testing.assert_close(w[ok], w_ref[ok], rtol=1e-5, atol=1e-6)
        # Everywhere: distinct, allowed experts whose biased scores are the reference's.
        ids_l = ids.long()
        assert ((ids_l >= 0) & (ids_l < E)).all()
        assert (ids_l.sort(-1).values.diff(dim=-1) != 0).all()
        got = choice.gather(1, ids_l).sort(-1, descending=True).values
        want = choice.gather(1, ids_ref.long()).sort(-1, descending=True).values
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("E,n_group,topk_group,top_k", [(1024, 8, 4, 8), (2048, 1, 1, 8)])
def test_route_wide(poisoned, E, n_group, topk_group, top_k):
    """Past 512 padded experts the weight tile takes two stages and a narrower
    BLOCK_K (sm_90's shared memory: E=1024 needed 266 KB with three); up to 2048."""
    test_route(poisoned, E, n_group, topk_group, top_k, (torch.float32, torch.float32))


def test_route_rejects_too_many_experts():
    h, gate_w, bias = fresh(4, 16), fresh(4096, 16), fresh(4096)
    with pytest.raises(NotImplementedError, match=r"E=4096 \(padded to 4096 with n_group=1\) is over 2048"):
        tm.moe_route(h, gate_w, bias, 8, 1, 1, 1.0, True)
    with pytest.raises(NotImplementedError, match=r"E=1300 \(padded to 4096 with n_group=5\)"):
        tm.moe_route(h, fresh(1300, 16), fresh(1300), 8, 5, 1, 1.0, True)   # 5 x 260 -> 8 x 512


# --------------------------------------------------------------- alignment --

@pytest.mark.parametrize("T,E,k,block_m", [(37, 8, 3, 16), (5, 256, 8, 16), (300, 3, 2, 32), (1, 4, 1, 16)])
def test_align_plan(T, E, k, block_m):
    g = torch.Generator().manual_seed(T + E)
    ids = torch.randint(0, E, (T, k), generator=g, dtype=torch.int32).to(DEVICE)
    if E > 4:
        ids[ids == 1] = 0   # expert 1 gets no token
    plan = tm._Plan(ids, E, block_m)
    P = T * k
    counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    assert torch.equal(plan.seg_end.long(), padded.cumsum(0))
    n = int(plan.num_rows)
    assert n == int(padded.sum()) and plan.rows_max >= n and plan.rows_max % block_m == 0
    sp = plan.sorted_pairs.long()
    real = sp[sp < P]
    assert torch.equal(real.sort().values, torch.arange(P, device=DEVICE)), "every pair exactly once"
    assert (sp[n:] == P).all(), "rows past the end are padding"
    flat = ids.reshape(-1).long()
    for e in range(E):
        seg = sp[int(plan.seg_start[e]):int(plan.seg_end[e])]
        mine = seg[seg < P]
        # stable: the expert's pairs in (token, slot) order, then padding only
        assert torch.equal(mine, (flat == e).nonzero().flatten())
        assert (seg[mine.numel():] == P).all()
    blocks = torch.arange(n // block_m, device=DEVICE) * block_m
    want = torch.searchsorted(plan.seg_end.long(), blocks, right=True)
    assert torch.equal(plan.expert_ids[: n // block_m].long(), want)


# ------------------------------------------------------------- fused experts --

def _ids(kind, T, E, k, g):
    if kind == "random":    # distinct experts per token, as the router gives
        return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    if kind == "one":       # every token to one expert, all others get nothing
        return torch.full((T, k), E - 2, dtype=torch.int32)
    if kind == "few":       # a few experts, drawn with repeats, most experts idle
        few = torch.tensor([0, 5, E - 1])
        return few[torch.randint(0, 3, (T, k), generator=g)].int()
    raise ValueError(kind)


# (T, E, k, D, I, ids kind): odd D and I, T=1 decode, E=256 with top-12, one
# expert with every token (several M blocks, several N blocks of I), idle experts.
CASES = [(19, 8, 2, 33, 21, "random"), (1, 256, 8, 16, 16, "random"), (3, 256, 12, 17, 9, "random"),
         (40, 6, 1, 40, 70, "one"), (23, 16, 4, 24, 13, "few"), (5, 12, 12, 8, 8, "random")]


def _fused_inputs(T, E, k, D, I, kind, seed):
    g = torch.Generator().manual_seed(seed)
    x = fresh(T, D, seed=seed)
    wgu = fresh(E, 2 * I, D, seed=seed + 1, scale=D ** -0.5)
    wd = fresh(E, D, I, seed=seed + 2, scale=I ** -0.5)
    weights = (torch.rand(T, k, generator=g) + 0.1).to(DEVICE)
    ids = _ids(kind, T, E, k, g).to(DEVICE)
    dout = fresh(T, D, seed=seed + 3)
    return x, wgu, wd, weights, ids, dout


def _reference_grads(x, wgu, wd, weights, ids, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (x, wgu, wd, weights)]
    out = reference.fused_moe(*leaves, ids)
    out.backward(dout.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("T,E,k,D,I,kind", CASES)
def test_fused_fp32(poisoned, T, E, k, D, I, kind):
    x, wgu, wd, weights, ids, dout = _fused_inputs(T, E, k, D, I, kind, seed=T * 7 + E + D)
    out = tm.fused_moe_fwd(x, wgu, wd, weights, ids)
    ref, ref_grads = _reference_grads(x, wgu, wd, weights, ids, dout)
    assert out.dtype == torch.float32 and out.shape == (T, D)
    assert rel_err(out, ref) <= 1e-5
    grads = tm.fused_moe_bwd(dout, x, wgu, wd, weights, ids)
    for name, got, want in zip(("dx", "dw_gate_up", "dw_down", "dweights"), grads, ref_grads):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert torch.isfinite(got).all(), f"{name}: unwritten (poisoned) or non-finite entries"
        assert rel_err(got, want) <= 1e-5, f"{name}: rel err {rel_err(got, want):.2e}"
    idle = torch.ones(E, dtype=torch.bool, device=DEVICE)
    idle[ids.long().unique()] = False
    assert (grads[1][idle] == 0).all() and (grads[2][idle] == 0).all(), "idle experts must get zero gradients"


@pytest.mark.parametrize("T,E,k,D,I,kind", CASES[:1] + CASES[3:5])
@pytest.mark.parametrize("dtype", LOW)
def test_fused_low_precision(poisoned, T, E, k, D, I, kind, dtype):
    """Inputs rounded to dtype: the error vs the fp32 oracle on the fp32 inputs
    stays within 2x (3x on CUDA: LOW_PRECISION_FACTOR) of the reference's own error
    when run on the rounded inputs."""
    x, wgu, wd, weights, ids, dout = _fused_inputs(T, E, k, D, I, kind, seed=T * 11 + E)
    ref32, grads32 = _reference_grads(x, wgu, wd, weights, ids, dout)
    low = [t.to(dtype) for t in (x, wgu, wd)]
    ref_lo, grads_lo = _reference_grads(*low, weights, ids, dout.to(dtype))
    out = tm.fused_moe_fwd(*low, weights, ids)
    assert out.dtype == dtype
    assert rel_err(out, ref32) <= LOW_PRECISION_FACTOR * rel_err(ref_lo, ref32) + 1e-6
    grads = tm.fused_moe_bwd(dout.to(dtype), *low, weights, ids)
    for name, got, lo, want in zip(("dx", "dw_gate_up", "dw_down", "dweights"), grads, grads_lo, grads32):
        assert got.dtype == lo.dtype and torch.isfinite(got).all(), name
        err, base = rel_err(got, want), rel_err(lo, want)
        assert err <= LOW_PRECISION_FACTOR * base + 1e-6, f"{name}: rel err {err:.2e} vs the reference's {base:.2e}"


def test_fused_rejects_bad_dtypes():
    x, wgu, wd, weights, ids, _ = _fused_inputs(3, 4, 2, 8, 8, "random", seed=1)
    with pytest.raises(ValueError, match="one dtype"):
        tm.fused_moe_fwd(x, wgu.half(), wd, weights, ids)
    with pytest.raises(NotImplementedError, match="float64"):
        tm.fused_moe_fwd(x.double(), wgu.double(), wd.double(), weights, ids)
