// INT8 inference on the CPU: per-row symmetric quantisation, the weight-only
// int8 linear, the W8A8 linear and fused_moe with int8 expert weights.
//
// int8_quantize_rows(x[..., K]) -> (q int8 [..., K], scale fp32 [...])
//   scale = max|x_row| / 127, q = round_half_even(x / scale) (exact division), 0 for a zero row
// int8_linear(x[M,K], w int8 [N,K], scale fp32 [N], bias?[N]) -> [M,N] x.dtype
//   y = (x @ w^T) * scale + bias, fp32 accumulation
// w8a8_linear(x, w, scale, bias?) -> [M,N]: x quantised per row as above, int32 GEMM,
//   y = acc * x_scale[m] * scale[n] + bias
// fused_moe_int8(x[T,D], w_gate_up int8 [E,2I,D], gate_up_scale fp32 [E,2I],
//                w_down int8 [E,D,I], down_scale fp32 [E,D], weights[T,k], ids int32 [T,k]) -> [T,D]
//
// Why these paths (bench/int8_bench.py measures them; bench/RESULTS.md, "INT8"):
// - Few rows (decode, M <= kGemvMaxRows): the weights are the traffic. Where the
//   CPU has AVX512_VNNI (checked at run time; the build's x86-64-v4 does not
//   include it) and K <= 131072, int8_vnni.h: each activation row written once
//   as three int8 digits (max|x|/127, /254, /254; residual <= 6.1e-8 max|x| per
//   element, fp32's order), exact int32 dot products by vpdpbusd (3 per 64
//   weight bytes and activation row, against ~12 ops to widen the weights to
//   fp32 and FMA them, which bound the decode paths below the memory
//   bandwidth), combined in float64; each thread reads a contiguous range of
//   weight rows, 4 side by side, prefetched non-temporally. Measured (bench/RESULTS.md,
//   "fused_moe_int8 decode"): fused_moe_int8 decode 1.15-1.3x, int8_linear
//   M=1-2 1.2-1.65x, M=16 1.0-1.19x, M=4-8 0.72-1.17x (slower on K=2048 rows).
//   Otherwise the GEMV tiles of gemv_tiles.h stream 8
//   int8 weight rows side by side per thread, widening 16 int8 to fp32 in
//   registers and FMA-ing against fp32 activations: a quarter of fp32's bytes.
// - Many rows (prefill): compute bounds the step. The weight-only path takes
//   fp32 activations on VNNI through int8_digit_gemm.h (three digit rows per
//   row in oneDNN's int8 GEMM, the decode kernel's accuracy); otherwise it
//   dequantises the weight once into x's dtype and calls the BLAS GEMM (the
//   dequantisation is O(N K) against the GEMM's O(M N K)). The W8A8 path calls
//   at::_int_mm (oneDNN's u8s8 VNNI GEMM) where the CPU has VNNI, which measured
//   faster than an fp32 or bf16 GEMM at prefill sizes; without VNNI (AVX2) _int_mm
//   measured 46x slower than sgemm, so there the same integers go through sgemm in
//   exact chunks (int8_digit_gemm.h, int_mm_wt).
// - fused_moe_int8: a serial counting sort of the (token, slot) pairs by
//   expert; when no expert has more than kGemvMaxRows rows (decode, T <= 16 with
//   top-k spread), gate/up of all chosen experts in one parallel pass over
//   (expert, 8-row tile) items split between the threads by cost, the threads
//   meeting in the middle (MeetPass; with AVX-512 each item's rows read one after
//   another: one sequential stream per thread; on VNNI the int8_vnni.h kernel,
//   each thread making the digits of the token rows it reads),
//   silu(g)*u and its digits (each thread its experts' rows), then down likewise
//   (each chosen expert's int8 rows read once; on VNNI both passes in one parallel
//   region, decode_passes); otherwise per active expert GEMV or dequantise+GEMM by its row
//   count. packed=True: the experts in int8_vnni.h's packed layout (16 rows a
//   vector, a tile one 16-row group), which the VNNI decode pass reads as one
//   stream per thread with no horizontal reductions; the other paths unpack what they read.
//   A gather by token sums its k slots in order (deterministic, no atomics).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "checks.h"
#include "gemv_tiles.h"
#include "int8_digit_gemm.h"
#include "int8_vnni.h"
#include "parallel.h"
#include "swiglu.h"
#include "workspace.h"

namespace glm5 {
namespace cpu {
namespace {

constexpr int64_t kTileRows = gemv::kParallelTileRows;
using gemv::kGemvMaxRows;   // at most this many activation rows take the GEMV path
using gemv::kMinBytesPerThread;
// Prefetched ahead of the decode's streams (ExpertTiles::prefetch): a thread's run at its
// start (MeetPass::run_worker) and, on VNNI, an expert after a jump (ExpertTiles::run_digits).
constexpr int64_t kLeadBytes = 32 << 10;
constexpr int64_t kJumpLeadBytes = 16 << 10;

// Elements per thread below which row loops stay on the calling thread: a decode
// step's few rows cost less than waking the other threads.
constexpr int64_t kRowLoopGrainElems = 65536;

int64_t row_grain(int64_t row_elems) {
  return std::max<int64_t>(1, kRowLoopGrainElems / std::max<int64_t>(row_elems, 1));
}

// y[M,N] fp32 = x[M,K] fp32 @ (w * scale)^T + bias: each thread streams its own
// contiguous range of weight rows (gemv_tiles.h; a row's result does not depend on M).
void gemv(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scale, const float* bias, int64_t N,
          float* y) {
#if defined(__AVX512F__)
  if (vnni::use_digits(K)) {   // int8_vnni.h: each thread reads its contiguous range of rows start to end
    const vnni::ActDigits digits = vnni::make_digits(x, M, K, K);
    at::parallel_for(0, N, std::max<int64_t>(1, kMinBytesPerThread / K), [&](int64_t n0, int64_t n1) {
      vnni::rows_digits(digits, 0, M, w, n0, n1, scale, bias, y, N);
    });
    return;
  }
#endif
  gemv::rows_parallel<int8_t>(x, K, 1, M, K, w, 0, scale, 0, bias, N, y);
}

// y[H,M,N] fp32, y[h] = x[h] @ (w[h] * scale[h])^T: heads ws / ss elements apart in w / scale,
// rows contiguous. Threads take ranges of (head, row tile) pairs: MLA's heads are small
// (64 x 256), too small to split one head's rows across threads.
void gemv_heads(const float* x, int64_t H, int64_t M, int64_t K, const int8_t* w, int64_t ws, const float* scale,
                int64_t ss, int64_t N, float* y) {
#if defined(__AVX512F__)
  if (vnni::use_digits(K)) {
    const int64_t tiles = (N + kTileRows - 1) / kTileRows;   // per head
    const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / (kTileRows * K));
    const vnni::ActDigits digits = vnni::make_digits(x, H * M, K, K);   // row h*M + m: head h's row m
    at::parallel_for(0, H * tiles, grain, [&](int64_t t0, int64_t t1) {
      for (int64_t h = t0 / tiles; h * tiles < t1; ++h) {
        const int64_t n0 = (std::max(t0, h * tiles) - h * tiles) * kTileRows;
        const int64_t n1 = std::min(N, (std::min(t1, (h + 1) * tiles) - h * tiles) * kTileRows);
        vnni::rows_digits(digits, h * M, M, w + h * ws, n0, n1, scale + h * ss, nullptr, y, N);
      }
    });
    return;
  }
#endif
  gemv::rows_parallel<int8_t>(x, K, H, M, K, w, ws, scale, ss, nullptr, N, y);
}

#if defined(__AVX512F__)
// One int8 weight row read start to end against MB activation rows, 4 accumulator
// chains of 16 lanes per activation row (fixed order: a row's result does not
// depend on MB). The decode MoE's rows are short (1024 B gate/up, 256 B down): a
// thread reading them one after another is one sequential stream that the
// hardware prefetcher follows, where gemv_tiles.h's 8 rows side by side are 8
// short streams; measured 64-68% against 54-60% of the sum bandwidth at T=1/4
// (bench/RESULTS.md).
template <int MB>
inline void row_seq(const float* const* x, const int8_t* w, int64_t K, float* out) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_setzero_ps();
  auto widen = [](__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); };
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    __m512 wv[4];
    for (int c = 0; c < 4; ++c) wv[c] = widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k + 16 * c)));
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_fmadd_ps(wv[c], _mm512_loadu_ps(x[m] + k + 16 * c), acc[m][c]);
  }
  for (int c = 0; k < K; k += 16, ++c) {
    const __mmask16 mask = K - k >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (K - k)) - 1u);
    const __m512 wv = widen(_mm_maskz_loadu_epi8(mask, w + k));
    for (int m = 0; m < MB; ++m) acc[m][c] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x[m] + k), acc[m][c]);
  }
  for (int m = 0; m < MB; ++m)
    out[m] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3])));
}
#endif

// For every expert e with rows [offsets[e], offsets[e+1]) of x (sorted pairs, [*, K]):
// y[r] = x[r] @ (w[e] * scale[e])^T, w int8 [E, N, K], scale [E, N], y [*, N].
// The work is one flat list of (chosen expert, 8-row weight tile) items (16-row packed
// tiles where packed), split between the threads by cost, the threads meeting in the middle
// (weighted_split, MeetPass): one fork/join per projection, and the threads stay busy across
// expert boundaries. With AVX-512 each item's
// 8 rows are read one after another (row_seq); otherwise gemv_tiles.h's tiles (on a
// Zen 3, AVX2, row_seq's order measured 0.77x the tiles' GB/s at T = 1, 4 and 16),
// each prefetching the item gemv::kPrefetchMinBytes ahead in the thread's own
// run, also across an expert boundary (gemv::rows, called per expert, stopped at
// each expert's end). Either way each y[r, n] has one fixed chain order: the same
// bits whatever the thread split or the other rows of the batch.
struct ExpertTiles {
  const std::vector<int64_t>& offsets;
  const std::vector<int64_t>& active;   // experts with at least one row, ascending
  const float* x;
  int64_t K;
  const int8_t* w;
  const float* scale;
  int64_t N;
  float* y;
  int64_t rows;         // rows per tile: kTileRows, or a packed group (vnni::kPackRows)
  int64_t per_expert;   // tiles per expert
  int64_t ahead;        // prefetch distance in tiles (0: none)
  bool packed;          // w in vnni's packed layout (the digits path only)
  bool nta = false;     // prefetch non-temporally (the digits path; see prefetch)

  const int8_t* tile_weights(int64_t t) const {
    return w + active[t / per_expert] * N * K + (t % per_expert) * rows * K;
  }
  int64_t tiles() const { return int64_t(active.size()) * per_expert; }
  // The sorted rows of tile t's expert start at first_row(t) (t clamped to the last tile) and end
  // before end_row(t).
  int64_t first_row(int64_t t) const { return offsets[active[std::min(t, tiles() - 1) / per_expert]]; }
  int64_t end_row(int64_t t) const { return offsets[active[t / per_expert] + 1]; }
  int64_t tile_bytes() const { return rows * std::max<int64_t>(K, 1); }
  // Tiles a thread should have at least: below kMinBytesPerThread a second thread costs more than it reads.
  int64_t grain() const { return std::max<int64_t>(1, kMinBytesPerThread / tile_bytes()); }

#if defined(__AVX512F__)
  // The items' rows one at a time (row_seq): the AVX-512 decode path.
  void run_rows(int64_t t0, int64_t t1) const {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = active[t / per_expert], n0 = (t % per_expert) * rows;
      const int64_t r0 = offsets[e], M = offsets[e + 1] - r0;
      for (int64_t n = n0; n < std::min(N, n0 + rows); ++n) {
        const int8_t* wr = w + (e * N + n) * K;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          const int mb = int(std::min<int64_t>(4, M - m0));
          const float* xr[4];
          float out[4];
          for (int i = 0; i < mb; ++i) xr[i] = x + (r0 + m0 + i) * K;
          switch (mb) {
            case 1: row_seq<1>(xr, wr, K, out); break;
            case 2: row_seq<2>(xr, wr, K, out); break;
            case 3: row_seq<3>(xr, wr, K, out); break;
            default: row_seq<4>(xr, wr, K, out); break;
          }
          for (int i = 0; i < mb; ++i) y[(r0 + m0 + i) * N + n] = out[i] * scale[e * N + n];
        }
      }
    }
  }

  // The same items on VNNI (int8_vnni.h): activation digits, integer dot products.
  // Each expert's run of tiles in one call (one stream, prefetched ahead within the expert).
  // Where the next expert of the run lies elsewhere in memory (not e + 1: at T = 1 and 4 nearly
  // every boundary), the hardware prefetcher restarts cold there: the next expert's first
  // kJumpLeadBytes are prefetched as this expert's last tile starts. In-process on fast hours this took
  // T = 1 / 4 from 69-71 / 79-81% to 71-73 / 82-84% of the read bandwidth, slow hours +6-14
  // points; 8 KiB gained in one build and not in another, 12-16 KiB in every run; at T = 16, where
  // most boundaries are contiguous, level (bench/RESULTS.md, "A lead at each jump").
  void run_digits(const vnni::ActDigits& digits, int64_t t0, int64_t t1) const {
    for (int64_t t = t0; t < t1;) {
      const int64_t i = t / per_expert, e = active[i];
      const int64_t t_end = std::min(t1, (i + 1) * per_expert);
      const int64_t r0 = offsets[e], M = offsets[e + 1] - r0;
      const int64_t n0 = (t % per_expert) * rows, n1 = std::min(N, (t_end - i * per_expert) * rows);
      const auto run = [&](int64_t a, int64_t b) {
        if (packed)
          vnni::packed_rows_digits(digits, r0, M, w + e * N * K, N, a, b, scale + e * N, nullptr, y, N);
        else
          vnni::rows_digits(digits, r0, M, w + e * N * K, a, b, scale + e * N, nullptr, y, N);
      };
      const int64_t last = (n1 - 1) / rows * rows;   // the last tile's first row
      if (packed && t_end < t1 && active[i + 1] != e + 1 && last > n0) {
        run(n0, last);
        prefetch(t_end, kJumpLeadBytes);
        run(last, n1);
      } else {
        run(n0, n1);
      }
      t = t_end;
    }
  }

#endif

  // The first `bytes` from tile t on, within its expert: into L2 (T1), or where nta
  // non-temporally (NTA), as the digits kernel prefetches its stream (int8_vnni.h,
  // kPrefetchBytes): in-process on a Zen 4 these leads as NTA read 1.027x at T = 1, 1.01x at
  // T = 4 and 16 over T1 (bench/RESULTS.md, "Non-temporal prefetch"). The fp32 tiles keep T1:
  // an AVX2 build on the same Zen 4 read level with NTA (1.003-1.005x, leads and tiles).
  void prefetch(int64_t t, int64_t bytes) const {
    const int8_t* p = tile_weights(t);
    const int8_t* expert_end = w + (active[t / per_expert] + 1) * N * K;
    const int64_t n = std::min<int64_t>(bytes, expert_end - p);
    if (nta)
      for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 0);   // 0: _MM_HINT_NTA
    else
      for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 2);   // 2: _MM_HINT_T1
  }

  // Portable path: gemv_tiles.h's tiles, 8 rows side by side, prefetching across experts.

  void run(int64_t t0, int64_t t1) const {
    float out[8][4];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = active[t / per_expert], n = (t % per_expert) * rows;
      const int64_t r0 = offsets[e], M = offsets[e + 1] - r0;
      const int nb = int(std::min<int64_t>(rows, N - n));
      const int8_t* wr[8];
      for (int j = 0; j < nb; ++j) wr[j] = w + (e * N + n + j) * K;
      const int64_t tp = t + ahead;   // prefetch only full tiles (a tail tile is the last of its expert)
      const char* pf = ahead > 0 && tp < t1 && (tp % per_expert + 1) * rows <= N
                           ? reinterpret_cast<const char*>(tile_weights(tp)) : nullptr;
      const int mstep = M <= 2 ? 2 : 4;   // gemv::rows's shapes: 8 x (1|2), else 4 x 4
      for (int64_t m0 = 0; m0 < M; m0 += mstep) {
        const int mb = int(std::min<int64_t>(mstep, M - m0));
        const float* xr[4];
        for (int i = 0; i < mb; ++i) xr[i] = x + (r0 + m0 + i) * K;
        const char* p = m0 == 0 ? pf : nullptr;
        if (nb == 8 && mstep == 2) {
          gemv::tile_any(8, mb, xr, wr, K, out, p);
        } else if (nb == 8) {
          gemv::tile_any(4, mb, xr, wr, K, out, p);
          gemv::tile_any(4, mb, xr, wr + 4, K, out + 4, p ? p + 4 * K : nullptr);
        } else {
          for (int j = 0; j < nb; ++j) gemv::tile_any(1, mb, xr, wr + j, K, out + j);
        }
        const float* sc = scale + e * N + n;
        for (int j = 0; j < nb; ++j)
          for (int i = 0; i < mb; ++i) y[(r0 + m0 + i) * N + n + j] = out[j][i] * sc[j];
      }
    }
  }
};

#if defined(__AVX512F__)
// The activation digits a thread reads, made by that thread: alloc(ra, rb) the storage for
// sorted rows [ra, rb), fill(d, ra, r0, r1) the digits of rows [r0, r1) within it (a thread
// fills its own run's rows first, those of the tiles it takes from a MeetZone as it takes them).
struct RowsDigits {
  std::function<vnni::ActDigits(int64_t ra, int64_t rb)> alloc;
  std::function<void(vnni::ActDigits& d, int64_t ra, int64_t r0, int64_t r1)> fill;
};
#endif

// The first tile of each of W threads' runs (and the end, tiles), splitting the experts'
// tiles in proportion to their cost, the weight bytes plus the products: a tile of an expert
// with M rows costs kBytesPerRow + M, its bytes counted as kBytesPerRow rows' products
// (vpdpbusd: three a 64-byte vector and row, ~0.9 ns at 3.4 GHz, against ~2 ns to read the
// vector on a core at ~31 GB/s). Both projections' tiles of an expert cost in the same
// proportion, so they split at the same point and each thread makes the silu(g) * u
// digits of the h rows it wrote. Splitting the bytes alone often left one thread 10-30%
// more rows than the other at T = 16 (1-5 rows per expert); in-process on fast hours this
// split read 68 -> 69% of the read bandwidth at T = 16 and 84 -> 87% at T = 4
// (bench/RESULTS.md, "Faster digits, a row-weighted split").
constexpr double kBytesPerRow = 2.5;
std::vector<int64_t> weighted_split(const std::vector<int64_t>& offsets, const std::vector<int64_t>& active,
                                    int64_t per_expert, int64_t W) {
  const int64_t n = int64_t(active.size()), tiles = n * per_expert;
  std::vector<double> cum(n + 1, 0.0);   // cost of the experts before each
  for (int64_t i = 0; i < n; ++i) cum[i + 1] = cum[i] + kBytesPerRow + double(offsets[active[i] + 1] - offsets[active[i]]);
  std::vector<int64_t> first(W + 1, tiles);
  first[0] = 0;
  for (int64_t w = 1; w < W; ++w) {
    const double target = cum[n] * double(w) / double(W);
    const int64_t i = std::min<int64_t>(n - 1, std::upper_bound(cum.begin(), cum.end(), target) - cum.begin() - 1);
    const double into = (target - cum[i]) / (cum[i + 1] - cum[i]) * double(per_expert);
    first[w] = std::clamp<int64_t>(i * per_expert + std::llround(into), first[w - 1], tiles);
  }
  return first;
}

// The tiles between two threads' runs, [lo, hi), taken in chunks by both as each finishes its
// own run: the lower thread from lo upward (its stream goes on), the upper from hi downward.
// Why: the two cores read at different speeds from minute to minute (on a fast-memory hour
// the threads' ends were 8-14 us apart at T = 1 and 20-35 us at T = 16, either one first), and
// one core alone reads only half the bandwidth. kMeetShare of the smaller neighbour's run on
// each side of the split, chunks of a quarter of what is left and at least kMeetChunkBytes (a
// claim costs a cache line's trip between the cores, ~0.3 us when both are claiming):
// in-process on fast hours, T = 1 / 4 / 16 71 / 84 / 73% -> 75 / 87 / 74% of the read bandwidth;
// a quarter of the runs on each side, or 16 KiB chunks, gained less (bench/RESULTS.md, "Threads
// meeting in the middle").
constexpr double kMeetShare = 0.15;
constexpr int64_t kMeetChunkBytes = 64 << 10;
struct alignas(64) MeetZone {   // a line of its own: only the two neighbours touch it
  std::atomic<uint64_t> lohi{0};   // hi << 32 | lo
  void set(int64_t lo, int64_t hi) { lohi.store((uint64_t(hi) << 32) | uint64_t(lo), std::memory_order_relaxed); }
  // The next chunk [a, b) from below (up) or above; false when the zone is empty. The join
  // after the pass orders the tiles' writes: the claim itself needs no ordering.
  bool claim(bool up, int64_t min_tiles, int64_t& a, int64_t& b) {
    uint64_t cur = lohi.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = int64_t(cur & 0xffffffffu), hi = int64_t(cur >> 32);
      if (lo >= hi) return false;
      const int64_t c = std::min(hi - lo, std::max(min_tiles, (hi - lo) / 4));
      a = up ? lo : hi - c, b = a + c;
      const uint64_t next = up ? (uint64_t(hi) << 32) | uint64_t(lo + c) : (uint64_t(hi - c) << 32) | uint64_t(lo);
      if (lohi.compare_exchange_weak(cur, next, std::memory_order_relaxed)) return true;
    }
  }
};

// The (expert, tile) items of one projection: 8-row tiles, or one packed group of 16 rows.
ExpertTiles expert_tiles(const std::vector<int64_t>& offsets, const std::vector<int64_t>& active, const float* x,
                         int64_t K, const int8_t* w, const float* scale, int64_t N, float* y, bool packed) {
  const int64_t rows = packed ? vnni::kPackRows : kTileRows;
  const int64_t tile_bytes = rows * std::max<int64_t>(K, 1);
  // gemv::rows's rule: rows longer than kPrefetchMaxRowBytes stream well enough on their own.
  const int64_t ahead = K > gemv::kPrefetchMaxRowBytes ? 0 : (gemv::kPrefetchMinBytes + tile_bytes - 1) / tile_bytes;
  return ExpertTiles{offsets, active, x, K, w, scale, N, y, rows, (N + rows - 1) / rows, ahead, packed};
}

// One projection's tiles, planned for W workers: worker w runs its own tiles
// [first[w] + margin[w], first[w + 1] - margin[w + 1]) (weighted_split), then takes tiles from
// the zones on either side (MeetZone). run(begin): begin(lo, hi) is called once by each worker
// with all the tiles it may take, [lo, hi), and returns what runs a range of them.
class MeetPass {
 public:
  MeetPass(const ExpertTiles& job, int64_t max_workers) : job_(job), tiles_(job.tiles()) {
    TORCH_INTERNAL_ASSERT(tiles_ < (int64_t(1) << 32), "MeetPass: a MeetZone holds tile indices in 32 bits");
    workers_ = std::max<int64_t>(1, std::min<int64_t>(max_workers, (tiles_ + job.grain() - 1) / job.grain()));
    first_ = weighted_split(job.offsets, job.active, job.per_expert, workers_);
    margin_.assign(workers_ + 1, 0);
    zones_ = std::vector<MeetZone>(workers_ + 1);
    for (int64_t b = 1; b < workers_; ++b) {
      margin_[b] = std::llround(kMeetShare * double(std::min(first_[b] - first_[b - 1], first_[b + 1] - first_[b])));
      zones_[b].set(first_[b] - margin_[b], first_[b] + margin_[b]);
    }
    min_tiles_ = std::max<int64_t>(1, kMeetChunkBytes / job.tile_bytes());
  }

  template <typename Begin>
  void run(const Begin& begin) {
    at::parallel_for(0, workers_, 1, [&](int64_t w0, int64_t w1) {
      for (int64_t w = w0; w < w1; ++w) run_worker(w, begin);
    });
  }

  int64_t workers() const { return workers_; }

  // Worker w's share (none where w >= workers()).
  template <typename Begin>
  void run_worker(int64_t w, const Begin& begin) {
    if (w >= workers_) return;
    const int64_t lo = first_[w] - margin_[w], hi = first_[w + 1] + margin_[w + 1];   // all it may take
    const int64_t s0 = first_[w] + margin_[w], s1 = first_[w + 1] - margin_[w + 1];   // its own run
    if (lo >= hi) return;
    // The first kLeadBytes of its own run prefetched: memory idles while a thread makes its first
    // digits (1-3 us at T = 1, 10-25 us at T = 16). In-process on fast hours 32 KiB took the VNNI
    // pass at T = 1 / 4 / 16 from 75 / 87 / 76% to 78 / 90 / 77% of the read bandwidth; 96 KiB less,
    // into L1 (T0) less still (bench/RESULTS.md, "A lead before the digits"). Only the run's start:
    // at each zone chunk a prefetch cost more than it saved. (The fp32 tiles, whose first tile
    // waits on memory too, take it as well; measured with the meeting, not alone.)
    if (s0 < s1) job_.prefetch(s0, kLeadBytes);
    auto run = begin(lo, hi);
    if (s0 < s1) run(s0, s1);
    int64_t a, b;
    if (w + 1 < workers_)
      while (zones_[w + 1].claim(true, min_tiles_, a, b)) run(a, b);
    if (w > 0)
      while (zones_[w].claim(false, min_tiles_, a, b)) run(a, b);
  }

  const ExpertTiles& job_;
  int64_t tiles_, workers_ = 1, min_tiles_ = 1;
  std::vector<int64_t> first_, margin_;   // zone b: tiles [first_[b] - margin_[b], first_[b] + margin_[b])
  std::vector<MeetZone> zones_;
};

// The fp32 kernels over one projection's tiles (plain rows), the threads meeting in the middle.
// Split evenly, a T = 1 call's two threads ended 7-10 us apart on average on a Zen 3 (either one
// first); on MeetPass T = 4 / 16 read 1.017 / 1.032x, T = 1 level (bench/RESULTS.md, "AVX2
// hosts, again").
void expert_gemv(const std::vector<int64_t>& offsets, const std::vector<int64_t>& active, const float* x, int64_t K,
                 const int8_t* w, const float* scale, int64_t N, float* y) {
  const ExpertTiles job = expert_tiles(offsets, active, x, K, w, scale, N, y, false);
  MeetPass(job, at::get_num_threads()).run([&](int64_t, int64_t) {
#if defined(__AVX512F__)
    return [&](int64_t t0, int64_t t1) { job.run_rows(t0, t1); };
#else
    return [&](int64_t t0, int64_t t1) { job.run(t0, t1); };
#endif
  });
}

#if defined(__AVX512F__)
// What runs a worker's ranges of one projection on the VNNI digits kernel (MeetPass's
// `begin`), the worker making the digits of the rows its tiles read as it comes to them
// (digits.fill). before(t0, t1) runs ahead of a range's digits, after(t0, t1) once its tiles ran.
template <typename Before, typename After>
auto digits_worker(const ExpertTiles& job, const RowsDigits& digits, Before before, After after) {
  return [&job, &digits, before, after](int64_t lo, int64_t hi) {
    const int64_t ra = job.first_row(lo), rb = job.end_row(hi - 1);
    // The rows whose digits are made, [fa, fb): from the first range's on, grown at either end
    // (its own run, then chunks upward from its end and downward from its start).
    return [&job, &digits, before, after, ra, d = digits.alloc(ra, rb), fa = int64_t(-1),
            fb = int64_t(-1)](int64_t t0, int64_t t1) mutable {
      before(t0, t1);
      const int64_t r0 = job.first_row(t0), r1 = job.end_row(t1 - 1);
      if (fb < 0) fa = fb = r0;
      if (r1 > fb) digits.fill(d, ra, std::max(r0, fb), r1), fb = r1;
      if (r0 < fa) digits.fill(d, ra, r0, std::min(r1, fa)), fa = r0;
      job.run_digits(d, t0, t1);
      after(t0, t1);
    };
  };
}

// The tiles of an expert's gate/up rows done so far (a line of its own: both threads may count).
struct alignas(64) TilesDone {
  std::atomic<int64_t> n{0};
};

// The decode's gate/up and down passes (both MeetPass plans, split at the same expert) in one
// parallel region: a worker goes on to its down tiles as soon as its gate/up tiles are done,
// each down range first waiting until its experts' gate/up tiles are all done (by either
// thread: around the split they meet). One fork and join a call instead of two, and no
// thread idles between the passes. A thread runs all its gate/up work before any down work,
// and gate/up work never waits, so a range's wait ends, also where parallel_for runs the
// workers one after another on one thread.
void decode_passes(const ExpertTiles& gate_up, const RowsDigits& token_digits, const ExpertTiles& down,
                   const RowsDigits& silu_digits) {
  const int64_t threads = at::get_num_threads();
  MeetPass first(gate_up, threads), second(down, threads);
  std::vector<TilesDone> done(gate_up.active.size());
  std::atomic<bool> failed{false};   // a gate/up worker threw: the waits give up
  const auto experts = [](const ExpertTiles& job, int64_t t0, int64_t t1, auto&& f) {
    for (int64_t i = t0 / job.per_expert; i <= (t1 - 1) / job.per_expert; ++i)
      f(i, std::min(t1, (i + 1) * job.per_expert) - std::max(t0, i * job.per_expert));
  };
  const auto count = [&](int64_t t0, int64_t t1) {
    experts(gate_up, t0, t1, [&](int64_t i, int64_t n) { done[i].n.fetch_add(n, std::memory_order_release); });
  };
  const auto wait = [&](int64_t t0, int64_t t1) {
    experts(down, t0, t1, [&](int64_t i, int64_t) {
      while (done[i].n.load(std::memory_order_acquire) < gate_up.per_expert) {
        TORCH_CHECK(!failed.load(std::memory_order_relaxed), "fused_moe_int8: the gate/up pass failed");
        _mm_pause();
      }
    });
  };
  const auto nothing = [](int64_t, int64_t) {};
  const auto begin_gate_up = digits_worker(gate_up, token_digits, nothing, count);
  const auto begin_down = digits_worker(down, silu_digits, wait, nothing);
  at::parallel_for(0, std::max(first.workers(), second.workers()), 1, [&](int64_t w0, int64_t w1) {
    try {
      for (int64_t w = w0; w < w1; ++w) first.run_worker(w, begin_gate_up);
    } catch (...) {
      failed.store(true);
      throw;
    }
    for (int64_t w = w0; w < w1; ++w) second.run_worker(w, begin_down);
  });
}
#endif

// w[N,K] int8 * scale[N] -> [N,K] of `dtype`.
at::Tensor dequantize_rows(const at::Tensor& w, const at::Tensor& scale, at::ScalarType dtype) {
  return (w.to(at::kFloat) * scale.unsqueeze(1)).to(dtype);
}

// ---------------------------------------------------------------- helpers --

c10::optional<at::Tensor> fp32_bias(const c10::optional<at::Tensor>& bias) {
  if (!bias.has_value()) return c10::nullopt;
  return bias->to(at::kFloat).contiguous();
}

// Weight-only x[M,K] @ (w * scale)^T + bias for many rows, where compute bounds the
// call: fp32 x on a VNNI CPU through the digits GEMM (int8_digit_gemm.h) where N is
// wide enough to pay for writing the digits, otherwise
// one dequantisation and the BLAS GEMM in x's dtype (O(N K) against O(M N K)). bf16
// and fp16 x keep the latter: their BLAS GEMM measured faster than three digit rows.
// y [M, N] of x's dtype, contiguous; bias fp32 or none.
void weight_only_gemm_out(at::Tensor y, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& bias) {
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kFloat && vnni::use_digit_gemm(x.size(1), w.size(0)) && x.size(0) > 0) {
    vnni::digit_gemm(x.contiguous(), w.contiguous(), scale.contiguous().data_ptr<float>(),
                     bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>());
    return;
  }
#endif
  if (!bias.has_value()) {
    at::linear_out(y, x, dequantize_rows(w, scale, x.scalar_type()));
    return;
  }
  y.copy_(at::linear(x, dequantize_rows(w, scale, x.scalar_type())).to(at::kFloat).add_(*bias));
}

at::Tensor weight_only_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& bias) {
  auto y = at::empty({x.size(0), w.size(0)}, x.options());
  weight_only_gemm_out(y, x, w, scale, bias);
  return y;
}

// q[k] = round_half_even(x[k] / s) clamped to [-127, 127], s = max|x| / 127 (returned;
// q = 0 where s = 0). Vectorised it is the scalar loop's arithmetic lane by lane (an
// IEEE division, round to nearest even, the same clamp), so the same bits: a NaN
// element is skipped by the max and clamps to 127, as std::max / std::min leave it.
float quantize_row(const float* x, int64_t K, int8_t* q) {
#if defined(__AVX512F__)
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const auto tail = [K](int64_t k) {
    return K - k >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (K - k)) - 1u);
  };
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16)   // max(|x|, acc): MAXPS returns acc where |x| is NaN
    vmax = _mm512_max_ps(_mm512_and_ps(_mm512_maskz_loadu_ps(tail(k), x + k), abs_mask), vmax);
  const float s = _mm512_reduce_max_ps(vmax) / 127.f;
  const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = tail(k);
    __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(m, x + k), sv),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_max_ps(_mm512_min_ps(v, hi), lo);   // MINPS returns hi where v is NaN
    const __m128i qi = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v));
    _mm_mask_storeu_epi8(q + k, m, s > 0.f ? qi : _mm_setzero_si128());
  }
  return s;
#else
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float s = amax / 127.f;
  for (int64_t k = 0; k < K; ++k)   // nearbyint: half to even under the default rounding mode
    q[k] = s > 0.f ? int8_t(std::max(-127.f, std::min(127.f, std::nearbyint(x[k] / s)))) : 0;
  return s;
#endif
}

// ------------------------------------------------------------------- ops --

std::tuple<at::Tensor, at::Tensor> int8_quantize_rows(const at::Tensor& x_in) {
  GLM5_CHECK_FLOAT(x_in, "x");
  TORCH_CHECK_VALUE(x_in.dim() >= 1, "x must have shape [..., K], got a 0-d tensor");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t K = x.size(-1);
  auto q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  auto scale_sizes = x.sizes().vec();
  scale_sizes.pop_back();
  auto scale = at::empty(scale_sizes, x.options());
  const int64_t R = scale.numel();   // rows; with K = 0 each gets scale 0
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) sp[r] = quantize_row(xp + r * K, K, qp + r * K);
  });
  return {q, scale};
}

// y fp32 [M,N] (rows N apart) = quantise_rows(x) @ w^T (int32 accumulation) * x_scale[m]
// * scale[n] + bias[n]; M, N, K >= 1; bias fp32 or null. The scaling is one pass over
// the products (as ATen ops, convert, two multiplies and an add were four), in the
// oracle's order: fp32 (acc * x_scale) * scale, then + bias.
void int8_gemm_out(float* yp, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale_in,
                   const float* bias) {
  auto [qx, sx] = int8_quantize_rows(x);
  const at::Tensor acc = vnni::int_mm_wt(qx, w);   // oneDNN's int8 GEMM (VNNI where the CPU has it)
  const at::Tensor scale = scale_in.contiguous();
  const int64_t M = acc.size(0), N = acc.size(1);
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float *sxp = sx.data_ptr<float>(), *sp = scale.data_ptr<float>();
  at::parallel_for(0, M, row_grain(N), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int32_t* a = ap + m * N;
      float* yr = yp + m * N;
      int64_t n = 0;
#if defined(__AVX512F__)
      const __m512 xs = _mm512_set1_ps(sxp[m]);
      for (; n + 16 <= N; n += 16) {
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(a + n)), xs),
                                 _mm512_loadu_ps(sp + n));
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
        _mm512_storeu_ps(yr + n, v);
      }
#endif
      for (; n < N; ++n) {
        const float v = (float(a[n]) * sxp[m]) * sp[n];
        yr[n] = bias ? v + bias[n] : v;
      }
    }
  });
}

at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const float* bias) {
  auto y = at::empty({x.size(0), w.size(0)}, x.options().dtype(at::kFloat));
  int8_gemm_out(y.data_ptr<float>(), x, w, scale, bias);
  return y;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w_in, const at::Tensor& scale_in,
                       const c10::optional<at::Tensor>& bias_in) {
  check_int8_linear_args(x, w_in, scale_in, bias_in);
  const int64_t M = x.size(0), K = x.size(1), N = w_in.size(0);
  const at::Tensor w = w_in.contiguous(), scale = scale_in.contiguous();
  const auto bias = fp32_bias(bias_in);
  if (M > kGemvMaxRows) return weight_only_gemm(x, w, scale, bias);   // compute-bound
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  auto y = at::empty({M, N}, xf.options());
  if (M > 0 && N > 0)
    gemv(xf.data_ptr<float>(), M, K, w.data_ptr<int8_t>(), scale.data_ptr<float>(),
         bias.has_value() ? bias->data_ptr<float>() : nullptr, N, y.data_ptr<float>());
  return y.to(x.scalar_type());
}

at::Tensor int8_linear_heads(const at::Tensor& x, const at::Tensor& w_in, const at::Tensor& scale_in) {
  check_int8_linear_heads_args(x, w_in, scale_in);
  const int64_t H = x.size(0), M = x.size(1), K = x.size(2), N = w_in.size(1);
  // rows contiguous, heads any distance apart (W_UV is a strided view of kv_b_proj's weight)
  const at::Tensor w = w_in.stride(2) == 1 && w_in.stride(1) == K ? w_in : w_in.contiguous();
  const at::Tensor scale = scale_in.stride(1) == 1 ? scale_in : scale_in.contiguous();
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  auto y = at::empty({H, M, N}, xf.options());
  if (H > 0 && M > 0 && N > 0) {
    if (K == 0) return y.zero_().to(x.scalar_type());
    gemv_heads(xf.data_ptr<float>(), H, M, K, w.data_ptr<int8_t>(), w.stride(0), scale.data_ptr<float>(),
               scale.stride(0), N, y.data_ptr<float>());
  }
  return y.to(x.scalar_type());
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& w_in, const at::Tensor& scale_in,
                       const c10::optional<at::Tensor>& bias_in) {
  check_int8_linear_args(x, w_in, scale_in, bias_in);
  TORCH_CHECK_VALUE(x.size(1) <= 131072, "x must have K <= 131072 (int32 accumulation of int8 products), got K=",
                    x.size(1));
  const int64_t M = x.size(0), N = w_in.size(0);
  if (M == 0 || N == 0 || x.size(1) == 0) {
    auto y = at::zeros({M, N}, x.options().dtype(at::kFloat));
    if (bias_in.has_value()) y += *fp32_bias(bias_in);
    return y.to(x.scalar_type());
  }
  const auto bias = fp32_bias(bias_in);
  return int8_gemm(x, w_in, scale_in, bias.has_value() ? bias->data_ptr<float>() : nullptr).to(x.scalar_type());
}

// w [..., N, K] in the packed layout (int8_vnni.h) -> the same weights in plain rows. With
// `only`, just those [N, K] blocks (the rest left unwritten): a decode call reads its chosen
// experts alone, and unpacking all 64 of the small preset's cost ~40x the call.
at::Tensor unpacked(const at::Tensor& w, const std::vector<int64_t>* only = nullptr) {
  const at::Tensor src = w.contiguous();
  at::Tensor dst = at::empty_like(src);
  const int64_t K = src.size(-1), N = src.size(-2), B = src.numel() / std::max<int64_t>(1, N * K);
  const auto unpack = [&](int64_t b) {
    vnni::unpack_rows(src.data_ptr<int8_t>() + b * N * K, dst.data_ptr<int8_t>() + b * N * K, N, K);
  };
  if (only)
    for (const int64_t b : *only) unpack(b);
  else
    for (int64_t b = 0; b < B; ++b) unpack(b);
  return dst;
}

// a = silu(h[:, :I]) * h[:, I:] for h [R, 2I], a [R, I], both contiguous: as ATen
// ops (silu, mul, copy) this was ~20 us of dispatch per MoE layer at decode.
void silu_mul_rows(const at::Tensor& h, const at::Tensor& a) {
  TORCH_INTERNAL_ASSERT(h.is_contiguous() && a.is_contiguous() && h.size(1) == 2 * a.size(1));
  const int64_t R = a.size(0), I = a.size(1);
  const float* hp = h.data_ptr<float>();
  float* ap = a.data_ptr<float>();
  at::parallel_for(0, R, row_grain(I), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) swiglu<float>(hp + r * 2 * I, hp + r * 2 * I + I, ap + r * I, I);
  });
}

at::Tensor fused_moe_int8(const at::Tensor& x_in, const at::Tensor& w_gate_up_in, const at::Tensor& gu_scale_in,
                          const at::Tensor& w_down_in, const at::Tensor& down_scale_in, const at::Tensor& weights_in,
                          const at::Tensor& ids_in, bool w8a8, bool packed) {
  check_fused_moe_int8_args(x_in, w_gate_up_in, gu_scale_in, w_down_in, down_scale_in, weights_in, ids_in);
  const int64_t T = x_in.size(0), D = x_in.size(1);
  const int64_t E = w_gate_up_in.size(0), I2 = w_gate_up_in.size(1), I = I2 / 2;
  const int64_t k = ids_in.size(1);
  const at::Tensor x = x_in.to(at::kFloat).contiguous(), ids = ids_in.contiguous();
  const at::Tensor weights = weights_in.to(at::kFloat).contiguous();
  at::Tensor wgu = w_gate_up_in.contiguous(), wd = w_down_in.contiguous();
  const at::Tensor gus = gu_scale_in.contiguous(), ds = down_scale_in.contiguous();
  const int32_t* id = ids.data_ptr<int32_t>();

  // Counting sort of the pairs by expert (stable: token order within an expert).
  std::vector<int64_t> offsets(E + 1, 0), pair_of(T * k), cursor;
  for (int64_t p = 0; p < T * k; ++p) {
    TORCH_CHECK_VALUE(id[p] >= 0 && id[p] < E, "ids must be expert ids in [0, E=", E, "), got ", id[p]);
    ++offsets[id[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  cursor.assign(offsets.begin(), offsets.end() - 1);
  for (int64_t p = 0; p < T * k; ++p) pair_of[cursor[id[p]]++] = p;

  int64_t busiest = 0;
  for (int64_t e = 0; e < E; ++e) busiest = std::max(busiest, offsets[e + 1] - offsets[e]);
  const bool decode = busiest <= kGemvMaxRows;
  // The expert output of each sorted pair (y_sorted) and, at decode, the gate/up rows (h), in
  // the calling thread's Workspace: buffers allocated per call went back to the OS and were
  // faulted in again call after call (a perf profile at T = 16: ~1.3% of the samples in page
  // faults). Reused, T = 1 / 4 read 1.0-1.4 points more of the bandwidth in-process, and a
  // 2048-token prefill's 50 MB of sorted rows (over glibc's 32 MiB mmap bound: fresh pages every
  // call) ran the op 1.2-1.4x faster (bench/RESULTS.md, "A lead at each jump").
  const Workspace buf(size_t(T * k * (D + (decode ? I2 : 0))) * sizeof(float));
  float* ys = buf.as<float>();
  const at::Tensor y_sorted = at::from_blob(ys, {T * k, D}, x.options());
  const float* xp = x.data_ptr<float>();
  if (decode) {   // every chosen expert's int8 rows streamed once, all experts in one pass
    std::vector<int64_t> active;
    for (int64_t e = 0; e < E; ++e)
      if (offsets[e + 1] > offsets[e]) active.push_back(e);
    const at::Tensor h = at::from_blob(ys + T * k * D, {T * k, I2}, x.options());
#if defined(__AVX512F__)
    if (vnni::use_digits(D) && vnni::use_digits(I)) {
      // The digits of the T token rows, read through the sort, made by each thread of the
      // gate/up pass for itself (two threads: twice 14 us of work at T = 16, where a pass
      // of their own cost ~17 us on a slow hour and ~37 us on a fast one; see below).
      const RowsDigits token_digits{[&](int64_t ra, int64_t rb) {
                                      vnni::ActDigits d = vnni::alloc_digits(xp, T, D, D);
                                      vnni::fill_digits(d, 0, T);
                                      d.map.assign(rb, 0);
                                      for (int64_t r = ra; r < rb; ++r) d.map[r] = pair_of[r] / k;
                                      return d;
                                    },
                                    [](vnni::ActDigits&, int64_t, int64_t, int64_t) {}};   // all T made at once
      ExpertTiles gate_up = expert_tiles(offsets, active, xp, D, wgu.data_ptr<int8_t>(), gus.data_ptr<float>(), I2,
                                         h.data_ptr<float>(), packed);
      // a = silu(g) * u and its digits, made in the down pass by the thread that reads them:
      // the rows of its experts, whose h rows it wrote itself in the gate/up pass (both
      // passes split the same expert list at the same point, weighted_split), except around
      // a split, where the threads meet (MeetZone: each makes the rows of the experts it
      // takes there, its own copy). No pass of its own, and few rows cross between the cores:
      // on this host's fast-memory hours its two vCPUs sit on different CCDs, where a round
      // trip costs ~330 ns and reading the other core's rows ~26 GB/s (bench/RESULTS.md,
      // "Packed rows in groups of 16").
      const float* hp = h.data_ptr<float>();
      const RowsDigits silu_digits{[&](int64_t ra, int64_t rb) {
                                     vnni::ActDigits d = vnni::alloc_digits(nullptr, rb - ra, I, I);
                                     d.own_rows.resize((rb - ra) * I);
                                     d.x = d.own_rows.data();
                                     d.map.assign(rb, 0);
                                     for (int64_t r = ra; r < rb; ++r) d.map[r] = r - ra;
                                     return d;
                                   },
                                   [&](vnni::ActDigits& d, int64_t ra, int64_t r0, int64_t r1) {
                                     for (int64_t r = r0; r < r1; ++r)
                                       swiglu<float>(hp + r * I2, hp + r * I2 + I, d.own_rows.data() + (r - ra) * I, I);
                                     vnni::fill_digits(d, r0 - ra, r1 - ra);
                                   }};
      ExpertTiles down = expert_tiles(offsets, active, nullptr, I, wd.data_ptr<int8_t>(), ds.data_ptr<float>(), D, ys,
                                      packed);
      gate_up.nta = down.nta = true;
      decode_passes(gate_up, token_digits, down, silu_digits);
    } else
#endif
    {
      if (packed) wgu = unpacked(wgu, &active), wd = unpacked(wd, &active);   // the fp32 kernels read plain rows
      const at::Tensor a = at::empty({T * k, I}, x.options());
      auto xs = at::empty({T * k, D}, x.options());
      float* xsp = xs.data_ptr<float>();
      for (int64_t r = 0; r < T * k; ++r) std::copy_n(xp + (pair_of[r] / k) * D, D, xsp + r * D);
      expert_gemv(offsets, active, xsp, D, wgu.data_ptr<int8_t>(), gus.data_ptr<float>(), I2, h.data_ptr<float>());
      silu_mul_rows(h, a);
      expert_gemv(offsets, active, a.data_ptr<float>(), I, wd.data_ptr<int8_t>(), ds.data_ptr<float>(), D, ys);
    }
  } else {
#if defined(__AVX512F__)
    // Weight-only gate/up on the digits: each token's digits written once and read by
    // its k experts through the sort (k times fewer digits to write than per expert).
    vnni::ActDigits xd;
    const bool token_digits = !w8a8 && vnni::use_digit_gemm(D, I2);
    if (token_digits) {
      xd = vnni::digits_of(xp, T, D);
      xd.map.resize(T * k);
      for (int64_t r = 0; r < T * k; ++r) xd.map[r] = pair_of[r] / k;
    }
#else
    const bool token_digits = false;
#endif
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = offsets[e], n = offsets[e + 1] - r0;
      if (n == 0) continue;
      // Packed experts are unpacked for the GEMMs (O(N K) against their O(M N K)).
      const at::Tensor wgu_e = packed ? unpacked(wgu[e]) : wgu[e], wd_e = packed ? unpacked(wd[e]) : wd[e];
      const at::Tensor gus_e = gus[e], ds_e = ds[e];
      at::Tensor h = at::empty({n, I2}, x.options());
      if (n > kGemvMaxRows && token_digits) {
#if defined(__AVX512F__)
        vnni::digits_times_w(xd, r0, n, wgu_e, gus_e.data_ptr<float>(), nullptr, h.data_ptr<float>());
#endif
      } else {
        auto xs = at::empty({n, D}, x.options());
        float* xsp = xs.data_ptr<float>();
        at::parallel_for(0, n, row_grain(D), [&](int64_t a0, int64_t a1) {
          for (int64_t r = a0; r < a1; ++r) std::copy_n(xp + (pair_of[r0 + r] / k) * D, D, xsp + r * D);
        });
        if (n <= kGemvMaxRows)
          gemv(xsp, n, D, wgu_e.data_ptr<int8_t>(), gus_e.data_ptr<float>(), nullptr, I2, h.data_ptr<float>());
        else if (w8a8)
          int8_gemm_out(h.data_ptr<float>(), xs, wgu_e, gus_e, nullptr);
        else
          weight_only_gemm_out(h, xs, wgu_e, gus_e, c10::nullopt);
      }
      const at::Tensor a = at::empty({n, I}, x.options());
      silu_mul_rows(h, a);
      at::Tensor y = y_sorted.narrow(0, r0, n);
      if (n <= kGemvMaxRows)
        gemv(a.data_ptr<float>(), n, I, wd_e.data_ptr<int8_t>(), ds_e.data_ptr<float>(), nullptr, D, ys + r0 * D);
      else if (w8a8)
        int8_gemm_out(ys + r0 * D, a, wd_e, ds_e, nullptr);
      else
        weight_only_gemm_out(y, a, wd_e, ds_e, c10::nullopt);
    }
  }

  // Combine: out[t] = sum_j weights[t,j] * y of pair (t,j), slots in order.
  std::vector<int64_t> row_of(T * k);
  for (int64_t r = 0; r < T * k; ++r) row_of[pair_of[r]] = r;
  auto out = at::empty({T, D}, x.options());
  float* op = out.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      std::fill_n(op + t * D, D, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const float wt = wp[t * k + j];
        const float* yr = ys + row_of[t * k + j] * D;
        for (int64_t d = 0; d < D; ++d) op[t * D + d] += wt * yr[d];
      }
    }
  });
  return out.to(x_in.scalar_type());
}

// Which kernel serves int8_linear / fused_moe_int8 decode rows of K elements on
// this CPU and build (tests assert the VNNI kernel runs where the CPU has it).
std::string int8_decode_kernel(int64_t K) {
  TORCH_CHECK_VALUE(K >= 0, "int8_decode_kernel: K must be >= 0, got ", K);
  if (vnni::use_digits(K)) return "vnni_digits";
#if defined(__AVX512F__)
  return "avx512_fp32";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2_fp32";
#else
  return "portable_fp32";
#endif
}

// Which kernel serves weight-only int8_linear / fused_moe_int8 prefill of fp32 rows of
// K elements into N outputs on this CPU and build (weight_only_gemm_out's choice).
std::string int8_prefill_kernel(int64_t K, int64_t N) {
  TORCH_CHECK_VALUE(K >= 0 && N >= 0, "int8_prefill_kernel: K and N must be >= 0, got K=", K, ", N=", N);
#if defined(__AVX512F__)
  if (vnni::use_digit_gemm(K, N)) return "vnni_digits_gemm";
#endif
  return "dequantise_gemm";
}

}  // namespace
}  // namespace cpu
}  // namespace glm5

TORCH_LIBRARY_IMPL(glm5, CompositeExplicitAutograd, m) {
  m.impl("int8_decode_kernel", &glm5::cpu::int8_decode_kernel);
  m.impl("int8_prefill_kernel", &glm5::cpu::int8_prefill_kernel);
}

TORCH_LIBRARY_IMPL(glm5, CPU, m) {
  m.impl("int8_quantize_rows", &glm5::cpu::int8_quantize_rows);
  m.impl("int8_linear", &glm5::cpu::int8_linear);
  m.impl("int8_linear_heads", &glm5::cpu::int8_linear_heads);
  m.impl("w8a8_linear", &glm5::cpu::w8a8_linear);
  m.impl("fused_moe_int8", &glm5::cpu::fused_moe_int8);
}
