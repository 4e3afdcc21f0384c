// Register-blocked fp32 micro-kernels shared by the CPU attention kernels.
//
// Sparse attention never has a dense K matrix: the keys of a tile are rows
// scattered through k (the selected tokens), so every kernel here takes an
// array of row pointers instead of a leading dimension. That lets the fp32
// kernels read k and v in place (no gather copy; the hardware prefetcher
// streams each 4*D-byte row) and makes token-level and block-sparse tiles one
// code path. Three products cover forward and backward:
//   dots:    C[i][j]  = sum_d A[i][d] * R_j[d]        (S = Q K^T, dP = dO V^T)
//   gather:  C[i][:] += sum_j W[i][j] * R_j[:]        (O += P V, dQ += dS K)
//   scatter: R_j[:]  += sum_i W[i][j] * A[i][:]       (dK += dS^T Q, dV += P^T dO)
// Blocking: 4 x 2 (dots: 4 rows of R, 2 rows of A, a vector of D each) or
// 4 rows x 2 vectors of output (gather/scatter) keep 8 accumulators plus the
// operands inside the 16 AVX2 registers, so the loops are FMA-bound.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace glm5 {
namespace cpu {
namespace tiles {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

inline float hsum(const Vec& v) {
  alignas(64) float buf[W];
  v.store(buf);
  float s = 0.f;
  for (int64_t i = 0; i < W; ++i) s += buf[i];
  return s;
}

inline Vec load(const float* p, int64_t n) { return n >= W ? Vec::loadu(p) : Vec::loadu(p, n); }

// Horizontal sums of 2 x 4 accumulators, stored to c0[0..4) and c1[0..4).
// With AVX2 one hadd tree reduces all eight (~10 instructions instead of
// eight separate reductions, which would cost as much as the dot products).
inline void store_sums_2x4(const Vec* a, const Vec* b, float* c0, float* c1) {
#if (defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)) && defined(__AVX2__)
#if defined(CPU_CAPABILITY_AVX512)
  // Fold each 16-lane accumulator to 8 lanes first (lower + upper half).
  auto h = [](const Vec& v) {
    const __m512 x = v;
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  };
#else
  auto h = [](const Vec& v) { return static_cast<__m256>(v); };
#endif
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(h(a[0]), h(a[1])), _mm256_hadd_ps(h(a[2]), h(a[3])));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(h(b[0]), h(b[1])), _mm256_hadd_ps(h(b[2]), h(b[3])));
  const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  _mm_storeu_ps(c0, _mm256_castps256_ps128(r));
  _mm_storeu_ps(c1, _mm256_extractf128_ps(r, 1));
#else
  for (int r = 0; r < 4; ++r) c0[r] = hsum(a[r]), c1[r] = hsum(b[r]);
#endif
}

// C[i * ldc + j] = sum_d A[i * lda + d] * R[j][d] for i < M, j < N, d < D.
// Blocks of 2 rows of A x 4 rows of R: 8 accumulators, 6 loads per 8 FMAs.
inline void dots(const float* A, int64_t lda, int64_t M, const float* const* R, int64_t N, int64_t D, float* C,
                 int64_t ldc) {
  const int64_t Dfull = D - D % W;
  int64_t j = 0;
  for (; j + 4 <= N; j += 4) {
    const float* r[4] = {R[j], R[j + 1], R[j + 2], R[j + 3]};
    for (int64_t i = 0; i < M; i += 2) {
      const bool two = i + 1 < M;
      const float* a0 = A + i * lda;
      const float* a1 = two ? a0 + lda : a0;  // a lone last row computes itself twice
      Vec c0[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)}, c1[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
      auto step = [&](const Vec& x0, const Vec& x1, int64_t d, int64_t n) {
        for (int q = 0; q < 4; ++q) {
          const Vec kv = n == W ? Vec::loadu(r[q] + d) : Vec::loadu(r[q] + d, n);
          c0[q] = at::vec::fmadd(x0, kv, c0[q]);
          c1[q] = at::vec::fmadd(x1, kv, c1[q]);
        }
      };
      for (int64_t d = 0; d < Dfull; d += W) step(Vec::loadu(a0 + d), Vec::loadu(a1 + d), d, W);
      if (Dfull < D) step(Vec::loadu(a0 + Dfull, D - Dfull), Vec::loadu(a1 + Dfull, D - Dfull), Dfull, D - Dfull);
      float tmp[4];
      store_sums_2x4(c0, c1, C + i * ldc + j, two ? C + (i + 1) * ldc + j : tmp);
    }
  }
  for (; j < N; ++j) {
    const float* r = R[j];
    for (int64_t i = 0; i < M; ++i) {
      const float* a = A + i * lda;
      Vec c(0.f);
      for (int64_t d = 0; d < D; d += W) c = at::vec::fmadd(load(a + d, D - d), load(r + d, D - d), c);
      C[i * ldc + j] = hsum(c);
    }
  }
}

// Transposed scores for many heads: C[j * ldc + h] = sum_d AT[d * lda + h] * R[j][d]
// for j < N and h < Mp, where AT is A transposed ([D][Mp], Mp a multiple of W,
// padding heads zero). Vectorised across heads, each key element is broadcast
// once per vector of heads: no horizontal sums, 9 loads per 8 FMAs. This is
// the shape MQA/MLA queries have (G = Hq/Hkv >= W heads share every key).
// Two vectors of heads at once (Mp >= 2W): 8 keys x 2 vectors, 16 accumulators;
// per d, 2 loads and 8 broadcasts feed 16 FMAs instead of 9 loads feeding 8.
inline void dots_t2(const float* AT, int64_t lda, int64_t h, const float* const* R, int64_t N, int64_t D, float* C,
                    int64_t ldc) {
  int64_t j = 0;
  for (; j + 8 <= N; j += 8) {
    const float* r[8];
    Vec c0[8], c1[8];
    for (int q = 0; q < 8; ++q) r[q] = R[j + q], c0[q] = Vec(0.f), c1[q] = Vec(0.f);
    int64_t d = 0;
    for (; d + 2 <= D; d += 2) {
      const float* at = AT + d * lda + h;
      const Vec a0 = Vec::loadu(at), a1 = Vec::loadu(at + W), b0 = Vec::loadu(at + lda), b1 = Vec::loadu(at + lda + W);
      for (int q = 0; q < 8; ++q) {
        const Vec x0(r[q][d]), x1(r[q][d + 1]);
        c0[q] = at::vec::fmadd(x0, a0, c0[q]);
        c1[q] = at::vec::fmadd(x0, a1, c1[q]);
        c0[q] = at::vec::fmadd(x1, b0, c0[q]);
        c1[q] = at::vec::fmadd(x1, b1, c1[q]);
      }
    }
    for (; d < D; ++d) {
      const Vec a0 = Vec::loadu(AT + d * lda + h), a1 = Vec::loadu(AT + d * lda + h + W);
      for (int q = 0; q < 8; ++q) {
        const Vec x(r[q][d]);
        c0[q] = at::vec::fmadd(x, a0, c0[q]);
        c1[q] = at::vec::fmadd(x, a1, c1[q]);
      }
    }
    for (int q = 0; q < 8; ++q) c0[q].store(C + (j + q) * ldc + h), c1[q].store(C + (j + q) * ldc + h + W);
  }
  for (; j < N; ++j) {
    Vec c0(0.f), c1(0.f);
    for (int64_t d = 0; d < D; ++d) {
      const Vec x(R[j][d]);
      c0 = at::vec::fmadd(x, Vec::loadu(AT + d * lda + h), c0);
      c1 = at::vec::fmadd(x, Vec::loadu(AT + d * lda + h + W), c1);
    }
    c0.store(C + j * ldc + h), c1.store(C + j * ldc + h + W);
  }
}

inline void dots_t(const float* AT, int64_t lda, int64_t Mp, const float* const* R, int64_t N, int64_t D, float* C,
                   int64_t ldc) {
  int64_t h0 = 0;
  if (W >= 16)  // AVX-512: 32 registers hold the 16 accumulators
    for (; h0 + 2 * W <= Mp; h0 += 2 * W) dots_t2(AT, lda, h0, R, N, D, C, ldc);
  for (int64_t h = h0; h < Mp; h += W) {
    int64_t j = 0;
    for (; j + 8 <= N; j += 8) {
      const float* r[8];
      Vec c[8];
      for (int q = 0; q < 8; ++q) r[q] = R[j + q], c[q] = Vec(0.f);
      // Four d per pass: the eight row pointers do not fit the general
      // registers beside the loop state, and reloading each one per d
      // (a vector-to-GPR move on the FMA port) halved the FMA rate.
      int64_t d = 0;
      for (; d + 4 <= D; d += 4) {
        const float* at = AT + d * lda + h;
        const Vec a0 = Vec::loadu(at), a1 = Vec::loadu(at + lda), a2 = Vec::loadu(at + 2 * lda),
                  a3 = Vec::loadu(at + 3 * lda);
        for (int q = 0; q < 8; ++q) {
          const float* x = r[q] + d;
          c[q] = at::vec::fmadd(Vec(x[0]), a0, c[q]);
          c[q] = at::vec::fmadd(Vec(x[1]), a1, c[q]);
          c[q] = at::vec::fmadd(Vec(x[2]), a2, c[q]);
          c[q] = at::vec::fmadd(Vec(x[3]), a3, c[q]);
        }
      }
      for (; d < D; ++d) {
        const Vec a = Vec::loadu(AT + d * lda + h);
        for (int q = 0; q < 8; ++q) c[q] = at::vec::fmadd(Vec(r[q][d]), a, c[q]);
      }
      for (int q = 0; q < 8; ++q) c[q].store(C + (j + q) * ldc + h);
    }
    for (; j < N; ++j) {
      const float* r = R[j];
      Vec c(0.f);
      for (int64_t d = 0; d < D; ++d) c = at::vec::fmadd(Vec(r[d]), Vec::loadu(AT + d * lda + h), c);
      c.store(C + j * ldc + h);
    }
  }
}

// Asks for rows[j][0..D) to be brought into L2 ahead of use: the selected
// rows of the next tile are scattered through k and v, where the hardware
// prefetcher cannot guess them, and fetching them costs about as long as the
// products over the current tile.
inline void prefetch_row(const float* row, int64_t D) {
  for (int64_t d = 0; d < D; d += 64 / sizeof(float)) __builtin_prefetch(row + d, 0, 2);  // one per cache line
}

inline void prefetch_rows(const float* const* rows, int64_t n, int64_t D) {
  for (int64_t j = 0; j < n; ++j) prefetch_row(rows[j], D);
}

// dots_t for at most W/2 heads on AVX-512: lanes [0, 8) of each output vector
// computed with 256-bit FMAs (half the work of a padded 16-lane dots_t), lanes
// [8, 16) stored as 0. Each lane is the same FMA chain over d = 0, 1, ..., D-1
// as in dots_t / dots_t2, so a head's score is bit-identical whichever
// computes it: the forward's head split at decode (sparse_attention.cpp) relies on that.
// With P, the np rows P[0..np) (D floats each, the next tile's) are
// prefetched while these compute: rows j..j+7 of P during keys j..j+7, two
// cache lines per pass over d. At decode the selected rows come from DRAM:
// asked for all at once (one tile: 1,152 lines, far more than a core keeps
// in flight), a cold call took 1.7x a warm one; spread, ~1.4x.
#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kHalfDots = true;
inline void dots_t_half(const float* AT, int64_t lda, const float* const* R, int64_t N, int64_t D, float* C,
                        int64_t ldc, const float* const* P = nullptr, int64_t np = 0) {
  static_assert(W == 16, "dots_t_half fills half of a 16-lane vector");
  auto store = [&](__m256 c, int64_t j) { _mm512_storeu_ps(C + j * ldc, _mm512_zextps256_ps512(c)); };
  const int64_t lines = (D + 15) / 16;  // cache lines of a row
  int64_t j = 0;
  for (; j + 8 <= N; j += 8) {
    const float* r[8];
    __m256 c[8];
    for (int q = 0; q < 8; ++q) r[q] = R[j + q], c[q] = _mm256_setzero_ps();
    // the prefetch cursor: row pr of P (up to row pe), line pl of it
    int64_t pr = j, pl = 0;
    const int64_t pe = std::min(j + 8, np);
    auto prefetch_next = [&] {
      if (pr >= pe) return;
      __builtin_prefetch(P[pr] + pl * 16, 0, 2);
      if (++pl == lines) pl = 0, ++pr;
    };
    int64_t d = 0;
    for (; d + 4 <= D; d += 4) {  // four d per pass, as dots_t (the row pointers' registers)
      prefetch_next();
      prefetch_next();
      const float* at = AT + d * lda;
      const __m256 a0 = _mm256_loadu_ps(at), a1 = _mm256_loadu_ps(at + lda), a2 = _mm256_loadu_ps(at + 2 * lda),
                   a3 = _mm256_loadu_ps(at + 3 * lda);
      for (int q = 0; q < 8; ++q) {
        const float* x = r[q] + d;
        c[q] = _mm256_fmadd_ps(_mm256_set1_ps(x[0]), a0, c[q]);
        c[q] = _mm256_fmadd_ps(_mm256_set1_ps(x[1]), a1, c[q]);
        c[q] = _mm256_fmadd_ps(_mm256_set1_ps(x[2]), a2, c[q]);
        c[q] = _mm256_fmadd_ps(_mm256_set1_ps(x[3]), a3, c[q]);
      }
    }
    for (; d < D; ++d) {
      const __m256 a = _mm256_loadu_ps(AT + d * lda);
      for (int q = 0; q < 8; ++q) c[q] = _mm256_fmadd_ps(_mm256_set1_ps(r[q][d]), a, c[q]);
    }
    while (pr < pe) prefetch_next();  // D not a multiple of 16: a partial line per row more than passes cover
    for (int q = 0; q < 8; ++q) store(c[q], j + q);
  }
  for (int64_t k = j; k < np; ++k) prefetch_row(P[k], D);  // the rows past the last block of 8
  for (; j < N; ++j) {
    __m256 c = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) c = _mm256_fmadd_ps(_mm256_set1_ps(R[j][d]), _mm256_loadu_ps(AT + d * lda), c);
    store(c, j);
  }
}
#else
constexpr bool kHalfDots = false;
inline void dots_t_half(const float*, int64_t, const float* const*, int64_t, int64_t, float*, int64_t,
                        const float* const* = nullptr, int64_t = 0) {
  TORCH_CHECK(false, "internal: dots_t_half needs AVX-512");
}
#endif

// Rows [i, i + Rows) of gather's AVX-512 path over columns [d, d + 4W):
// Rows x 4 accumulators in registers; per key 4 loads of R's row and Rows
// broadcasts of Wt feed 4 * Rows FMAs.
template <int Rows>
inline void gather_rows(const float* Wt, int64_t wi, int64_t wj, int64_t i, const float* const* R, int64_t N,
                        int64_t d, float* C, int64_t ldc, const float* row_scale) {
  Vec acc[Rows][4];
  for (int r = 0; r < Rows; ++r) {
    const Vec sc(row_scale ? row_scale[i + r] : 1.f);
    for (int v = 0; v < 4; ++v) acc[r][v] = Vec::loadu(C + (i + r) * ldc + d + v * W) * sc;
  }
  const float* w = Wt + i * wi;
  for (int64_t j = 0; j < N; ++j) {
    const float* row = R[j] + d;
    const Vec x0 = Vec::loadu(row), x1 = Vec::loadu(row + W), x2 = Vec::loadu(row + 2 * W), x3 = Vec::loadu(row + 3 * W);
    for (int r = 0; r < Rows; ++r) {
      const Vec p(w[r * wi + j * wj]);
      acc[r][0] = at::vec::fmadd(p, x0, acc[r][0]);
      acc[r][1] = at::vec::fmadd(p, x1, acc[r][1]);
      acc[r][2] = at::vec::fmadd(p, x2, acc[r][2]);
      acc[r][3] = at::vec::fmadd(p, x3, acc[r][3]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v].store(C + (i + r) * ldc + d + v * W);
}

// C[i * ldc + :D] += sum_j Wt[i * wi + j * wj] * R[j][:D] for i < M, j < N.
// With row_scale, C's row i is first multiplied by row_scale[i]: the online
// softmax's rescaling of O folded into the accumulators' load (a separate
// pass over O cost ~3% of a tile).
inline void gather(const float* Wt, int64_t wi, int64_t wj, int64_t M, const float* const* R, int64_t N, int64_t D,
                   float* C, int64_t ldc, const float* row_scale = nullptr) {
  auto scale = [&](int64_t i) { return Vec(row_scale ? row_scale[i] : 1.f); };
  if (W >= 16 && D % (4 * W) == 0 && M % 2 == 0) {
    // AVX-512 and whole 4-vector column chunks (D = 64, 128, 512, ...): blocks
    // of 6 rows x 4 vectors, 24 accumulators in the 32 registers (per key 4
    // loads and 6 broadcasts feed 24 FMAs; 4-row blocks: 2.5-3% slower
    // lane tiles), then 4- and 2-row blocks.
    for (int64_t d = 0; d < D; d += 4 * W) {
      int64_t i = 0;
      for (; i + 6 <= M; i += 6) gather_rows<6>(Wt, wi, wj, i, R, N, d, C, ldc, row_scale);
      for (; i + 4 <= M; i += 4) gather_rows<4>(Wt, wi, wj, i, R, N, d, C, ldc, row_scale);
      for (; i < M; i += 2) gather_rows<2>(Wt, wi, wj, i, R, N, d, C, ldc, row_scale);
    }
    return;
  }
  for (int64_t d = 0; d < D; d += 2 * W) {
    const int64_t n0 = std::min<int64_t>(W, D - d), n1 = std::max<int64_t>(0, std::min<int64_t>(W, D - d - W));
    int64_t i = 0;
    for (; i + 4 <= M; i += 4) {
      float* c[4] = {C + i * ldc + d, C + (i + 1) * ldc + d, C + (i + 2) * ldc + d, C + (i + 3) * ldc + d};
      const float* w[4] = {Wt + i * wi, Wt + (i + 1) * wi, Wt + (i + 2) * wi, Wt + (i + 3) * wi};
      Vec a0[4], a1[4];
      for (int r = 0; r < 4; ++r) {
        a0[r] = load(c[r], n0) * scale(i + r);
        a1[r] = n1 ? load(c[r] + W, n1) * scale(i + r) : Vec(0.f);
      }
      for (int64_t j = 0; j < N; ++j) {
        const Vec v0 = load(R[j] + d, n0), v1 = n1 ? load(R[j] + d + W, n1) : Vec(0.f);
        for (int r = 0; r < 4; ++r) {
          const Vec p(w[r][j * wj]);
          a0[r] = at::vec::fmadd(p, v0, a0[r]);
          a1[r] = at::vec::fmadd(p, v1, a1[r]);
        }
      }
      for (int r = 0; r < 4; ++r) {
        a0[r].store(c[r], n0);
        if (n1) a1[r].store(c[r] + W, n1);
      }
    }
    for (; i < M; ++i) {
      float* c = C + i * ldc + d;
      const float* w = Wt + i * wi;
      Vec a0 = load(c, n0) * scale(i), a1 = n1 ? load(c + W, n1) * scale(i) : Vec(0.f);
      for (int64_t j = 0; j < N; ++j) {
        const Vec p(w[j * wj]);
        a0 = at::vec::fmadd(p, load(R[j] + d, n0), a0);
        if (n1) a1 = at::vec::fmadd(p, load(R[j] + d + W, n1), a1);
      }
      a0.store(c, n0);
      if (n1) a1.store(c + W, n1);
    }
  }
}

// R[j][:D] += sum_i Wt[i * wi + j * wj] * A[i * lda + :D] for j < N, i < M.
inline void scatter(const float* Wt, int64_t wi, int64_t wj, int64_t M, const float* A, int64_t lda, int64_t N,
                    int64_t D, float* const* R) {
  if (W >= 16 && D % (4 * W) == 0 && N % 4 == 0) {
    // AVX-512, whole 4-vector chunks: 4 keys x 4 vectors (see gather).
    for (int64_t d = 0; d < D; d += 4 * W)
      for (int64_t j = 0; j < N; j += 4) {
        Vec acc[4][4];
        for (int r = 0; r < 4; ++r)
          for (int v = 0; v < 4; ++v) acc[r][v] = Vec(0.f);
        for (int64_t i = 0; i < M; ++i) {
          const float* a = A + i * lda + d;
          const Vec x0 = Vec::loadu(a), x1 = Vec::loadu(a + W), x2 = Vec::loadu(a + 2 * W), x3 = Vec::loadu(a + 3 * W);
          const float* w = Wt + i * wi + j * wj;
          for (int r = 0; r < 4; ++r) {
            const Vec p(w[r * wj]);
            acc[r][0] = at::vec::fmadd(p, x0, acc[r][0]);
            acc[r][1] = at::vec::fmadd(p, x1, acc[r][1]);
            acc[r][2] = at::vec::fmadd(p, x2, acc[r][2]);
            acc[r][3] = at::vec::fmadd(p, x3, acc[r][3]);
          }
        }
        for (int r = 0; r < 4; ++r) {
          float* dst = R[j + r] + d;
          for (int v = 0; v < 4; ++v) (Vec::loadu(dst + v * W) + acc[r][v]).store(dst + v * W);
        }
      }
    return;
  }
  for (int64_t d = 0; d < D; d += 2 * W) {
    const int64_t n0 = std::min<int64_t>(W, D - d), n1 = std::max<int64_t>(0, std::min<int64_t>(W, D - d - W));
    int64_t j = 0;
    for (; j + 4 <= N; j += 4) {
      Vec a0[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)}, a1[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
      for (int64_t i = 0; i < M; ++i) {
        const float* a = A + i * lda + d;
        const Vec x0 = load(a, n0), x1 = n1 ? load(a + W, n1) : Vec(0.f);
        const float* w = Wt + i * wi + j * wj;
        for (int r = 0; r < 4; ++r) {
          const Vec p(w[r * wj]);
          a0[r] = at::vec::fmadd(p, x0, a0[r]);
          a1[r] = at::vec::fmadd(p, x1, a1[r]);
        }
      }
      for (int r = 0; r < 4; ++r) {
        float* dst = R[j + r] + d;
        (load(dst, n0) + a0[r]).store(dst, n0);
        if (n1) (load(dst + W, n1) + a1[r]).store(dst + W, n1);
      }
    }
    for (; j < N; ++j) {
      Vec a0(0.f), a1(0.f);
      for (int64_t i = 0; i < M; ++i) {
        const float* a = A + i * lda + d;
        const Vec p(Wt[i * wi + j * wj]);
        a0 = at::vec::fmadd(p, load(a, n0), a0);
        if (n1) a1 = at::vec::fmadd(p, load(a + W, n1), a1);
      }
      float* dst = R[j] + d;
      (load(dst, n0) + a0).store(dst, n0);
      if (n1) (load(dst + W, n1) + a1).store(dst + W, n1);
    }
  }
}

// dst[d * ldd + r] = scale * src[r * lds + d] for a 16 x 16 block: the
// standard AVX-512 in-register transpose (unpack 32-bit, unpack 64-bit, two
// 128-bit lane shuffles; 64 shuffles per 256 elements, where a scalar
// transposition costs a load and a store per element); element by element
// where AVX-512 is not compiled in.
inline void transpose_16x16(const float* src, int64_t lds, float* dst, int64_t ldd, float scale) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 s = _mm512_set1_ps(scale);
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_mul_ps(_mm512_loadu_ps(src + i * lds), s);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    _mm512_storeu_ps(dst + i * ldd, _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88));
    _mm512_storeu_ps(dst + (i + 8) * ldd, _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd));
  }
#else
  for (int64_t r = 0; r < 16; ++r)
    for (int64_t d = 0; d < 16; ++d) dst[d * ldd + r] = src[r * lds + d] * scale;
#endif
}

// rows [M][D] (row stride ld) times scale -> transposed [D][Mp], zero padded
// (M <= Mp): the query (or dO) rows of a work item laid out for dots_t.
// Whole 16 x 16 blocks go through registers: element by element, this cost
// ~6% of the block-sparse forward at its bench shape, and the scattered
// stores queued behind each missing source load kept the row fetches from
// overlapping.
inline void transpose_rows(const float* rows, int64_t ld, int64_t M, int64_t D, float scale, int64_t Mp, float* buf) {
  int64_t r0 = 0;  // rows below r0 are done in 16 x 16 blocks
  if (D % 16 == 0)
    for (; r0 + 16 <= M; r0 += 16)
      for (int64_t d = 0; d < D; d += 16) transpose_16x16(rows + r0 * ld + d, ld, buf + d * Mp + r0, Mp, scale);
  for (int64_t d = 0; d < D; ++d) {
    float* col = buf + d * Mp;
    for (int64_t r = r0; r < M; ++r) col[r] = rows[r * ld + d] * scale;
    std::fill(col + M, col + Mp, 0.f);
  }
}

// exp(x) for a vector, exact 0 for x = -inf (masked slots). exp_u20 is
// at::vec's inline polynomial (max error 20 ulp, ~1e-6 relative): the
// per-score exp costs as much as a 16-wide dot product in scalar code.
inline Vec exp_masked(const Vec& x) {
  const Vec e = x.exp_u20();
  return Vec::blendv(e, Vec(0.f), x == Vec(-std::numeric_limits<float>::infinity()));
}

// One row of the online softmax (FlashAttention): folds the scores s[0..n)
// (already scaled; -inf = masked) into the running max m and sum l, rescales
// the output row o[0..Dv) by exp(m_old - m_new) and overwrites s with p.
inline void online_softmax_row(float* s, int64_t n, float& m, float& l, float* o, int64_t Dv) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  Vec vmx(m);
  int64_t j = 0;
  for (; j + W <= n; j += W) vmx = at::vec::maximum(vmx, Vec::loadu(s + j));
  float mx = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmx);
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  if (mx == kNegInf) {  // nothing visible yet: p = 0
    std::fill(s, s + n, 0.f);
    return;
  }
  const float alpha = (m == kNegInf) ? 0.f : std::exp(m - mx);
  const Vec vm(mx);
  Vec vsum(0.f);
  for (j = 0; j < n; j += W) {
    const int64_t c = std::min<int64_t>(W, n - j);
    Vec p = exp_masked(load(s + j, c) - vm);
    if (c < W) p = Vec::set(Vec(0.f), p, c);
    p.store(s + j, c);
    vsum = vsum + p;
  }
  if (alpha != 1.f) {
    const Vec va(alpha);
    for (int64_t d = 0; d < Dv; d += W) (load(o + d, Dv - d) * va).store(o + d, std::min<int64_t>(W, Dv - d));
  }
  l = l * alpha + hsum(vsum);
  m = mx;
}

// Scores of many heads laid out [key][Mp] (dots_t's output): the online
// softmax of every column h < Mp over keys j < n, vectorised across heads.
// Updates the running max m[Mp] and sum l[Mp], writes p over s, and returns
// in alpha[Mp] the factor exp(m_old - m_new) the caller rescales O rows by.
// Masked scores are -inf (only where `masked`: tiles without any skip the
// exact-zero blend); a column with nothing visible yet keeps p = 0.
inline void online_softmax_cols(float* s, int64_t ld, int64_t n, int64_t Mp, float* m, float* l, float* alpha,
                                bool masked = true) {
  const Vec neg_inf(-std::numeric_limits<float>::infinity());
  for (int64_t h = 0; h < Mp; h += W) {
    const Vec m_old = Vec::loadu(m + h);
    // Four running maxima: one chain of n dependent max ops (4 cycles each)
    // cost ~5% of a tile's products.
    Vec mq[4] = {m_old, m_old, m_old, m_old};
    int64_t j = 0;
    for (; j + 4 <= n; j += 4)
      for (int q = 0; q < 4; ++q) mq[q] = at::vec::maximum(mq[q], Vec::loadu(s + (j + q) * ld + h));
    for (; j < n; ++j) mq[0] = at::vec::maximum(mq[0], Vec::loadu(s + j * ld + h));
    const Vec mx = at::vec::maximum(at::vec::maximum(mq[0], mq[1]), at::vec::maximum(mq[2], mq[3]));
    // The shift: mx, or 0 where the column is still empty (avoids -inf - -inf).
    const Vec shift = Vec::blendv(mx, Vec(0.f), mx == neg_inf);
    const Vec a = exp_masked(m_old - shift);  // 0 on the first visible tile (m_old = -inf)
    Vec sum(0.f);
    for (j = 0; j < n; ++j) {
      const Vec x = Vec::loadu(s + j * ld + h) - shift;
      const Vec p = masked ? exp_masked(x) : x.exp_u20();
      p.store(s + j * ld + h);
      sum = sum + p;
    }
    (Vec::loadu(l + h) * a + sum).store(l + h);
    mx.store(m + h);
    a.store(alpha + h);
  }
}

// s[j] = exp(s[j] - c) for j < n (c finite).
inline void exp_shifted(float* s, int64_t n, float c) {
  const Vec vc(c);
  for (int64_t j = 0; j < n; j += W) {
    const int64_t k = std::min<int64_t>(W, n - j);
    exp_masked(load(s + j, k) - vc).store(s + j, k);
  }
}

}  // namespace tiles
}  // namespace cpu
}  // namespace glm5
