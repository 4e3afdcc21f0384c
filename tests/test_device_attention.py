"""Sparse attention at GLM-5's MLA sizes and the block-sparse paths the other
attention tests do not reach, every backend and dtype, forward and backward
(tolerances of tests/test_attention.py: fp32 1e-5 / 1e-4, fp16/bf16 within 2x
the reference's own error in that dtype):
- sparse_attention: Hq=64 and 128 query heads on one MLA key head (Dk=576,
  Dv=512, v = k[..., :512]), G=20, Dv > 512 (two Dv chunks), q_start int/tensor;
- block_sparse_attention: random unsorted masks with garbage past
  kv_num_blocks, partial and tiny (7) blocks, MLA widths with 128-blocks;
- block_topk_mask: sink/local blocks, minmax pooling, q_start, T=4096.
Shapes the Triton interpreter cannot afford are skipped there (big_ok)."""
import zlib

import pytest
import torch

import glm5_ops
from conftest import DEVICE, big_ok, float_dtypes
from glm5_ops import reference as R
from test_attention import compare, qkv, random_selection, run_with_grads

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _seed(case):
    return zlib.crc32(repr(case).encode()) % 1000   # stable across runs (str hashes are salted)


def _q_start(kind, B, S, T):
    if kind == "tensor":
        return torch.tensor(([0, T - S - 20] + [T - S] * B)[:B], device=DEVICE)
    return T // 2 if kind == "int" else None


def _skip_unless_affordable(backend, dtype, cost):
    if dtype not in float_dtypes(backend):
        pytest.skip("the Triton interpreter has no bf16 math")
    if not big_ok(backend) and cost > 2e6:
        pytest.skip("too large for the Triton interpreter (runs on the GPU)")


def _check_fwd_bwd(op, ref, q, k, v, dtype, seed):
    ours = run_with_grads(op, q, k, v, seed + 5)
    kf = k.float()
    vf = kf[..., :v.shape[-1]] if v.data_ptr() == k.data_ptr() else v.float()
    ref32 = run_with_grads(ref, q.float(), kf, vf, seed + 5)
    ref_lp = run_with_grads(ref, q, k, v, seed + 5) if dtype != torch.float32 else ref32
    compare(ours, ref32, ref_lp, dtype)


# B, S, T, Hq, Hkv, Dk, Dv, topk, causal, q_start, v_views_k
SPARSE_CASES = [
    (1, 9, 200, 64, 1, 576, 512, 64, True, None, True),      # MLA absorbed, G=64
    (1, 6, 400, 128, 1, 576, 512, 130, True, None, True),    # G=128: two units per query, topk % 64 != 0
    (1, 4, 100, 8, 1, 576, 512, 64, False, None, False),     # GLM-5 at TP8 (8 heads), v not a view
    (1, 4, 130, 20, 1, 40, 24, 70, False, None, False),      # G=20: masked rows in a 64-row tile
    (2, 33, 513, 16, 16, 128, 128, 100, True, "tensor", False),  # MHA, q_start per batch: empty rows
    (1, 3, 150, 2, 1, 96, 600, 40, True, "int", False),      # Dv > 512: two Dv chunks
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SPARSE_CASES, ids=lambda c: "B{}S{}T{}H{}/{}D{}/{}k{}{}-{}{}".format(
    *c[:8], "c" if c[8] else "", c[9], "-v=k" if c[10] else ""))
def test_sparse_glm5_shapes(backend, poisoned, case, dtype):
    B, S, T, Hq, Hkv, Dk, Dv, topk, causal, qs, v_views_k = case
    _skip_unless_affordable(backend, dtype, S * Hq * topk * (Dk + Dv))
    seed = _seed(case)
    q, k, v = qkv(B, S, T, Hq, Hkv, Dk, Dv, dtype, seed, v_views_k)
    idx = random_selection(B, S, T, topk, seed)
    idx[0, S // 2] = -1                      # a query with no key: zeros, lse -inf, zero gradients
    q_start = _q_start(qs, B, S, T)
    kw = dict(scale=Dk ** -0.5, causal=causal, q_start=q_start)
    _check_fwd_bwd(lambda a, b, c: glm5_ops.sparse_attention(a, b, c, idx, **kw),
                   lambda a, b, c: R.sparse_attention(a, b, c, idx, **kw), q, k, v, dtype, seed)


def random_block_mask(B, H, S, T, bs, seed):
    """Rows of distinct key blocks in random order, garbage (-7) past
    kv_num_blocks (never read), one empty row."""
    g = torch.Generator().manual_seed(seed)
    Qb, Kb = -(-S // bs), -(-T // bs)
    num = torch.randint(0, Kb + 1, (B, H, Qb), generator=g, dtype=torch.int32)
    order = torch.rand(B, H, Qb, Kb, generator=g).argsort(-1).to(torch.int32)
    idx = torch.where(torch.arange(Kb) < num[..., None], order, torch.full_like(order, -7))
    num[0, 0, 0] = 0
    return num.to(DEVICE), idx.to(DEVICE)


# B, S, T, Hq, Hkv, D, Dv, block_size, topk_blocks, causal, q_start, v_views_k, mask
BLOCK_CASES = [
    (2, 200, 200, 4, 2, 64, 64, 32, 3, True, None, False, "predicted"),
    (1, 77, 130, 3, 1, 20, 24, 16, 2, True, "int", False, "random"),      # odd sizes, partial blocks
    (1, 256, 300, 2, 2, 128, 128, 64, 2, True, None, False, "random"),
    (1, 100, 100, 2, 1, 64, 64, 7, 4, False, None, False, "random"),      # tiny blocks pack into key tiles
    (1, 129, 129, 2, 1, 576, 512, 128, 1, True, None, True, "predicted"),  # MLA widths, two row chunks
    (2, 64, 96, 4, 4, 32, 32, 16, 2, True, "tensor", False, "random"),    # q_start: empty causal rows
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: "B{}S{}T{}H{}/{}D{}/{}bs{}k{}{}-{}{}-{}".format(
    *c[:9], "c" if c[9] else "", c[10], "-v=k" if c[11] else "", c[12]))
def test_block_sparse_paths(backend, poisoned, case, dtype):
    B, S, T, Hq, Hkv, D, Dv, bs, topk_blocks, causal, qs, v_views_k, kind = case
    _skip_unless_affordable(backend, dtype, S * T * Hq * (D + Dv) // 8)
    seed = _seed(case)
    q, k, v = qkv(B, S, T, Hq, Hkv, D, Dv, dtype, seed, v_views_k)
    q_start = _q_start(qs, B, S, T)
    if kind == "predicted":
        num, idx = R.block_topk_mask(q, k, block_size=bs, topk_blocks=topk_blocks, causal=causal, q_start=q_start)
    else:
        num, idx = random_block_mask(B, Hq, S, T, bs, seed)
    mask = glm5_ops.BlockMask(num, idx, bs)
    kw = dict(scale=D ** -0.5, causal=causal, q_start=q_start)
    _check_fwd_bwd(lambda a, b, c: glm5_ops.block_sparse_attention(a, b, c, mask, **kw),
                   lambda a, b, c: R.block_sparse_attention(a, b, c, num, idx, block_size=bs, **kw),
                   q, k, v, dtype, seed)


def _block_scores(q, k, bs, pooling):
    """fp32 [B,H,Qb,Kb] block scores as reference.block_topk_mask defines them."""
    G = q.shape[2] // k.shape[2]
    qbar = R._block_means(q.float(), bs)
    if pooling == "mean":
        kbar = R._block_means(k.float(), bs).repeat_interleave(G, dim=2)
        return torch.einsum("bihd,bjhd->bhij", qbar, kbar)
    kmax = R._block_extreme(k.float(), bs, True).repeat_interleave(G, dim=2)
    kmin = R._block_extreme(k.float(), bs, False).repeat_interleave(G, dim=2)
    return (torch.einsum("bihd,bjhd->bhij", qbar.clamp(min=0), kmax)
            + torch.einsum("bihd,bjhd->bhij", qbar.clamp(max=0), kmin))


def assert_same_blocks(mask, ref_num, ref_idx, q, k, bs, pooling):
    """Same counts; rows ascending, 0 after kv_num_blocks; the chosen set is the
    reference's, or differs from it only by blocks of (near-)equal score."""
    num, idx = mask.kv_num_blocks, mask.kv_indices
    assert num.dtype == idx.dtype == torch.int32 and num.shape == ref_num.shape and idx.shape == ref_idx.shape
    assert torch.equal(num, ref_num), f"kv_num_blocks differs in {int((num != ref_num).sum())} rows"
    used = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    assert not ((idx[..., 1:] <= idx[..., :-1]) & used[..., 1:]).any(), "chosen blocks not strictly ascending"
    assert not (idx[~used] != 0).any(), "padding after kv_num_blocks is not 0"
    Kb = -(-k.shape[1] // bs)
    mine, ref = R._ordered_to_blocks(num, idx, Kb), R._ordered_to_blocks(ref_num, ref_idx, Kb)
    if torch.equal(mine, ref):
        return
    sc = _block_scores(q, k, bs, pooling)
    only_mine = torch.where(mine & ~ref, sc, torch.zeros_like(sc)).sum(-1)
    only_ref = torch.where(ref & ~mine, sc, torch.zeros_like(sc)).sum(-1)
    diff = float((only_mine - only_ref).abs().max())
    assert diff <= 1e-4 * max(float(sc.abs().max()), 1e-6), f"chosen blocks differ beyond ties ({diff:.2e})"


# B, S, T, H, Hkv, D, block_size, topk_blocks, causal, sink, local, pooling, q_start
MASK_CASES = [
    (2, 300, 300, 4, 2, 64, 32, 3, True, 1, 1, "mean", None),
    (1, 77, 1000, 3, 1, 20, 16, 5, True, 2, 2, "minmax", "int"),
    (1, 256, 4096, 8, 1, 128, 64, 16, True, 1, 2, "mean", None),
    (2, 100, 130, 2, 2, 32, 7, 4, False, 0, 1, "minmax", "tensor"),
    (1, 64, 64, 2, 1, 16, 16, 10, True, 1, 1, "mean", None),            # topk past the candidates: all taken
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: "B{}S{}T{}H{}/{}D{}bs{}k{}{}-s{}l{}-{}-{}".format(
    *c[:8], "c" if c[8] else "", *c[9:]))
def test_block_topk_mask_options(backend, poisoned, case, dtype):
    B, S, T, H, Hkv, D, bs, topk_blocks, causal, sink, local, pooling, qs = case
    _skip_unless_affordable(backend, dtype, S * T * H * D // bs ** 2)
    seed = _seed(case)
    q, k, _ = qkv(B, S, T, H, Hkv, D, D, dtype, seed)
    kw = dict(block_size=bs, topk_blocks=topk_blocks, causal=causal, sink_blocks=sink, local_blocks=local,
              pooling=pooling, q_start=_q_start(qs, B, S, T))
    mask = glm5_ops.block_topk_mask(q, k, **kw)
    assert mask.block_size == bs
    assert_same_blocks(mask, *R.block_topk_mask(q, k, **kw), q, k, bs, pooling)
