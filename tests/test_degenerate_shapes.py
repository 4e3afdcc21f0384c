"""Degenerate shapes: every row of docs/OPS.md's table ("Degenerate shapes"),
on every backend here and through direct torch.ops.glm5 calls.

Rule: an empty batch, query, row or token axis gives an empty result of the
documented shape (as torch does); an empty selection (zero slots) selects
nothing; an axis the op cannot run without (heads, head dims, keys, experts,
k = 0, k past the keys) raises ValueError naming the argument. Cases that
once crashed or hung the process (issue 24) run in a subprocess with a timeout.
"""
import os
import subprocess
import sys

import pytest
import torch

import glm5_ops
from conftest import DEVICE, fresh

ops = torch.ops.glm5
NEG_INF = float("-inf")
NO_TRITON = ("moe_dispatch", "moe_combine")  # no Triton kernel: NotImplementedError on that backend


def ids(T, k, E=4):
    return torch.randint(0, E, (T, k), dtype=torch.int32, device=DEVICE)


def shapes(out):
    """The shapes of the tensors in an op's result (tuples, BlockMask, MoEPlan)."""
    if isinstance(out, torch.Tensor):
        return [tuple(out.shape)]
    if isinstance(out, (tuple, list)):
        return [s for o in out for s in shapes(o)]
    return []


def _causal_mask(S, T, bs=4):
    return glm5_ops.BlockMask.causal(S, T, bs, device=DEVICE)


# ------------------------------------------------ empty in -> empty out --
# (op, call, expected result shapes, check of the values or None)

EMPTY = [
    ("indexer_scores", "B=0", lambda: glm5_ops.indexer_scores(fresh(0, 5, 3, 8), fresh(0, 5, 3), fresh(0, 16, 8)),
     [(0, 5, 16)]),
    ("indexer_scores", "S=0", lambda: glm5_ops.indexer_scores(fresh(2, 0, 3, 8), fresh(2, 0, 3), fresh(2, 16, 8)),
     [(2, 0, 16)]),
    ("indexer_topk", "B=0", lambda: glm5_ops.indexer_topk(fresh(0, 5, 3, 8), fresh(0, 5, 3), fresh(0, 16, 8), 4),
     [(0, 5, 4)]),
    ("indexer_topk", "S=0", lambda: glm5_ops.indexer_topk(fresh(2, 0, 3, 8), fresh(2, 0, 3), fresh(2, 16, 8), 4),
     [(2, 0, 4)]),
    ("topk_indices", "rows=0", lambda: glm5_ops.topk_indices(fresh(3, 0, 16), 4), [(3, 0, 4)]),
    ("sparse_attention", "B=0", lambda: glm5_ops.sparse_attention(fresh(0, 3, 4, 8), fresh(0, 6, 2, 8),
                                                                  fresh(0, 6, 2, 8), ids(0, 9).view(0, 3, 3)),
     [(0, 3, 4, 8), (0, 3, 4)]),
    ("sparse_attention", "S=0", lambda: glm5_ops.sparse_attention(fresh(2, 0, 4, 8), fresh(2, 6, 2, 8),
                                                                  fresh(2, 6, 2, 6), ids(0, 3)[None].expand(2, 0, 3)),
     [(2, 0, 4, 6), (2, 0, 4)]),
    ("sparse_attention", "topk=0", lambda: glm5_ops.sparse_attention(fresh(2, 3, 4, 8), fresh(2, 6, 2, 8),
                                                                     fresh(2, 6, 2, 8), ids(6, 0).view(2, 3, 0)),
     [(2, 3, 4, 8), (2, 3, 4)]),
    ("block_topk_mask", "B=0", lambda: glm5_ops.block_topk_mask(fresh(0, 5, 4, 8), fresh(0, 16, 2, 8), block_size=4,
                                                                topk_blocks=1),
     [(0, 4, 2), (0, 4, 2, 3)]),
    ("block_topk_mask", "S=0", lambda: glm5_ops.block_topk_mask(fresh(2, 0, 4, 8), fresh(2, 16, 2, 8), block_size=4,
                                                                topk_blocks=1),
     [(2, 4, 0), (2, 4, 0, 3)]),
    ("block_topk_mask", "no blocks asked", lambda: glm5_ops.block_topk_mask(
        fresh(2, 5, 4, 8), fresh(2, 16, 2, 8), block_size=4, topk_blocks=0, sink_blocks=0, local_blocks=0),
     [(2, 4, 2), (2, 4, 2, 0)]),
    ("block_sparse_attention", "B=0", lambda: glm5_ops.block_sparse_attention(
        fresh(0, 5, 4, 8), fresh(0, 16, 2, 8), fresh(0, 16, 2, 8), _causal_mask(5, 16)),
     [(0, 5, 4, 8), (0, 5, 4)]),
    ("block_sparse_attention", "S=0", lambda: glm5_ops.block_sparse_attention(
        fresh(2, 0, 4, 8), fresh(2, 16, 2, 8), fresh(2, 16, 2, 8), _causal_mask(0, 16)),
     [(2, 0, 4, 8), (2, 0, 4)]),
    ("moe_route", "T=0", lambda: glm5_ops.moe_route(fresh(0, 8), fresh(4, 8), fresh(4), top_k=2),
     [(0, 2), (0, 2)]),
    ("moe_dispatch", "T=0", lambda: glm5_ops.moe_dispatch(fresh(0, 8), ids(0, 2), 4),
     [(0, 8), (5,), (0,), (0, 2)]),
    ("moe_dispatch", "k=0", lambda: glm5_ops.moe_dispatch(fresh(3, 8), ids(3, 0), 4, align=4),
     [(0, 8), (5,), (0,), (3, 0)]),
    ("moe_dispatch", "D=0", lambda: glm5_ops.moe_dispatch(fresh(3, 0), ids(3, 2), 4),   # no bytes to copy
     [(6, 0), (5,), (6,), (3, 2)]),
    ("moe_combine", "T=0", lambda: glm5_ops.moe_combine(fresh(0, 8), ids(0, 2), fresh(0, 2)), [(0, 8)]),
    ("moe_combine", "k=0", lambda: glm5_ops.moe_combine(fresh(0, 8), ids(3, 0), fresh(3, 0)), [(3, 8)]),
    ("fused_moe", "T=0", lambda: glm5_ops.fused_moe(fresh(0, 8), fresh(4, 6, 8), fresh(4, 8, 3), fresh(0, 2),
                                                    ids(0, 2)), [(0, 8)]),
    ("fused_moe", "k=0", lambda: glm5_ops.fused_moe(fresh(3, 8), fresh(4, 6, 8), fresh(4, 8, 3), fresh(3, 0),
                                                    ids(3, 0)), [(3, 8)]),
    ("quantize_groupwise", "numel=0", lambda: glm5_ops.quantize_groupwise(fresh(0, 16), 4, 8), [(0,), (0,), (0,)]),
    ("dequantize", "numel=0", lambda: glm5_ops.dequantize(torch.zeros(0, dtype=torch.uint8, device=DEVICE),
                                                          fresh(0), fresh(0), 4, 8, (0, 16)), [(0, 16)]),
]


def _values_ok(op: str, case: str, out) -> None:
    """Beyond the shapes: what an empty selection computes (sums over nothing)."""
    if op == "sparse_attention" and case == "topk=0":
        assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((out[1] == NEG_INF).all())
    if op in ("moe_combine", "fused_moe") and case == "k=0":
        assert torch.equal(out, torch.zeros_like(out))
    if op == "moe_dispatch" and case != "D=0":
        assert int(out[1].expert_offsets.abs().sum()) == 0


@pytest.mark.parametrize("op,case,call,expect", EMPTY, ids=[f"{o}-{c}" for o, c, *_ in EMPTY])
def test_empty_in_empty_out(backend, poisoned, op, case, call, expect):
    if backend == "triton" and op in NO_TRITON:
        pytest.skip(f"{op} has no triton backend")
    out = call()
    assert shapes(out) == expect
    _values_ok(op, case, out)


@pytest.mark.parametrize("fn,case,make", [
    ("sparse_attention", "S=0", lambda: ((fresh(2, 0, 4, 8), fresh(2, 6, 2, 8), fresh(2, 6, 2, 8)),
                                         dict(indices=ids(0, 3)[None].expand(2, 0, 3)))),
    ("sparse_attention", "topk=0", lambda: ((fresh(2, 3, 4, 8), fresh(2, 6, 2, 8), fresh(2, 6, 2, 8)),
                                            dict(indices=ids(6, 0).view(2, 3, 0)))),
    ("block_sparse_attention", "B=0", lambda: ((fresh(0, 5, 4, 8), fresh(0, 16, 2, 8), fresh(0, 16, 2, 8)),
                                               dict(block_mask=_causal_mask(5, 16)))),
    ("fused_moe", "T=0", lambda: ((fresh(0, 8), fresh(4, 6, 8), fresh(4, 8, 3), fresh(0, 2)), dict(ids=ids(0, 2)))),
    ("fused_moe", "k=0", lambda: ((fresh(3, 8), fresh(4, 6, 8), fresh(4, 8, 3), fresh(3, 0)), dict(ids=ids(3, 0)))),
])
def test_empty_backward(backend, poisoned, fn, case, make):
    """The backward of an empty forward: gradients shaped like the inputs, all zero."""
    tensors, rest = make()
    leaves = [t.requires_grad_() for t in tensors]
    out = getattr(glm5_ops, fn)(*leaves, **rest)
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
    for t in leaves:
        assert t.grad is not None and t.grad.shape == t.shape and not bool(t.grad.any())


# ---------------------------------------------------- refused, named --
# (call through the wrapper, the argument it names, the same input as a direct
# torch.ops.glm5 call: the C++ refuses it too, so no kernel runs on it)

def _attn(S=4, T=10, Hq=4, Hkv=2, Dk=8, Dv=8):
    q, k, v = fresh(1, S, Hq, Dk), fresh(1, T, Hkv, Dk), fresh(1, T, Hkv, Dv)
    idx = ids(S, 2, E=T).view(1, S, 2) if T else torch.full((1, S, 2), -1, dtype=torch.int32, device=DEVICE)
    return q, k, v, idx


def _sparse(**kw):
    q, k, v, idx = _attn(**kw)
    return (lambda: glm5_ops.sparse_attention(q, k, v, idx),
            lambda: ops.sparse_attention_fwd(q, k, v, idx, 0.5, False, None))


def _sparse_bwd(**kw):
    q, k, v, idx = _attn(**kw)
    o, lse = torch.zeros(*q.shape[:3], v.shape[3]), torch.zeros(q.shape[:3])
    return lambda: ops.sparse_attention_bwd(o, q, k, v, idx, o, lse, 0.5, False, None)


def _block(**kw):
    q, k, v, _ = _attn(**kw)
    m = _causal_mask(q.shape[1], max(k.shape[1], 1))
    m = glm5_ops.BlockMask(m.kv_num_blocks.expand(1, q.shape[2], -1).contiguous(),
                           m.kv_indices.expand(1, q.shape[2], -1, -1).contiguous(), 4)
    return (lambda: glm5_ops.block_sparse_attention(q, k, v, m),
            lambda: ops.block_sparse_attention_fwd(q, k, v, m.kv_num_blocks, m.kv_indices, 4, 0.5, True, None))


def _block_topk(H=4, D=8, T=16):
    q, k = fresh(1, 5, H, D), fresh(1, T, 2 if H else 1, D)
    return (lambda: glm5_ops.block_topk_mask(q, k, block_size=4, topk_blocks=1),
            lambda: ops.block_topk_mask(q, k, 4, 1, True, 1, 1, "mean", None))


def _indexer(H=3, D=8, T=16, topk=4):
    q, w, k = fresh(2, 5, H, D), fresh(2, 5, H), fresh(2, T, D)
    return (lambda: glm5_ops.indexer_topk(q, w, k, topk),
            lambda: ops.indexer_topk(q, w, k, topk, True, None))


def _scores(H=3, D=8, T=16):
    q, w, k = fresh(2, 5, H, D), fresh(2, 5, H), fresh(2, T, D)
    return (lambda: glm5_ops.indexer_scores(q, w, k), lambda: ops.indexer_scores(q, w, k, True, None))


def _topk(T=16, k=4):
    s = fresh(3, T)
    return lambda: glm5_ops.topk_indices(s, k), lambda: ops.topk_indices(s, k, False)


def _route(E=4, top_k=2):
    h, g, b = fresh(5, 8), fresh(E, 8), fresh(E)
    return (lambda: glm5_ops.moe_route(h, g, b, top_k=top_k),
            lambda: ops.moe_route(h, g, b, top_k, 1, 1, 1.0, True))


def _fused_no_experts():
    x, wgu, wd, w, i = fresh(3, 8), fresh(0, 6, 8), fresh(0, 8, 3), fresh(3, 2), ids(3, 2)
    return lambda: glm5_ops.fused_moe(x, wgu, wd, w, i), lambda: ops.fused_moe_fwd(x, wgu, wd, w, i)


def _dispatch_no_experts():
    x, i = fresh(3, 8), ids(3, 0)
    return lambda: glm5_ops.moe_dispatch(x, i, 0), lambda: ops.moe_dispatch(x, i, 0, 1)


REFUSED = [
    ("indexer_topk zero heads", _indexer(H=0), "q"),
    ("indexer_topk head dim 0", _indexer(D=0), "q"),
    ("indexer_topk zero keys", _indexer(T=0), "k"),
    ("indexer_topk topk=0", _indexer(topk=0), "topk"),
    ("indexer_topk topk past the keys", _indexer(topk=17), "topk"),
    ("indexer_scores zero keys", _scores(T=0), "k"),
    ("indexer_scores head dim 0", _scores(D=0), "q"),
    ("topk_indices k=0", _topk(k=0), "k"),
    ("topk_indices k past the keys", _topk(k=17), "k"),
    ("topk_indices zero keys", _topk(T=0, k=1), "scores"),
    ("sparse_attention zero heads", _sparse(Hq=0), "q"),
    ("sparse_attention zero kv heads", _sparse(Hkv=0), "k"),
    ("sparse_attention Dk=0", _sparse(Dk=0), "q"),
    ("sparse_attention Dv=0", _sparse(Dv=0), "v"),
    ("sparse_attention zero keys", _sparse(T=0), "k"),
    ("block_sparse_attention Dk=0", _block(Dk=0), "q"),
    ("block_sparse_attention zero heads", _block(Hq=0), "q"),
    ("block_sparse_attention zero keys", _block(T=0), "k"),
    ("block_topk_mask zero heads", _block_topk(H=0), "q"),
    ("block_topk_mask head dim 0", _block_topk(D=0), "q"),
    ("block_topk_mask zero keys", _block_topk(T=0), "k"),
    ("moe_route zero experts", _route(E=0, top_k=1), "gate_w"),
    ("moe_route top_k=0", _route(top_k=0), "top_k"),
    ("moe_route top_k past the experts", _route(top_k=5), "top_k"),
    ("moe_dispatch zero experts", _dispatch_no_experts(), "num_experts"),
    ("fused_moe zero experts", _fused_no_experts(), "w_gate_up"),
]


@pytest.mark.parametrize("case,calls,arg", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_naming_the_argument(backend, case, calls, arg):
    with pytest.raises(ValueError) as err:
        calls[0]()
    msg = str(err.value)
    assert msg.startswith(f"{arg} must ") and ", got " in msg, msg


@pytest.mark.parametrize("case,calls,arg", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_by_direct_calls(case, calls, arg):
    with pytest.raises((ValueError, TypeError)):
        calls[1]()


@pytest.mark.parametrize("kw", [dict(Dk=0), dict(Dv=0), dict(Hq=0), dict(T=0)])
def test_sparse_attention_bwd_refuses_direct_calls(kw):
    with pytest.raises((ValueError, TypeError)):
        _sparse_bwd(**kw)()


# ------------------------------------------ issue 24: crashes and hangs --
# Each ran in a fresh process: a crash (SIGFPE) or a hang fails this test
# instead of taking pytest down with it.

_CRASHES = {
    "indexer_topk zero queries": (
        "out = glm5_ops.indexer_topk(torch.randn(2, 0, 3, 8), torch.randn(2, 0, 3), torch.randn(2, 16, 8), 4)\n"
        "assert out.shape == (2, 0, 4), out.shape", None),
    "direct indexer_topk zero queries": (
        "out = torch.ops.glm5.indexer_topk(torch.randn(2, 0, 3, 8), torch.randn(2, 0, 3), torch.randn(2, 16, 8),"
        " 4, True, None)\nassert out.shape == (2, 0, 4), out.shape", None),
    "direct sparse_attention_bwd head dim 0": (
        "q, k, v = torch.randn(2, 5, 4, 0), torch.randn(2, 30, 2, 0), torch.randn(2, 30, 2, 0)\n"
        "idx = torch.randint(0, 30, (2, 5, 6), dtype=torch.int32)\n"
        "o, lse = torch.randn(2, 5, 4, 0), torch.randn(2, 5, 4)\n"
        "torch.ops.glm5.sparse_attention_bwd(o, q, k, v, idx, o, lse, 1.0, False, None)", "ValueError: q and v must"),
    "sparse_attention head dim 0": (
        "glm5_ops.sparse_attention(torch.randn(1, 4, 2, 0), torch.randn(1, 8, 1, 0), torch.randn(1, 8, 1, 4),"
        " torch.zeros(1, 4, 2, dtype=torch.int32))", r"ValueError: q must have shape [B,S,Hq,Dk] with Dk >= 1"),
}


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the reproductions are CPU tensors")
@pytest.mark.parametrize("case", list(_CRASHES))
def test_issue24_no_crash_no_hang(case):
    body, error = _CRASHES[case]
    script = "import torch, glm5_ops\n" + body
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=root,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    if error is None:
        assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    else:  # a Python exception, not a signal: exit status 1 and the message
        assert res.returncode == 1 and error in res.stderr, (res.returncode, res.stderr[-2000:])


# ------------------------------------------ issue 24: fuzz findings --

def _odd_strides(t: torch.Tensor, head_stride: int = 7) -> torch.Tensor:
    """t's values with a non-unit stride along a size-1 or empty head dim (which
    torch still calls contiguous)."""
    return torch.empty_strided(t.shape, (*t.contiguous().stride()[:3], head_stride), dtype=t.dtype,
                               device=t.device).copy_(t)


@pytest.mark.parametrize("shape", [(1, 5, 1, 1), (0, 5, 1, 4)], ids=["Dk=1", "B=0"])
def test_attention_takes_any_stride_along_a_size1_or_empty_head_dim(backend, shape):
    """A size-1 dim's stride is irrelevant: the wrapper normalises it instead of
    passing the kernel a k/v it refuses ('must have unit stride')."""
    B, T, Hkv, D = shape
    q, k, v = fresh(B, 3, 2, D), fresh(*shape), fresh(*shape)
    k_odd, v_odd = _odd_strides(k), _odd_strides(v)
    assert k_odd.stride(3) == 7 and k_odd.is_contiguous()
    idx = torch.randint(0, T, (B, 3, 2), dtype=torch.int32, device=DEVICE)
    mask = glm5_ops.BlockMask.causal(3, T, 2, device=DEVICE)
    for call in (lambda k, v: glm5_ops.sparse_attention(q, k, v, idx),
                 lambda k, v: glm5_ops.block_sparse_attention(q, k, v, mask)):
        out, lse = call(k_odd, v_odd)
        ref_out, ref_lse = call(k, v)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("block_size", [2**31 - 1, 2**62])
def test_a_huge_block_size_is_one_block(backend, block_size):
    """block_size >= max(S, T) is one query block and one key block: the same
    result as block_size = max(S, T), without a mask or scratch of block_size rows."""
    q, k, v = fresh(1, 5, 2, 8), fresh(1, 9, 1, 8), fresh(1, 9, 1, 8)
    num = torch.ones(1, 2, 1, dtype=torch.int32, device=DEVICE)
    idx = torch.zeros(1, 2, 1, 1, dtype=torch.int32, device=DEVICE)
    want = glm5_ops.block_sparse_attention(q, k, v, glm5_ops.BlockMask(num, idx, 9))
    if block_size < 2**31:
        got = glm5_ops.block_sparse_attention(q, k, v, glm5_ops.BlockMask(num, idx, block_size))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    if backend == "cpp":   # the raw op takes any int64
        got = ops.block_sparse_attention_fwd(q, k, v, num, idx, block_size, 8 ** -0.5, True, None)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_block_topk_mask_with_a_huge_block_size_or_counts(backend):
    """block_size >= max(S, T) is one block (no padding to block_size rows), and
    sink/local/topk counts near 2^63 do not overflow the mask's width."""
    q, k = fresh(1, 5, 2, 8), fresh(1, 9, 1, 8)
    want = glm5_ops.block_topk_mask(q, k, block_size=9, topk_blocks=1)
    got = glm5_ops.block_topk_mask(q, k, block_size=2**31 - 1, topk_blocks=1)
    assert got.block_size == 2**31 - 1
    assert torch.equal(got.kv_num_blocks, want.kv_num_blocks) and torch.equal(got.kv_indices, want.kv_indices)
    if backend == "cpp":   # the raw op takes any int64
        for bs, counts in ((2**62, (1, 1, 1)), (4, (2**62, 2**62, 2**62))):
            num, idx = ops.block_topk_mask(q, k, bs, counts[0], True, counts[1], counts[2], "mean", None)
            assert num.shape == (1, 2, 1 if bs > 9 else 2) and idx.shape[-1] == (1 if bs > 9 else 3)   # Kb
