// Matrix-vector tiles for decode: y[m, n] = x[m, :] . w[n, :] with few rows
// m and weights w[N, K] in fp32, bf16 or int8 (csrc/cpu/gemv.cpp, int8.cpp),
// read once from memory.
//
// With one activation row the weight matrix is the whole traffic and each
// weight element is used once, so the kernel is a stream: a tile reads NB
// weight rows side by side (NB independent FMA chains per activation row,
// enough to cover the FMA latency) and multiplies each 16-wide weight vector
// into MB activation rows while it sits in a register. Activations are fp32
// (the caller widens a bf16 x once: M*K elements against N*K weights).
//
// Every (m, n) pair has exactly one accumulator chain over k, in steps of 16
// with a masked tail, reduced by one fixed sequence. So y[m, n] is bit-for-bit
// the same whatever M, NB, MB or the thread split are: a row's result does not
// depend on the other rows of the batch (a lone request and the same request
// in a busy serving batch see the same numbers).
#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace glm5 {
namespace cpu {
namespace gemv {

using bf16_bits = uint16_t;   // bf16 as stored: the high half of an fp32

// bf16 weights are read 32 at a time as 16 32-bit lanes: lane i holds element
// 2i in its low half and 2i+1 in its high half, so `lane << 16` and
// `lane & 0xffff0000` are the even and odd elements as fp32 (two plain ALU
// ops, no shuffle). The activations are laid out to match: per block of 32,
// the 16 even elements then the 16 odd ones (split_pairs), zero-padded to a
// multiple of 32.
// Weight rows of at most this many bytes get a later tile prefetched by
// software (see rows()); longer rows stream well enough on their own, and the
// extra prefetches measured a few % slower there (noisy shared host), except the
// one-row path's rows (kOneRowMaxRowBytes) with AVX-512, prefetched non-temporally.
constexpr int64_t kPrefetchMaxRowBytes = 2048;
constexpr int64_t kPrefetchMinBytes = 8192;   // 8 KiB ahead measured best of 1 tile, 8, 16 and 32 KiB
// One fp32 activation row against weight rows longer than kPrefetchMaxRowBytes and at most
// this long (K = 513..1024: the LM head, the dense MLP's gate/up, most projections): rows are
// read one after another, one sequential stream per thread, not 8 side by side. In one process
// alternating the two (2 threads, weights cycled through 600 MB): 1024 x 1024 27.3 -> 30.4 GB/s,
// 5632 x 1024 24.8 -> 28.1, 32000 x 1024 25.8 -> 28.0 (14, 14 and 11 of 15 blocks faster); at
// 1024 x 2816 (11 KiB rows) 29.3 -> 25.8, so longer rows keep the 8-row tiles.
constexpr int64_t kOneRowMaxRowBytes = 4096;

inline int64_t split_len(int64_t K) { return (K + 31) / 32 * 32; }

inline void split_pairs(const float* x, int64_t K, float* out) {
  for (int64_t k0 = 0; k0 < K; k0 += 32)
    for (int64_t i = 0; i < 16; ++i) {
      out[k0 + i] = k0 + 2 * i < K ? x[k0 + 2 * i] : 0.f;
      out[k0 + 16 + i] = k0 + 2 * i + 1 < K ? x[k0 + 2 * i + 1] : 0.f;
    }
}

#if defined(__AVX512F__)

template <int NB, int MB>
inline void tile(const float* const* x, const float* const* w, int64_t K, float (*out)[4], const char* pf) {
  __m512 acc[NB][MB];
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) acc[n][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NB];
    for (int n = 0; n < NB; ++n) {
      wv[n] = _mm512_loadu_ps(w[n] + k);
      // One row (NB = 1: only the one-row path prefetches it): non-temporal, 1.09-1.15x on
      // 1024- and 5632-row matrices of 4 KiB rows against no prefetch; 8-row tiles of 2 KiB
      // rows keep T0 (NTA 0.95x there; bench/RESULTS.md, "Non-temporal prefetch").
      if (pf) {
        if constexpr (NB == 1) _mm_prefetch(pf + (k / 16 * NB + n) * 64, _MM_HINT_NTA);
        else _mm_prefetch(pf + (k / 16 * NB + n) * 64, _MM_HINT_T0);
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(x[m] + k);
      for (int n = 0; n < NB; ++n) acc[n][m] = _mm512_fmadd_ps(wv[n], xv, acc[n][m]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = _mm512_maskz_loadu_ps(mask, w[n] + k);
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x[m] + k);
      for (int n = 0; n < NB; ++n) acc[n][m] = _mm512_fmadd_ps(wv[n], xv, acc[n][m]);
    }
  }
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) out[n][m] = _mm512_reduce_add_ps(acc[n][m]);
}

// int8 weights (per-row scales applied by the caller): 16 widened to fp32 per step.
template <int NB, int MB>
inline void tile(const float* const* x, const int8_t* const* w, int64_t K, float (*out)[4], const char* pf) {
  __m512 acc[NB][MB];
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) acc[n][m] = _mm512_setzero_ps();
  auto widen = [](__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); };
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NB];
    for (int n = 0; n < NB; ++n) {
      wv[n] = widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[n] + k)));
      if (pf && (k & 63) == 0) _mm_prefetch(pf + (k / 64 * NB + n) * 64, _MM_HINT_T0);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(x[m] + k);
      for (int n = 0; n < NB; ++n) acc[n][m] = _mm512_fmadd_ps(wv[n], xv, acc[n][m]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = widen(_mm_maskz_loadu_epi8(mask, w[n] + k));
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x[m] + k);
      for (int n = 0; n < NB; ++n) acc[n][m] = _mm512_fmadd_ps(wv[n], xv, acc[n][m]);
    }
  }
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) out[n][m] = _mm512_reduce_add_ps(acc[n][m]);
}

// x: split_pairs layout (K padded to split_len(K)).
template <int NB, int MB>
inline void tile(const float* const* x, const bf16_bits* const* w, int64_t K, float (*out)[4], const char* pf) {
  __m512 acc[NB][MB];
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) acc[n][m] = _mm512_setzero_ps();
  const __m512i hi = _mm512_set1_epi32(int(0xffff0000u));
  auto pair = [&](int n, __m512i v, int64_t k) {
    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
    for (int m = 0; m < MB; ++m) {
      acc[n][m] = _mm512_fmadd_ps(even, _mm512_loadu_ps(x[m] + k), acc[n][m]);
      acc[n][m] = _mm512_fmadd_ps(odd, _mm512_loadu_ps(x[m] + k + 16), acc[n][m]);
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32)   // plain loads: a masked 16-bit load measured slower on full blocks
    for (int n = 0; n < NB; ++n) {
      pair(n, _mm512_loadu_si512(w[n] + k), k);
      // non-temporal: 1.02-1.04x against T0 (bench/RESULTS.md, "Non-temporal prefetch")
      if (pf) _mm_prefetch(pf + (k / 32 * NB + n) * 64, _MM_HINT_NTA);
    }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1u);
    for (int n = 0; n < NB; ++n) pair(n, _mm512_maskz_loadu_epi16(mask, w[n] + k), k);
  }
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) out[n][m] = _mm512_reduce_add_ps(acc[n][m]);
}

#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 (x86-64-v3 builds: Zen 3, Haswell..Ice Lake client): 16 ymm registers, so each
// (m, n) pair's chain is 8 lanes wide, and tiles whose accumulators would not fit run
// their weight rows in two passes (see tile). The fixed order holds the same way: one
// chain per (m, n) in steps of 8 with a zero-padded tail, reduced by one sequence, so a
// row's result does not depend on M, NB, MB or the thread split. (Without this section
// the portable loops below ran bf16 at ~9% and int8 at ~15% of the read bandwidth on
// a Zen 3, against ~50% for fp32: bench/RESULTS.md, "AVX2 decode tiles".)

inline float reduce8(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// G weight rows of a tile of NB (the prefetch covers all NB rows: one line per line read).
template <int G, int MB, int NB, typename W>
inline void pass(const float* const* x, const W* const* w, int64_t K, float (*out)[4], const char* pf) {
  constexpr int64_t kLine = 64 / int64_t(sizeof(W));   // weight elements per 64-byte line
  __m256 acc[G][MB];
  for (int n = 0; n < G; ++n)
    for (int m = 0; m < MB; ++m) acc[n][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (pf && k % kLine == 0)
      for (int n = 0; n < NB; ++n) _mm_prefetch(pf + (k / kLine * NB + n) * 64, _MM_HINT_T0);
    __m256 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x[m] + k);
    for (int n = 0; n < G; ++n) {
      const __m256 wv = load8(w[n] + k);
      for (int m = 0; m < MB; ++m) acc[n][m] = _mm256_fmadd_ps(wv, xv[m], acc[n][m]);
    }
  }
  if (k < K) {   // the tail through zero-padded copies (x rows are not padded)
    alignas(32) W wt[8] = {};
    alignas(32) float xt[MB][8] = {};
    for (int m = 0; m < MB; ++m) std::copy(x[m] + k, x[m] + K, xt[m]);
    for (int n = 0; n < G; ++n) {
      std::copy(w[n] + k, w[n] + K, wt);
      const __m256 wv = load8(wt);
      for (int m = 0; m < MB; ++m) acc[n][m] = _mm256_fmadd_ps(wv, _mm256_load_ps(xt[m]), acc[n][m]);
    }
  }
  for (int n = 0; n < G; ++n)
    for (int m = 0; m < MB; ++m) out[n][m] = reduce8(acc[n][m]);
}

// fp32 and int8 weights (int8: per-row scales applied by the caller).
template <int NB, int MB, typename W, typename = std::enable_if_t<!std::is_same_v<W, bf16_bits>>>
inline void tile(const float* const* x, const W* const* w, int64_t K, float (*out)[4], const char* pf) {
  constexpr int G = NB * MB > 12 ? NB / 2 : NB;   // accumulators + activations within 16 registers
  pass<G, MB, NB>(x, w, K, out, pf);
  if constexpr (G < NB) pass<G, MB, NB>(x, w + G, K, out + G, nullptr);
}

// bf16 weights, x in split_pairs layout (padded to split_len(K) with zeros): 16 weights
// a step as 8 32-bit lanes, the even elements (lane << 16) against x's even half of the
// block of 32, then the odd ones (lane & 0xffff0000) against its odd half.
template <int G, int MB, int NB>
inline void pass_bf16(const float* const* x, const bf16_bits* const* w, int64_t K, float (*out)[4], const char* pf) {
  __m256 acc[G][MB];
  for (int n = 0; n < G; ++n)
    for (int m = 0; m < MB; ++m) acc[n][m] = _mm256_setzero_ps();
  const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
  auto step = [&](int n, __m256i v, int64_t k) {
    const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
    const int64_t e = k / 32 * 32 + (k % 32) / 2;   // x's even elements of k..k+15; the odd 16 later
    for (int m = 0; m < MB; ++m) {
      acc[n][m] = _mm256_fmadd_ps(even, _mm256_loadu_ps(x[m] + e), acc[n][m]);
      acc[n][m] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(x[m] + e + 16), acc[n][m]);
    }
  };
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if (pf && k % 32 == 0)
      for (int n = 0; n < NB; ++n) _mm_prefetch(pf + (k / 32 * NB + n) * 64, _MM_HINT_T0);
    for (int n = 0; n < G; ++n) step(n, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[n] + k)), k);
  }
  if (k < K) {
    alignas(32) bf16_bits wt[16] = {};
    for (int n = 0; n < G; ++n) {
      std::copy(w[n] + k, w[n] + K, wt);
      step(n, _mm256_load_si256(reinterpret_cast<const __m256i*>(wt)), k);
    }
  }
  for (int n = 0; n < G; ++n)
    for (int m = 0; m < MB; ++m) out[n][m] = reduce8(acc[n][m]);
}

template <int NB, int MB>
inline void tile(const float* const* x, const bf16_bits* const* w, int64_t K, float (*out)[4], const char* pf) {
  constexpr int G = NB * MB > 8 ? NB / 2 : NB;   // each weight step feeds 2 FMAs per row
  pass_bf16<G, MB, NB>(x, w, K, out, pf);
  if constexpr (G < NB) pass_bf16<G, MB, NB>(x, w + G, K, out + G, nullptr);
}

#else  // portable: the same chains, 16 lanes in arrays (the compiler vectorises them)

inline void reduce16(const float* lanes, float& out) {   // pairwise, like a vector reduction
  float s[16];
  for (int l = 0; l < 16; ++l) s[l] = lanes[l];
  for (int w2 = 8; w2 >= 1; w2 /= 2)
    for (int l = 0; l < w2; ++l) s[l] += s[l + w2];
  out = s[0];
}

template <int NB, int MB, typename W, typename = std::enable_if_t<!std::is_same_v<W, bf16_bits>>>
inline void tile(const float* const* x, const W* const* w, int64_t K, float (*out)[4], const char*) {
  float acc[NB][MB][16] = {};
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    const int64_t len = K - k0 < 16 ? K - k0 : 16;
    for (int n = 0; n < NB; ++n)
      for (int m = 0; m < MB; ++m)
        for (int64_t l = 0; l < len; ++l) acc[n][m][l] += float(w[n][k0 + l]) * x[m][k0 + l];
  }
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) reduce16(acc[n][m], out[n][m]);
}

inline float bf16_to_float(bf16_bits v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <int NB, int MB>
inline void tile(const float* const* x, const bf16_bits* const* w, int64_t K, float (*out)[4], const char* pf) {
  float acc[NB][MB][16] = {};
  for (int64_t k0 = 0; k0 < K; k0 += 32)
    for (int n = 0; n < NB; ++n)
      for (int m = 0; m < MB; ++m)
        for (int l = 0; l < 16; ++l) {
          const float we = k0 + 2 * l < K ? bf16_to_float(w[n][k0 + 2 * l]) : 0.f;
          const float wo = k0 + 2 * l + 1 < K ? bf16_to_float(w[n][k0 + 2 * l + 1]) : 0.f;
          acc[n][m][l] += we * x[m][k0 + l];
          acc[n][m][l] += wo * x[m][k0 + 16 + l];
        }
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) reduce16(acc[n][m], out[n][m]);
}

#endif

template <typename W>
inline void tile_any(int nb, int mb, const float* const* x, const W* const* w, int64_t K, float (*out)[4],
                     const char* pf = nullptr) {
  switch (nb * 8 + mb) {
    case 8 * 8 + 1: tile<8, 1>(x, w, K, out, pf); break;
    case 8 * 8 + 2: tile<8, 2>(x, w, K, out, pf); break;
    case 4 * 8 + 1: tile<4, 1>(x, w, K, out, pf); break;
    case 4 * 8 + 2: tile<4, 2>(x, w, K, out, pf); break;
    case 4 * 8 + 3: tile<4, 3>(x, w, K, out, pf); break;
    case 4 * 8 + 4: tile<4, 4>(x, w, K, out, pf); break;
    case 1 * 8 + 1: tile<1, 1>(x, w, K, out, pf); break;
    case 1 * 8 + 2: tile<1, 2>(x, w, K, out, pf); break;
    case 1 * 8 + 3: tile<1, 3>(x, w, K, out, pf); break;
    default: tile<1, 4>(x, w, K, out, pf); break;
  }
}

// y[m * ldy + n] = (x[m] . w[n]) * (scale ? scale[n] : 1) + (bias ? bias[n] : 0)
// for m < M, n in [n0, n1). w [N, K] contiguous rows (fp32, int8, or bf16 bits
// with x in split_pairs layout, row stride ldx = split_len(K)); x fp32 [M, ldx].
// One or two activation rows (decode): 8 weight rows per tile, 8 streams and
// 8-16 independent chains (one fp32 row against 2-4 KiB weight rows: one weight row
// at a time, see kOneRowMaxRowBytes). More rows: 4 x 4 tiles (fewer loads per FMA), the
// 4 weight rows staying in L1/L2 while each block of 4 activation rows reuses them.
template <typename W>
void rows(const float* x, int64_t ldx, int64_t M, int64_t K, const W* w, const float* scale, const float* bias,
          int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const bool wide = M <= 2;
  const int64_t row_bytes = K * int64_t(sizeof(W));
  const bool one_row = std::is_same_v<W, float> && M == 1 && row_bytes > kPrefetchMaxRowBytes &&
                       row_bytes <= kOneRowMaxRowBytes;   // same single chain per (m, n): same bits
  const int NB = one_row ? 1 : wide ? 8 : 4, MBmax = wide ? 2 : 4;
  // The next tile's rows (contiguous) are prefetched one line per line read: rows of a
  // few KiB are too short a stream for the hardware prefetcher, and with AVX-512 (where
  // it was measured) the one-row path's single stream gains from it too (as NTA: see
  // tile). The distance is at least kPrefetchMinBytes, so tiles of short rows look
  // several tiles ahead.
#if defined(__AVX512F__)
  const bool ahead_pays = K > 0 && (row_bytes <= kPrefetchMaxRowBytes || one_row);
#else
  const bool ahead_pays = K > 0 && row_bytes <= kPrefetchMaxRowBytes;
#endif
  const int64_t ahead = ahead_pays ? NB * ((kPrefetchMinBytes / int64_t(sizeof(W)) + NB * K - 1) / (NB * K)) : 0;
  float out[8][4];
  for (int64_t n = n0; n < n1; n += NB) {
    const int nb = n1 - n < NB ? int(n1 - n) : NB;
    const W* wr[8];
    for (int j = 0; j < nb; ++j) wr[j] = w + (n + j) * K;
    for (int64_t m0 = 0; m0 < M; m0 += MBmax) {
      const int mb = M - m0 < MBmax ? int(M - m0) : MBmax;
      const float* xr[4];
      for (int j = 0; j < mb; ++j) xr[j] = x + (m0 + j) * ldx;
      const bool prefetch = m0 == 0 && ahead_pays && n + NB + ahead <= n1;
      if (nb == NB)
        tile_any(NB, mb, xr, wr, K, out, prefetch ? reinterpret_cast<const char*>(w + (n + ahead) * K) : nullptr);
      else
        for (int j = 0; j < nb; ++j) tile_any(1, mb, xr, wr + j, K, out + j);
      for (int j = 0; j < nb; ++j) {
        const float b = bias ? bias[n + j] : 0.f;
        const float sc = scale ? scale[n + j] : 1.f;
        for (int i = 0; i < mb; ++i) y[(m0 + i) * ldy + n + j] = (scale ? out[j][i] * sc : out[j][i]) + b;
      }
    }
  }
}

constexpr int64_t kGemvMaxRows = 16;               // at most this many activation rows take a GEMV
                                                   // path: above it a GEMM reuses each weight row
constexpr int64_t kParallelTileRows = 8;           // weight rows per work item (the widest tile)
constexpr int64_t kMinBytesPerThread = 1 << 16;    // below this a second thread costs more than it reads

// rows() over all N weight rows of H heads (1 without heads), split between the threads:
// head h's x rows at x + h*M*ldx, its weight rows at w + h*ws (contiguous within the
// head), its row scales (int8 weights; or null) at scale + h*ss, its y at y + h*M*N.
// The flat list of (head, row tile) items is split in contiguous ranges, so each thread
// streams its own range of weight rows once.
template <typename W>
void rows_parallel(const float* x, int64_t ldx, int64_t H, int64_t M, int64_t K, const W* w, int64_t ws,
                   const float* scale, int64_t ss, const float* bias, int64_t N, float* y) {
  const int64_t per_head = (N + kParallelTileRows - 1) / kParallelTileRows;
  const int64_t tile_bytes = kParallelTileRows * std::max<int64_t>(K, 1) * int64_t(sizeof(W));
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / tile_bytes);
  at::parallel_for(0, H * per_head, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1;) {
      const int64_t h = t / per_head, end = std::min(t1, (h + 1) * per_head);
      rows<W>(x + h * M * ldx, ldx, M, K, w + h * ws, scale ? scale + h * ss : nullptr, bias,
              (t - h * per_head) * kParallelTileRows,
              std::min(N, (end - h * per_head) * kParallelTileRows), y + h * M * N, N);
      t = end;
    }
  });
}

}  // namespace gemv
}  // namespace cpu
}  // namespace glm5
