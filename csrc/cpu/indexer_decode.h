// The indexer's scores for one query against a run of keys, without a GEMM:
//   out[t] = sum_h w[h] * relu(q[h,:] . k[t,:]),  q [H,D], k [n,D] row-major.
//
// Why: at decode (one query, H=8 heads) the scores are a [H x D] by [D x n]
// product with n in the thousands. MKL's sgemm packs the key chunk (a
// transposed copy of all of it) on every call, and that copy took 4x the
// multiply's time (perf: 45% of indexer_topk in sgemm_scopy_right16 against
// 12% in the kernel, T=16,384). Here 16 keys at a time are transposed in
// registers into a D x 16 block in L1, and each head's 16 dot products are D
// FMAs of a broadcast q[h,d] against the block's row d: no packing pass, no
// horizontal sums, relu and the head weights applied before the 16 scores
// are stored. fp32 throughout; the order over d is fixed (one chain per head
// and key), so a query's scores do not depend on other queries or threads.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace glm5 {
namespace cpu {
namespace indexer_decode {

#if defined(__AVX512F__)
constexpr bool kAvailable = true;
constexpr int64_t kMaxDim = 512;   // the L1 block is kMaxDim x 16 floats (32 KiB)
constexpr int64_t kPrefetchKeys = 16;   // the next block (measured best of 16, 32, 64, 128, 256 keys ahead)

// 16 rows of 16 floats (rows[i] at src + i * stride, masked to `dm`; rows at
// and past `nrows` read as zeros) transposed into dst[j * 16 + i]. Unrolled so
// that the 16 rows stay in registers (a loop left them on the stack and copied
// them out with rep movs: 12% of the kernel).
inline void transpose16(const float* src, int64_t stride, int64_t nrows, __mmask16 dm, float* dst) {
  __m512 r[16], t[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = i < nrows ? _mm512_maskz_loadu_ps(dm, src + i * stride) : _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
#pragma GCC unroll 2
  for (int i = 0; i < 16; i += 8)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
    }
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    _mm512_store_ps(dst + j * 16, _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88));
    _mm512_store_ps(dst + (j + 8) * 16, _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd));
  }
}

// total += sum over heads [h0, h0 + HS) of w[h] * relu(q[h,:] . block's 16 keys).
template <int HS>
inline __m512 head_group(const float* q, const float* w, int64_t h0, int64_t D, const float* block, __m512 total) {
  __m512 acc[HS];
  for (int j = 0; j < HS; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 kv = _mm512_load_ps(block + d * 16);
    for (int j = 0; j < HS; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[(h0 + j) * D + d]), kv, acc[j]);
  }
  for (int j = 0; j < HS; ++j)
    total = _mm512_fmadd_ps(_mm512_set1_ps(w[h0 + j]), _mm512_max_ps(acc[j], _mm512_setzero_ps()), total);
  return total;
}

// out[0..n) for keys k[0..n) (row stride D); D <= kMaxDim.
inline void scores(const float* q, const float* w, int64_t H, int64_t D, const float* k, int64_t n, float* out) {
  alignas(64) float block[(kMaxDim + 16) * 16];   // rows past D (a tail block's zeros) are written, never read
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int64_t keys = std::min<int64_t>(16, n - t0);
    // The next block's keys, one line at a time: the transposing reads (a
    // line of each of 16 rows, then the next line of each) do not look like a
    // stream to the hardware prefetcher. Cold keys (D=64, H=8, 8,192 keys on
    // one thread): 365 us without, 136 with; 108 us from L2.
    if (t0 + kPrefetchKeys + 16 <= n) {
      const char* ahead = reinterpret_cast<const char*>(k + (t0 + kPrefetchKeys) * D);
      for (int64_t b = 0; b < 16 * D * int64_t(sizeof(float)); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    }
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      const int64_t dims = std::min<int64_t>(16, D - d0);
      transpose16(k + t0 * D + d0, D, keys, dims == 16 ? __mmask16(0xffff) : __mmask16((1u << dims) - 1u),
                  block + d0 * 16);
    }
    __m512 total = _mm512_setzero_ps();
    int64_t h0 = 0;
    for (; h0 + 8 <= H; h0 += 8) total = head_group<8>(q, w, h0, D, block, total);
    for (; h0 < H; ++h0) total = head_group<1>(q, w, h0, D, block, total);
    _mm512_mask_storeu_ps(out + t0, keys == 16 ? __mmask16(0xffff) : __mmask16((1u << keys) - 1u), total);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 (x86-64-v3 builds): the same kernel on blocks of 8 keys. Without it the decode
// queries went through sgemm: indexer_scores 1.5x (4,096 keys) and 2.4x (16,384) slower on a
// Zen 3 (bench/RESULTS.md, "AVX2 hosts").
constexpr bool kAvailable = true;
constexpr int64_t kMaxDim = 512;       // the L1 block is kMaxDim x 8 floats (16 KiB)
constexpr int64_t kPrefetchKeys = 16;  // two blocks ahead

// 8 rows of 8 floats (rows[i] at src + i * stride, the first `dims` columns; rows at and
// past `nrows` and columns past `dims` read as zeros) transposed into dst[j * 8 + i].
inline void transpose8(const float* src, int64_t stride, int64_t nrows, int64_t dims, float* dst) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(dims)), lanes);
  __m256 r[8], t[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    r[i] = i >= nrows ? _mm256_setzero_ps()
                      : dims == 8 ? _mm256_loadu_ps(src + i * stride) : _mm256_maskload_ps(src + i * stride, mask);
#pragma GCC unroll 4
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 8; i += 4) {   // per 128-bit half: columns c and c + 4 of rows i..i+3
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    _mm256_store_ps(dst + j * 8, _mm256_permute2f128_ps(r[j], r[j + 4], 0x20));
    _mm256_store_ps(dst + (j + 4) * 8, _mm256_permute2f128_ps(r[j], r[j + 4], 0x31));
  }
}

// total += sum over heads [h0, h0 + HS) of w[h] * relu(q[h,:] . block's 8 keys).
template <int HS>
inline __m256 head_group(const float* q, const float* w, int64_t h0, int64_t D, const float* block, __m256 total) {
  __m256 acc[HS];
  for (int j = 0; j < HS; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 kv = _mm256_load_ps(block + d * 8);
    for (int j = 0; j < HS; ++j) acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(q[(h0 + j) * D + d]), kv, acc[j]);
  }
  for (int j = 0; j < HS; ++j)
    total = _mm256_fmadd_ps(_mm256_set1_ps(w[h0 + j]), _mm256_max_ps(acc[j], _mm256_setzero_ps()), total);
  return total;
}

// out[0..n) for keys k[0..n) (row stride D); D <= kMaxDim.
inline void scores(const float* q, const float* w, int64_t H, int64_t D, const float* k, int64_t n, float* out) {
  alignas(32) float block[(kMaxDim + 8) * 8];   // rows past D (a tail block's zeros) are written, never read
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    const int64_t keys = std::min<int64_t>(8, n - t0);
    if (t0 + kPrefetchKeys + 8 <= n) {   // as above: the transposing reads are no stream
      const char* ahead = reinterpret_cast<const char*>(k + (t0 + kPrefetchKeys) * D);
      for (int64_t b = 0; b < 8 * D * int64_t(sizeof(float)); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    }
    for (int64_t d0 = 0; d0 < D; d0 += 8) transpose8(k + t0 * D + d0, D, keys, std::min<int64_t>(8, D - d0), block + d0 * 8);
    __m256 total = _mm256_setzero_ps();
    int64_t h0 = 0;
    for (; h0 + 8 <= H; h0 += 8) total = head_group<8>(q, w, h0, D, block, total);
    for (; h0 < H; ++h0) total = head_group<1>(q, w, h0, D, block, total);
    if (keys == 8) {
      _mm256_storeu_ps(out + t0, total);
    } else {
      alignas(32) float tail[8];
      _mm256_store_ps(tail, total);
      std::copy_n(tail, keys, out + t0);
    }
  }
}
#else
constexpr bool kAvailable = false;
constexpr int64_t kMaxDim = 0;
inline void scores(const float*, const float*, int64_t, int64_t, const float*, int64_t, float*) {}
#endif

}  // namespace indexer_decode
}  // namespace cpu
}  // namespace glm5
