"""Bad input raises a clear error naming the argument and the expected shape,
on every backend (the checks run before dispatch), and the C++ ops guard
direct torch.ops calls too."""
import re

import pytest
import torch

import glm5_ops
from conftest import DEVICE, fresh

q, w, k = fresh(2, 5, 4, 16), fresh(2, 5, 4), fresh(2, 30, 16)


@pytest.mark.parametrize("fn", ["indexer_scores", "indexer_topk"])
@pytest.mark.parametrize("args,match", [
    ((q[0], w, k), r"q must have shape \[B,S,H,D\]"),
    ((q, w[0], k), r"w must have shape \[B,S,H\]"),
    ((q, w, k[0]), r"k must have shape \[B,T,D\]"),
    ((q, w[:1], k), r"w must have shape \[B,S,H\]=\[2,5,4\]"),
    ((q, w[:, :, :3], k), r"w must have shape \[B,S,H\]=\[2,5,4\]"),
    ((q, w, k[:1]), r"k must have shape .* B=2"),
    ((q, w, k[..., :8]), r"k must have shape .* D=16"),
    ((q, w, k.half()), r"k must have the dtype of q"),
    ((q.int(), w, k.int()), r"q must have dtype"),
    ((q[:, :, :0], w[:, :, :0], k), r"q must have shape \[B,S,H,D\] with H >= 1"),  # the kernels divide by H
])
def test_indexer_bad_shapes(backend, fn, args, match):
    extra = (3,) if fn == "indexer_topk" else ()
    with pytest.raises((ValueError, TypeError), match=match):
        getattr(glm5_ops, fn)(*args, *extra)


def test_q_start_checked(backend):
    with pytest.raises(ValueError, match=r"q_start must have shape \[B=2\]"):
        glm5_ops.indexer_scores(q, w, k, q_start=torch.tensor([1, 2, 3], device=DEVICE))
    with pytest.raises(TypeError, match=r"q_start must have dtype"):
        glm5_ops.indexer_scores(q, w, k, q_start=torch.tensor([1.0, 2.0], device=DEVICE))


def test_mixed_devices(backend):
    other = torch.device("meta") if DEVICE.type == "cpu" else torch.device("cpu")
    with pytest.raises(ValueError, match=r"k must be on \S+ like q \(all tensors on one device\), got q on .*, k on"):
        glm5_ops.indexer_topk(q, w, k.to(other), 3)
    with pytest.raises(ValueError, match=r"q_start must be on"):
        glm5_ops.indexer_scores(q, w, k, q_start=torch.tensor([1, 2], device=other))


@pytest.mark.parametrize("bad_k", [0, -1, 31])
def test_topk_range(backend, bad_k):
    with pytest.raises(ValueError, match=r"topk must be in \[1, 30\]"):
        glm5_ops.indexer_topk(q, w, k, bad_k)
    with pytest.raises(ValueError, match=r"k must be in \[1, 30\]"):
        glm5_ops.topk_indices(fresh(3, 30), bad_k)


def test_topk_bad_scores(backend):
    with pytest.raises(TypeError, match=r"scores must have dtype"):
        glm5_ops.topk_indices(torch.arange(10, device=DEVICE), 2)
    with pytest.raises(TypeError, match=r"scores must have dtype"):
        glm5_ops.topk_indices(fresh(3, 10).double(), 2)
    with pytest.raises(ValueError, match=r"scores must have shape \[\.\.\., T\]"):
        glm5_ops.topk_indices(torch.tensor(1.0, device=DEVICE), 1)
    with pytest.raises(TypeError, match=r"k must be an int"):
        glm5_ops.topk_indices(fresh(3, 10), 2.0)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        with glm5_ops.use_backend("cuda-magic"):
            pass


def test_cpp_ops_guard_direct_calls():
    ops = torch.ops.glm5
    with pytest.raises(ValueError, match=r"k must be in \[1, T=30\]"):
        ops.topk_indices(fresh(2, 30), 31, False)
    with pytest.raises(ValueError, match=r"q must have shape \[B,S,H,D\]"):
        ops.indexer_scores(q[0], w, k, True, None)
    with pytest.raises(ValueError, match=r"w must have shape \[B,S,H\]"):
        ops.indexer_topk(q, w[:, :3], k, 3, True, None)
    with pytest.raises(TypeError, match=r"scores must be fp32, fp16 or bf16"):
        ops.topk_indices(torch.arange(10, device=DEVICE), 2, False)
    with pytest.raises(ValueError, match=r"at least one head"):  # was SIGFPE
        ops.indexer_scores(q[:, :, :0], w[:, :, :0], k, True, None)
    if DEVICE.type == "cpu":  # the CPU kernel buckets keys by position: it must refuse any past T
        qa, ka = fresh(1, 4, 16, 64), fresh(1, 10, 1, 64)
        idx = torch.tensor([[[0, 1, 12]] * 4], dtype=torch.int32)
        with pytest.raises(ValueError, match=r"key positions in \[0, T=10\), got 12"):
            ops.sparse_attention_fwd(qa, ka, ka, idx, 0.125, False, None)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CUDA kernel skips such entries (no host sync)")
@pytest.mark.parametrize("num, first, match", [
    (1, -1, r"key blocks in \[0, 3\), got -1"),     # would read the 8 rows before k
    (1, 3, r"key blocks in \[0, 3\), got 3"),
    (3, 0, r"kv_num_blocks entries must be in \[0, maxKV=2\], got 3"),  # would read past the row
])
def test_cpp_block_sparse_guards_direct_calls(num, first, match):
    ops = torch.ops.glm5
    q, k = fresh(1, 16, 2, 32), fresh(1, 20, 2, 32)
    kv_num = torch.full((1, 2, 2), 1, dtype=torch.int32)
    kv_idx = torch.zeros(1, 2, 2, 2, dtype=torch.int32)
    kv_num[0, 1, 1], kv_idx[0, 1, 1, 0] = num, first
    with pytest.raises((ValueError, TypeError), match=match):
        ops.block_sparse_attention_fwd(q, k, k, kv_num, kv_idx, 8, 0.125, False, None)
    out, lse = fresh(1, 16, 2, 32), fresh(1, 16, 2)
    with pytest.raises((ValueError, TypeError), match=match):
        ops.block_sparse_attention_bwd(out, q, k, k, kv_num, kv_idx, out, lse, 8, 0.125, False, None)


def test_missing_kernel_is_not_implemented():
    """Schemas of later work exist but have no kernel yet: a clear NotImplementedError."""
    ops = torch.ops.glm5
    if torch._C._dispatch_has_kernel_for_dispatch_key("glm5::fused_moe_fwd", "CPU"):
        pytest.skip("fused_moe has landed")
    x, wgu, wd = fresh(4, 8), fresh(2, 6, 8), fresh(2, 8, 3)
    with pytest.raises(NotImplementedError):
        ops.fused_moe_fwd(x, wgu, wd, fresh(4, 1), torch.zeros(4, 1, dtype=torch.int32, device=DEVICE))


@pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU-only check")
def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with glm5_ops.use_backend("triton"):
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            glm5_ops.topk_indices(fresh(2, 10), 3)


# ---------------------------------------------------- one check layer: the wrappers --
# The oracles assume valid input (glm5_ops/reference.py); every contract is
# checked by the public wrapper, so each case raises the same way on every
# backend. The message names the argument, says "must" and what it got.

def _attn(S=4, T=10, Hq=4, Hkv=2, D=8):
    return fresh(1, S, Hq, D), fresh(1, T, Hkv, D), fresh(1, T, Hkv, D)


def _idx(S=4, topk=3, value=0):
    return torch.full((1, S, topk), value, dtype=torch.int32, device=DEVICE)


def _mask(num=1, first=0, Qb=2, W=2):
    n = torch.full((1, 1, Qb), num, dtype=torch.int32, device=DEVICE)
    i = torch.zeros(1, 1, Qb, W, dtype=torch.int32, device=DEVICE)
    i[..., 0] = first
    return glm5_ops.BlockMask(n, i, 4)


def _moe(T=6, D=8, I=3, E=5, k=2):
    ids = torch.randint(0, E, (T, k), dtype=torch.int32, device=DEVICE)
    return fresh(T, D), fresh(E, 2 * I, D), fresh(E, D, I), fresh(T, k), ids


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


WRAPPER_CASES = [
    ("sparse Hkv", lambda: glm5_ops.sparse_attention(*_attn(Hq=3), _idx()), ValueError, "k", r"divides q's Hq=3"),
    ("sparse index past T", lambda: glm5_ops.sparse_attention(*_attn(), _idx(value=10)), ValueError, "indices",
     r"in \[0, T=10\), got values in \[10, 10\]"),
    ("sparse index below -1", lambda: glm5_ops.sparse_attention(*_attn(), _idx(value=-2)), ValueError, "indices",
     r"-1 or key positions"),
    ("sparse float indices", lambda: glm5_ops.sparse_attention(*_attn(), _idx().float()), TypeError, "indices",
     r"dtype in \(int32, int64\)"),
    ("block mask query blocks", lambda: glm5_ops.block_sparse_attention(*_attn(S=12), _mask()), ValueError,
     "kv_num_blocks", r"\[B,Hq,Qb\]"),
    ("block mask entry past Kb", lambda: glm5_ops.block_sparse_attention(*_attn(S=8), _mask(first=3)), ValueError,
     "kv_indices", r"\[0, Kb=3\).*got values in \[3, 3\]"),
    ("block mask count past W", lambda: glm5_ops.block_sparse_attention(*_attn(S=8), _mask(num=3)), ValueError,
     "kv_num_blocks", r"\[0, min\(maxKV=2, Kb=3\)\], got values in \[3, 3\]"),
    ("block_topk pooling", lambda: glm5_ops.block_topk_mask(*_attn()[:2], block_size=4, topk_blocks=1, pooling="max"),
     ValueError, "pooling", "'mean' or 'minmax'"),
    ("block_topk block_size", lambda: glm5_ops.block_topk_mask(*_attn()[:2], block_size=0, topk_blocks=1),
     ValueError, "block_size", r"in \[1, "),
    ("recall selection past T", lambda: glm5_ops.attention_recall(*_attn(), _idx(value=10)), ValueError,
     "selection", r"in \[0, T=10\)"),
    ("route n_group", lambda: glm5_ops.moe_route(fresh(4, 8), fresh(6, 8), fresh(6), top_k=2, n_group=4),
     ValueError, "n_group", r"in \[1, 3\]"),
    ("route top_k", lambda: glm5_ops.moe_route(fresh(4, 8), fresh(6, 8), fresh(6), top_k=4, n_group=2),
     ValueError, "top_k", r"in \[1, 3\]"),
    ("fused ids past E", lambda: glm5_ops.fused_moe(*_moe()[:4], torch.full((6, 2), 5, dtype=torch.int32,
                                                                           device=DEVICE)),
     ValueError, "ids", r"\[0, 5\), got values in \[5, 5\]"),
    ("fused weights", lambda: glm5_ops.fused_moe(*_moe()[:3], fresh(6, 1), _moe()[4]), ValueError, "weights",
     r"\[T,k\]=\[6,2\]"),
    ("combine token_slot", lambda: glm5_ops.moe_combine(fresh(3, 8), _i32(0, 3).view(2, 1), fresh(2, 1)),
     ValueError, "token_slot", r"\[0, 3\), got values in \[0, 3\]"),
    ("quantize bits", lambda: glm5_ops.quantize_groupwise(fresh(4, 64), 3, 32), ValueError, "bits", r"\(8, 4, 2\)"),
    ("quantize group_size", lambda: glm5_ops.quantize_groupwise(fresh(4, 64), 8, 48), ValueError, "group_size",
     "divide the last dimension"),
    ("quantize int x", lambda: glm5_ops.quantize_groupwise(torch.arange(64, device=DEVICE).view(1, 64), 8, 32),
     TypeError, "x", "dtype in"),
    ("dequantize packed", lambda: glm5_ops.dequantize(torch.zeros(31, dtype=torch.uint8, device=DEVICE),
                                                      fresh(1), fresh(1), 8, 32, (1, 32)),
     ValueError, "packed", r"bytes=32"),
]


@pytest.mark.parametrize("name,call,exc,arg,detail", WRAPPER_CASES, ids=[c[0] for c in WRAPPER_CASES])
def test_wrappers_check_every_contract(backend, name, call, exc, arg, detail):
    """Bad input raises on every backend, before any kernel, naming the argument
    as spelled in the signature, what it must be and what it got."""
    with pytest.raises(exc) as err:
        call()
    msg = str(err.value)
    assert msg.startswith(f"{arg} must ") and ", got " in msg, msg
    assert re.search(detail, msg), msg


# --------------------------- direct torch.ops calls: C++ guards the memory it reads --

@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CUDA kernels skip such entries (no host sync)")
def test_direct_calls_with_out_of_range_indices_raise():
    """No Python check runs on a direct torch.ops.glm5 call: the C++ kernels
    refuse indices they would read out of bounds with, and never read them."""
    ops = torch.ops.glm5
    q, k, v = fresh(1, 4, 2, 16), fresh(1, 10, 1, 16), fresh(1, 10, 1, 16)
    out, lse = fresh(1, 4, 2, 16), fresh(1, 4, 2)
    for bad in (10, -2):
        idx = torch.tensor([[[0, 1, bad]] * 4], dtype=torch.int32)
        with pytest.raises(ValueError, match=r"indices entries must be -1 or key positions in \[0, T=10\)"):
            ops.sparse_attention_fwd(q, k, v, idx, 0.25, False, None)
        with pytest.raises(ValueError, match=r"indices entries must be -1 or key positions in \[0, T=10\)"):
            ops.sparse_attention_bwd(out, q, k, v, idx, out, lse, 0.25, False, None)
    x, wgu, wd, w, ids = _moe()
    for bad in (5, -1):
        bad_ids = ids.clone()
        bad_ids[3, 1] = bad
        with pytest.raises(ValueError, match=r"ids must be expert ids in \[0, num_experts=5\)"):
            ops.moe_dispatch(x, bad_ids, 5, 1)
        with pytest.raises(ValueError, match=r"ids must be expert ids in \[0, E=5\)"):
            ops.fused_moe_fwd(x, wgu, wd, w, bad_ids)
        with pytest.raises(ValueError, match=r"ids must be expert ids in \[0, E=5\)"):
            ops.fused_moe_bwd(x, x, wgu, wd, w, bad_ids)
    for bad in (12, -1):
        slot = torch.arange(12, dtype=torch.int32).view(6, 2).clone()
        slot[2, 0] = bad
        with pytest.raises(ValueError, match=r"token_slot entries must be rows of y_sorted in \[0, N=12\)"):
            ops.moe_combine(fresh(12, 8), slot, w)
    with pytest.raises(ValueError, match=r"topk must be in \[1, T=10\]"):
        ops.indexer_topk(fresh(1, 4, 2, 8), fresh(1, 4, 2), fresh(1, 10, 8), 11, True, None)


# ------------------------------ issue 24: fuzz findings, one test each --

def test_direct_calls_raise_value_and_type_errors():
    """TORCH_CHECK_VALUE / TORCH_CHECK_TYPE: a bad direct call raises what the
    wrappers raise, naming the argument, what it must be and what it got."""
    ops = torch.ops.glm5
    q, k = fresh(1, 4, 3, 8), fresh(1, 6, 2, 8)
    idx = torch.zeros(1, 4, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"^k must have kv heads Hkv >= 1 that divide the query heads of q "
                                         r"\(Hq=3\), got Hkv=2"):
        ops.sparse_attention_fwd(q, k, k, idx, 0.1, False, None)
    with pytest.raises(TypeError, match=r"^indices must be int32, got Long"):
        ops.sparse_attention_fwd(q, k[:, :, :1], k[:, :, :1], idx.long(), 0.1, False, None)
    with pytest.raises(ValueError, match=r"^group_size must divide the last dimension of x \(12\), got 8"):
        ops.quantize_groupwise(fresh(2, 12), 8, 8, False, 0)


def test_moe_dispatch_bounds_align_and_num_experts():
    """One huge int must not allocate (or zero-fill) billions of rows."""
    ops = torch.ops.glm5
    x, _, _, _, ids = _moe()
    with pytest.raises(ValueError, match=r"^align must be in \[1, 4096\], got 4611686018427387904"):
        ops.moe_dispatch(x, ids, 5, 2**62)
    with pytest.raises(ValueError, match=r"^ids, num_experts and align must give .* got T=6, k=2, "
                                         r"num_experts=1048576, align=4096"):
        ops.moe_dispatch(x, ids, 2**20, 4096)
    with pytest.raises(ValueError, match=r"^num_experts must be in \[1, 2\^20\], got 1073741824"):
        ops.moe_dispatch(x, ids, 2**30, 1)
    with pytest.raises(ValueError, match=r"^num_experts must be in \[1, 1048576\], got 1073741824"):
        glm5_ops.moe_dispatch(x, ids, 2**30)


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_moe_dispatch_bounds_align_by_max_align(backend):
    """align=2^31-1 with one token fits int32 rows yet padded it to 2^31-1 rows:
    the reference tried to allocate 16 GiB (fuzz seed 2, 100k cases)."""
    x, ids = fresh(1, 1), torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    with glm5_ops.use_backend(backend):
        with pytest.raises(ValueError, match=r"^align must be in \[1, 4096\], got 2147483647$"):
            glm5_ops.moe_dispatch(x, ids, 1, align=2**31 - 1)
        xs, plan = glm5_ops.moe_dispatch(x, ids, 1, align=glm5_ops.moe.MAX_ALIGN)
    assert xs.shape == (4096, 1) and plan.expert_offsets.tolist() == [0, 4096]


@pytest.mark.parametrize("shape", [["x", 32], (2.5, 32), (None,)])
def test_dequantize_shape_must_hold_ints(shape):
    with pytest.raises(TypeError, match=r"^shape must be a sequence of ints, got"):
        glm5_ops.dequantize(torch.zeros(32, dtype=torch.uint8, device=DEVICE), fresh(1), fresh(1), 8, 32, shape)
