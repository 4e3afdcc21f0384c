// Weight-only int8 decode on AVX-512 VNNI: integer dot products that keep
// fp32-level accuracy (csrc/cpu/int8.cpp's decode paths use it where the CPU
// has VNNI; docs/INT8.md, "Decode on VNNI").
//
// Widening each int8 weight to fp32 costs ~12 vector ops per 64 weight bytes
// and activation row (sign-extend, convert, FMA), which bounds the decode
// kernels below the memory bandwidth. Here each fp32 activation row x is
// written once per call as three int8 digits with scales
//   s1 = max|x| / 127,  q1 = round(x / s1),           r1 = x - s1 q1
//   s2 = s1 / 254,      q2 = round(r1 / s2),          r2 = r1 - s2 q2
//   s3 = s2 / 254,      q3 = round(r2 / s3)           (every |q| <= 127)
// (float64 arithmetic), so |x - s1 q1 - s2 q2 - s3 q3| <= s3 / 2 = max|x| / 16,387,064
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
#include <string>
#include <vector>

namespace glm5 {
namespace cpu {
namespace vnni {

constexpr int64_t kVnniMaxK = 131072;   // see above: 127 * 127 * K < 2^31
constexpr int kDigits = 3;
constexpr int64_t kPrefetchBytes = 8192;   // gemv_tiles.h's distance; 16 KiB measured no better here

// The packed layout of an int8 weight [N, K] (fused_moe_int8's packed=True; its spec is
// pack_rows4 in glm5_ops/reference.py, and docs/INT8.md says why): rows in groups of 4 (the last
// group: the N % 4 rows left), each group's nb * K bytes ordered chunk by chunk, 64 bytes of
// each of its rows in turn, then the rows' tails (K % 64 bytes each) in turn. Reading a group
// 4 rows side by side is then one sequential stream, which the hardware prefetcher follows
// at the full read bandwidth; 4 rows 1 KiB apart are 4 short streams it does not, and the
// software prefetches that made up for it cost a third of the bandwidth on a fast hour
// (bench/RESULTS.md, "Packed expert rows").
constexpr int64_t kPackRows = 4;

// Byte offset of w[n, k] in the packed layout of [N, K].
inline int64_t packed_offset(int64_t N, int64_t K, int64_t n, int64_t k) {
  const int64_t g = n / kPackRows * kPackRows, nb = std::min(kPackRows, N - g), j = n - g;
  const int64_t kfull = K / 64 * 64;
  const int64_t in_group = k < kfull ? (k / 64) * 64 * nb + j * 64 + k % 64 : kfull * nb + j * (K - kfull) + (k - kfull);
  return g * K + in_group;
}

// dst [N, K] plain <- src [N, K] packed.
inline void unpack_rows4(const int8_t* src, int8_t* dst, int64_t N, int64_t K) {
  const int64_t kfull = K / 64 * 64;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < kfull; k += 64) std::copy_n(src + packed_offset(N, K, n, k), 64, dst + n * K + k);
    if (kfull < K) std::copy_n(src + packed_offset(N, K, n, kfull), K - kfull, dst + n * K + kfull);
  }
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
  std::vector<int64_t> map;     // logical row -> stored row, where set (the MoE's sorted pairs share token rows)

  int64_t stored(int64_t r) const { return map.empty() ? r : map[r]; }
  ActDigits() = default;
  ActDigits(ActDigits&&) = default;   // q stays valid: a moved vector keeps its storage
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
    s[0] = amax / 127.0;
    for (int d = 1; d < kDigits; ++d) s[d] = s[d - 1] / 254.0;
    __m512d sv[kDigits], inv[kDigits];
    for (int d = 0; d < kDigits; ++d) sv[d] = _mm512_set1_pd(s[d]), inv[d] = _mm512_set1_pd(1.0 / s[d]);
    const __m512d lo = _mm512_set1_pd(-127.0), hi = _mm512_set1_pd(127.0);
    __m256i sums[kDigits];
    for (int d = 0; d < kDigits; ++d) sums[d] = _mm256_setzero_si256();
    int8_t* qr = a.q + r * kDigits * a.Kp;
    for (int64_t k = 0; k < K; k += 8) {   // 8 lanes of float64; the tail reads zeros (digits 0)
      const __mmask8 m = K - k >= 8 ? __mmask8(0xff) : static_cast<__mmask8>((1u << (K - k)) - 1u);
      __m512d rest = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, xr + k));
      for (int d = 0; d < kDigits; ++d) {
        // x * (1/s) instead of x / s: a digit one off at a near-tie leaves a remainder
        // the next digit takes; the clamp keeps |q| <= 127 whatever the rounding.
        __m512d qd = _mm512_roundscale_pd(_mm512_mul_pd(rest, inv[d]), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        qd = _mm512_min_pd(_mm512_max_pd(qd, lo), hi);
        rest = _mm512_fnmadd_pd(qd, sv[d], rest);
        const __m256i qi = _mm512_cvtpd_epi32(qd);
        sums[d] = _mm256_add_epi32(sums[d], qi);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(qr + d * a.Kp + k), _mm256_cvtepi32_epi8(qi));
      }
    }
    for (int d = 0; d < kDigits; ++d) {
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sums[d]);
      int32_t t = 0;
      for (int l = 0; l < 8; ++l) t += lanes[l];
      a.qsum[r * kDigits + d] = t;
    }
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
// PACKED: w[0] is a group of NB rows in the packed layout (packed_offset above): the 64-byte
// chunk at k of row j at w[0] + k * NB + 64 j, the tail at w[0] + kfull * NB + j (K - kfull).
template <int NB, int MB, bool PACKED = false>
GLM5_VNNI_TARGET inline void dot_digits(const int8_t* const* q, int64_t Kp, const int8_t* const* w, int64_t K,
                                        uint32_t* out, const int8_t* pf) {
  const auto at = [&](int j, int64_t k, int64_t len) { return PACKED ? w[0] + k * NB + j * len : w[j] + k; };
  __m512i acc[NB][MB][kDigits];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m)
      for (int d = 0; d < kDigits; ++d) acc[j][m][d] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {   // plain loads: masked ones on every vector measured 2x slower
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = _mm512_xor_si512(_mm512_loadu_si512(at(j, k, 64)), flip);
      if (!PACKED && pf) _mm_prefetch(reinterpret_cast<const char*>(pf + (k / 64 * NB + j) * 64), _MM_HINT_T1);
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
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, at(j, k, K - k)), flip);
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
                                          int64_t K, uint32_t* out, const int8_t* pf, bool packed) {
  if (packed) {   // one sequential stream: the hardware prefetcher's, no software prefetch
    switch (nb) {
      case 1: dot_digits<1, 1, true>(q, Kp, w, K, out, nullptr); return;
      case 2: dot_digits<2, 1, true>(q, Kp, w, K, out, nullptr); return;
      case 3: dot_digits<3, 1, true>(q, Kp, w, K, out, nullptr); return;
      default: dot_digits<4, 1, true>(q, Kp, w, K, out, nullptr); return;
    }
  }
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
                                                                   int64_t ldy, bool packed = false) {
  // packed: w [N, K] in the packed layout; n0 a multiple of 4 and n1 one too or N, so each
  // block below is one of the layout's groups (fused_moe_int8's 8-row tiles are).
  constexpr int kNB = 4;
  static_assert(kNB == kPackRows, "a block is a packed group");
  const int64_t K = a.K, Kp = a.Kp;
  // A later block is prefetched into L2 (one line per line read, with the first
  // activation row), at least kPrefetchBytes ahead: at M > 1 the block is worked on M
  // times, too slowly for the hardware prefetcher (measured 1.5-2x slower at M = 4 and
  // 16 without it); into L1 it evicted the digit rows (M = 4 another 1.5x slower).
  const int64_t ahead = kNB * ((kPrefetchBytes + kNB * K - 1) / (kNB * K));
  alignas(16) uint32_t out[kDigits * 4];
  for (int64_t n = n0; n < n1; n += kNB) {
    const int nb = int(std::min<int64_t>(kNB, n1 - n));
    const int8_t* wr[kNB];
    for (int j = 0; j < nb; ++j) wr[j] = w + (n + j) * K;
    for (int64_t r = r0; r < r0 + M; ++r) {
      const int8_t* q[1] = {a.row(r)};
      const bool pf = !packed && r == r0 && n + ahead + kNB <= n1;   // packed rows: the hardware's prefetch
      block_digits(nb, q, Kp, wr, K, out, pf ? w + (n + ahead) * K : nullptr, packed);
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
        for (int j = 0; j < nb; ++j) {
          if (!packed) {
            vs[j] = dot_f64(wr[j], xr, K);
            continue;
          }
          for (int64_t k = 0; k < K; ++k)   // in order, as dot_f64 (the group's rows: [nb, K])
            vs[j] += double(wr[0][packed_offset(nb, K, j, k)]) * double(xr[k]);
        }
        v = _mm256_load_pd(vs);
      }
      _mm_mask_storeu_ps(y + r * ldy + n, lanes, _mm256_cvtpd_ps(_mm256_fmadd_pd(sc, v, b)));
    }
  }
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
