// Weight-only int8 decode on AVX-512 VNNI: integer dot products that keep
// fp32-level accuracy (csrc/cpu/int8.cpp's decode paths use it where the CPU
// has VNNI; docs/INT8.md, "Decode on VNNI").
//
// Widening each int8 weight to fp32 costs ~12 vector ops per 64 weight bytes
// and activation row (sign-extend, convert, FMA), which bounds the decode
// kernels below the memory bandwidth. Here each fp32 activation row x is
// written once per call as three int8 digits with scales s1 = max|x| / 127,
// s2 = s1 / 254, s3 = s2 / 254: n = round(x / s3) (float64; |n| <= 127 * 254^2)
// and n's digits in base 254,
//   q1 = round(n / 254^2),  r = n - 254^2 q1,  q2 = round(r / 254),  q3 = r - 254 q2
// (every |q| <= 127), so |x - s1 q1 - s2 q2 - s3 q3| <= s3 / 2 = max|x| / 16,387,064
// ~ 6.1e-8 max|x| per element: the order of fp32's own rounding of max|x|
// (two digits would leave 1.6e-5 max|x|, 250x more). Then
//   w . x = s1 (w . q1) + s2 (w . q2) + s3 (w . q3),
// each w . q an exact int32 dot product by vpdpbusd (u8 x s8, 64 bytes per op):
// the weight enters as unsigned after flipping its sign bit (w ^ 0x80 = w + 128),
// and 128 * sum(q) (per activation row and digit, computed once) is taken off
// after the reduction. vpdpbusd adds with wraparound, so the lanes hold the sum
// mod 2^32; the corrected w . q is exact as long as |w . q| <= 127 * 127 * K <
// 2^31, i.e. K <= kVnniMaxK (131072, the bound w8a8_linear uses); longer rows
// take the fp32 path. The three products are combined and scaled in float64
// and rounded to fp32 once, so against the float64 oracle
//   |y - y_ref| <= scale * sum_k |w_k| * 6.1e-8 * max|x| + half an ulp of y.
// Integers are exact and the combine has one fixed order: a row's result does
// not depend on the thread split or the other rows of the batch.
// An activation row with a NaN or an infinity gets no digits; its outputs are
// summed in float64 directly (they are NaN or infinite either way).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace glm5 {
namespace cpu {
namespace vnni {

constexpr int64_t kVnniMaxK = 131072;   // see above: 127 * 127 * K < 2^31
constexpr int kDigits = 3;   // fill_digits writes three (static_assert there)
constexpr int64_t kPrefetchBytes = 8192;   // gemv_tiles.h's distance; 16 KiB measured no better here

// The packed layout of an int8 weight [N, K] (fused_moe_int8's packed=True; its spec is
// pack_rows in glm5_ops/reference.py, and docs/INT8.md says why): rows in groups of 16, each
// group's 16 K bytes ordered 4-byte chunk by chunk (bytes 4c..4c+3 of rows 0..15 in turn: one
// 64-byte vector), then the rows' K % 4 tails in turn; the N % 16 rows after the last group
// stay plain. One vector holds 4 bytes of 16 rows, so vpdpbusd against 4 digit bytes
// broadcast sums each row in its own lane: no horizontal reduction, which on the MoE's
// 256-byte down rows cost as much as the products themselves (13 ops per 4 rows and digit).
// And a group is one sequential stream, which the hardware prefetcher follows at the full
// read bandwidth; rows read side by side from plain storage are short streams it does not
// (bench/RESULTS.md, "Packed expert rows").
constexpr int64_t kPackRows = 16;
constexpr int64_t kPackChunk = 4;   // vpdpbusd's bytes per lane

// Byte offset of w[n, k] in the packed layout of [N, K].
inline int64_t packed_offset(int64_t N, int64_t K, int64_t n, int64_t k) {
  if (n >= N / kPackRows * kPackRows) return n * K + k;   // after the last group: plain
  const int64_t g = n / kPackRows * kPackRows, j = n - g, kc = K / kPackChunk * kPackChunk;
  return g * K + (k < kc ? k / kPackChunk * (kPackRows * kPackChunk) + j * kPackChunk + k % kPackChunk
                         : kc * kPackRows + j * (K - kc) + (k - kc));
}

// dst [N, K] plain <- src [N, K] packed.
inline void unpack_rows(const int8_t* src, int8_t* dst, int64_t N, int64_t K) {
  const int64_t full = N / kPackRows * kPackRows, kc = K / kPackChunk * kPackChunk;
  for (int64_t g = 0; g < full; g += kPackRows) {
    const int8_t* s = src + g * K;
    for (int64_t k = 0; k < kc; k += kPackChunk)
      for (int64_t j = 0; j < kPackRows; ++j, s += kPackChunk) std::copy_n(s, kPackChunk, dst + (g + j) * K + k);
    for (int64_t j = 0; j < kPackRows; ++j, s += K - kc) std::copy_n(s, K - kc, dst + (g + j) * K + kc);
  }
  std::copy_n(src + full * K, (N - full) * K, dst + full * K);
}

#if defined(__AVX512F__)

// True where the CPU executes vpdpbusd (AVX512_VNNI); checked once. The build
// targets x86-64-v4, which does not include VNNI, so the kernel carries its
// own target attribute and runs only where this says so. GLM5_NO_VNNI=1 in the
// environment turns it off, so the fp32 paths of CPUs without VNNI are tested
// on machines that have it (tests/test_int8_digits.py).
inline bool cpu_has_vnni() {
  static const bool has = [] {
    const char* off = std::getenv("GLM5_NO_VNNI");
    if (off && std::string(off) == "1") return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") != 0;
  }();
  return has;
}

// The digits of R activation rows of length K, each row's kDigits digit rows
// zero-padded to Kp: whole 64-byte vectors plus one line, so the digit rows a
// block of activation rows reads side by side (up to 12) start on different L1
// sets; 64-byte aligned (a vector load crossing two lines costs two, measured:
// an unaligned buffer ran the 4-row blocks ~2x slower).
struct ActDigits {
  int64_t R = 0, K = 0, Kp = 0;
  std::vector<int8_t> buf;      // q's storage, 63 bytes of slack for the alignment
  int8_t* q = nullptr;          // [R][kDigits][Kp], 64-byte aligned in buf
  std::vector<double> s;        // [R][kDigits]; NaN marks a row with a non-finite value
  std::vector<int32_t> qsum;    // [R][kDigits]: sum of the row's digits (the u8 offset's correction)
  const float* x = nullptr;     // the rows themselves (the float64 path of non-finite rows)
  int64_t ldx = 0;
  std::vector<float> own_rows;  // x's storage where the digits keep their rows (a thread's own rows)
  std::vector<int64_t> map;     // logical row -> stored row, where set (the MoE's sorted pairs share token rows)

  int64_t stored(int64_t r) const { return map.empty() ? r : map[r]; }
  ActDigits() = default;
  ActDigits(ActDigits&&) = default;   // q and x stay valid: a moved vector keeps its storage
  ActDigits& operator=(ActDigits&&) = default;
  ActDigits(const ActDigits&) = delete;

  const int8_t* row(int64_t r) const { return q + stored(r) * kDigits * Kp; }
  const double* scales(int64_t r) const { return s.data() + stored(r) * kDigits; }
  const int32_t* sums(int64_t r) const { return qsum.data() + stored(r) * kDigits; }
  const float* xrow(int64_t r) const { return x + stored(r) * ldx; }
  bool finite(int64_t r) const { return !std::isnan(scales(r)[0]); }
};

// Storage for the digits of x fp32 [R, ldx] (K used), all zero; fill_digits writes them.
inline ActDigits alloc_digits(const float* x, int64_t R, int64_t K, int64_t ldx) {
  ActDigits a;
  a.R = R, a.K = K, a.Kp = (K + 63) / 64 * 64 + 64, a.x = x, a.ldx = ldx;
  a.buf.assign(R * kDigits * a.Kp + 63, 0);
  a.q = a.buf.data() + (64 - reinterpret_cast<uintptr_t>(a.buf.data()) % 64) % 64;
  a.s.assign(R * kDigits, 0.0);
  a.qsum.assign(R * kDigits, 0);
  return a;
}

// The digits of rows [r0, r1) of a's x (the layout above); rows are independent,
// so threads may fill disjoint ranges.
inline void fill_digits(ActDigits& a, int64_t r0, int64_t r1) {
  const int64_t K = a.K;
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = a.x + r * a.ldx;
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 m = K - k >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (K - k)) - 1u);
      const __m512 v = _mm512_maskz_loadu_ps(m, xr + k);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vmax = _mm512_max_ps(vmax, _mm512_and_ps(v, abs_mask));
    }
    const double amax = _mm512_reduce_max_ps(vmax);
    double* s = a.s.data() + r * kDigits;
    if (nan || std::isinf(amax)) {
      s[0] = NAN;
      continue;
    }
    if (amax == 0.0) continue;   // digits, scales and sums 0
    static_assert(kDigits == 3, "fill_digits writes three digits");
    s[0] = amax / 127.0;
    for (int d = 1; d < kDigits; ++d) s[d] = s[d - 1] / 254.0;
    // n = round(x / s3) in float64 (|n| <= 127 * 254^2 < 2^24), then n's digits in fp32,
    // where every integer involved is exact: q1 = round(n / 254^2), r = n - 254^2 q1,
    // q2 = round(r / 254), q3 = r - 254 q2. A q1 rounded one off at a near-tie (n / 254^2
    // within fp32's error of a half) leaves |r| = 254 * 127 + 1, still |q2|, |q3| <= 127.
    const __m512d inv3 = _mm512_set1_pd(1.0 / s[kDigits - 1]);
    const __m512 b2 = _mm512_set1_ps(254.0f * 254.0f), inv_b2 = _mm512_set1_ps(1.0f / (254.0f * 254.0f));
    const __m512 b = _mm512_set1_ps(254.0f), inv_b = _mm512_set1_ps(1.0f / 254.0f);
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m512i sums[kDigits];
    for (int d = 0; d < kDigits; ++d) sums[d] = _mm512_setzero_si512();
    int8_t* qr = a.q + r * kDigits * a.Kp;
    for (int64_t k = 0; k < K; k += 16) {   // the tail reads zeros (digits 0); the rows have >= 16 bytes of padding
      const __mmask16 m = K - k >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (K - k)) - 1u);
      const __m512 v = _mm512_maskz_loadu_ps(m, xr + k);
      const __m256i n_lo = _mm512_cvtpd_epi32(_mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(v)), inv3));
      const __m256i n_hi = _mm512_cvtpd_epi32(
          _mm512_mul_pd(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))), inv3));
      const __m512 n = _mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(n_lo), n_hi, 1));
      const __m512 q1 = _mm512_roundscale_ps(_mm512_mul_ps(n, inv_b2), kNearest);
      const __m512 rest = _mm512_fnmadd_ps(q1, b2, n);
      const __m512 q2 = _mm512_roundscale_ps(_mm512_mul_ps(rest, inv_b), kNearest);
      const __m512i q[kDigits] = {_mm512_cvtps_epi32(q1), _mm512_cvtps_epi32(q2),
                                  _mm512_cvtps_epi32(_mm512_fnmadd_ps(q2, b, rest))};
      for (int d = 0; d < kDigits; ++d) {
        sums[d] = _mm512_add_epi32(sums[d], q[d]);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + d * a.Kp + k), _mm512_cvtepi32_epi8(q[d]));
      }
    }
    for (int d = 0; d < kDigits; ++d) a.qsum[r * kDigits + d] = _mm512_reduce_add_epi32(sums[d]);
  }
}

// x fp32 [R, ldx] (K used) -> its digits, on the calling thread (decode: a few rows).
inline ActDigits make_digits(const float* x, int64_t R, int64_t K, int64_t ldx) {
  ActDigits a = alloc_digits(x, R, K, ldx);
  fill_digits(a, 0, R);
  return a;
}

// w . x summed in float64, in order: a row with a NaN or an infinity, which gets no digits.
inline double dot_f64(const int8_t* w, const float* x, int64_t K) {
  double v = 0.0;
  for (int64_t k = 0; k < K; ++k) v += double(w[k]) * double(x[k]);
  return v;
}

#define GLM5_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

// [sum(a), sum(b), sum(c), sum(d)] of four vectors of 16 int32 lanes (wrapping adds):
// a transpose-and-add tree, 13 ops where four separate reductions take ~36 (the
// reductions weigh on short rows: the MoE's down rows are 4 vectors long).
GLM5_VNNI_TARGET inline __m128i reduce4(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  // per 128-bit lane: [a, b, c, d] partial sums
  const __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  const __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
}

// acc += vpdpbusd(u8 a, s8 b), in place. GCC 12 compiles _mm512_dpbusd_epi32 on
// dot_digits's accumulator array with two register copies per product (24 moves a
// loop step at 4 x 1, ~2x the loop's instructions); the asm keeps acc in its
// register: the same bits, 1.09-1.10x the GB/s hot in L2 at K = 256, 512 and 1024
// (`stream_probe rows`, 5 alternating runs; bench/RESULTS.md).
GLM5_VNNI_TARGET inline void dpbusd(__m512i& acc, __m512i a, __m512i b) {
  __m512i r = acc;
  asm("vpdpbusd %2, %1, %0" : "+v"(r) : "v"(a), "v"(b));
  acc = r;
}

// out[(m * kDigits + d) * 4 + j] = sum_k (w_j[k] + 128) * q_m,d[k] mod 2^32 for NB <= 4
// weight rows w[j] read side by side, start to end, and MB activation rows (q[m]: the
// row's digits, Kp apart, 64-byte aligned); lanes j >= NB are 0. Every digit load feeds
// NB products, every (j, m, d) has its own accumulator chain.
template <int NB, int MB>
GLM5_VNNI_TARGET inline void dot_digits(const int8_t* const* q, int64_t Kp, const int8_t* const* w, int64_t K,
                                        uint32_t* out, const int8_t* pf) {
  __m512i acc[NB][MB][kDigits];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m)
      for (int d = 0; d < kDigits; ++d) acc[j][m][d] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {   // plain loads: masked ones on every vector measured 2x slower
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = _mm512_xor_si512(_mm512_loadu_si512(w[j] + k), flip);
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + (k / 64 * NB + j) * 64), _MM_HINT_NTA);
    }
    for (int m = 0; m < MB; ++m)
      for (int d = 0; d < kDigits; ++d) {
        const __m512i qv = _mm512_load_si512(q[m] + d * Kp + k);
        for (int j = 0; j < NB; ++j) dpbusd(acc[j][m][d], wv[j], qv);
      }
  }
  for (; k < K; k += 64) {   // a masked tail (its digits are zero-padded)
    const __mmask64 mask = K - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1;
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w[j] + k), flip);
    for (int m = 0; m < MB; ++m)
      for (int d = 0; d < kDigits; ++d) {
        const __m512i qv = _mm512_load_si512(q[m] + d * Kp + k);
        for (int j = 0; j < NB; ++j) dpbusd(acc[j][m][d], wv[j], qv);
      }
  }
  const __m512i zero = _mm512_setzero_si512();
  for (int m = 0; m < MB; ++m)
    for (int d = 0; d < kDigits; ++d) {
      __m512i v[4] = {zero, zero, zero, zero};
      for (int j = 0; j < NB; ++j) v[j] = acc[j][m][d];
      _mm_store_si128(reinterpret_cast<__m128i*>(out + (m * kDigits + d) * 4), reduce4(v[0], v[1], v[2], v[3]));
    }
}

// One block: nb weight rows x one activation row -> out (dot_digits's layout).
GLM5_VNNI_TARGET inline void block_digits(int nb, const int8_t* const* q, int64_t Kp, const int8_t* const* w,
                                          int64_t K, uint32_t* out, const int8_t* pf) {
  switch (nb) {
    case 1: dot_digits<1, 1>(q, Kp, w, K, out, nullptr); return;
    case 2: dot_digits<2, 1>(q, Kp, w, K, out, nullptr); return;
    case 3: dot_digits<3, 1>(q, Kp, w, K, out, nullptr); return;
    default: dot_digits<4, 1>(q, Kp, w, K, out, pf); return;
  }
}

// y[(r0 + i) * ldy + n] = float(scale[n] * sum_d s_d (w[n] . q_d) + bias[n]) for the
// activation rows r0 + i (i < M) of `a` and the weight rows n in [n0, n1) of w [*, K]
// (scale and bias indexed by n; bias may be null). Blocks of 4 weight rows read side
// by side, against one activation row at a time (the block stays in L1 for the next).
// Measured (hot, one thread, K = 256 / 1024): 4 x 1 blocks beat the other digit blocks
// tried, 1 x (1..4), 2 x (1, 2), 3 x 2, 2 x 4 and 4 x (2, 4), at every M <= 16; with more
// activation rows per block the accumulators (3 per pair) outgrow the registers. The
// 4 rows' products are combined in one float64 vector (1.25x on the MoE's 256-byte
// rows against a scalar combine per row).
GLM5_VNNI_TARGET __attribute__((noinline)) inline void rows_digits(const ActDigits& a, int64_t r0, int64_t M,
                                                                   const int8_t* w, int64_t n0, int64_t n1,
                                                                   const float* scale, const float* bias, float* y,
                                                                   int64_t ldy) {
  constexpr int kNB = 4;
  const int64_t K = a.K, Kp = a.Kp;
  // A later block is prefetched (one line per line read, with the first activation row),
  // at least kPrefetchBytes ahead: at M > 1 the block is worked on M times, too slowly for
  // the hardware prefetcher (measured 1.5-2x slower at M = 4 and 16 without it); into L1
  // (T0) it evicted the digit rows (M = 4 another 1.5x slower). Non-temporal (NTA), as
  // group_digits: against T1, in-process on a Zen 4, int8_linear 2048 x 1024 and 1024 x
  // 4096 at M = 1 read 1.09-1.10x and at M = 4 1.09-1.11x (bench/RESULTS.md,
  // "Non-temporal prefetch").
  const int64_t ahead = kNB * ((kPrefetchBytes + kNB * K - 1) / (kNB * K));
  alignas(16) uint32_t out[kDigits * 4];
  for (int64_t n = n0; n < n1; n += kNB) {
    const int nb = int(std::min<int64_t>(kNB, n1 - n));
    const int8_t* wr[kNB];
    for (int j = 0; j < nb; ++j) wr[j] = w + (n + j) * K;
    for (int64_t r = r0; r < r0 + M; ++r) {
      const int8_t* q[1] = {a.row(r)};
      const bool pf = r == r0 && n + ahead + kNB <= n1;
      block_digits(nb, q, Kp, wr, K, out, pf ? w + (n + ahead) * K : nullptr);
      const double* s = a.scales(r);
      const int32_t* qs = a.sums(r);
      const __mmask8 lanes = static_cast<__mmask8>((1u << nb) - 1u);
      const __m256d sc = _mm256_cvtps_pd(_mm_maskz_loadu_ps(lanes, scale + n));
      const __m256d b = bias ? _mm256_cvtps_pd(_mm_maskz_loadu_ps(lanes, bias + n)) : _mm256_setzero_pd();
      __m256d v = _mm256_setzero_pd();   // the 4 weight rows' sum_d s_d (w . q_d), float64
      if (a.finite(r)) {
        for (int d = 0; d < kDigits; ++d) {   // exact: |w . q| < 2^31 (K <= kVnniMaxK)
          const __m128i off = _mm_set1_epi32(static_cast<int32_t>(128u * static_cast<uint32_t>(qs[d])));
          const __m128i dot = _mm_sub_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(out + d * 4)), off);
          v = _mm256_fmadd_pd(_mm256_set1_pd(s[d]), _mm256_cvtepi32_pd(dot), v);
        }
      } else {
        alignas(32) double vs[4] = {0.0, 0.0, 0.0, 0.0};
        const float* xr = a.xrow(r);
        for (int j = 0; j < nb; ++j) vs[j] = dot_f64(wr[j], xr, K);
        v = _mm256_load_pd(vs);
      }
      _mm_mask_storeu_ps(y + r * ldy + n, lanes, _mm256_cvtpd_ps(_mm256_fmadd_pd(sc, v, b)));
    }
  }
}

// acc += vpdpbusd(u8 a, the 4 s8 bytes at p in every lane), in place (dpbusd's asm after a
// vpbroadcastd: an asm with the digits as its broadcast memory operand made GCC store the
// accumulators after every product).
GLM5_VNNI_TARGET inline void dpbusd_bcast(__m512i& acc, __m512i a, const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  dpbusd(acc, a, _mm512_set1_epi32(v));
}

// One weight vector (4 bytes of 16 rows at k, sign bit flipped) into the MB x kDigits accumulators.
template <int MB>
GLM5_VNNI_TARGET inline void group_step(__m512i (&acc)[MB][kDigits], __m512i wv, const int8_t* const* q, int64_t Kp,
                                        int64_t k) {
  for (int m = 0; m < MB; ++m)
    for (int d = 0; d < kDigits; ++d) dpbusd_bcast(acc[m][d], wv, q[m] + d * Kp + k);
}

// out[m * kDigits + d] lane j = sum_k (w_j[k] + 128) * q_m,d[k] mod 2^32 for the 16 rows of
// one packed group at g (packed_offset's layout) and MB activation rows (q[m]: the row's
// digits, Kp apart, zero past K). Each weight vector is loaded once and feeds 3 MB products.
// The accumulators are this function's own (written out once at the end): GCC stored an
// array the caller passed by reference after every product (2x slower at MB = 2).
template <int MB>
GLM5_VNNI_TARGET inline void group_digits(const int8_t* const* q, int64_t Kp, const int8_t* g, int64_t K,
                                          __m512i* out, const int8_t* end) {
  __m512i acc[MB][kDigits];
  for (int m = 0; m < MB; ++m)
    for (int d = 0; d < kDigits; ++d) acc[m][d] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t chunks = K / kPackChunk, tail = K - chunks * kPackChunk;
  // (a helper, not a lambda: a lambda does not carry the target attribute, and dpbusd_bcast
  // would then not inline into it)
  for (int64_t c = 0; c < chunks; ++c) {
    // A prefetch kPrefetchBytes ahead (up to the run's end), non-temporal. From two
    // activation rows on the products outrun the read, and the demand loads with the
    // hardware prefetcher behind them come too slowly to keep memory busy: a prefetch into
    // L2 (T1) helped there and cost at one row ("Prefetch where the products outrun the
    // read"). As NTA it pays at one row too: in-process on a Zen 4, against none at one row,
    // T = 1 / 4 read 1.11x / 1.14x with 4 KiB ahead and 8 KiB another 1.09x over that; T = 16
    // 1.06x with 8 KiB (NTA from two rows, in place of T1, +1.4% of it); fast hours 88 / 93 /
    // 83% of the sum; 2 / 12 / 16 KiB less than 8 (bench/RESULTS.md, "Non-temporal prefetch"). Our reading (not measured
    // apart): a line fetched NTA is not kept in L2 and, on its eviction, not written to the
    // L3, which on Zen is the L2's victim cache; the stream then leaves the rest of the call
    // (and the caller's code and data) in the caches and spares the L2-to-L3 traffic.
    const int8_t* p = g + c * 64 + kPrefetchBytes;
    if (p < end) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_NTA);
    group_step<MB>(acc, _mm512_xor_si512(_mm512_loadu_si512(g + c * 64), flip), q, Kp, c * kPackChunk);
  }
  if (tail) {   // the rows' tails, one lane each (the digits past K are 0, so are the products)
    alignas(64) int8_t v[64] = {};
    for (int j = 0; j < kPackRows; ++j) std::copy_n(g + chunks * 64 + j * tail, tail, v + j * kPackChunk);
    group_step<MB>(acc, _mm512_xor_si512(_mm512_load_si512(v), flip), q, Kp, chunks * kPackChunk);
  }
  for (int m = 0; m < MB; ++m)
    for (int d = 0; d < kDigits; ++d) out[m * kDigits + d] = acc[m][d];
}

// rows_digits for one packed group: y[(r + m) * ldy + j] for its 16 rows j and the MB
// activation rows r + m, in rows_digits' float64 order (the same bits).
template <int MB>
GLM5_VNNI_TARGET inline void group_rows(const ActDigits& a, int64_t r, const int8_t* g, const float* scale,
                                        const float* bias, float* y, int64_t ldy, const int8_t* end) {
  const int64_t K = a.K;
  const int8_t* q[MB];
  for (int m = 0; m < MB; ++m) q[m] = a.row(r + m);
  __m512i acc[MB * kDigits];
  group_digits<MB>(q, a.Kp, g, K, acc, end);
  const __m512 sc = _mm512_loadu_ps(scale), b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512d sc_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(sc));
  const __m512d sc_hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sc), 1)));
  const __m512d b_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(b));
  const __m512d b_hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(b), 1)));
  for (int m = 0; m < MB; ++m) {
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();   // sum_d s_d (w . q_d), float64
    if (a.finite(r + m)) {
      const double* s = a.scales(r + m);
      const int32_t* qs = a.sums(r + m);
      for (int d = 0; d < kDigits; ++d) {   // exact: |w . q| < 2^31 (K <= kVnniMaxK)
        const __m512i dot = _mm512_sub_epi32(acc[m * kDigits + d], _mm512_set1_epi32(static_cast<int32_t>(128u * uint32_t(qs[d]))));
        lo = _mm512_fmadd_pd(_mm512_set1_pd(s[d]), _mm512_cvtepi32_pd(_mm512_castsi512_si256(dot)), lo);
        hi = _mm512_fmadd_pd(_mm512_set1_pd(s[d]), _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(dot, 1)), hi);
      }
    } else {   // in order, as dot_f64
      alignas(64) double vs[kPackRows] = {};
      const float* xr = a.xrow(r + m);
      for (int j = 0; j < kPackRows; ++j)
        for (int64_t k = 0; k < K; ++k) vs[j] += double(g[packed_offset(kPackRows, K, j, k)]) * double(xr[k]);
      lo = _mm512_load_pd(vs), hi = _mm512_load_pd(vs + 8);
    }
    const __m256 y_lo = _mm512_cvtpd_ps(_mm512_fmadd_pd(sc_lo, lo, b_lo));
    const __m256 y_hi = _mm512_cvtpd_ps(_mm512_fmadd_pd(sc_hi, hi, b_hi));
    _mm512_storeu_ps(y + (r + m) * ldy,
                     _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(y_lo)),
                                                         _mm256_castps_pd(y_hi), 1)));
  }
}

// rows_digits for w [N, K] in the packed layout: rows [n0, n1), n0 a multiple of 16 and n1 one
// too or past the last group (fused_moe_int8's packed tiles are whole groups). Each group is
// read once for up to 8 activation rows (3 accumulators each), so at M <= 8 once in all.
GLM5_VNNI_TARGET __attribute__((noinline)) inline void packed_rows_digits(const ActDigits& a, int64_t r0, int64_t M,
                                                                          const int8_t* w, int64_t N, int64_t n0,
                                                                          int64_t n1, const float* scale,
                                                                          const float* bias, float* y, int64_t ldy) {
  const int64_t K = a.K, full = N / kPackRows * kPackRows;
  const int8_t* const end = w + std::min(n1, N) * K;   // the run's last weight byte + 1: prefetch no further
  int64_t n = n0;
  for (; n + kPackRows <= std::min(n1, full); n += kPackRows) {
    const int8_t* g = w + n * K;
    const float* b = bias ? bias + n : nullptr;
    for (int64_t m = 0; m < M; m += 8) {
      const int64_t r = r0 + m;
      const int8_t* const pf_end = m == 0 ? end : g;   // a second pass of 8 rows finds the group cached
      switch (std::min<int64_t>(8, M - m)) {
        case 1: group_rows<1>(a, r, g, scale + n, b, y + n, ldy, pf_end); break;
        case 2: group_rows<2>(a, r, g, scale + n, b, y + n, ldy, pf_end); break;
        case 3: group_rows<3>(a, r, g, scale + n, b, y + n, ldy, pf_end); break;
        case 4: group_rows<4>(a, r, g, scale + n, b, y + n, ldy, pf_end); break;
        case 5: group_rows<5>(a, r, g, scale + n, b, y + n, ldy, pf_end); break;
        case 6: group_rows<6>(a, r, g, scale + n, b, y + n, ldy, pf_end); break;
        case 7: group_rows<7>(a, r, g, scale + n, b, y + n, ldy, pf_end); break;
        default: group_rows<8>(a, r, g, scale + n, b, y + n, ldy, pf_end); break;
      }
    }
  }
  if (n < n1) rows_digits(a, r0, M, w, n, n1, scale, bias, y, ldy);   // the plain rows after the last group
}

#undef GLM5_VNNI_TARGET

#else

inline bool cpu_has_vnni() { return false; }

#endif

// Whether a decode call with rows of K elements takes the digits kernel.
inline bool use_digits(int64_t K) { return cpu_has_vnni() && K >= 1 && K <= kVnniMaxK; }

}  // namespace vnni
}  // namespace cpu
}  // namespace glm5
