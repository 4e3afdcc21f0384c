"""torch.library.opcheck on every op: schema, fake kernel, autograd
registration and torch.compile tracing (forward and, for the differentiable
ops, whose inputs require grad here, backward). Both namespaces: torch.ops.glm5
(the C++ kernels) and torch.ops.glm5_triton (the Triton kernels as ops, with
glm5's schemas; the cases the interpreter can run, fp32/fp16, at small shapes)."""
import pathlib
import re

import pytest
import torch

import glm5_ops
from conftest import CPU_ONLY_OPS, DEVICE, INTERPRETED, fresh, triton_available

# The differentiable ops and the ops whose kernels are Triton ops too.
DIFFERENTIABLE = ("sparse_attention_fwd", "block_sparse_attention_fwd", "moe_route", "fused_moe_fwd",
                  "moe_dispatch", "moe_combine")
TRITON_OPS = ("sparse_attention_fwd", "sparse_attention_bwd", "block_sparse_attention_fwd",
              "block_sparse_attention_bwd", "moe_route", "fused_moe_fwd", "fused_moe_bwd",
              "int8_quantize_rows", "int8_linear", "int8_linear_heads", "w8a8_linear", "fused_moe_int8")


def _grad(*tensors):
    return tuple(t.requires_grad_() for t in tensors)


def _indexer(causal=True, with_q_start=False):
    q, w, k = fresh(2, 5, 3, 16), fresh(2, 5, 3).abs(), fresh(2, 40, 16)
    return q, w, k, causal, torch.tensor([30, 35], device=DEVICE) if with_q_start else None


def _selection(B, S, T, topk, seed):
    """Duplicate-free key positions per query, about a tenth of the slots -1."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(B, S, T, generator=g).argsort(-1)[..., :topk].to(torch.int32)
    return torch.where(torch.rand(B, S, topk, generator=g) < 0.1, -1, idx).to(DEVICE)


def _qkv(S, dtype):
    return _grad(fresh(2, S, 4, 16, dtype=dtype), fresh(2, 30, 2, 16, dtype=dtype), fresh(2, 30, 2, 8, dtype=dtype))


def _sparse_fwd(dtype, with_q_start):
    qs = torch.tensor([20, 25], device=DEVICE) if with_q_start else None
    return (*_qkv(5, dtype), _selection(2, 5, 30, 7, seed=41), 0.25, True, qs)


def _block_fwd(dtype, with_q_start):
    q, k, v = _qkv(19, dtype)
    with glm5_ops.use_backend("reference"):
        mask = glm5_ops.block_topk_mask(q.detach(), k.detach(), block_size=8, topk_blocks=1)
    qs = torch.tensor([11, 9], device=DEVICE) if with_q_start else None
    return q, k, v, mask.kv_num_blocks, mask.kv_indices, 8, 0.25, True, qs


def _bwd_args(fwd_args, n_tensors):
    """The backward op's arguments for fwd_args: dout, the tensors, out, lse, the rest."""
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in fwd_args)
    with glm5_ops.use_backend("reference"):
        out, lse = (glm5_ops.sparse_attention(*detached[:4], scale=0.25, q_start=detached[-1]) if n_tensors == 4
                    else glm5_ops.block_sparse_attention(*detached[:3], glm5_ops.BlockMask(*detached[3:6]),
                                                         scale=0.25, q_start=detached[-1]))
    return (torch.randn_like(out), *detached[:n_tensors], out, lse, *detached[n_tensors:])


def _route(dtype, top_k, n_group, topk_group, scale, norm):
    h, gate_w, bias = fresh(9, 16, dtype=dtype), fresh(32, 16, scale=0.25), fresh(32, scale=0.05)
    return (*_grad(h, gate_w, bias), top_k, n_group, topk_group, scale, norm)


def _fused(dtype, seed=2):
    T, D, I, E, k = 7, 8, 5, 4, 2
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE, torch.int32)
    w = fresh(T, k, dtype=torch.float64 if dtype == torch.float64 else torch.float32).abs()
    return (*_grad(fresh(T, D, dtype=dtype), fresh(E, 2 * I, D, dtype=dtype, scale=D ** -0.5),
                   fresh(E, D, I, dtype=dtype, scale=I ** -0.5), w), ids)


def _moe_ids():
    return torch.randint(0, 6, (9, 3), dtype=torch.int32, device=DEVICE)


def _combine():
    _, plan = glm5_ops.reference.moe_dispatch(fresh(9, 8), _moe_ids(), 6, align=4)
    N = int(plan.expert_offsets[-1])
    return [(_grad(fresh(N, 8))[0], plan.token_slot, _grad(fresh(9, 3))[0]),
            (fresh(N, 8, dtype=torch.float16), plan.token_slot, fresh(9, 3))]


def _int8_linear_cases():
    w, s = torch.ops.glm5.int8_quantize_rows(fresh(24, 40))
    return [(fresh(3, 40), w, s, None), (fresh(20, 40, dtype=torch.bfloat16), w, s, fresh(24, dtype=torch.bfloat16))]


def _packed(args):
    x, wgu, sgu, wd, sd, weights, ids = args
    return x, glm5_ops.int8.pack_rows(wgu), sgu, glm5_ops.int8.pack_rows(wd), sd, weights, ids


def _fused_int8(T):
    x, wgu, wd, w, ids = (a.detach() for a in _fused(torch.float32))
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(T)]).to(DEVICE, torch.int32)
    return (fresh(T, 8), *torch.ops.glm5.int8_quantize_rows(wgu), *torch.ops.glm5.int8_quantize_rows(wd),
            fresh(T, 2).abs(), ids)


CASES = {
    "topk_indices": lambda: [(fresh(4, 100), 7, False), (fresh(3, 2, 50, dtype=torch.float16), 50, True)],
    "indexer_scores": lambda: [_indexer(), _indexer(False), _indexer(True, True)],
    "indexer_topk": lambda: [(*_indexer()[:3], 9, True, None), (*_indexer(True, True)[:3], 40, True,
                                                               torch.tensor([30, 35], device=DEVICE))],
    "sparse_attention_fwd": lambda: [_sparse_fwd(torch.float32, qs) for qs in (False, True)]
    + [_sparse_fwd(torch.float16, False)],
    "sparse_attention_bwd": lambda: [_bwd_args(_sparse_fwd(torch.float32, qs), 4) for qs in (False, True)],
    "block_sparse_attention_fwd": lambda: [_block_fwd(torch.float32, qs) for qs in (False, True)]
    + [_block_fwd(torch.float16, False)],
    "block_sparse_attention_bwd": lambda: [_bwd_args(_block_fwd(torch.float32, qs), 5) for qs in (False, True)],
    "block_topk_mask": lambda: [(fresh(2, 19, 4, 16), fresh(2, 30, 2, 16), 8, 2, True, 1, 1, "mean",
                                 torch.tensor([11, 9], device=DEVICE)),
                                (fresh(2, 19, 4, 16), fresh(2, 30, 2, 16), 4, 1, False, 0, 2, "minmax", None)],
    "moe_route": lambda: [_route(torch.float32, 4, 4, 2, 2.5, True), _route(torch.float32, 3, 1, 1, 1.0, False),
                          _route(torch.float16, 2, 2, 1, 1.5, True), _route(torch.bfloat16, 1, 1, 1, 1.0, False)],
    "moe_dispatch": lambda: [(_grad(fresh(9, 8))[0], _moe_ids(), 6, 1),
                             # align > 1: the row count depends on the ids (a data-dependent size in the fake)
                             (_grad(fresh(9, 8))[0], _moe_ids(), 6, 4)],
    "moe_combine": _combine,
    "fused_moe_fwd": lambda: [_fused(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float64)],
    "fused_moe_bwd": lambda: [(fresh(7, 8, dtype=dtype), *(a.detach() for a in _fused(dtype)))
                              for dtype in (torch.float32, torch.bfloat16, torch.float64)],
    "quantize_groupwise": lambda: [(fresh(6, 256), 8, 128, False, 0), (fresh(6, 256, dtype=torch.float16), 4, 64,
                                                                        True, 5), (fresh(3, 96), 2, 32, False, 0)],
    "int8_quantize_rows": lambda: [(fresh(5, 37),), (fresh(2, 3, 64, dtype=torch.bfloat16),)],
    "gemv": lambda: [(fresh(1, 40), fresh(24, 40), None), (fresh(3, 33, dtype=torch.bfloat16),
                                                          fresh(9, 33, dtype=torch.bfloat16),
                                                          fresh(9, dtype=torch.bfloat16)),
                     (fresh(4, 2, 24), fresh(4, 10, 48)[:, :, :24], None)],   # per head, heads strided
    "int8_linear": lambda: _int8_linear_cases(),
    "w8a8_linear": lambda: _int8_linear_cases(),
    # per head; the second with w's and scale's heads strided (views of one kv_b_proj)
    "int8_linear_heads": lambda: [(fresh(3, 2, 40), *torch.ops.glm5.int8_quantize_rows(fresh(3, 7, 40))),
                                  (fresh(4, 1, 24, dtype=torch.bfloat16),
                                   *(t[:, 3:] for t in torch.ops.glm5.int8_quantize_rows(fresh(4, 10, 24))))],
    "fused_moe_int8": lambda: [(*_fused_int8(T), w8a8) for T in (3, 40) for w8a8 in (False, True)] + [
        # the packed row layout: the CPU kernel's (on CUDA the wrapper unpacks before the op)
        (*_packed(_fused_int8(T)), False, True) for T in (3, 40) if DEVICE.type == "cpu"],
    "rms_norm": lambda: [(fresh(3, 5, 40), fresh(40), 1e-6), (fresh(7, 33, dtype=torch.bfloat16),
                                                            fresh(33, dtype=torch.bfloat16), 1e-5)],
    "rope": lambda: [(fresh(2, 3, 4, 24)[..., 8:], fresh(2, 3, 8), fresh(2, 3, 8), 16),   # strided heads, tail copied
                     (fresh(2, 5, 12, dtype=torch.bfloat16), fresh(2, 5, 6, dtype=torch.bfloat16),
                      fresh(2, 5, 6, dtype=torch.bfloat16), 12)],
    "cache_write": lambda: [(fresh(9, 24), torch.tensor([4, 0, 7], device=DEVICE), fresh(3, 24)),
                            (fresh(11, 5, dtype=torch.bfloat16), torch.tensor([10], device=DEVICE),
                             fresh(1, 5, dtype=torch.bfloat16))],
    "dequantize": lambda: [(*torch.ops.glm5.quantize_groupwise(fresh(6, 256), 4, 64, False, 0), 4, 64, [6, 256],
                            dtype) for dtype in (torch.float32, torch.bfloat16)],
}


def _triton_runs(args) -> bool:
    """Triton has no float64 kernels, and the interpreter no bf16 math."""
    ok = (torch.float32, torch.float16) if INTERPRETED else (torch.float32, torch.float16, torch.bfloat16)
    return all(a.dtype in ok for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())


# Ops without tensor arguments: opcheck's fake-tensor and autograd checks have
# nothing to trace. cpu_lane_costs (two constants of the CPU attention kernel)
# is tested against the kernel's behaviour in tests/test_attention_modes.py;
# int8_decode_kernel (which int8 decode kernel runs) in tests/test_int8_digits.py.
NO_TENSOR_OPS = {"cpu_lane_costs", "int8_decode_kernel", "int8_prefill_kernel"}


def test_every_op_is_checked():
    declared = {op.split("::")[1] for op in torch._C._dispatch_get_all_op_names() if op.startswith("glm5::")}
    assert declared - NO_TENSOR_OPS == set(CASES)


def _on_cpu(args):
    """CPU_ONLY_OPS are checked on CPU tensors wherever the tests run (on a GPU
    machine too: they have no CUDA kernel to check)."""
    return tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name):
    for args in CASES[name]():
        torch.library.opcheck(getattr(torch.ops.glm5, name).default, _on_cpu(args) if name in CPU_ONLY_OPS else args)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("name", TRITON_OPS)
def test_opcheck_triton(name):
    cases = [args for args in CASES[name]() if _triton_runs(args)]
    assert cases
    for args in cases:
        torch.library.opcheck(getattr(torch.ops.glm5_triton, name).default, args)


@pytest.mark.parametrize("ns", ["glm5", "glm5_triton"])
def test_backward_registered_through_torch_library(ns):
    """Every differentiable op of either namespace has its autograd kernel."""
    for name in DIFFERENTIABLE if ns == "glm5" else set(DIFFERENTIABLE) & set(TRITON_OPS):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{ns}::{name}", "Autograd"), f"{ns}::{name}"


def test_no_autograd_function_wraps_a_kernel():
    """One backward mechanism: torch.library. The only autograd.Function left
    wraps a collective (expert_parallel's all-to-all), not a kernel."""
    root = pathlib.Path(glm5_ops.__file__).parent
    found = {str(p.relative_to(root)) for p in root.rglob("*.py")
             if re.search(r"autograd\.Function\b", p.read_text())}
    assert found == {"expert_parallel.py"}
