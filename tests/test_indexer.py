"""indexer_scores and indexer_topk on every backend vs the reference, and the
fused op's memory bound."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import glm5_ops
from conftest import INTERPRETED, big_ok, fresh
from glm5_ops import reference
from topk_checks import assert_valid_topk

# Relative to the largest |score|: kernels sum heads and dims in another order.
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-3}

# (B, S, T, H, D): decode S=1, odd sizes, GLM-5's 32 heads x 128, T below S.
SHAPES = [(1, 1, 1, 1, 16), (2, 1, 700, 8, 64), (1, 5, 17, 3, 16), (2, 33, 300, 32, 128), (3, 64, 513, 8, 64),
          (1, 40, 1100, 4, 32)]


def _dtypes(backend):
    if backend == "triton" and INTERPRETED:
        return [torch.float32, torch.float16]  # no bf16 math in the interpreter
    return [torch.float32, torch.float16, torch.bfloat16]


def _query_rows(backend, B, S):
    """Triton's interpreter runs each program in Python: there a shape keeps at most 2 x 17
    of its query rows, still two query blocks of the kernel's 16, the second partial (its
    keys, heads and dims stay; a GPU runs every row)."""
    return (B, S) if big_ok(backend) else (min(B, 2), min(S, 17))


def _inputs(B, S, T, H, D, dtype):
    return fresh(B, S, H, D, dtype=dtype), fresh(B, S, H, dtype=dtype).abs(), fresh(B, T, D, dtype=dtype)


def _q_starts(B, S, T):
    yield None
    yield torch.randint(-S // 2 - 1, T, (B,), device=fresh(1).device)  # some queries see no key at all


def _assert_scores_close(got, want, dtype):
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "masked (-inf) positions differ"
    finite = torch.isfinite(want)
    scale = max(float(want[finite].abs().max()) if finite.any() else 0.0, 1e-6)
    err = float((got[finite] - want[finite]).abs().max()) if finite.any() else 0.0
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} > {TOL[dtype]} x {scale:.3g}"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("B,S,T,H,D", SHAPES)
def test_scores_match_reference(backend, poisoned, B, S, T, H, D, causal):
    B, S = _query_rows(backend, B, S)
    for dtype in _dtypes(backend):
        q, w, k = _inputs(B, S, T, H, D, dtype)
        for qs in _q_starts(B, S, T):
            got = glm5_ops.indexer_scores(q, w, k, causal=causal, q_start=qs)
            _assert_scores_close(got, reference.indexer_scores(q, w, k, causal=causal, q_start=qs), dtype)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("B,S,T,H,D", SHAPES)
def test_topk_matches_reference(backend, poisoned, B, S, T, H, D, causal):
    B, S = _query_rows(backend, B, S)
    for dtype in _dtypes(backend):
        q, w, k = _inputs(B, S, T, H, D, dtype)
        # The interpreter is slow: one topk per dtype there, all three elsewhere.
        topks = sorted({1, max(1, T // 3), T}) if big_ok(backend) else [max(1, T // 3)]
        for topk in topks:
            for qs in _q_starts(B, S, T):
                idx = glm5_ops.indexer_topk(q, w, k, topk, causal=causal, q_start=qs)
                want = reference.indexer_scores(q, w, k, causal=causal, q_start=qs)
                finite = torch.isfinite(want)
                scale = float(want[finite].abs().max()) if finite.any() else 1.0
                assert_valid_topk(want, idx, topk, value_tol=TOL[dtype] * scale)


def test_topk_long_rows_cross_many_chunks(backend, poisoned):
    """Several compactions of the running top-k: T >> topk, causal q_start per batch."""
    B, S, T, H, D, topk = 2, 24, 9000 if not INTERPRETED or backend != "triton" else 3000, 4, 32, 256
    q, w, k = _inputs(B, S, T, H, D, torch.float32)
    qs = torch.tensor([T - S, T // 2], device=q.device)
    idx = glm5_ops.indexer_topk(q, w, k, topk, q_start=qs)
    want = reference.indexer_scores(q, w, k, q_start=qs)
    assert_valid_topk(want, idx, topk, value_tol=1e-5 * float(want[torch.isfinite(want)].abs().max()))


def test_int_q_start_equals_tensor(backend):
    q, w, k = _inputs(2, 4, 50, 2, 16, torch.float32)
    a = glm5_ops.indexer_scores(q, w, k, q_start=10)
    b = glm5_ops.indexer_scores(q, w, k, q_start=torch.tensor([10, 10], device=q.device))
    assert torch.equal(a, b)


MEMORY_PROBE = textwrap.dedent("""
    import sys, time, torch, glm5_ops
    from glm5_ops.memory import peak_rss_bytes, reset_peak_rss
    reset_peak_rss()  # the child inherits the parent's high-water mark otherwise
    torch.manual_seed(0)
    S = T = 32768; H, D, topk = 8, 64, 2048
    q = torch.randn(1, S, H, D); w = torch.randn(1, S, H).abs(); k = torch.randn(1, T, D)
    t0 = time.perf_counter()
    idx = glm5_ops.indexer_topk(q, w, k, topk)
    # Spot-check a few rows against their own exact scores.
    rows = [0, 1, 2047, 2048, 20000, S - 1]
    for s in rows:
        sc = glm5_ops.reference.indexer_scores(q[:, s:s+1], w[:, s:s+1], k, q_start=s)[0, 0]
        n = min(topk, s + 1)
        got = sc[idx[0, s, :n].long()].sort(descending=True).values
        ref = torch.topk(sc, n).values
        assert torch.allclose(got, ref, rtol=0, atol=1e-4 * float(ref.abs().max())), s
        assert bool((idx[0, s, n:] == -1).all())
    peak = peak_rss_bytes() / 2**30
    print(f"peak_rss_gib={peak:.3f} seconds={time.perf_counter() - t0:.1f}")
""")


@pytest.mark.skipif(INTERPRETED and os.environ.get("GLM5_SKIP_SLOW") == "1", reason="GLM5_SKIP_SLOW=1")
def test_fused_topk_32k_under_1gib():
    """S=T=32768, H=8, D=64, topk=2048, causal, one layer: the unfused chain
    would hold [S,H,T] fp32 = 34 GiB; the fused op must stay under 1 GiB."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    print(line)
    peak = float(line.split()[0].split("=")[1])
    assert peak < 1.0, f"peak resident memory {peak:.2f} GiB >= 1 GiB"


@pytest.mark.parametrize("H,D", [(11, 13), (3, 20), (9, 512)])
def test_decode_kernel_odd_heads_dims_and_keys(backend, poisoned, H, D):
    """Decode calls (at most 4 queries) take the CPU's transposing kernel (AVX-512: blocks
    of 16 keys, AVX2: 8): heads past a multiple of 8, dims ending mid-vector, D at the
    kernel's limit (512), and a last block of fewer keys (37)."""
    q, w, k = _inputs(2, 2, 37, H, D, torch.float32)
    _assert_scores_close(glm5_ops.indexer_scores(q, w, k), reference.indexer_scores(q, w, k), torch.float32)


@pytest.mark.parametrize("S", [1, 3])
def test_decode_long_context(backend, poisoned, S):
    """Decode-shaped calls (one query block, long T): the CPU kernel splits the
    key range across threads and merges the splits' candidates."""
    T = 20000 if not (INTERPRETED and backend == "triton") else 5000
    q, w, k = _inputs(1, S, T, 8, 64, torch.float32)
    want = reference.indexer_scores(q, w, k)
    _assert_scores_close(glm5_ops.indexer_scores(q, w, k), want, torch.float32)
    idx = glm5_ops.indexer_topk(q, w, k, 2048)
    assert_valid_topk(want, idx, 2048, value_tol=1e-5 * float(want[torch.isfinite(want)].abs().max()))


def test_cpu_decode_scratch_is_sized_for_the_queries_it_has():
    """A decode call (S=1) sized its scratch for a whole query block (32
    queries: ~1.8 MB a thread) and zero-filled it: in a fresh process 544 page
    faults per call, and 1,257 against 85 us at 4,096 keys on the 2-core EPYC.
    Only the pages one query needs may be touched. A fresh process, since what
    malloc hands back depends on the allocations before."""
    pytest.importorskip("resource")
    script = textwrap.dedent("""
        import resource, torch, glm5_ops
        g = torch.Generator().manual_seed(0)
        q, w, k = torch.randn(1, 1, 8, 64, generator=g), torch.rand(1, 1, 8, generator=g), torch.randn(1, 4096, 64, generator=g)
        with glm5_ops.use_backend("cpp"):
            for _ in range(3):
                glm5_ops.indexer_topk(q, w, k, 2048)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(10):
                glm5_ops.indexer_topk(q, w, k, 2048)
                glm5_ops.indexer_scores(q, w, k)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    faults = float(out.stdout.split()[-1])
    assert faults < 60, f"{faults:.0f} minor page faults per call pair: scratch sized for a whole query block"
