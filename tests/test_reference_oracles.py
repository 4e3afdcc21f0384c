"""Sanity tests of the pure-PyTorch oracles in glm5_ops/reference.py (the spec).

Each oracle is checked against an independent computation (torch SDPA, a
dense formula, a hand-made example, transformers when importable), so a wrong
oracle fails here before any kernel is compared with it. Fast: CPU, tiny shapes.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import glm5_ops
from glm5_ops import balance, flex
from glm5_ops import reference as ref


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=_gen(seed), dtype=dtype)


def _sdpa(q, k, v, allowed, scale):
    """Dense reference from torch: q [B,S,Hq,D] ... allowed bool [B,1|Hq,S,T]."""
    Hq, Hkv = q.shape[2], k.shape[2]
    kk = k.repeat_interleave(Hq // Hkv, dim=2)
    vv = v.repeat_interleave(Hq // Hkv, dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                       attn_mask=allowed, scale=scale)
    s = torch.einsum("bshd,bthd->bhst", q, kk) * scale
    lse = s.masked_fill(~allowed, float("-inf")).logsumexp(-1)
    return o.transpose(1, 2), lse.transpose(1, 2)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# --------------------------------------------------------------------------
# sparse_attention
# --------------------------------------------------------------------------

@pytest.mark.parametrize("B,S,T,Hq,Hkv,Dk,Dv", [(2, 5, 11, 6, 2, 12, 10), (1, 7, 7, 4, 1, 16, 8),
                                                (2, 1, 9, 3, 3, 8, 8)])
def test_sparse_attention_all_keys_equals_dense_causal(B, S, T, Hq, Hkv, Dk, Dv):
    q, k, v = _randn(B, S, Hq, Dk, seed=1), _randn(B, T, Hkv, Dk, seed=2), _randn(B, T, Hkv, Dv, seed=3)
    # every key, listed in a different random order per query: order must not matter
    g = _gen(4)
    idx = torch.stack([torch.stack([torch.randperm(T, generator=g) for _ in range(S)]) for _ in range(B)])
    idx = idx.to(torch.int32)
    scale = Dk ** -0.5
    out, lse = ref.sparse_attention(q, k, v, idx, scale=scale, causal=True)
    allowed = ~ref.causal_mask(B, S, T, None, q.device)[:, None]
    o_ref, lse_ref = _sdpa(q, k, v, allowed, scale)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == (B, S, Hq, Dv) and lse.shape == (B, S, Hq)
    torch.testing.assert_close(out, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)
    # non-causal: plain dense attention
    out_nc, lse_nc = ref.sparse_attention(q, k, v, idx, scale=scale, causal=False)
    o_ref, lse_ref = _sdpa(q, k, v, torch.ones(1, 1, S, T, dtype=torch.bool), scale)
    torch.testing.assert_close(out_nc, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_nc, lse_ref, rtol=1e-5, atol=1e-5)
    # and dense_attention agrees with both
    o_d, lse_d = ref.dense_attention(q, k, v, scale=scale, causal=True)
    torch.testing.assert_close(o_d, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_d, lse, rtol=1e-5, atol=1e-5)


def test_sparse_attention_q_start_tensor_and_bf16():
    B, S, T, Hq, Hkv, D = 2, 4, 10, 4, 2, 8
    q, k, v = _randn(B, S, Hq, D, seed=5), _randn(B, T, Hkv, D, seed=6), _randn(B, T, Hkv, D, seed=7)
    q_start = torch.tensor([2, 6])
    idx = torch.arange(T, dtype=torch.int32).expand(B, S, T).contiguous()
    out, lse = ref.sparse_attention(q, k, v, idx, scale=0.3, causal=True, q_start=q_start)
    allowed = ~ref.causal_mask(B, S, T, q_start, q.device)[:, None]
    o_ref, lse_ref = _sdpa(q, k, v, allowed, 0.3)
    torch.testing.assert_close(out, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)
    ob, lb = ref.sparse_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), idx, scale=0.3, causal=True,
                                  q_start=q_start)
    assert ob.dtype == torch.bfloat16 and lb.dtype == torch.float32


def test_sparse_attention_minus_one_future_and_empty_rows():
    B, S, T, Hq, Hkv, D = 1, 4, 9, 4, 2, 8
    q, k, v = _randn(B, S, Hq, D, seed=8), _randn(B, T, Hkv, D, seed=9), _randn(B, T, Hkv, D, seed=10)
    q_start = 3  # query s sits at position 3 + s
    idx = torch.tensor([[[0, -1, 2, 8, -1],      # 8 is in the future of position 3: skipped
                         [-1, -1, -1, -1, -1],   # nothing selected: empty row
                         [7, 6, -1, 1, 5],       # 7 and 6 are in the future of position 5
                         [8, 3, 4, -1, -1]]], dtype=torch.int32)  # 8 is in the future of 6
    out, lse = ref.sparse_attention(q, k, v, idx, scale=0.5, causal=True, q_start=q_start)
    allowed = torch.zeros(B, 1, S, T, dtype=torch.bool)
    for s, keys in enumerate([[0, 2], [], [1, 5], [3, 4]]):
        allowed[0, 0, s, keys] = True
    o_ref, lse_ref = _sdpa(q[:, [0, 2, 3]], k, v, allowed[:, :, [0, 2, 3]], 0.5)
    torch.testing.assert_close(out[:, [0, 2, 3]], o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[:, [0, 2, 3]], lse_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:, 1], torch.zeros_like(out[:, 1]))
    assert torch.isneginf(lse[:, 1]).all()
    # the empty row and the skipped slots give finite (zero) gradients, never NaN
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    o, _ = ref.sparse_attention(qq, kk, vv, idx, scale=0.5, causal=True, q_start=q_start)
    o.square().sum().backward()
    for t in (qq, kk, vv):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(qq.grad[:, 1], torch.zeros_like(qq.grad[:, 1]))
    # a selection made only of future keys is empty too
    o2, l2 = ref.sparse_attention(q, k, v, torch.full((B, S, 2), 8, dtype=torch.int32), scale=0.5,
                                  causal=True, q_start=0)
    assert torch.equal(o2, torch.zeros_like(o2)) and torch.isneginf(l2).all()


def test_sparse_attention_matches_dense_on_selection_mask_mla_view():
    # MLA's absorbed form: Hkv = 1 and v a view of the first Dv channels of k
    B, S, T, Hq, Dk, Dv, topk = 2, 6, 23, 8, 20, 16, 7
    q, kv = _randn(B, S, Hq, Dk, seed=11), _randn(B, T, 1, Dk, seed=12)
    v = kv[..., :Dv]
    g = _gen(13)
    idx = torch.stack([torch.stack([torch.randperm(T, generator=g)[:topk] for _ in range(S)])
                       for _ in range(B)]).to(torch.int32)
    out, lse = ref.sparse_attention(q, kv, v, idx, scale=0.2, causal=True)
    allowed = torch.zeros(B, S, T + 1, dtype=torch.bool).scatter_(-1, idx.long(), True)[..., :T]
    allowed &= ~ref.causal_mask(B, S, T, None, q.device)
    o_ref, lse_ref = _sdpa(q, kv, v, allowed[:, None], 0.2)
    torch.testing.assert_close(out, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)


def test_sparse_attention_gradcheck_float64():
    B, S, T, Hq, Hkv, D = 1, 3, 5, 2, 1, 3
    q = _randn(B, S, Hq, D, seed=14, dtype=torch.float64).requires_grad_()
    k = _randn(B, T, Hkv, D, seed=15, dtype=torch.float64).requires_grad_()
    v = _randn(B, T, Hkv, D, seed=16, dtype=torch.float64).requires_grad_()
    idx = torch.tensor([[[0, 4, -1], [1, 2, 3], [4, -1, 0]]], dtype=torch.int32)

    def f(q, k, v):
        return ref.sparse_attention(q, k, v, idx, scale=0.7, causal=True, q_start=2)

    assert torch.autograd.gradcheck(f, (q, k, v))


# --------------------------------------------------------------------------
# block masks and block_sparse_attention
# --------------------------------------------------------------------------

def _full_block_mask(B, H, S, T, bs):
    Qb, Kb = -(-S // bs), -(-T // bs)
    num = torch.full((B, H, Qb), Kb, dtype=torch.int32)
    idx = torch.arange(Kb, dtype=torch.int32).expand(B, H, Qb, Kb).contiguous()
    return num, idx


@pytest.mark.parametrize("S,T,bs", [(13, 13, 4), (5, 19, 8), (16, 16, 16)])
def test_block_sparse_all_blocks_equals_dense_causal(S, T, bs):
    B, Hq, Hkv, D = 2, 4, 2, 8
    q, k, v = _randn(B, S, Hq, D, seed=20), _randn(B, T, Hkv, D, seed=21), _randn(B, T, Hkv, D, seed=22)
    num, idx = _full_block_mask(B, 1, S, T, bs)
    out, lse = ref.block_sparse_attention(q, k, v, num, idx, block_size=bs, scale=0.4)
    o_ref, lse_ref = _sdpa(q, k, v, ~ref.causal_mask(B, S, T, None, q.device)[:, None], 0.4)
    torch.testing.assert_close(out, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)


def test_block_sparse_gradcheck_float64():
    B, S, T, Hq, Hkv, D, bs = 1, 5, 6, 2, 1, 3, 2
    q = _randn(B, S, Hq, D, seed=26, dtype=torch.float64).requires_grad_()
    k = _randn(B, T, Hkv, D, seed=27, dtype=torch.float64).requires_grad_()
    v = _randn(B, T, Hkv, D, seed=28, dtype=torch.float64).requires_grad_()
    num = torch.tensor([[[1, 1, 2], [1, 2, 2]]], dtype=torch.int32)           # per query head
    idx = torch.tensor([[[[0, 0], [1, 0], [0, 2]], [[0, 0], [0, 1], [1, 2]]]], dtype=torch.int32)

    def f(q, k, v):
        return ref.block_sparse_attention(q, k, v, num, idx, block_size=bs, scale=0.6)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_block_sparse_equals_token_sparse_on_the_same_keys():
    B, S, T, Hq, Hkv, D, bs = 2, 11, 29, 4, 4, 8, 4
    q, k, v = _randn(B, S, Hq, D, seed=23), _randn(B, T, Hkv, D, seed=24), _randn(B, T, Hkv, D, seed=25)
    num, idx = ref.block_topk_mask(q, k, block_size=bs, topk_blocks=2)
    out, lse = ref.block_sparse_attention(q, k, v, num, idx, block_size=bs, scale=0.3)
    dense = ref.block_mask_to_dense(num, idx, bs, S, T)            # [B,Hq,S,T]
    for h in range(Hq):
        tok = torch.where(dense[:, h], torch.arange(T), torch.full((T,), -1)).to(torch.int32)
        o_h, l_h = ref.sparse_attention(q[:, :, h:h + 1], k[:, :, h:h + 1], v[:, :, h:h + 1], tok,
                                        scale=0.3, causal=True)
        torch.testing.assert_close(out[:, :, h:h + 1], o_h, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[:, :, h:h + 1], l_h, rtol=1e-5, atol=1e-5)


def _brute_block_scores(q, k, bs, pooling):
    B, S, H, D = q.shape
    T, Hkv = k.shape[1], k.shape[2]
    Qb, Kb = -(-S // bs), -(-T // bs)
    out = torch.empty(B, H, Qb, Kb)
    for i in range(Qb):
        qbar = q[:, i * bs:(i + 1) * bs].mean(1)                   # [B,H,D]
        for j in range(Kb):
            kb = k[:, j * bs:(j + 1) * bs].repeat_interleave(H // Hkv, dim=2)  # [B,n,H,D]
            if pooling == "mean":
                out[:, :, i, j] = (qbar * kb.mean(1)).sum(-1)
            else:
                out[:, :, i, j] = torch.maximum(qbar * kb.amin(1), qbar * kb.amax(1)).sum(-1)
    return out


@pytest.mark.parametrize("pooling", ["mean", "minmax"])
@pytest.mark.parametrize("S,T,q_start", [(37, 37, None), (9, 30, None), (12, 40, torch.tensor([5, 28]))])
def test_block_topk_mask_invariants(pooling, S, T, q_start):
    B, H, Hkv, D, bs, topk, sink, local = 2, 4, 2, 8, 4, 3, 1, 2
    q, k = _randn(B, S, H, D, seed=30), _randn(B, T, Hkv, D, seed=31)
    num, idx = ref.block_topk_mask(q, k, block_size=bs, topk_blocks=topk, sink_blocks=sink,
                                   local_blocks=local, pooling=pooling, q_start=q_start)
    Qb, Kb = -(-S // bs), -(-T // bs)
    assert num.dtype == torch.int32 and idx.dtype == torch.int32
    assert num.shape == (B, H, Qb) and idx.shape == (B, H, Qb, min(Kb, sink + local + topk))
    scores = _brute_block_scores(q, k, bs, pooling)
    pos = ref.query_positions(B, S, T, q_start, q.device)
    for b in range(B):
        for i in range(Qb):
            last = int(pos[b, min((i + 1) * bs, S) - 1])
            diag = min(last // bs, Kb - 1)
            allowed = set(range(diag + 1))
            mandatory = ({j for j in range(sink)} | set(range(diag - local + 1, diag + 1))) & allowed
            for h in range(H):
                n = int(num[b, h, i])
                row = idx[b, h, i].tolist()
                sel = row[:n]
                assert sel == sorted(set(sel)), "ascending, no duplicates"
                assert all(x == 0 for x in row[n:]), "padding is 0"
                assert mandatory <= set(sel), "sink and local blocks always present"
                assert set(sel) <= allowed, "causal: no block starting after the last query"
                rest = sorted(allowed - mandatory, key=lambda j: (-scores[b, h, i, j].item(), j))
                assert n == len(mandatory) + min(topk, len(rest))
                assert set(sel) - mandatory == set(rest[:topk]), "the top-scoring remaining blocks"


def test_block_topk_mask_minmax_bounds_every_key():
    # Quest's score is an upper bound of qbar·k_t for every key of the block
    B, S, H, D, bs = 1, 8, 2, 16, 4
    q, k = _randn(B, S, H, D, seed=32), _randn(B, 19, H, D, seed=33)
    bound = _brute_block_scores(q, k, bs, "minmax")
    qbar = torch.stack([q[:, i * bs:(i + 1) * bs].mean(1) for i in range(2)], 1)  # [B,2,H,D]
    dots = torch.einsum("bihd,bthd->bhit", qbar, k)
    for t in range(19):
        assert (dots[..., t] <= bound[..., t // bs] + 1e-5).all()


def test_block_topk_mask_non_causal():
    q, k = _randn(1, 8, 2, 4, seed=34), _randn(1, 20, 1, 4, seed=35)
    num, idx = ref.block_topk_mask(q, k, block_size=4, topk_blocks=10, causal=False)
    assert (num == 5).all()                                         # every block, capped by Kb


def test_block_mask_to_dense():
    num = torch.tensor([[[1, 2]]], dtype=torch.int32)
    idx = torch.tensor([[[[1, 0], [0, 2]]]], dtype=torch.int32)
    d = ref.block_mask_to_dense(num, idx, 2, 3, 5)
    expect = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 1, 1, 0], [1, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(d[0, 0], expect)


def _flex():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    return fa


def _run_flex(fa, q, k, v, block_mask, scale):
    import warnings
    Hq, Hkv = q.shape[2], k.shape[2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            o, aux = fa.flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       block_mask=block_mask, scale=scale, enable_gqa=Hq != Hkv,
                                       return_aux=fa.AuxRequest(lse=True))
            lse = aux.lse
        except (AttributeError, TypeError):
            o, lse = fa.flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       block_mask=block_mask, scale=scale, enable_gqa=Hq != Hkv,
                                       return_lse=True)
    return o.transpose(1, 2), lse.transpose(1, 2)


def test_from_flex_block_mask_matches_flex_attention():
    fa = _flex()
    B, H, S, D, bs = 2, 2, 200, 16, 64                              # 200: a partial last block
    q, k, v = _randn(B, S, H, D, seed=40), _randn(B, S, H, D, seed=41), _randn(B, S, H, D, seed=42)

    def mask_mod(b, h, q_idx, kv_idx):                              # causal, key block 1 dropped
        return (q_idx >= kv_idx) & ((kv_idx // bs) != 1)

    try:
        bm = fa.create_block_mask(mask_mod, B, H, S, S, device="cpu", BLOCK_SIZE=bs)
        o_flex, lse_flex = _run_flex(fa, q, k, v, bm, 0.25)
    except Exception as e:  # pragma: no cover - flex unavailable on this CPU build
        pytest.skip(f"flex_attention does not run on CPU here: {e}")
    num, idx, block_size = flex.from_flex_block_mask(bm)
    assert block_size == bs and num.shape == (B, H, 4)
    assert idx[0, 0, 3, :int(num[0, 0, 3])].tolist() == [0, 2, 3]
    out, lse = ref.block_sparse_attention(q, k, v, num, idx, block_size=bs, scale=0.25)
    torch.testing.assert_close(out, o_flex, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_flex.float(), rtol=1e-5, atol=1e-5)


def test_block_topk_mask_through_flex_attention():
    fa = _flex()
    B, Hq, Hkv, S, D, bs = 1, 4, 2, 150, 16, 32
    q, k, v = _randn(B, S, Hq, D, seed=43), _randn(B, S, Hkv, D, seed=44), _randn(B, S, Hkv, D, seed=45)
    num, idx = ref.block_topk_mask(q, k, block_size=bs, topk_blocks=1, pooling="minmax")
    try:
        bm = flex.to_flex_block_mask(num, idx, bs, S, S)
        o_flex, lse_flex = _run_flex(fa, q, k, v, bm, 0.25)
    except Exception as e:  # pragma: no cover
        pytest.skip(f"flex_attention does not run on CPU here: {e}")
    out, lse = ref.block_sparse_attention(q, k, v, num, idx, block_size=bs, scale=0.25)
    torch.testing.assert_close(out, o_flex, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_flex.float(), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# attention_recall
# --------------------------------------------------------------------------

def test_attention_recall():
    B, S, T, Hq, Hkv, D, topk = 1, 6, 24, 4, 2, 8, 5
    q, k, v = _randn(B, S, Hq, D, seed=50), _randn(B, T, Hkv, D, seed=51), _randn(B, T, Hkv, D, seed=52)
    everything = torch.arange(T, dtype=torch.int32).expand(B, S, T).contiguous()
    r = glm5_ops.attention_recall(q, k, v, everything, scale=0.35)
    torch.testing.assert_close(r.recall, torch.ones_like(r.recall))
    assert r.rel_err.max() < 1e-6 and r.output_rel_err < 1e-6 and abs(r.mean_recall - 1) < 1e-6
    # a random selection: recall = the dense probabilities summed over the kept keys
    g = _gen(53)
    sel = torch.stack([torch.randperm(T, generator=g)[:topk] for _ in range(S)])[None].to(torch.int32)
    r = glm5_ops.attention_recall(q, k, v, sel, scale=0.35)
    allowed = ~ref.causal_mask(B, S, T, None, q.device)
    kk = k.repeat_interleave(2, dim=2)
    p = torch.einsum("bshd,bthd->bsht", q, kk).mul(0.35)
    p = p.masked_fill(~allowed[:, :, None], -math.inf).softmax(-1)
    keep = torch.zeros(B, S, T, dtype=torch.bool).scatter_(-1, sel.long(), True)
    torch.testing.assert_close(r.recall, (p * keep[:, :, None]).sum(-1), rtol=1e-5, atol=1e-6)
    assert ((r.recall >= 0) & (r.recall <= 1 + 1e-6)).all()
    # the error matches sparse_attention against dense attention
    o_sel, _ = ref.sparse_attention(q, k, v, sel, scale=0.35, causal=True)
    o, _ = ref.dense_attention(q, k, v, scale=0.35)
    assert abs(r.output_rel_err - _rel(o_sel, o)) < 1e-5
    # a block selection with every block equals full recall
    num, idx = _full_block_mask(B, 1, S, T, 4)
    rb = glm5_ops.attention_recall(q, k, v, (num, idx, 4), scale=0.35)
    torch.testing.assert_close(rb.recall, torch.ones_like(rb.recall))


# --------------------------------------------------------------------------
# MoE routing
# --------------------------------------------------------------------------

def _route_transcribed(h, gate_w, bias, top_k, n_group, topk_group, rsf, norm):
    """Direct transcription of transformers' GlmMoeDsaTopkRouter.forward (v5.25)."""
    E = gate_w.shape[0]
    logits = F.linear(h.float(), gate_w.float())
    scores = logits.sigmoid()
    sfc = scores + bias
    gs = sfc.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    gi = torch.topk(gs, k=topk_group, dim=-1, sorted=False)[1]
    gm = torch.zeros_like(gs)
    gm.scatter_(1, gi, 1)
    sm = gm.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(-1, E)
    sfc = sfc.masked_fill(~sm.bool(), float("-inf"))
    idx = torch.topk(sfc, k=top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, idx)
    if norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * rsf, idx


def _by_id(w, ids):
    order = ids.long().argsort(-1)
    return w.gather(1, order), ids.long().gather(1, order)


@pytest.mark.parametrize("E,top_k,n_group,topk_group,norm", [(16, 4, 1, 1, True), (32, 6, 4, 2, True),
                                                              (24, 3, 8, 3, False), (8, 1, 2, 1, True)])
def test_moe_route_matches_transcription(E, top_k, n_group, topk_group, norm):
    T, D = 33, 20
    h, gate_w = _randn(T, D, seed=60), _randn(E, D, seed=61) * 0.3
    bias = _randn(E, seed=62) * 0.1
    w, ids = ref.moe_route(h, gate_w, bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                           routed_scaling_factor=2.5, norm_topk_prob=norm)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (T, top_k)
    w_ref, ids_ref = _route_transcribed(h, gate_w, bias, top_k, n_group, topk_group, 2.5, norm)
    w_a, i_a = _by_id(w, ids)
    w_b, i_b = _by_id(w_ref, ids_ref)
    assert torch.equal(i_a, i_b)
    torch.testing.assert_close(w_a, w_b, rtol=0, atol=1e-6)
    if n_group > 1:   # every chosen expert lies in one of the topk_group best groups
        groups = (ids.long() // (E // n_group))
        assert (torch.tensor([len(set(r)) for r in groups.tolist()]) <= topk_group).all()
    # the bias steers the choice, never the weights: a huge bias on expert 0 forces it in
    big = bias.clone()
    big[0] = 100.0
    w2, ids2 = ref.moe_route(h, gate_w, big, top_k=top_k, n_group=n_group, topk_group=topk_group,
                             routed_scaling_factor=1.0, norm_topk_prob=False)
    assert (ids2 == 0).any(-1).all()
    scores = torch.sigmoid(h @ gate_w.T)
    torch.testing.assert_close(w2, scores.gather(1, ids2.long()))


def test_moe_route_and_experts_match_transformers():
    pytest.importorskip("transformers")
    try:
        from transformers import GlmMoeDsaConfig
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (GlmMoeDsaExperts,
                                                                          GlmMoeDsaTopkRouter)
    except ImportError:
        pytest.skip("this transformers has no glm_moe_dsa")
    for E, top_k, n_group, topk_group in [(16, 4, 1, 1), (32, 8, 4, 2)]:
        D, I, T = 24, 10, 19
        cfg = GlmMoeDsaConfig(hidden_size=D, n_routed_experts=E, num_experts_per_tok=top_k,
                              n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5,
                              norm_topk_prob=True, moe_intermediate_size=I)
        router = GlmMoeDsaTopkRouter(cfg)
        experts = GlmMoeDsaExperts(cfg)
        with torch.no_grad():
            router.weight.copy_(_randn(E, D, seed=63) * 0.3)
            router.e_score_correction_bias.copy_(_randn(E, seed=64) * 0.1)
            experts.gate_up_proj.copy_(_randn(E, 2 * I, D, seed=65) * 0.2)
            experts.down_proj.copy_(_randn(E, D, I, seed=66) * 0.2)
        h = _randn(T, D, seed=67)
        _, w_hf, ids_hf = router(h)
        w, ids = ref.moe_route(h, router.weight, router.e_score_correction_bias, top_k=top_k,
                               n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5,
                               norm_topk_prob=True)
        w_a, i_a = _by_id(w, ids)
        w_b, i_b = _by_id(w_hf, ids_hf)
        assert torch.equal(i_a, i_b)
        torch.testing.assert_close(w_a, w_b, rtol=0, atol=1e-6)
        with torch.no_grad():
            y_hf = experts(h, ids_hf, w_hf)
        y = ref.fused_moe(h, experts.gate_up_proj, experts.down_proj, w, ids)
        torch.testing.assert_close(y, y_hf, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# dispatch / combine / fused_moe
# --------------------------------------------------------------------------

@pytest.mark.parametrize("align", [1, 4])
def test_dispatch_combine_round_trip(align):
    T, D, k, E = 9, 5, 3, 6
    x = _randn(T, D, seed=70)
    g = _gen(71)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])  # expert 5 unused
    ids = ids.to(torch.int32)
    x_sorted, plan = ref.moe_dispatch(x, ids, E, align=align)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
    seg = torch.diff(plan.expert_offsets.long())
    assert plan.expert_offsets.dtype == plan.slot_token.dtype == plan.token_slot.dtype == torch.int32
    assert int(plan.expert_offsets[0]) == 0 and (seg % align == 0).all()
    assert torch.equal(seg, (counts + align - 1) // align * align) and seg[E - 1] == 0
    N = int(plan.expert_offsets[-1])
    assert x_sorted.shape == (N, D) and plan.slot_token.shape == (N,)
    for e in range(E):
        a, c = int(plan.expert_offsets[e]), int(counts[e])
        rows = plan.slot_token[a:a + c].tolist()
        expect = [t for t in range(T) for j in range(k) if ids[t, j] == e]   # stable: token, then slot
        assert rows == expect
        assert (plan.slot_token[a + c:int(plan.expert_offsets[e + 1])] == -1).all()
    pad = plan.slot_token < 0
    assert (x_sorted[pad] == 0).all() and int(pad.sum()) == N - T * k
    assert torch.equal(x_sorted[plan.token_slot.long()], x[:, None].expand(T, k, D))
    assert torch.equal(ids.long(), torch.searchsorted(plan.expert_offsets.long(),
                                                      plan.token_slot.long(), right=True) - 1)
    # identity experts, weights 1: combine(dispatch(x)) = k * x; with a plan or with token_slot
    torch.testing.assert_close(ref.moe_combine(x_sorted, plan, torch.ones(T, k)), k * x)
    w = _randn(T, k, seed=72)
    torch.testing.assert_close(ref.moe_combine(2 * x_sorted, plan.token_slot, w),
                               2 * w.sum(1, keepdim=True) * x)


def test_fused_moe_equals_dense_every_expert():
    T, D, I, E = 7, 9, 5, 4
    x = _randn(T, D, seed=80, dtype=torch.float64).requires_grad_()
    wgu = (_randn(E, 2 * I, D, seed=81, dtype=torch.float64) * 0.3).requires_grad_()
    wd = (_randn(E, D, I, seed=82, dtype=torch.float64) * 0.3).requires_grad_()
    w = _randn(T, E, seed=83, dtype=torch.float64).requires_grad_()
    g = _gen(84)
    # every token goes to every expert, in a random slot order
    ids = torch.stack([torch.randperm(E, generator=g) for _ in range(T)]).to(torch.int32)
    y = ref.fused_moe(x, wgu, wd, w, ids)
    # dense: all experts on all tokens at once, mixing weights scattered to expert order
    gate, up = torch.einsum("td,efd->tef", x, wgu).chunk(2, dim=-1)
    per_expert = torch.einsum("tei,edi->ted", F.silu(gate) * up, wd)           # [T,E,D]
    w_dense = torch.zeros(T, E, dtype=w.dtype).scatter(1, ids.long(), w)
    y_dense = (w_dense[:, :, None] * per_expert).sum(1)
    torch.testing.assert_close(y, y_dense, rtol=1e-10, atol=1e-10)
    gy = _randn(T, D, seed=85, dtype=torch.float64)
    g1 = torch.autograd.grad(y, (x, wgu, wd, w), gy)
    g2 = torch.autograd.grad(y_dense, (x, wgu, wd, w), gy)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # fp32 and bf16 inputs come back in their dtype; an expert with no token is fine
    x32 = x.detach().float()
    y32 = ref.fused_moe(x32, wgu.detach().float(), wd.detach().float(), w.detach().float()[:, :2],
                        torch.zeros(T, 2, dtype=torch.int32))
    assert y32.dtype == torch.float32 and y32.shape == (T, D)
    assert ref.fused_moe(x32.bfloat16(), wgu.detach().bfloat16(), wd.detach().bfloat16(),
                         w.detach().float(), ids).dtype == torch.bfloat16


def test_fused_moe_equals_dispatch_experts_combine():
    T, D, I, E, k = 12, 8, 6, 5, 2
    x, wgu, wd = _randn(T, D, seed=86), _randn(E, 2 * I, D, seed=87) * 0.3, _randn(E, D, I, seed=88) * 0.3
    g = _gen(89)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    w = _randn(T, k, seed=90)
    xs, plan = ref.moe_dispatch(x, ids, E, align=4)
    ys = torch.zeros_like(xs)
    for e in range(E):
        a, b = int(plan.expert_offsets[e]), int(plan.expert_offsets[e + 1])
        ys[a:b] = ref.swiglu_expert(xs[a:b], wgu[e], wd[e])
    torch.testing.assert_close(ref.moe_combine(ys, plan, w), ref.fused_moe(x, wgu, wd, w, ids),
                               rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# load balancing
# --------------------------------------------------------------------------

def test_load_balancing_helpers():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1]], dtype=torch.int32)
    load = balance.expert_load(ids, 4)
    assert load.tolist() == [3, 2, 1, 0]
    assert abs(float(balance.max_violation(load)) - (3 - 1.5) / 1.5) < 1e-6
    assert float(balance.max_violation(torch.tensor([2, 2, 2]))) == 0.0
    b = balance.bias_update(torch.zeros(4), load, rate=0.01)
    torch.testing.assert_close(b, torch.tensor([-0.01, -0.01, 0.01, 0.01]))
    # Switch: 1 at perfect balance with uniform probabilities; hand example otherwise
    E, T = 4, 8
    uniform = torch.full((T, E), 1 / E)
    ids_bal = torch.arange(T).remainder(E)[:, None].to(torch.int32)
    assert abs(float(balance.switch_aux_loss(uniform, ids_bal)) - 1) < 1e-6
    probs = torch.softmax(_randn(3, 4, seed=91), -1)
    expect = 4 * sum(float(load[e]) / 6 * float(probs[:, e].mean()) for e in range(4))
    assert abs(float(balance.switch_aux_loss(probs, ids)) - expect) < 1e-6
    # DeepSeek-V3 sequence-wise loss, by its formula, for two sequences
    s = torch.sigmoid(_randn(2, 3, 4, seed=92))
    ids2 = torch.tensor([[[0, 1], [0, 2], [3, 1]], [[2, 3], [2, 1], [2, 0]]], dtype=torch.int32)
    vals = []
    for n in range(2):
        sn = s[n] / s[n].sum(-1, keepdim=True)
        f = [4 / (2 * 3) * sum(e in ids2[n, t].tolist() for t in range(3)) for e in range(4)]
        vals.append(sum(f[e] * float(sn[:, e].mean()) for e in range(4)))
    assert abs(float(balance.seq_aux_loss(s, ids2)) - sum(vals) / 2) < 1e-6
    assert abs(float(balance.seq_aux_loss(torch.full((4, 4), 0.3), ids_bal[:4])) - 1) < 1e-6


def test_bias_update_balances_a_skewed_router():
    T, D, E, k = 256, 16, 16, 2
    h = _randn(T, D, seed=93)
    gate_w = _randn(E, D, seed=94) * 0.5
    gate_w[:2] += 4.0 * h.mean(0) / h.mean(0).norm() ** 2            # experts 0, 1 preferred by everyone
    bias = torch.zeros(E)
    w0, ids = ref.moe_route(h, gate_w, bias, top_k=k, n_group=1, topk_group=1,
                            routed_scaling_factor=1.0, norm_topk_prob=False)
    start = float(balance.max_violation(balance.expert_load(ids, E)))
    late = []
    for step in range(600):
        w, ids = ref.moe_route(h, gate_w, bias, top_k=k, n_group=1, topk_group=1,
                               routed_scaling_factor=1.0, norm_topk_prob=False)
        load = balance.expert_load(ids, E)
        if step >= 580:                                             # sign updates end in a small cycle
            late.append(float(balance.max_violation(load)))
        bias = balance.bias_update(bias, load, rate=1e-3)
    assert start > 2.0 and sum(late) / len(late) < start / 4
    torch.testing.assert_close(w, torch.sigmoid(h @ gate_w.T).gather(1, ids.long()))


# --------------------------------------------------------------------------
# quantize_groupwise / dequantize
# --------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_quantize_round_trip_within_half_step(bits, group_size):
    x = _randn(3, 2 * 256, seed=100 + bits) * 3 + 1
    packed, scale, zero = ref.quantize_groupwise(x, bits, group_size)
    G = x.numel() // group_size
    assert packed.dtype == torch.uint8 and packed.shape == (x.numel() * bits // 8,)
    assert scale.shape == zero.shape == (G,) and scale.dtype == zero.dtype == torch.float32
    xg = x.reshape(G, group_size)
    torch.testing.assert_close(zero, xg.amin(1))
    torch.testing.assert_close(scale, (xg.amax(1) - xg.amin(1)) / (2 ** bits - 1))
    y = ref.dequantize(packed, scale, zero, bits, group_size, x.shape, torch.float32)
    assert y.shape == x.shape
    err = (y - x).reshape(G, group_size).abs()
    assert (err <= scale[:, None] * 0.5 * (1 + 1e-4) + 1e-6).all()
    # group min and max come back (nearly) exactly
    yg = y.reshape(G, group_size)
    torch.testing.assert_close(yg.amin(1), xg.amin(1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(yg.amax(1), xg.amax(1), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantize_stochastic_is_unbiased(bits):
    x = _randn(16, 256, seed=110)
    gen = torch.Generator().manual_seed(111)
    group_size, draws = 64, 300
    total = torch.zeros_like(x)
    for _ in range(draws):
        p, s, z = ref.quantize_groupwise(x, bits, group_size, stochastic=True, generator=gen)
        total += ref.dequantize(p, s, z, bits, group_size, x.shape, torch.float32) - x
    step = s.repeat_interleave(group_size).reshape(x.shape)
    mean_err = total / draws / step                                 # in units of the group's step
    assert abs(float(mean_err.mean())) < 2e-3                       # overall: unbiased
    assert float(mean_err.abs().max()) < 0.2                        # per element: 6+ sigma
    # deterministic rounding, by contrast, is biased per element
    p, s, z = ref.quantize_groupwise(x, bits, group_size, stochastic=False)
    det = (ref.dequantize(p, s, z, bits, group_size, x.shape, torch.float32) - x) / step
    assert float(det.abs().max()) > 0.3
    # same seed, same draw
    a = ref.quantize_groupwise(x, bits, group_size, stochastic=True, seed=5)[0]
    b = ref.quantize_groupwise(x, bits, group_size, stochastic=True, seed=5)[0]
    assert torch.equal(a, b)


def test_quantize_packing_byte_layout():
    x = torch.tensor([0., 1., 2., 3., 3., 2., 1., 0.])
    p, s, z = ref.quantize_groupwise(x, 2, 4)                       # codes 0,1,2,3 | 3,2,1,0
    assert p.tolist() == [0 | 1 << 2 | 2 << 4 | 3 << 6, 3 | 2 << 2 | 1 << 4 | 0 << 6]   # [228, 27]
    assert s.tolist() == [1.0, 1.0] and z.tolist() == [0.0, 0.0]
    x4 = torch.arange(16.).flip(0).reshape(1, 16) * 0.5 - 2         # codes 15, 14, ..., 0
    p4, s4, z4 = ref.quantize_groupwise(x4, 4, 16)
    assert p4.tolist() == [15 | 14 << 4, 13 | 12 << 4, 11 | 10 << 4, 9 | 8 << 4, 7 | 6 << 4,
                           5 | 4 << 4, 3 | 2 << 4, 1 | 0 << 4]
    assert s4.tolist() == [0.5] and z4.tolist() == [-2.0]
    # scale 1, zero 10: codes 0, 0 (0.5 ties to even), 128 (127.5 ties to even), 255
    x8 = torch.tensor([[10., 10.5, 137.5, 265.]])
    p8, s8, z8 = ref.quantize_groupwise(x8, 8, 4)
    assert p8.tolist() == [0, 0, 128, 255]
    # constant groups: scale 0, exact round trip
    c = torch.full((2, 8), 1.25)
    pc, sc, zc = ref.quantize_groupwise(c, 4, 8)
    assert sc.tolist() == [0.0, 0.0] and torch.equal(ref.dequantize(pc, sc, zc, 4, 8, c.shape), c)


def test_quantize_dtypes():
    x = _randn(4, 64, seed=120).bfloat16()
    p, s, z = ref.quantize_groupwise(x, 8, 32)
    y = ref.dequantize(p, s, z, 8, 32, x.shape, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
