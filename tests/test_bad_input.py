"""Bad input raises a clear error naming the argument and the expected shape,
on every backend (the checks run before dispatch), and the C++ ops guard
direct torch.ops calls too."""
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
    with pytest.raises(ValueError, match=r"all tensors must be on one device.*k on"):
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
    with pytest.raises(RuntimeError, match=r"k must be in \[1, T=30\]"):
        ops.topk_indices(fresh(2, 30), 31, False)
    with pytest.raises(RuntimeError, match=r"q must have shape \[B,S,H,D\]"):
        ops.indexer_scores(q[0], w, k, True, None)
    with pytest.raises(RuntimeError, match=r"w must have shape \[B,S,H\]"):
        ops.indexer_topk(q, w[:, :3], k, 3, True, None)
    with pytest.raises(RuntimeError, match=r"scores must be fp32, fp16 or bf16"):
        ops.topk_indices(torch.arange(10, device=DEVICE), 2, False)
    with pytest.raises(RuntimeError, match=r"at least one head"):  # was SIGFPE
        ops.indexer_scores(q[:, :, :0], w[:, :, :0], k, True, None)
    if DEVICE.type == "cpu":  # the CPU kernel buckets keys by position: it must refuse any past T
        qa, ka = fresh(1, 4, 16, 64), fresh(1, 10, 1, 64)
        idx = torch.tensor([[[0, 1, 12]] * 4], dtype=torch.int32)
        with pytest.raises(RuntimeError, match=r"key positions in \[0, T=10\), got 12"):
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
    with pytest.raises(RuntimeError, match=match):
        ops.block_sparse_attention_fwd(q, k, k, kv_num, kv_idx, 8, 0.125, False, None)
    out, lse = fresh(1, 16, 2, 32), fresh(1, 16, 2)
    with pytest.raises(RuntimeError, match=match):
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
