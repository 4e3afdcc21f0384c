"""The int8 decode kernels' VNNI path (csrc/cpu/int8_vnni.h): each fp32 activation
row becomes three int8 digits (scales max|x|/127, /254, /254) multiplied by the
int8 weights in exact int32 dot products, so that against the float64 oracle
    |y - y_ref| <= scale * sum_k |w_k| * 6.1e-8 * max|x| + half an ulp of y.
Prefill (more than 16 rows, fp32 x, at least 256 outputs) takes the same digits
through oneDNN's int8 GEMM (csrc/cpu/int8_digit_gemm.h): the same bound, and each
row the bits the decode kernel gives it alone.
On a CPU without AVX512_VNNI the same tests run the fp32 path at the usual
fp32 tolerance; the first test says which path this machine takes."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import glm5_ops
from glm5_ops import reference as ref
from conftest import fresh

DIGITS_REL = 1.0 / (2 * 127 * 254 * 254)   # the digits' residual per element, relative to max|x|


def _kernel(K):
    return torch.ops.glm5.int8_decode_kernel(K)


def _cpu_has_vnni():
    try:
        return " avx512_vnni" in open("/proc/cpuinfo").read()
    except OSError:
        return False


VNNI = _kernel(1024) == "vnni_digits"


def test_decode_takes_the_vnni_kernel_where_the_cpu_has_it(capsys):
    kernel = _kernel(1024)
    with capsys.disabled():
        print(f"\nint8 decode kernel on this machine: {kernel}")
    if _cpu_has_vnni():   # only a portable (non-AVX-512) build may skip it here
        assert kernel in ("vnni_digits", "avx2_fp32", "portable_fp32")
    else:
        assert kernel in ("avx512_fp32", "avx2_fp32", "portable_fp32")
    assert _kernel(131072) == kernel        # the int32 bound: 127 * 127 * K < 2^31
    assert _kernel(131073) != "vnni_digits"
    assert _kernel(0) != "vnni_digits"
    with pytest.raises(ValueError, match="K"):
        _kernel(-1)


def test_prefill_takes_the_digits_gemm_where_it_pays():
    kernel = torch.ops.glm5.int8_prefill_kernel
    if VNNI:
        assert kernel(1024, 256) == "vnni_digits_gemm" and kernel(1, 4096) == "vnni_digits_gemm"
        assert kernel(1024, 255) == "dequantise_gemm"    # writing the digits costs more than it saves
        assert kernel(131073, 4096) == "dequantise_gemm"  # the int32 bound
    else:
        assert kernel(1024, 4096) == "dequantise_gemm"
    with pytest.raises(ValueError, match="K and N"):
        kernel(-1, 3)


def _weight(N, K, seed):
    return glm5_ops.quantize_int8(fresh(N, K, seed=seed, scale=K ** -0.5))


def _assert_within_digits_bound(y, x, w, s, bias=None):
    """y against the float64 oracle: the digits bound on the VNNI path, fp32's otherwise."""
    expect = x.double() @ (w.double() * s.double()[:, None]).T
    if bias is not None:
        expect = expect + bias.double()
    err = (y.double() - expect).abs()
    if VNNI:
        amax = x.double().abs().amax(1, keepdim=True)
        bound = (s.double()[None, :] * w.double().abs().sum(1)[None, :]) * amax * DIGITS_REL * 1.001
        bound = bound + expect.abs() * 2.0 ** -24 + 1e-30
        assert bool((err <= bound).all()), float((err - bound).max())
    else:
        K = x.shape[1]
        assert bool((err <= 1e-4 * expect.abs() + 1e-4 * K ** 0.5).all())


@pytest.mark.parametrize("K", [1, 5, 63, 64, 65, 191, 1000, 2500])
@pytest.mark.parametrize("M", [1, 3, 16, 17, 45])
def test_int8_linear_digits_meet_their_bound(M, K):
    """Odd K (below one vector, a tail, whole vectors), the 1/2/3/4-row blocks;
    M > 16: the prefill GEMM (N >= 256 takes it)."""
    N = 37 if M <= 16 else 257
    w, s = _weight(N, K, seed=K)
    x = fresh(M, K, seed=M * 1000 + K)
    bias = fresh(N, seed=7)
    _assert_within_digits_bound(glm5_ops.int8_linear(x, w, s, bias), x, w, s, bias)


def test_one_huge_element_and_a_tiny_rest():
    """The digits carry max|x| / 16e6 at best: tiny elements beside a huge one vanish
    into the residual, an error of the order of fp32's rounding of the huge term."""
    K = 300
    w, s = _weight(19, K, seed=3)
    x = fresh(4, K, seed=4) * 1e-6
    x[:, 17] = torch.tensor([1e4, -3e5, 7.0, 1e-3])
    _assert_within_digits_bound(glm5_ops.int8_linear(x, w, s), x, w, s)


def test_zero_row_gives_the_bias_exactly():
    w, s = _weight(9, 130, seed=5)
    x = fresh(3, 130, seed=6)
    x[1] = 0
    bias = fresh(9, seed=8)
    y = glm5_ops.int8_linear(x, w, s, bias)
    assert torch.equal(y[1], bias)
    _assert_within_digits_bound(y, x, w, s, bias)


def test_non_finite_rows_propagate_and_leave_the_others_alone():
    K = 200
    w, s = _weight(11, K, seed=9)
    x = fresh(4, K, seed=10)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    y = glm5_ops.int8_linear(x, w, s)
    assert bool(y[1].isnan().all())
    expect = ref.int8_linear(x, w, s)
    assert torch.equal(y[2].isinf(), expect[2].isinf()) and torch.equal(y[2].isnan(), expect[2].isnan())
    for m in (0, 3):
        assert torch.equal(y[m], glm5_ops.int8_linear(x[m:m + 1], w, s)[0])


@pytest.mark.parametrize("K,N", [(400, 700), (2500, 90)])
def test_int8_linear_rows_are_thread_and_batch_independent(K, N):
    """2 threads split the rows (grain 64 KiB / K rows); each row alone = in the batch
    (K=2500: 39 whole vectors and a 4-byte tail)."""
    w, s = _weight(N, K, seed=12)
    x = fresh(6, K, seed=13)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(glm5_ops.int8_linear(x, w, s))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    alone = torch.cat([glm5_ops.int8_linear(x[m:m + 1], w, s) for m in range(6)])
    assert torch.equal(outs[0], alone)
    _assert_within_digits_bound(outs[0], x, w, s)


@pytest.mark.parametrize("M,K,N", [(17, 65, 256), (45, 1000, 300), (530, 300, 263)])
def test_prefill_rows_get_the_decode_kernels_bits(M, K, N):
    """The prefill GEMM (M > 16; 530 crosses its 512-row blocks) gives each row
    exactly what the decode kernel gives it alone: the same digits, exact integer
    products and the same fused float64 combine. Where the CPU has no VNNI both
    paths are fp32 and only the bound is checked."""
    w, s = _weight(N, K, seed=M + K)
    x = fresh(M, K, seed=N)
    x[M // 2] = 0
    x[1, 3] = 1e5   # one row with a huge element
    bias = fresh(N, seed=M)
    y = glm5_ops.int8_linear(x, w, s, bias)
    _assert_within_digits_bound(y, x, w, s, bias)
    if VNNI:
        alone = torch.cat([glm5_ops.int8_linear(x[m:m + 1], w, s, bias) for m in range(M)])
        assert torch.equal(y, alone)


def test_prefill_non_finite_rows_propagate_and_leave_the_others_alone():
    M, K = 20, 200
    w, s = _weight(256, K, seed=19)
    x = fresh(M, K, seed=20)
    x[1, 5] = float("nan")
    x[2, 7] = float("-inf")
    y = glm5_ops.int8_linear(x, w, s)
    expect = ref.int8_linear(x, w, s)
    assert bool(y[1].isnan().all())
    assert torch.equal(y[2].isinf(), expect[2].isinf()) and torch.equal(y[2].isnan(), expect[2].isnan())
    keep = [m for m in range(M) if m not in (1, 2)]
    _assert_within_digits_bound(y[keep], x[keep], w, s)


def test_k_above_the_int32_bound_takes_the_fp32_path():
    K = 131073   # 127 * 127 * K >= 2^31: the digits' int32 sums could overflow
    w, s = _weight(3, K, seed=14)
    x = fresh(2, K, seed=15)
    y = glm5_ops.int8_linear(x, w, s)
    torch.testing.assert_close(y, ref.int8_linear(x, w, s), rtol=1e-4, atol=1e-4 * K ** 0.5)


@pytest.mark.parametrize("T,D,I,E,k,busiest", [(5, 200, 67, 6, 2, 16), (40, 300, 131, 4, 2, None)])
def test_fused_moe_int8_digits_against_float64(T, D, I, E, k, busiest):
    """Decode (no expert above 16 rows): gate/up digits of the token rows read through
    the sort, down digits of silu(g)*u. Prefill (busiest=None: some expert above 16
    rows): those experts run the digits GEMM (2I and D outputs >= 256), the others the
    GEMV. The error is the two projections' digit bounds carried through silu, far
    inside the fp32 tolerance the oracle test uses; checked here at 1e-6 relative to
    the output scale (the fp32 path: the usual 1e-4)."""
    g = torch.Generator().manual_seed(T)
    wgu, sgu = glm5_ops.quantize_int8(torch.randn(E, 2 * I, D, generator=g) * D ** -0.5)
    wd, sd = glm5_ops.quantize_int8(torch.randn(E, D, I, generator=g) * I ** -0.5)
    x = torch.randn(T, D, generator=g)
    weights = torch.rand(T, k, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    most = int(torch.bincount(ids.flatten().long(), minlength=E).max())
    assert most <= busiest if busiest else most > 16
    out = glm5_ops.fused_moe_int8(x, wgu, sgu, wd, sd, weights, ids)
    expect = ref.fused_moe_int8(x.double(), wgu, sgu, wd, sd, weights.double(), ids)
    rel = 1e-6 if VNNI else 1e-4
    torch.testing.assert_close(out.double(), expect, rtol=rel, atol=rel * float(expect.abs().max()))


@pytest.mark.skipif(not VNNI, reason="the fp32 paths already run here")
def test_the_fp32_paths_of_cpus_without_vnni_against_the_oracle():
    """GLM5_NO_VNNI=1 turns the VNNI kernels off: the oracle tests of the int8 ops
    (decode GEMV tiles, per-head tiles, dequantise + GEMM prefill, MoE, W8A8's exact
    sgemm chunks) on the paths a CPU without VNNI takes."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, GLM5_NO_VNNI="1")
    probe = subprocess.run([sys.executable, "-c", "import glm5_ops, torch; ops = torch.ops.glm5; "
                            "print(ops.int8_decode_kernel(1024), ops.int8_prefill_kernel(1024, 4096))"],
                           env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert probe.stdout.split() == ["avx512_fp32", "dequantise_gemm"], probe.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_int8.py",
                          "-k", "(matches_oracle or integer_bounds) and (int8_linear or fused_moe_int8 or w8a8) and not triton "
                          "and not reference"],
                         env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
