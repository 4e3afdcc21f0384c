"""The Triton backend of the sparse-attention family (glm5_ops/triton/attention.py),
through the public API, against glm5_ops.reference: forward, backward
(autograd through the API vs autograd through the oracle) and the block
predictor. Shapes are tiny and odd (the interpreter is slow): topk and block
sizes off the kernels' tiles, -1 slots, causal future keys, empty rows,
S=1 decode, GQA 1/4/16, Hq 1..64, Dk 64/192/256/576, v as a view of k.

Tolerances: fp32 relative error (max |err| / max |ref|) <= 1e-5 forward and
<= 1e-4 for gradients; fp16 at most 2x the error of the reference run on the
same fp16 inputs, both measured against the fp32 reference on the fp32 data.
"""
import math

import pytest
import torch

pytest.importorskip("triton")

import glm5_ops  # noqa: E402
from conftest import DEVICE, LOW_PRECISION_FACTOR, fresh  # noqa: E402
from glm5_ops import reference  # noqa: E402

DTYPES = [torch.float32, torch.float16]   # no bf16 math in the interpreter


def _rel(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    if want.numel() == 0:
        return 0.0
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _inputs(B, S, T, Hq, Hkv, Dk, Dv, view, seed):
    """fp32 q, k and v (None when v is to be the view k[..., :Dv])."""
    q = fresh(B, S, Hq, Dk, seed=seed)
    k = fresh(B, T, Hkv, Dk, seed=seed + 1)
    v = None if view else fresh(B, T, Hkv, Dv, seed=seed + 2)
    return q, k, v


def _run(op, q, k, v, Dv, dtype, g):
    """op(q, k, v) on fresh leaves of `dtype`, then backward(g). With v None the
    value is the view k[..., :Dv], so k's gradient is dk + dv (autograd adds them)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v) if t is not None]
    qq, kk = leaves[:2]
    vv = leaves[2] if len(leaves) == 3 else kk[..., :Dv]
    out, lse = op(qq, kk, vv)
    out.backward(g.to(out.dtype))
    grads = [t.grad for t in leaves]
    for t, gr in zip(leaves, grads):
        assert gr is not None and gr.dtype == t.dtype and gr.shape == t.shape
    return [out, lse, *grads]


def _compare(triton_op, ref_op, q, k, v, Dv, dtype):
    B, S, Hq = q.shape[:3]
    g = fresh(B, S, Hq, Dv, seed=99)
    want = _run(ref_op, q, k, v, Dv, torch.float32, g)
    with glm5_ops.use_backend("triton"):
        got = _run(triton_op, q, k, v, Dv, dtype, g)
    out, lse = got[0], got[1]
    assert out.dtype == dtype and out.shape == want[0].shape
    assert lse.dtype == torch.float32 and lse.shape == want[1].shape
    empty = torch.isneginf(want[1])
    assert torch.equal(torch.isneginf(lse), empty), "rows with no key (lse = -inf) differ"
    assert not torch.isnan(lse).any() and not torch.isposinf(lse).any()
    assert bool((out[empty].float() == 0).all()), "a query with no key must output zeros"
    lse_f, want_lse_f = lse.masked_fill(empty, 0), want[1].masked_fill(empty, 0)
    names = ["out", "lse", "dq", "dk", "dv"]
    if dtype == torch.float32:
        for name, a, b, tol in zip(names, [out, lse_f, *got[2:]], [want[0], want_lse_f, *want[2:]],
                                   [1e-5, 1e-5, 1e-4, 1e-4, 1e-4]):
            err = _rel(a, b)
            assert err <= tol, f"{name}: relative error {err:.3g} > {tol}"
        return
    base = _run(ref_op, q, k, v, Dv, dtype, g)   # the reference itself on the fp16 inputs
    base[1] = base[1].masked_fill(empty, 0)
    for name, a, b, w in zip(names, [out, lse_f, *got[2:]], base, [want[0], want_lse_f, *want[2:]]):
        err, ref_err = _rel(a, w), _rel(b, w)
        assert err <= LOW_PRECISION_FACTOR * ref_err + 1e-6, \
            f"{name}: error {err:.3g} > {LOW_PRECISION_FACTOR} x the fp16 reference's {ref_err:.3g}"


def _q_start(kind, B, S, T, seed):
    if kind is None:
        return None
    # Some batch elements start before 0: their first queries see no key at all.
    return torch.randint(-S - 1, T, (B,), generator=_gen(seed)).to(DEVICE)


# ---------------------------------------------------------- token-level --

def _indices(B, S, T, topk, seed):
    """Duplicate-free key positions per query, about a fifth of the slots -1."""
    g = _gen(seed)
    perm = torch.rand(B, S, max(T, topk), generator=g).argsort(-1)[..., :topk]
    idx = torch.where(perm < T, perm, -1)                      # topk > T: extra slots are -1
    idx = torch.where(torch.rand(B, S, topk, generator=g) < 0.2, -1, idx)
    return idx.to(torch.int32).to(DEVICE)


# (B, S, T, Hq, Hkv, Dk, Dv, topk, v_view): odd T, topk off the 16/32/64 tiles.
SPARSE_SHAPES = [
    (2, 5, 37, 4, 1, 64, 64, 21, False),      # GQA 4
    (1, 3, 50, 16, 1, 64, 64, 37, False),     # GQA 16
    (2, 4, 23, 3, 3, 64, 48, 23, False),      # GQA 1, Hq = 3, topk = T, Dv != Dk
    (1, 1, 40, 1, 1, 64, 64, 17, False),      # decode, Hq = 1
    (1, 2, 19, 64, 1, 576, 512, 13, True),    # MLA absorbed: 64 heads, v = k[..., :512]
    (1, 3, 29, 8, 2, 192, 128, 11, False),    # Dk = 128 + 64 split
    (1, 2, 17, 4, 2, 256, 256, 9, False),
    (1, 2, 80, 2, 1, 64, 64, 75, True),       # several key tiles per query, v view with Dv = Dk
    (1, 3, 12, 5, 5, 64, 64, 20, False),      # topk > T: trailing -1 slots
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal,qs", [(False, None), (True, None), (True, "tensor")])
@pytest.mark.parametrize("B,S,T,Hq,Hkv,Dk,Dv,topk,view", SPARSE_SHAPES)
def test_sparse_attention(poisoned, B, S, T, Hq, Hkv, Dk, Dv, topk, view, causal, qs, dtype):
    seed = hash((B, S, T, Hq, Dk, topk)) % 10_000
    q, k, v = _inputs(B, S, T, Hq, Hkv, Dk, Dv, view, seed)
    idx = _indices(B, S, T, topk, seed)
    q_start = _q_start(qs, B, S, T, seed)
    scale = 0.8 / math.sqrt(Dk)

    def op(mod):
        return lambda q_, k_, v_: mod.sparse_attention(q_, k_, v_, idx, scale=scale, causal=causal, q_start=q_start)

    _compare(op(glm5_ops), op(reference), q, k, v, Dv, dtype)


def test_sparse_attention_empty_rows(poisoned):
    """All slots -1 for one query, every key in the future for another batch
    element: zeros, lse = -inf, and zero (not NaN) gradients."""
    B, S, T, Hq, Hkv, D = 2, 3, 21, 4, 2, 64
    q, k, v = _inputs(B, S, T, Hq, Hkv, D, D, False, 7)
    idx = _indices(B, S, T, 19, 7)
    idx[0, 1] = -1
    q_start = torch.tensor([T - S, -S - 5], device=DEVICE)
    with glm5_ops.use_backend("triton"):
        got = _run(lambda *a: glm5_ops.sparse_attention(*a, idx, causal=True, q_start=q_start), q, k, v, D,
                   torch.float32, fresh(B, S, Hq, D, seed=3))
    out, lse, dq = got[:3]
    assert torch.isneginf(lse[0, 1]).all() and torch.isneginf(lse[1]).all()
    assert (out[0, 1] == 0).all() and (out[1] == 0).all()
    assert (dq[0, 1] == 0).all() and (dq[1] == 0).all()
    assert not any(torch.isnan(t).any() for t in got)


# --------------------------------------------------------- block-sparse --

def _random_mask(B, Hq, Qb, Kb, W, seed):
    """Random distinct key blocks per row (ascending or not), random counts in
    [0, W] and junk after the used entries (the kernels must ignore it)."""
    g = _gen(seed)
    idx = torch.rand(B, Hq, Qb, Kb, generator=g).argsort(-1)[..., :W]
    num = torch.randint(0, W + 1, (B, Hq, Qb), generator=g)
    num[..., 0] = torch.clamp(num[..., 0], min=1)
    junk = torch.randint(0, Kb, idx.shape, generator=g)
    idx = torch.where(torch.arange(W) < num[..., None], idx, junk)
    return glm5_ops.BlockMask(num.to(torch.int32).to(DEVICE), idx.to(torch.int32).to(DEVICE), None)


# (B, S, T, Hq, Hkv, Dk, Dv, block_size, v_view): partial last blocks everywhere.
BLOCK_SHAPES = [
    (2, 13, 29, 4, 1, 64, 64, 5, False),      # GQA 4
    (1, 20, 23, 16, 1, 64, 64, 8, False),     # GQA 16
    (1, 9, 33, 3, 3, 64, 48, 4, False),       # GQA 1
    (1, 1, 40, 2, 1, 64, 64, 16, False),      # decode
    (1, 6, 21, 4, 1, 576, 512, 4, True),      # MLA absorbed, v = k[..., :512]
    (1, 7, 19, 2, 2, 192, 128, 3, False),
    (1, 5, 18, 2, 1, 256, 256, 6, False),
    (1, 40, 80, 2, 1, 64, 64, 37, True),      # blocks wider than a key/query tile
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal,qs", [(False, None), (True, None), (True, "tensor")])
@pytest.mark.parametrize("B,S,T,Hq,Hkv,Dk,Dv,bs,view", BLOCK_SHAPES)
def test_block_sparse_attention(poisoned, B, S, T, Hq, Hkv, Dk, Dv, bs, view, causal, qs, dtype):
    seed = hash((B, S, T, Hq, Dk, bs)) % 10_000
    q, k, v = _inputs(B, S, T, Hq, Hkv, Dk, Dv, view, seed)
    Qb, Kb = -(-S // bs), -(-T // bs)
    num, idx, _ = _random_mask(B, Hq, Qb, Kb, min(Kb, 3), seed)
    q_start = _q_start(qs, B, S, T, seed)
    scale = 1.3 / math.sqrt(Dk)

    def api(q_, k_, v_):
        return glm5_ops.block_sparse_attention(q_, k_, v_, glm5_ops.BlockMask(num, idx, bs), scale=scale,
                                               causal=causal, q_start=q_start)

    def ref(q_, k_, v_):
        return reference.block_sparse_attention(q_, k_, v_, num, idx, block_size=bs, scale=scale, causal=causal,
                                                q_start=q_start)

    _compare(api, ref, q, k, v, Dv, dtype)


def test_block_sparse_broadcast_mask_and_predictor(poisoned):
    """A [1,1,Qb] mask broadcast over batch and heads, then the predictor's own
    mask (the usual composition) on the same inputs."""
    B, S, T, Hq, Hkv, D, bs = 2, 11, 30, 4, 2, 64, 4
    q, k, v = _inputs(B, S, T, Hq, Hkv, D, D, False, 11)
    num, idx, _ = _random_mask(1, 1, -(-S // bs), -(-T // bs), 4, 11)
    with glm5_ops.use_backend("triton"):
        pred = glm5_ops.block_topk_mask(q, k, block_size=bs, topk_blocks=2)
    for n, i in ((num, idx), (pred.kv_num_blocks, pred.kv_indices)):
        _compare(lambda q_, k_, v_: glm5_ops.block_sparse_attention(q_, k_, v_, glm5_ops.BlockMask(n, i, bs)),
                 lambda q_, k_, v_: reference.block_sparse_attention(q_, k_, v_, n, i, block_size=bs,
                                                                     scale=D ** -0.5),
                 q, k, v, D, torch.float32)


# ------------------------------------------------------------ predictor --

@pytest.mark.parametrize("pooling", ["mean", "minmax"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("B,S,T,H,Hkv,D,bs,topk,sink,local", [
    (2, 13, 29, 4, 1, 64, 5, 2, 1, 1),
    (1, 1, 40, 8, 2, 32, 8, 3, 1, 2),          # decode
    (1, 33, 70, 3, 3, 576, 16, 1, 0, 1),       # MLA width, no sink
    (1, 17, 50, 16, 1, 24, 3, 4, 2, 0),        # D off the tiles, no local
    (2, 9, 9, 2, 1, 16, 2, 10, 1, 1),          # topk_blocks >= Kb
])
def test_block_topk_mask(poisoned, B, S, T, H, Hkv, D, bs, topk, sink, local, causal, pooling):
    seed = hash((B, S, T, H, D, bs)) % 10_000
    q, k, _ = _inputs(B, S, T, H, Hkv, D, D, True, seed)
    for q_start in (None, _q_start("tensor", B, S, T, seed)):
        kw = dict(block_size=bs, topk_blocks=topk, causal=causal, sink_blocks=sink, local_blocks=local,
                  pooling=pooling, q_start=q_start)
        with glm5_ops.use_backend("triton"):
            got = glm5_ops.block_topk_mask(q, k, **kw)
        num, idx = reference.block_topk_mask(q, k, **kw)
        assert got.block_size == bs
        assert got.kv_num_blocks.dtype == torch.int32 and got.kv_indices.dtype == torch.int32
        assert torch.equal(got.kv_num_blocks, num)
        assert torch.equal(got.kv_indices, idx)


def test_block_topk_mask_fp16(poisoned):
    """fp16 inputs are pooled in fp32, like the reference."""
    q, k, _ = _inputs(1, 20, 45, 4, 2, 64, 64, True, 5)
    q, k = q.half(), k.half()
    kw = dict(block_size=4, topk_blocks=3, pooling="minmax")
    with glm5_ops.use_backend("triton"):
        got = glm5_ops.block_topk_mask(q, k, **kw)
    num, idx = reference.block_topk_mask(q, k, **kw)
    assert torch.equal(got.kv_num_blocks, num) and torch.equal(got.kv_indices, idx)


# ------------------------------------------------------- shared memory --

def test_forward_tiles_fit_sm90():
    """Forward tiles shrink (BLOCK_N, then the query rows) where the estimate says
    sm_90's 227 KiB would not hold them: fp32 Dk = Dv = 1024 needed 398 KB (sparse)
    and 262 KB (block) with the default tiles. Every suite / GLM-5 shape keeps its tiles."""
    from glm5_ops.triton import attention as A
    from glm5_ops.triton._limits import SM90_SMEM
    for Dk, Dv, G in [(576, 1024, 64), (1024, 1024, 64), (768, 768, 8)]:
        cfg = A._fit_fwd(A._sparse_config(Dk, Dv, G, False), "BLOCK_H", 4, False, SM90_SMEM)
        assert A._fwd_smem(cfg["BLOCK_H"], cfg["BLOCK_N"], cfg["DK1"] + cfg["DK2"], cfg["DV"], 4, False) <= SM90_SMEM
        cfg = A._fit_fwd(A._block_config(Dk, Dv, 64, "fwd"), "BLOCK_M", 4, False, SM90_SMEM)
        assert A._fwd_smem(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["DK1"] + cfg["DK2"], cfg["DV"], 4, False) <= SM90_SMEM
    for item in (4, 2):   # GLM-5's MLA shapes (Hq = 64 or 8 per GPU, v = k[..., :512]) and the suite's fp32 case
        for G, alias in [(64, True), (8, True), (8, False)]:
            base = A._sparse_config(576, 512, G, False)
            assert A._fit_fwd(base, "BLOCK_H", item, alias, SM90_SMEM) == base
        base = A._block_config(576, 512, 128, "fwd")
        assert A._fit_fwd(base, "BLOCK_M", item, True, SM90_SMEM) == base


@pytest.mark.skipif(DEVICE.type != "cpu", reason="forces a tiny shared-memory budget: interpreter only")
def test_shrunk_forward_tiles_match_reference(poisoned, monkeypatch):
    """The smallest forward tiles (16 x 16), forced by a small budget, give the reference's results."""
    from glm5_ops.triton import attention as A
    monkeypatch.setattr(A, "smem_limit", lambda device: 16 * 1024)
    cfg = A._fit_fwd(A._sparse_config(64, 64, 32, False), "BLOCK_H", 4, False, 16 * 1024)
    assert (cfg["BLOCK_H"], cfg["BLOCK_N"]) == (16, 16)
    B, S, T, Hq, Hkv, D = 1, 3, 50, 32, 1, 64
    q, k, v = _inputs(B, S, T, Hq, Hkv, D, D, False, 21)
    idx = _indices(B, S, T, 37, 21)
    _compare(lambda q_, k_, v_: glm5_ops.sparse_attention(q_, k_, v_, idx, causal=True),
             lambda q_, k_, v_: reference.sparse_attention(q_, k_, v_, idx, scale=D ** -0.5, causal=True),
             q, k, v, D, torch.float32)
    S, T, bs = 40, 80, 37
    q, k, v = _inputs(1, S, T, 2, 1, D, D, False, 22)
    num, idx, _ = _random_mask(1, 2, -(-S // bs), -(-T // bs), 2, 22)
    _compare(lambda q_, k_, v_: glm5_ops.block_sparse_attention(q_, k_, v_, glm5_ops.BlockMask(num, idx, bs),
                                                                causal=True),
             lambda q_, k_, v_: reference.block_sparse_attention(q_, k_, v_, num, idx, block_size=bs,
                                                                 scale=D ** -0.5, causal=True),
             q, k, v, D, torch.float32)
