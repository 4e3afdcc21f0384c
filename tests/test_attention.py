"""Sparse attention (token-level DSA and block-sparse) and the block-level
predictor, every backend against glm5_ops/reference.py, forward and backward.

Tolerances: fp32 relative error (max |diff| / max |ref|) <= 1e-5 forward and
<= 1e-4 for gradients; fp16/bf16 at most 2x (3x on CUDA: conftest's
LOW_PRECISION_FACTOR) the error of the reference run in that precision, both measured against the fp32 reference on the same
(rounded) inputs, plus 1e-6 absolute slack for results that round exactly.
"""
import os
import zlib
import subprocess
import sys

import pytest
import torch

import glm5_ops
from glm5_ops import reference as R
from conftest import DEVICE, INTERPRETED, LOW_PRECISION_FACTOR, big_ok, fresh

LOW_PRECISION = [torch.float16] + ([] if INTERPRETED else [torch.bfloat16])


def rel_err(a, b):
    b = b.float()
    return float((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-12))


def random_selection(B, S, T, topk, seed, empty_frac=0.1):
    """Duplicate-free random key positions per query (any position, future
    ones included), with about empty_frac of the slots set to -1."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(B, S, T, generator=g).argsort(-1)[..., :topk].to(torch.int32)
    drop = torch.rand(B, S, topk, generator=g) < empty_frac
    return torch.where(drop, torch.full_like(idx, -1), idx).to(DEVICE)


def qkv(B, S, T, Hq, Hkv, Dk, Dv, dtype, seed, v_views_k=False):
    q = fresh(B, S, Hq, Dk, dtype=dtype, seed=seed)
    k = fresh(B, T, Hkv, Dk, dtype=dtype, seed=seed + 1)
    v = k[..., :Dv] if v_views_k else fresh(B, T, Hkv, Dv, dtype=dtype, seed=seed + 2)
    return q, k, v


def run_with_grads(fn, q, k, v, dout_seed):
    """(out, lse, dq, dk, dv) of fn(q, k, v) with a fresh random upstream gradient."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k)]
    qq, kk = leaves
    vv = kk[..., :v.shape[-1]] if v.data_ptr() == k.data_ptr() else v.detach().clone().requires_grad_(True)
    out, lse = fn(qq, kk, vv)
    dout = fresh(*out.shape, dtype=out.dtype, seed=dout_seed)
    inputs = (qq, kk) if not vv.is_leaf else (qq, kk, vv)
    grads = torch.autograd.grad(out, inputs, dout)
    dv = grads[2] if len(grads) == 3 else None
    return out.detach(), lse.detach(), grads[0], grads[1], dv


def compare(ours, ref32, ref_lp, dtype):
    """ours / ref_lp: results from inputs in dtype; ref32: the fp32 reference on the same inputs."""
    names = ("out", "lse", "dq", "dk", "dv")
    for name, a, r, rl in zip(names, ours, ref32, ref_lp):
        if r is None:
            continue
        if name == "lse":
            fin = torch.isfinite(r)
            assert torch.equal(torch.isfinite(a), fin), "lse: -inf exactly where no key is visible"
            a, r, rl = a[fin], r[fin], rl[fin]
            if r.numel() == 0:
                continue
        err = rel_err(a, r)
        if dtype == torch.float32:
            tol = 1e-5 if name in ("out", "lse") else 1e-4
        else:
            tol = LOW_PRECISION_FACTOR * rel_err(rl, r) + 1e-6
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"


# B, S, T, Hq, Hkv, Dk, Dv, topk, causal, v_views_k
SPARSE_CASES = [
    (2, 7, 33, 4, 4, 64, 64, 13, True, False),       # MHA (GQA 1), odd S/T, topk not a tile multiple
    (1, 5, 70, 16, 4, 64, 32, 67, True, False),      # GQA 4
    (1, 3, 50, 16, 1, 192, 128, 37, False, False),   # GQA 16 (MQA), Dk=192, non-causal
    (1, 1, 90, 8, 1, 256, 256, 70, True, False),     # S=1 decode, GLM-5's non-absorbed 256/256
    (1, 2, 80, 64, 1, 576, 512, 65, True, True),     # MLA absorbed: Hq=64, v = k[..., :512]
    (1, 4, 21, 1, 1, 64, 64, 21, True, False),       # Hq=1, topk = T
    (2, 6, 40, 20, 5, 24, 8, 9, True, False),        # G=4 with an odd Hq, tiny D
    (1, 9, 120, 14, 1, 96, 128, 40, True, False),    # G=14: the P.V product's 6-, 4- and 2-row blocks
    # Long T: the CPU forward sweeps keys in chunks of 256 positions (rows of
    # 2304 bytes) over blocks of up to 10 queries; MQA and GQA 4.
    (2, 41, 700, 16, 1, 576, 512, 300, True, True),
    (1, 37, 600, 8, 2, 576, 512, 250, True, True),
]


@pytest.mark.parametrize("case", SPARSE_CASES, ids=lambda c: "B{}S{}T{}H{}/{}D{}/{}k{}{}{}".format(
    *c[:8], "c" if c[8] else "", "v=k" if c[9] else ""))
@pytest.mark.parametrize("dtype", [torch.float32] + LOW_PRECISION)
def test_sparse_attention_matches_reference(backend, poisoned, case, dtype):
    B, S, T, Hq, Hkv, Dk, Dv, topk, causal, v_views_k = case
    if not big_ok(backend) and Dk * Hq > 4096:
        pytest.skip("largest heads too slow for the Triton interpreter")
    seed = zlib.crc32(repr(case).encode()) % 1000  # stable across runs (str hashes are salted)
    q, k, v = qkv(B, S, T, Hq, Hkv, Dk, Dv, dtype, seed, v_views_k)
    idx = random_selection(B, S, T, topk, seed)
    q_start = torch.tensor([T - S - 3, T - S][:B], device=DEVICE) if B == 2 else None

    def op(qq, kk, vv):
        return glm5_ops.sparse_attention(qq, kk, vv, idx, scale=0.7 / Dk ** 0.5, causal=causal, q_start=q_start)

    def ref(qq, kk, vv):
        return R.sparse_attention(qq, kk, vv, idx, scale=0.7 / Dk ** 0.5, causal=causal, q_start=q_start)

    ours = run_with_grads(op, q, k, v, seed + 5)
    kf = k.float()
    ref32 = run_with_grads(ref, q.float(), kf, kf[..., :Dv] if v_views_k else v.float(), seed + 5)
    ref_lp = run_with_grads(ref, q, k, v, seed + 5) if dtype != torch.float32 else ref32
    compare(ours, ref32, ref_lp, dtype)


# The CPU forward runs query blocks of 64 whose selections cover much of their
# span on lane tiles (the queries as vector lanes, a bitmask per key), the
# rest by gathering each query's keys. GLM5_SPARSE_LANE_BLOCKS forces either
# path, so both see every shape; these add several blocks, the last partial.
LANE_CASES = [
    (2, 131, 300, 8, 8, 96, 64, 120, True, False),    # MHA: MLA's expanded prefill form
    (1, 150, 260, 8, 2, 64, 64, 200, True, False),    # GQA 4, nearly every visible key chosen
    (1, 70, 200, 16, 1, 288, 256, 150, True, True),   # MQA absorbed, v = k[..., :256]
    (1, 90, 120, 4, 4, 32, 24, 50, False, False),     # non-causal: the span is not bounded by position
]


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU kernel's two forward paths")
@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("case", SPARSE_CASES + LANE_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cpu_sparse_forward_paths_match_reference(monkeypatch, poisoned, case, mode, dtype):
    monkeypatch.setenv("GLM5_SPARSE_LANE_BLOCKS", mode)
    B, S, T, Hq, Hkv, Dk, Dv, topk, causal, v_views_k = case
    seed = zlib.crc32(repr(case).encode()) % 1000
    q, k, v = qkv(B, S, T, Hq, Hkv, Dk, Dv, dtype, seed, v_views_k)
    idx = random_selection(B, S, T, topk, seed)
    q_start = torch.tensor([T - S - 3, T - S][:B]) if B == 2 else None
    kw = dict(scale=0.7 / Dk ** 0.5, causal=causal, q_start=q_start)
    with glm5_ops.use_backend("cpp"):
        ours = glm5_ops.sparse_attention(q, k, v, idx, **kw)
    kf = k.float()
    ref32 = R.sparse_attention(q.float(), kf, kf[..., :Dv] if v_views_k else v.float(), idx, **kw)
    ref_lp = R.sparse_attention(q, k, v, idx, **kw) if dtype != torch.float32 else ref32
    compare(ours, ref32, ref_lp, dtype)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU kernel's path choice")
def test_cpu_sparse_forward_chooses_lane_blocks_by_density(monkeypatch):
    """auto runs a dense MHA selection on lane tiles and a sparse MQA one by
    gathering (each bitwise equal to the forced path), and refuses other modes."""
    def run(mode, G, topk):
        monkeypatch.setenv("GLM5_SPARSE_LANE_BLOCKS", mode)
        q, k, v = qkv(1, 128, 400, 16, 16 // G, 64, 64, torch.float32, 7)
        with glm5_ops.use_backend("cpp"):
            return glm5_ops.sparse_attention(q, k, v, random_selection(1, 128, 400, topk, 7, 0.0), causal=True)[0]

    assert torch.equal(run("auto", 1, 300), run("always", 1, 300))
    assert not torch.equal(run("auto", 1, 300), run("never", 1, 300))
    assert torch.equal(run("auto", 16, 60), run("never", 16, 60))
    # A selection listing a key twice stays on the gathered path, which counts it
    # twice like the reference (the indexer never produces one).
    monkeypatch.setenv("GLM5_SPARSE_LANE_BLOCKS", "always")
    q, k, v = qkv(1, 64, 90, 4, 4, 32, 32, torch.float32, 8)
    idx = random_selection(1, 64, 90, 40, 8, 0.0)
    idx[:, :, 1] = idx[:, :, 0]
    with glm5_ops.use_backend("cpp"):
        ours = glm5_ops.sparse_attention(q, k, v, idx, causal=False)
    ref = R.sparse_attention(q, k, v, idx, scale=32 ** -0.5, causal=False)
    assert rel_err(ours[0], ref[0]) <= 1e-5
    monkeypatch.setenv("GLM5_SPARSE_LANE_BLOCKS", "sometimes")
    with pytest.raises(RuntimeError, match="GLM5_SPARSE_LANE_BLOCKS"):
        run("sometimes", 1, 300)


def test_sparse_attention_empty_and_duplicate_free_rows(backend, poisoned):
    """A query whose slots are all -1 or all in its future gets zeros, lse -inf and zero gradients."""
    B, S, T, H, D = 1, 4, 16, 2, 16
    q, k, v = qkv(B, S, T, H, H, D, D, torch.float32, 3)
    idx = torch.full((B, S, 3), -1, dtype=torch.int32, device=DEVICE)
    idx[0, 1] = torch.tensor([14, 15, -1])        # future of query 1 (position 13)
    idx[0, 2] = torch.tensor([0, 5, 14])
    q.requires_grad_(True)
    out, lse = glm5_ops.sparse_attention(q, k, v, idx, causal=True)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2]))
    assert bool(torch.isinf(lse[0, :2]).all()) and bool(torch.isfinite(lse[0, 2:3]).all())
    out.sum().backward()
    assert torch.equal(q.grad[0, :2], torch.zeros_like(q.grad[0, :2]))


# B, S, T, Hq, Hkv, D, Dv, block_size, topk_blocks, causal, pooling
BLOCK_CASES = [
    (2, 37, 53, 4, 2, 16, 8, 8, 2, True, "mean"),
    (1, 64, 64, 8, 8, 64, 64, 16, 1, True, "minmax"),
    (1, 9, 40, 3, 1, 24, 24, 4, 3, False, "mean"),
    (1, 130, 200, 16, 1, 32, 32, 64, 1, True, "mean"),
]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: "B{}S{}T{}H{}/{}D{}/{}bs{}k{}{}{}".format(
    *c[:9], "c" if c[9] else "", c[10]))
@pytest.mark.parametrize("dtype", [torch.float32] + LOW_PRECISION)
def test_block_sparse_attention_matches_reference(backend, poisoned, case, dtype):
    B, S, T, Hq, Hkv, D, Dv, bs, topk_blocks, causal, pooling = case
    if not big_ok(backend) and S * T > 10000:
        pytest.skip("too slow for the Triton interpreter")
    seed = zlib.crc32(repr(case).encode()) % 1000  # stable across runs (str hashes are salted)
    q, k, v = qkv(B, S, T, Hq, Hkv, D, Dv, dtype, seed)
    mask = glm5_ops.block_topk_mask(q, k, block_size=bs, topk_blocks=topk_blocks, causal=causal, pooling=pooling)
    ref_num, ref_idx = R.block_topk_mask(q, k, block_size=bs, topk_blocks=topk_blocks, causal=causal, pooling=pooling)
    if dtype == torch.float32:  # in low precision near-equal block scores may rank either way
        assert torch.equal(mask.kv_num_blocks, ref_num) and torch.equal(mask.kv_indices, ref_idx)
    num, idx = mask.kv_num_blocks, mask.kv_indices

    def op(qq, kk, vv):
        return glm5_ops.block_sparse_attention(qq, kk, vv, mask, scale=0.5, causal=causal)

    def ref(qq, kk, vv):
        return R.block_sparse_attention(qq, kk, vv, num, idx, block_size=bs, scale=0.5, causal=causal)

    ours = run_with_grads(op, q, k, v, seed + 5)
    ref32 = run_with_grads(ref, q.float(), k.float(), v.float(), seed + 5)
    ref_lp = run_with_grads(ref, q, k, v, seed + 5) if dtype != torch.float32 else ref32
    compare(ours, ref32, ref_lp, dtype)


# Decode shapes for the CPU forward's head split: with fewer query blocks than
# threads each query's heads are cut into groups, one work item each. Sizes
# sit above the split's work threshold (2 * topk * Hq * (Dk + Dv) >= 2^20).
# Hq, Hkv, Dk, Dv, T, topk, v_views_k
DECODE_SPLIT_CASES = [
    (16, 1, 288, 256, 700, 300, True),   # MLA decode: 16 heads -> 2 x 8 (half-width scores on AVX-512)
    (24, 1, 72, 64, 400, 200, False),    # G = 24: groups of 8 and 16 heads
    (40, 1, 40, 40, 500, 330, False),    # G = 40, D not a multiple of 16 or 64 (the kernels' tail paths)
    (5, 1, 100, 60, 1500, 700, False),   # G = 5 < W: the row layout, split head by head
    (32, 2, 96, 64, 400, 180, False),    # two kv heads of 16: split across and within kv heads
]


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU forward's decode head split")
@pytest.mark.parametrize("case", DECODE_SPLIT_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_sparse_decode_head_split_is_bitwise_exact(case, dtype):
    """A query's out and lse are bit-identical at 1 thread (no split), 2, 3 and
    4 threads (split into head groups), and alone against the same query inside
    a batch of 8 queries (enough blocks: nothing splits): the serving engine
    gives a request the same tokens alone as in a busy batch."""
    Hq, Hkv, Dk, Dv, T, topk, v_views_k = case
    seed = zlib.crc32(repr(case).encode()) % 1000
    q, k, v = qkv(1, 8, T, Hq, Hkv, Dk, Dv, dtype, seed, v_views_k)
    idx = random_selection(1, 8, T, topk, seed)  # -1 slots and future keys (dropped: causal)
    kw = dict(scale=0.7 / Dk ** 0.5, causal=True)
    threads = torch.get_num_threads()
    try:
        with glm5_ops.use_backend("cpp"):
            batch = glm5_ops.sparse_attention(q, k, v, idx, q_start=torch.tensor([T - 300]), **kw)
            for s in (0, 5):
                alone = []
                for n in (1, 2, 3, 4):
                    torch.set_num_threads(n)
                    alone.append(glm5_ops.sparse_attention(q[:, s:s + 1], k, v, idx[:, s:s + 1],
                                                           q_start=torch.tensor([T - 300 + s]), **kw))
                for out, lse in alone:
                    assert torch.equal(out, batch[0][:, s:s + 1]) and torch.equal(lse, batch[1][:, s:s + 1])
    finally:
        torch.set_num_threads(threads)
    assert bool(torch.isfinite(batch[1]).all())  # every query saw keys: a real comparison, not -inf = -inf


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU kernels' per-worker dK/dV buffers")
def test_cpu_backward_is_bitwise_repeatable():
    """dK/dV sum per-worker buffers; with items handed out by a shared counter
    the split changed run to run and so did the gradient's last bits (a
    resumed DSA training run drifted from the uninterrupted one)."""
    q, k, v = qkv(2, 200, 260, 8, 2, 64, 48, torch.float32, 11)
    idx = random_selection(2, 200, 260, 64, 12)
    mask = glm5_ops.block_topk_mask(q, k, block_size=16, topk_blocks=6, causal=True)
    ops = {"sparse": lambda qq, kk, vv: glm5_ops.sparse_attention(qq, kk, vv, idx, scale=0.1, causal=True),
           "block_sparse": lambda qq, kk, vv: glm5_ops.block_sparse_attention(qq, kk, vv, mask, scale=0.1)}
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    try:
        with glm5_ops.use_backend("cpp"):
            for name, op in ops.items():
                first = run_with_grads(op, q, k, v, 13)
                for _ in range(6):
                    again = run_with_grads(op, q, k, v, 13)
                    assert all(torch.equal(a, b) for a, b in zip(first[2:], again[2:]) if a is not None), name
    finally:
        torch.set_num_threads(threads)


def test_block_sparse_broadcast_mask_and_q_start(backend, poisoned):
    """A [1,1,Qb,W] mask broadcasts over B and H; q_start shifts the causal diagonal."""
    B, S, T, H, D, bs = 2, 20, 36, 4, 16, 8
    q, k, v = qkv(B, S, T, H, 2, D, D, torch.float32, 11)
    Qb, Kb = -(-S // bs), -(-T // bs)
    idx = torch.tensor([[0, 2, 4], [1, 3, 0], [0, 4, 0]], dtype=torch.int32, device=DEVICE)[None, None]
    num = torch.tensor([3, 2, 1], dtype=torch.int32, device=DEVICE)[None, None]
    assert idx.shape[2] == Qb and Kb == 5
    qs = torch.tensor([10, 16], device=DEVICE)
    out, lse = glm5_ops.block_sparse_attention(q, k, v, glm5_ops.BlockMask(num, idx, bs), scale=0.3, q_start=qs)
    ref, ref_lse = R.block_sparse_attention(q, k, v, num, idx, block_size=bs, scale=0.3, q_start=qs)
    assert rel_err(out, ref) <= 1e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin) and rel_err(lse[fin], ref_lse[fin]) <= 1e-5


@pytest.mark.skipif(DEVICE.type != "cpu", reason="eager flex_attention comparison runs on the CPU")
@pytest.mark.parametrize("S,T,q_start", [(130, 130, 0), (70, 200, 100), (5, 300, 295), (64, 64, 0)])
def test_causal_block_mask_is_dense_causal_attention(backend, poisoned, S, T, q_start):
    q, k, v = qkv(2, S, T, 4, 2, 32, 16, torch.float32, S + T)
    mask = glm5_ops.BlockMask.causal(S, T, 64, q_start=q_start, device=DEVICE)
    out, _ = glm5_ops.block_sparse_attention(q, k, v, mask, causal=True, q_start=q_start)
    every_key = torch.arange(T, device=DEVICE).expand(2, S, T).to(torch.int32)
    ref, _ = R.sparse_attention(q, k, v, every_key, scale=32 ** -0.5, causal=True, q_start=q_start)
    assert rel_err(out, ref) <= 1e-5


def test_block_sparse_matches_flex_attention():
    """Given a torch FlexAttention BlockMask (built by create_block_mask from a
    block-selection + causal mask_mod), block_sparse_attention(causal=True)
    equals flex_attention on the same mask, output and lse."""
    import warnings

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, S, T, Hq, Hkv, D, bs = 1, 96, 96, 4, 2, 32, 16
    q, k, v = qkv(B, S, T, Hq, Hkv, D, D, torch.float32, 21)
    chosen = glm5_ops.block_topk_mask(q, k, block_size=bs, topk_blocks=2)
    blocks = R._ordered_to_blocks(chosen.kv_num_blocks, chosen.kv_indices, -(-T // bs))

    def mask_mod(b, h, q_idx, kv_idx):
        return blocks[b, h, q_idx // bs, kv_idx // bs] & (kv_idx <= q_idx)

    fmask = create_block_mask(mask_mod, B, Hq, S, T, device=DEVICE, BLOCK_SIZE=bs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, aux = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=fmask,
                                  scale=0.2, enable_gqa=True, return_lse=True)
    out, lse = glm5_ops.block_sparse_attention(q, k, v, fmask, scale=0.2, causal=True)
    assert rel_err(out, ref.transpose(1, 2)) <= 1e-5
    assert rel_err(lse, aux.transpose(1, 2)) <= 1e-5


def test_attention_recall_measures_the_selection():
    """Full selection keeps everything; a sparse one keeps less; block and token forms agree."""
    B, S, T, H, D = 1, 32, 32, 2, 16
    q, k, v = qkv(B, S, T, H, H, D, D, torch.float32, 31)
    everything = torch.arange(T, dtype=torch.int32, device=DEVICE).expand(B, S, T)
    full = glm5_ops.attention_recall(q, k, v, everything)
    assert full.mean_recall == pytest.approx(1.0, abs=1e-6) and full.output_rel_err < 1e-5
    some = glm5_ops.attention_recall(q, k, v, everything[..., :4].contiguous())
    assert 0 < some.mean_recall < 1 and some.output_rel_err > 0
    mask = glm5_ops.block_topk_mask(q, k, block_size=8, topk_blocks=0, sink_blocks=1, local_blocks=0)
    blk = glm5_ops.attention_recall(q, k, v, mask)
    first8 = everything[..., :8].contiguous()
    tok = glm5_ops.attention_recall(q, k, v, first8)
    assert blk.mean_recall == pytest.approx(tok.mean_recall, abs=1e-6)


# ------------------------------------------------- arguments of the tests below --

def _sparse_args(causal=True, with_q_start=False):
    q, k, v = qkv(2, 5, 30, 4, 2, 16, 8, torch.float32, 41)
    idx = random_selection(2, 5, 30, 7, 41)
    qs = torch.tensor([20, 25], device=DEVICE) if with_q_start else None
    return q, k, v, idx, 0.25, causal, qs


def _block_args(with_q_start=False):
    q, k, v = qkv(2, 19, 30, 4, 2, 16, 8, torch.float32, 43)
    m = glm5_ops.block_topk_mask(q, k, block_size=8, topk_blocks=1)
    qs = torch.tensor([11, 9], device=DEVICE) if with_q_start else None
    return q, k, v, m.kv_num_blocks, m.kv_indices, 8, 0.25, True, qs


# -------------------------------------------------------------- bad input --

def test_bad_input_names_the_argument():
    q, k, v, idx, *_ = _sparse_args()
    with pytest.raises(ValueError, match=r"k must have a kv head count Hkv that divides q.s Hq=3, got shape"):
        glm5_ops.sparse_attention(q[:, :, :3], k, v, idx)
    with pytest.raises(ValueError, match="k must have shape"):
        glm5_ops.sparse_attention(q, k[..., :8], v, idx)
    with pytest.raises(ValueError, match="v must have shape"):
        glm5_ops.sparse_attention(q, k, v[:, :10], idx)
    with pytest.raises(TypeError, match="indices must have dtype"):
        glm5_ops.sparse_attention(q, k, v, idx.float())
    with pytest.raises(ValueError, match="indices must have shape"):
        glm5_ops.sparse_attention(q, k, v, idx[:, :3])
    with pytest.raises(ValueError, match=r"indices must hold -1 or key positions in \[0, T=\d+\), got values"):
        glm5_ops.sparse_attention(q, k, v, idx + 100)
    with pytest.raises(TypeError, match="dtype of q"):
        glm5_ops.sparse_attention(q, k.half(), v.half(), idx)
    with pytest.raises(ValueError, match="scale"):
        glm5_ops.sparse_attention(q, k, v, idx, scale=-1.0)
    bq, bk, bv, num, bidx, bs, *_ = _block_args()
    mask = glm5_ops.BlockMask(num, bidx, bs)
    with pytest.raises(ValueError, match=r"kv_num_blocks must have shape .* the block mask is for another shape, got"):
        glm5_ops.block_sparse_attention(bq[:, :9], bk, bv, mask)
    with pytest.raises(ValueError, match="kv_indices"):
        glm5_ops.block_sparse_attention(bq, bk, bv, glm5_ops.BlockMask(num, bidx + 10, bs))
    with pytest.raises(ValueError, match="kv_indices must list each key block at most once per row, got a repeat"):
        twice = bidx.clone()
        twice[..., 1] = twice[..., 0]
        glm5_ops.block_sparse_attention(bq, bk, bv, glm5_ops.BlockMask(torch.full_like(num, 2), twice, bs))
    with pytest.raises(TypeError, match="block_mask must be"):
        glm5_ops.block_sparse_attention(bq, bk, bv, "causal")
    with pytest.raises(ValueError, match="pooling"):
        glm5_ops.block_topk_mask(bq, bk, block_size=8, topk_blocks=1, pooling="max")
    with pytest.raises(ValueError, match=r"k must have a kv head count Hkv that divides q.s H=3, got shape"):
        glm5_ops.block_topk_mask(bq[:, :, :3], bk, block_size=8, topk_blocks=1)


def test_cpp_ops_guard_direct_calls():
    """torch.ops.glm5 called directly (no Python checks) rejects bad input too."""
    ops = torch.ops.glm5
    q, k, v, idx, scale, causal, qs = _sparse_args()
    with pytest.raises(TypeError, match="indices must be int32"):
        ops.sparse_attention_fwd(q, k, v, idx.long(), scale, causal, qs)
    with pytest.raises(ValueError, match="Hkv >= 1 that divide the query heads of q .*got Hkv="):
        ops.sparse_attention_fwd(q[:, :, :3].contiguous(), k, v, idx, scale, causal, qs)
    bq, bk, bv, num, bidx, bs, *_ = _block_args()
    with pytest.raises(ValueError, match="kv_num_blocks must have shape"):
        ops.block_sparse_attention_fwd(bq, bk, bv, num[:, :, :1].contiguous(), bidx, bs, 0.3, True, None)
    with pytest.raises(ValueError, match="pooling"):
        ops.block_topk_mask(bq, bk, 8, 1, True, 1, 1, "median", None)


# ----------------------------------------------------------------- memory --

_MEMORY_SCRIPT = r"""
import torch, glm5_ops
from glm5_ops.memory import peak_rss_bytes
S = T = 65536; H = 8; D = 64; topk = 2048
g = torch.Generator().manual_seed(0)
q = torch.randn(1, S, H, D, generator=g); k = torch.randn(1, T, H, D, generator=g); v = torch.randn(1, T, H, D, generator=g)
idx = torch.empty(1, S, topk, dtype=torch.int32)
for s0 in range(0, S, 4096):  # causal random selection, built in chunks (no 512 MiB float temporaries)
    pos = torch.arange(s0, s0 + 4096)[:, None]
    idx[0, s0:s0 + 4096] = (torch.rand(4096, topk, generator=g) * (pos + 1)).to(torch.int32)
inputs = peak_rss_bytes()
out, lse = glm5_ops.sparse_attention(q, k, v, idx, causal=True)
assert bool(torch.isfinite(out).all())
print(inputs, peak_rss_bytes())
"""


@pytest.mark.skipif(DEVICE.type != "cpu", reason="resident-memory check of the CPU kernel")
def test_sparse_attention_64k_within_2gib():
    """S=T=65536, H=8, D=64, topk=2048 forward in a fresh process: peak
    resident memory (torch itself included) under 2 GiB; no [S,T] anywhere."""
    res = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"}, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    inputs, peak = map(int, res.stdout.split()[-2:])
    assert peak < 2 * 2**30, f"peak RSS {peak / 2**30:.2f} GiB (inputs and torch: {inputs / 2**30:.2f} GiB)"
