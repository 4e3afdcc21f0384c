"""indexer_scores and indexer_topk at GLM-5's head counts and widths (H=64 and
160: several M tiles; D=576; topk = T = 2048), every backend and dtype, and on
a GPU the benchmark shapes (bench/gpu_timings_selection.py) checked before they
are timed, scores bit-identical from run to run (no atomics)."""
import pytest
import torch

import glm5_ops
from conftest import CUDA, DEVICE, big_ok, float_dtypes
from glm5_ops import reference
from test_indexer import TOL, _assert_scores_close, _inputs
from topk_checks import assert_valid_topk

# (B, S, H, D, T, causal, q_start, topk)
CASES = [
    (2, 37, 32, 128, 300, True, None, 64),
    (1, 5, 3, 20, 77, True, None, 10),             # odd H, D % 8 != 0
    (1, 3, 160, 64, 129, True, None, 16),          # H > 128: several M tiles
    (1, 4, 8, 576, 200, False, None, 50),          # D = 576, not causal
    (2, 33, 8, 40, 513, True, "tensor", 100),      # q_start per batch: short horizons fill -1
    (1, 64, 32, 128, 2048, True, None, 2048),      # topk = T for the last queries
    (3, 17, 64, 128, 1000, True, "int", 128),
]


def _q_start(kind, B, S, T):
    if kind == "tensor":
        return torch.tensor(([0, T - S - 20] + [T - S] * B)[:B], device=DEVICE)
    return T // 2 if kind == "int" else None


def _check(q, w, k, topk, causal, qs, dtype):
    want = reference.indexer_scores(q, w, k, causal=causal, q_start=qs)
    _assert_scores_close(glm5_ops.indexer_scores(q, w, k, causal=causal, q_start=qs), want, dtype)
    idx = glm5_ops.indexer_topk(q, w, k, topk, causal=causal, q_start=qs)
    finite = torch.isfinite(want)
    scale = float(want[finite].abs().max()) if finite.any() else 1.0
    assert_valid_topk(want, idx, topk, value_tol=TOL[dtype] * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("B,S,H,D,T,causal,qs,topk", CASES, ids=[
    "B{}S{}H{}D{}T{}{}-{}-k{}".format(*c[:5], "c" if c[5] else "", c[6], c[7]) for c in CASES])
def test_glm5_heads_match_reference(backend, poisoned, B, S, H, D, T, causal, qs, topk, dtype):
    if dtype not in float_dtypes(backend):
        pytest.skip("the Triton interpreter has no bf16 math")
    if not big_ok(backend) and S * H * T * D > 2e7:
        pytest.skip("too large for the Triton interpreter (runs on the GPU)")
    q, w, k = _inputs(B, S, T, H, D, dtype)
    _check(q, w, k, topk, causal, _q_start(qs, B, S, T), dtype)


# The timed shapes: prefill at 16K keys and decode (S=1) of 8 sequences at 64K, bf16.
BENCH = [(1, 1024, 16384, 32, 128, 2048), (8, 1, 65536, 32, 128, 2048)]


@pytest.mark.skipif(not CUDA, reason="benchmark-sized: GPU only")
@pytest.mark.parametrize("B,S,T,H,D,topk", BENCH, ids=str)
def test_bench_shapes(backend, B, S, T, H, D, topk):
    q, w, k = _inputs(B, S, T, H, D, torch.bfloat16)
    _check(q, w, k, topk, True, None, torch.bfloat16)
    a = glm5_ops.indexer_scores(q, w, k)
    assert torch.equal(a, glm5_ops.indexer_scores(q, w, k)), "two runs differ: a race in the scores path?"
