// Weight-only int8 GEMM at fp32-order accuracy through oneDNN's int8 GEMM: the
// prefill path of int8_linear and fused_moe_int8 for fp32 activations on CPUs
// with AVX512_VNNI (docs/INT8.md, "Prefill on VNNI").
//
// Each fp32 activation row is written as int8_vnni.h's three digits
// (x ~ s1 q1 + s2 q2 + s3 q3, residual <= 6.1e-8 max|x| per element), so
//   x . w = s1 (q1 . w) + s2 (q2 . w) + s3 (q3 . w),
// and the three integer products of a block of rows are one at::_int_mm of
// three times the rows (int32 sums, exact for K <= kVnniMaxK), combined and
// scaled in float64 and rounded to fp32 once: the decode kernel's numbers, by
// a GEMM. This is the Ozaki-style split that emulates a wide float GEMM on
// integer units. On this CPU's int8 GEMM, three digit rows cost less than one
// fp32 row through the BLAS sgemm (bench/RESULTS.md, "Weight-only prefill on
// VNNI digits"), and no fp32 copy of the weight is made, where dequantising
// and calling sgemm writes and rereads one.
// Rows with a NaN or an infinity get no digits; they are summed in float64
// directly, as the decode kernel does.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "int8_vnni.h"

namespace glm5 {
namespace cpu {
namespace vnni {

// Whether oneDNN's int8 GEMM has integer dot-product instructions here (AVX512_VNNI or
// AVX-VNNI; checked at run time, whatever the build targets). Without them at::_int_mm
// measured 46x slower than sgemm on the same integers (M = 2048, K = 1024, N = 2816 on a
// 2-core Zen 3: 6.9 s against 0.15 s). GLM5_NO_VNNI=1 says no, as for the decode kernels.
inline bool int_mm_has_vnni() {
  static const bool has = [] {
    const char* off = std::getenv("GLM5_NO_VNNI");
    if (off && std::string(off) == "1") return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") || __builtin_cpu_supports("avxvnni");
  }();
  return has;
}

// int32 q[M,K] @ w[N,K]^T through sgemm, exact: |q|, |w| <= 128, so a chunk of kSgemmExactK
// products sums to at most 2^24 in magnitude, every partial sum an integer fp32 holds
// exactly in whatever order the GEMM adds; the chunks add in int32.
constexpr int64_t kSgemmExactK = 1024;
inline at::Tensor int_mm_by_sgemm(const at::Tensor& q, const at::Tensor& w) {
  const int64_t K = q.size(1);
  at::Tensor acc = at::zeros({q.size(0), w.size(0)}, q.options().dtype(at::kInt));
  for (int64_t k0 = 0; k0 < K; k0 += kSgemmExactK) {
    const int64_t kc = std::min(kSgemmExactK, K - k0);
    acc.add_(at::mm(q.narrow(1, k0, kc).to(at::kFloat), w.narrow(1, k0, kc).to(at::kFloat).t()).to(at::kInt));
  }
  return acc;
}

// int32 q[M,K] @ w[N,K]^T, exact: oneDNN's int8 GEMM where the CPU has VNNI, else sgemm on
// the same integers. At K = 1 w^T goes as a plain [1, N] view: _int_mm (torch 2.14, CPU)
// reads w.t()'s strides (1, 1) wrongly and returns other numbers (tests/test_int8.py and
// test_int8_digits.py cover K = 1).
inline at::Tensor int_mm_wt(const at::Tensor& q, const at::Tensor& w) {
  if (!int_mm_has_vnni()) return int_mm_by_sgemm(q, w);
  return at::_int_mm(q, w.size(1) == 1 ? w.view({1, w.size(0)}) : w.t());
}

#if defined(__AVX512F__)

// Activation rows per _int_mm call: the int32 products of a block stay a few MB
// (kDigits * 512 rows * N) instead of 3 M N * 4 bytes for the whole prefill.
constexpr int64_t kDigitGemmRows = 512;
static_assert(kDigits == 3, "digit_gemm combines three digit products");

// Output columns below which dequantise + sgemm wins: writing the digits costs
// O(M K) whatever N, the GEMM saves O(M N K). Measured at M = 2048, K = 1024
// (bench/RESULTS.md, "Weight-only prefill on VNNI digits"): N = 64 0.5x, 128 0.9x,
// 192 1.0x, 256-2816 1.1-1.4x against dequantise + sgemm.
constexpr int64_t kDigitGemmMinN = 256;

// Whether a weight-only GEMM with rows of K and N outputs takes digit_gemm.
inline bool use_digit_gemm(int64_t K, int64_t N) { return use_digits(K) && N >= kDigitGemmMinN; }

// y[n] = float(scale[n] * (s0 a0[n] + s1 a1[n] + s2 a2[n]) + bias[n]) in float64, for the
// digit products a_d = a + d N; rows_digits' fused order (s0 a0, then + s1 a1, + s2 a2,
// then scale and bias in one fma), so a row gets the decode kernel's bits.
inline void combine_row(const double* s, const int32_t* a, const float* scale, const float* bias, int64_t N,
                        float* y) {
  const int32_t *a0 = a, *a1 = a + N, *a2 = a + 2 * N;
  const __m512d s0 = _mm512_set1_pd(s[0]), s1 = _mm512_set1_pd(s[1]), s2 = _mm512_set1_pd(s[2]);
  const auto load = [](const int32_t* p) {
    return _mm512_cvtepi32_pd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  int64_t n = 0;
  for (; n + 8 <= N; n += 8) {
    __m512d v = _mm512_mul_pd(s0, load(a0 + n));
    v = _mm512_fmadd_pd(s1, load(a1 + n), v);
    v = _mm512_fmadd_pd(s2, load(a2 + n), v);
    const __m512d b = bias ? _mm512_cvtps_pd(_mm256_loadu_ps(bias + n)) : _mm512_setzero_pd();
    _mm256_storeu_ps(y + n, _mm512_cvtpd_ps(_mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_loadu_ps(scale + n)), v, b)));
  }
  for (; n < N; ++n) {
    const double v = std::fma(s[2], double(a2[n]), std::fma(s[1], double(a1[n]), s[0] * double(a0[n])));
    y[n] = float(std::fma(double(scale[n]), v, bias ? double(bias[n]) : 0.0));
  }
}

// y[i, :] = x_r . (w * scale)^T + bias for the logical rows r = r0 + i, i < R, of d
// (through d.map where set: the MoE's sorted pairs read their token's digits), y rows
// N apart; w [N, K] int8 contiguous with K = d.K, N >= 1.
inline void digits_times_w(const ActDigits& d, int64_t r0, int64_t R, const at::Tensor& w, const float* scale,
                           const float* bias, float* y) {
  const int64_t K = d.K, N = w.size(0);
  const int8_t* wp = w.data_ptr<int8_t>();
  for (int64_t b0 = 0; b0 < R; b0 += kDigitGemmRows) {
    const int64_t rows = std::min(kDigitGemmRows, R - b0);
    at::Tensor q;   // the block's digit rows as one [rows * kDigits, K] int8 matrix
    if (d.map.empty()) {   // stored in order, Kp apart: read in place
      q = at::from_blob(const_cast<int8_t*>(d.row(r0 + b0)), {rows * kDigits, K}, {d.Kp, 1},
                        at::TensorOptions().dtype(at::kChar));
    } else {   // gathered through the map
      q = at::empty({rows * kDigits, K}, at::TensorOptions().dtype(at::kChar));
      int8_t* qp = q.data_ptr<int8_t>();
      at::parallel_for(0, rows, 16, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i)
          for (int g = 0; g < kDigits; ++g) std::copy_n(d.row(r0 + b0 + i) + g * d.Kp, K, qp + (i * kDigits + g) * K);
      });
    }
    const at::Tensor acc = int_mm_wt(q, w);
    const int32_t* ap = acc.data_ptr<int32_t>();
    at::parallel_for(0, rows, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = r0 + b0 + i;
        float* yr = y + (b0 + i) * N;
        if (!d.finite(r)) {   // NaN or infinity in the row: float64 sums, as the oracle
          for (int64_t n = 0; n < N; ++n) {
            const double v = dot_f64(wp + n * K, d.xrow(r), K);
            yr[n] = float(double(scale[n]) * v + (bias ? double(bias[n]) : 0.0));
          }
          continue;
        }
        combine_row(d.scales(r), ap + (i * kDigits) * N, scale, bias, N, yr);
      }
    });
  }
}

// Digits of x fp32 [R, K] (contiguous), filled on all threads.
inline ActDigits digits_of(const float* x, int64_t R, int64_t K) {
  ActDigits d = alloc_digits(x, R, K, K);
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) { fill_digits(d, r0, r1); });
  return d;
}

// y[M,N] fp32 (rows N apart) = x[M,K] fp32 @ (w[N,K] int8 * scale[N])^T + bias[N]; x and
// w contiguous, use_digits(K) true, M, N >= 1. Digits a block at a time: a few MB.
inline void digit_gemm(const at::Tensor& x, const at::Tensor& w, const float* scale, const float* bias, float* y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  for (int64_t m0 = 0; m0 < M; m0 += kDigitGemmRows) {
    const int64_t rows = std::min(kDigitGemmRows, M - m0);
    const ActDigits d = digits_of(x.data_ptr<float>() + m0 * K, rows, K);
    digits_times_w(d, 0, rows, w, scale, bias, y + m0 * N);
  }
}

#endif

}  // namespace vnni
}  // namespace cpu
}  // namespace glm5
