// The routed-expert layer on the CPU: counting sort by expert, a grouped
// SwiGLU GEMM chain per expert, weighted combine. Forward and backward.
//
// fused_moe_fwd(x[T,D], w_gate_up[E,2I,D], w_down[E,D,I], weights[T,k], ids int32[T,k]) -> out[T,D]
//   out[t] = sum_j weights[t,j] * W_down[e] (silu(g) * u),  [g; u] = W_gate_up[e] x[t],  e = ids[t,j]
// fused_moe_bwd(dout, x, w_gate_up, w_down, weights, ids) -> (dx, dw_gate_up, dw_down, dweights)
//
// Plan: a serial counting sort of the T*k (token, slot) pairs by expert (no
// general sort; a few microseconds even at T*k = 32K), stable like
// moe_dispatch. Sorted row r holds pair pair_of[r]; row_of is the inverse.
//
// Forward: work items are (expert, block of <= R of its rows), biggest first,
// handed out dynamically (csrc/cpu/parallel.h): many experts keep every thread
// busy, and an expert holding most tokens is split by rows, so 2 threads stay
// busy either way. An item gathers its token rows into per-thread scratch
// (ScatterMoE: no permuted copy of x), runs h = xs W_gu^T -> a = silu(g) * u
// -> y = a W_d^T with BLAS (single-threaded inside the parallel region) into
// its rows of y_sorted, and a second pass by token sums weights * y_sorted
// rows (a gather: deterministic, no atomics). At T <= 16 an expert has ~1 row:
// the GEMMs are GEMVs streaming the expert's weight rows once.
//
// Backward: the schema passes only the inputs, so the gate/up activations are
// recomputed (one GEMM per expert, +25% of the backward's FLOPs) rather than
// saved: saving them would keep T*k*2I floats per layer alive between forward
// and backward (256 MiB per layer at T=4096, k=8, I=2048), the memory MoE
// training runs out of first. dweights[t,j] = dout[t] . W_d a = (dout[t] W_d) . a,
// so y itself is never recomputed. One task owns an expert (its dW rows are
// written by that task only: no atomics); it walks its rows in blocks of <= R,
// accumulating dW with beta = 1. Experts holding a large share of the rows
// run first, one at a time, with multi-threaded BLAS (so one hot expert does
// not serialise the call on one thread); the rest run in parallel, one expert
// per task, single-threaded BLAS. dx: each row's dx_row = dh W_gu goes to a
// sorted buffer, then a pass by token sums a token's k rows (no atomics).
//
// Precision: fp32 and float64 compute in their own type; fp16/bf16 convert x
// rows and each expert's weights to fp32 in scratch (the reference computes in
// fp32 too) and round once at the end.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "cpu/gemv_tiles.h"
#include "cpu/parallel.h"
#include "cpu/swiglu.h"
#include "cpu/workspace.h"

namespace glm5 {
namespace cpu {
namespace {

constexpr int64_t kMaxRows = 256;
// Up to this many rows the register-tiled kernel below beats BLAS (measured on
// the 2-core Xeon, one thread, D=1024, I=512: 1.3x at 16 rows, 0.95x at 32).
constexpr int64_t kSmallRows = 24;  // rows per GEMM block: large enough for full BLAS speed, bounds scratch

// Row-major C[M,N] = op(A)[M,K] op(B)[K,N] + beta C on raw scratch pointers,
// through at::mm_out / at::addmm_out on from_blob views (no data is
// allocated or copied: the views carry the leading dimensions and
// transposes, which torch hands to BLAS as they are). Inside a parallel
// region BLAS runs single-threaded; outside it uses every thread.
template <typename T>
at::Tensor mat(const T* p, int64_t rows, int64_t cols, int64_t ld, bool trans) {
  const auto opt = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  at::Tensor m = at::from_blob(const_cast<T*>(p), {trans ? cols : rows, trans ? rows : cols}, {ld, 1}, opt);
  return trans ? m.t() : m;
}

template <typename T>
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
          T beta, T* C, int64_t ldc) {
  at::Tensor c = mat(C, M, N, ldc, false);
  if (beta == T(0))
    at::mm_out(c, mat(A, M, K, lda, ta), mat(B, K, N, ldb, tb));
  else
    at::addmm_out(c, c, mat(A, M, K, lda, ta), mat(B, K, N, ldb, tb), beta, 1);
}

// C[M,N] = A[M,K] B[N,K]^T for a few rows of A (a decode-sized expert):
// register tiles of MR rows of A by NR rows of B, so each weight row of B is
// read from memory once and reused from L1 by every row of A. BLAS packs B
// first, which costs more than the product when M is small (measured with
// MKL at D=1024, 2I=1024: 42 GFLOP/s at M=16 against 155 at M=256).
template <typename T, int MR, int NR>
void nt_tile(int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc) {
  using Vec = at::vec::Vectorized<T>;
  Vec acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = Vec(T(0));
  int64_t k = 0;
  for (; k + Vec::size() <= K; k += Vec::size()) {
    Vec a[MR];
    for (int m = 0; m < MR; ++m) a[m] = Vec::loadu(A + m * lda + k);
    for (int n = 0; n < NR; ++n) {
      Vec b = Vec::loadu(B + n * ldb + k);
#if defined(CPU_CAPABILITY_AVX512)
      // Keep b in a register: folded into each FMA as a memory operand it
      // would be loaded MR times, and the loop would be bound by loads.
      if constexpr (std::is_same_v<T, float>) {
        __m512 r = b;
        asm volatile("" : "+v"(r));
        b = Vec(r);
      }
#endif
      for (int m = 0; m < MR; ++m) acc[m][n] = at::vec::fmadd(a[m], b, acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      T sum = at::vec::vec_reduce_all<T>([](Vec x, Vec y) { return x + y; }, acc[m][n]);
      for (int64_t kk = k; kk < K; ++kk) sum += A[m * lda + kk] * B[n * ldb + kk];
      C[m * ldc + n] = sum;
    }
}

// Row blocks of A for gemm_nt_small: 4 rows (16 accumulators with NR = 4),
// with 5 and 6 split 3 + 2 and 3 + 3 rather than leaving a lone row.
inline int64_t row_block(int64_t rem) { return (rem == 5 || rem == 6) ? 3 : std::min<int64_t>(4, rem); }

template <typename T, int NR>
void nt_rows(int64_t mr, int64_t K, const T* a, int64_t lda, const T* b, int64_t ldb, T* c, int64_t ldc) {
  switch (mr) {
    case 4: return nt_tile<T, 4, NR>(K, a, lda, b, ldb, c, ldc);
    case 3: return nt_tile<T, 3, NR>(K, a, lda, b, ldb, c, ldc);
    case 2: return nt_tile<T, 2, NR>(K, a, lda, b, ldb, c, ldc);
    default: return nt_tile<T, 1, NR>(K, a, lda, b, ldb, c, ldc);
  }
}

// How many NR-row tiles of B ahead to prefetch. Each tile is swept once per
// row block of A: only the first sweep reads memory, the others hit L1, and
// the hardware prefetcher, which follows demand misses, idles through them.
// Requests for a later tile spread over those sweeps keep the weight stream
// running while the core computes (T=256, E=128: 62 -> 56 ms measured).
constexpr int64_t kPrefetchTiles = 2;

template <typename T>
void gemm_nt_small(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
                   int64_t ldc) {
  // Each tile of NR rows of B (16 KiB at K = 1024: L1-resident) is swept by every row block of A (L2).
  constexpr int NR = 4;
  int64_t blocks = 0;
  for (int64_t m = 0; m < M; m += row_block(M - m)) ++blocks;
  // One sweep (a row or two): the hardware prefetcher follows the stream by itself.
  const int64_t ahead_tiles = blocks >= 2 ? kPrefetchTiles : 0;
  const int64_t per_sweep = (NR * K * int64_t(sizeof(T)) / 64 + blocks - 1) / blocks;  // cache lines
  for (int64_t n = 0; n < N; n += NR) {
    const char* ahead = reinterpret_cast<const char*>(B + std::min(n + ahead_tiles * NR, N) * ldb);
    const char* ahead_end = reinterpret_cast<const char*>(B + std::min(n + (ahead_tiles + 1) * NR, N) * ldb);
    for (int64_t m = 0; m < M;) {
      if (ahead_tiles)
        for (int64_t l = 0; l < per_sweep && ahead < ahead_end; ++l, ahead += 64) __builtin_prefetch(ahead, 0, 2);
      const int64_t mr = row_block(M - m);
      const T* a = A + m * lda;
      T* c = C + m * ldc + n;
      if (n + NR <= N)
        nt_rows<T, NR>(mr, K, a, lda, B + n * ldb, ldb, c, ldc);
      else
        for (int64_t j = n; j < N; ++j) nt_rows<T, 1>(mr, K, a, lda, B + j * ldb, ldb, c + (j - n), ldc);
      m += mr;
    }
  }
}

// The small-M product for an expert's rows: at decode sizes (<= kGemvRows
// rows, fp32) the matrix-vector tiles of gemv_tiles.h, which stream 8 weight
// rows side by side (4 at 3-4 rows); above, the 4 x 4 tiles with spread
// prefetch above. Measured on the small preset's experts (D=1024, I=256, top-6
// of 64, 2 threads, weights streamed from memory): T=1/4/16/32 at 24/24/22/22
// GB/s with the 4 x 4 tiles against 30/31/27/26 with the gemv tiles; at 6+
// rows per expert (T >= 64) the two are level, and beyond the 4 x 4 tiles win.
constexpr int64_t kGemvRows = 4;

template <typename T>
void gemm_nt_few(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, T* C, int64_t ldc) {
  if constexpr (std::is_same_v<T, float>) {
    if (M <= kGemvRows) return gemv::rows<float>(A, lda, M, K, B, nullptr, nullptr, 0, N, C, ldc);
  }
  gemm_nt_small<T>(M, N, K, A, lda, B, K, C, ldc);
}

// src (n elements, scalar_t) -> dst (acc_t); a copy when the types agree.
template <typename S, typename A>
void to_acc(const S* src, A* dst, int64_t n) {
  if constexpr (std::is_same_v<S, A>)
    std::memcpy(dst, src, n * sizeof(A));
  else
    at::vec::convert(src, dst, n);
}

// Below this much work a call runs on the calling thread: waking the other
// workers costs more (and, on a shared machine, waits for a busy core's time
// slice: ~10 ms measured under load at E=16, D=128). 2^24 FLOPs: ~0.2 ms on one core.
constexpr int64_t kSerialFlops = int64_t(1) << 24;
// ...and below this many weight bytes. Decode is the other way round: at T=1
// the 6 chosen experts are few FLOPs but megabytes of weights, and one thread
// streams about half the machine's read bandwidth (fused_moe fp32 at T=1 on
// the small preset: 13.8 GB/s serial).
constexpr int64_t kSerialBytes = int64_t(1) << 19;

template <typename MakeScratch, typename Body>
void run_items(int64_t n, bool serial, MakeScratch make_scratch, Body body) {
  if (!serial) return parallel_dynamic(n, make_scratch, body);
  auto scratch = make_scratch();
  for (int64_t i = 0; i < n; ++i) body(i, scratch);
}

struct Plan {
  int64_t T = 0, k = 0, E = 0, N = 0;
  std::vector<int64_t> start;    // [E+1]: expert e owns sorted rows [start[e], start[e+1])
  std::vector<int32_t> pair_of;  // [N]: the pair p = t*k + j at sorted row r
  std::vector<int32_t> row_of;   // [N]: the sorted row of pair p
  int64_t rows(int64_t e) const { return start[e + 1] - start[e]; }
};

Plan make_plan(const at::Tensor& ids, int64_t E) {
  Plan p;
  p.T = ids.size(0);
  p.k = ids.size(1);
  p.E = E;
  p.N = p.T * p.k;
  const int32_t* id = ids.const_data_ptr<int32_t>();
  p.start.assign(E + 1, 0);
  for (int64_t q = 0; q < p.N; ++q) {
    TORCH_CHECK_VALUE(id[q] >= 0 && id[q] < E, "ids must be expert ids in [0, E=", E, "), got ", id[q], " at [", q / p.k,
                      ",", q % p.k, "]");
    ++p.start[id[q] + 1];
  }
  for (int64_t e = 0; e < E; ++e) p.start[e + 1] += p.start[e];
  std::vector<int64_t> cur(p.start.begin(), p.start.end() - 1);
  p.pair_of.resize(p.N);
  p.row_of.resize(p.N);
  for (int64_t q = 0; q < p.N; ++q) {
    const int64_t r = cur[id[q]]++;
    p.pair_of[r] = static_cast<int32_t>(q);
    p.row_of[q] = static_cast<int32_t>(r);
  }
  return p;
}

struct Shapes {
  int64_t T, D, E, I, k;
};

Shapes check_args(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down,
                  const at::Tensor& weights, const at::Tensor& ids) {
  check_fused_moe_args(x, w_gate_up, w_down, weights, ids);
  return {x.size(0), x.size(1), w_gate_up.size(0), w_gate_up.size(1) / 2, ids.size(1)};
}

// Work items, biggest first: (expert, first row, row count).
struct Item {
  int64_t e, r0, n;
};

// out[t] = sum_j scale[t,j] * rows[row_of[t*k+j]] (scale null: unit weights), cast to scalar_t.
template <typename scalar_t, typename acc_t>
void gather_sum(const Plan& p, const acc_t* rows, const acc_t* scale, int64_t D, scalar_t* out) {
  const int64_t per_item = std::max<int64_t>(1, 16384 / (D * p.k + 1));
  run_items((p.T + per_item - 1) / per_item, 2 * p.N * D < kSerialFlops, [&] { return std::vector<acc_t>(D); },
                   [&](int64_t item, std::vector<acc_t>& buf) {
                     using Vec = at::vec::Vectorized<acc_t>;
                     for (int64_t t = item * per_item, t1 = std::min(p.T, t + per_item); t < t1; ++t) {
                       acc_t* acc = std::is_same_v<scalar_t, acc_t> ? reinterpret_cast<acc_t*>(out + t * D) : buf.data();
                       std::fill(acc, acc + D, acc_t(0));
                       for (int64_t j = 0; j < p.k; ++j) {
                         const acc_t* src = rows + int64_t(p.row_of[t * p.k + j]) * D;
                         const acc_t w = scale ? scale[t * p.k + j] : acc_t(1);
                         at::vec::map2<acc_t>([w](Vec a, Vec b) { return a + Vec(w) * b; }, acc, acc, src, D);
                       }
                       if constexpr (!std::is_same_v<scalar_t, acc_t>) at::vec::convert(acc, out + t * D, D);
                     }
                   });
}

// Per-thread scratch: expert weights in acc_t (half precision only) and row blocks.
template <typename acc_t>
struct Scratch {
  std::vector<acc_t> wgu, wd, xs, h, a, dys;
};

// The expert's weights as acc_t pointers: the tensors themselves, or a conversion into scratch.
template <typename scalar_t, typename acc_t>
std::pair<const acc_t*, const acc_t*> expert_weights(const scalar_t* wgu, const scalar_t* wd, int64_t e, int64_t D,
                                                     int64_t I, Scratch<acc_t>& s) {
  const scalar_t* gu = wgu + e * 2 * I * D;
  const scalar_t* dn = wd + e * D * I;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return {gu, dn};
  } else {
    s.wgu.resize(2 * I * D);
    s.wd.resize(D * I);
    at::vec::convert(gu, s.wgu.data(), 2 * I * D);
    at::vec::convert(dn, s.wd.data(), D * I);
    return {s.wgu.data(), s.wd.data()};
  }
}

template <typename scalar_t, typename acc_t>
void fwd_kernel(const Plan& p, const Shapes& sh, const scalar_t* xp, const scalar_t* wgup, const scalar_t* wdp,
                const acc_t* wts, scalar_t* outp) {
  const int64_t D = sh.D, I = sh.I, threads = at::get_num_threads();
  // Enough items for dynamic balancing (>= 4 per thread), none so small that BLAS loses efficiency.
  const int64_t block = std::clamp<int64_t>((p.N + 4 * threads - 1) / (4 * threads), 16, kMaxRows);
  std::vector<Item> items;
  for (int64_t e = 0; e < p.E; ++e)
    for (int64_t r = p.start[e]; r < p.start[e + 1]; r += block) items.push_back({e, r, std::min(block, p.start[e + 1] - r)});
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.n > b.n; });

  // Uninitialised: every row is written by exactly one item.
  const Workspace y_buf(p.N * D * sizeof(acc_t));
  acc_t* const y_sorted = y_buf.as<acc_t>();
  int64_t experts_used = 0;
  for (int64_t e = 0; e < p.E; ++e) experts_used += p.rows(e) > 0;
  const bool serial = 6 * p.N * D * I < kSerialFlops && experts_used * 3 * I * D * int64_t(sizeof(scalar_t)) < kSerialBytes;
  run_items(static_cast<int64_t>(items.size()), serial, [] { return Scratch<acc_t>(); },
            [&](int64_t it, Scratch<acc_t>& s) {
    const Item& item = items[it];
    const int64_t n = item.n;
    s.xs.resize(n * D);
    s.h.resize(n * 2 * I);
    s.a.resize(n * I);
    for (int64_t i = 0; i < n; ++i)
      to_acc(xp + int64_t(p.pair_of[item.r0 + i] / p.k) * D, s.xs.data() + i * D, D);
    auto [gu, dn] = expert_weights<scalar_t, acc_t>(wgup, wdp, item.e, D, I, s);
    const bool small = n <= kSmallRows;
    if (small)
      gemm_nt_few<acc_t>(n, 2 * I, D, s.xs.data(), D, gu, s.h.data(), 2 * I);
    else
      gemm<acc_t>(false, true, n, 2 * I, D, s.xs.data(), D, gu, D, acc_t(0), s.h.data(), 2 * I);
    for (int64_t i = 0; i < n; ++i) {
      const acc_t* h = s.h.data() + i * 2 * I;
      swiglu<acc_t>(h, h + I, s.a.data() + i * I, I);
    }
    if (small)
      gemm_nt_few<acc_t>(n, D, I, s.a.data(), I, dn, y_sorted + item.r0 * D, D);
    else
      gemm<acc_t>(false, true, n, D, I, s.a.data(), I, dn, I, acc_t(0), y_sorted + item.r0 * D, D);
  });
  gather_sum<scalar_t, acc_t>(p, y_sorted, wts, D, outp);
}

template <typename scalar_t, typename acc_t>
struct BwdArgs {
  const Plan& p;
  const Shapes& sh;
  const scalar_t *xp, *dop, *wgup, *wdp;
  const acc_t* wts;
  acc_t* dwts;       // [T*k]
  acc_t* dx_sorted;  // [N, D]
  acc_t *dwgu, *dwd;  // [E,2I,D], [E,D,I]: the outputs (acc_t == scalar_t) or fp32 buffers
};

// One expert's backward, in row blocks of <= kMaxRows; threaded: called outside
// a parallel region (BLAS and the row loops use every thread).
template <typename scalar_t, typename acc_t>
void expert_bwd(const BwdArgs<scalar_t, acc_t>& A, int64_t e, Scratch<acc_t>& s, bool threaded) {
  const Plan& p = A.p;
  const int64_t D = A.sh.D, I = A.sh.I, k = p.k;
  using Vec = at::vec::Vectorized<acc_t>;
  auto [gu, dn] = expert_weights<scalar_t, acc_t>(A.wgup, A.wdp, e, D, I, s);
  acc_t* dgu = A.dwgu + e * 2 * I * D;
  acc_t* dd = A.dwd + e * D * I;
  const int64_t block = threaded ? 4 * kMaxRows : kMaxRows;
  s.xs.resize(block * D);
  s.dys.resize(block * D);
  s.h.resize(block * 2 * I);
  s.a.resize(block * I);
  auto rows = [&](int64_t n, auto fn) {  // fn(i) for i in [0, n), split over threads when threaded
    if (threaded)
      at::parallel_for(0, n, 8, [&](int64_t i0, int64_t i1) { for (int64_t i = i0; i < i1; ++i) fn(i); });
    else
      for (int64_t i = 0; i < n; ++i) fn(i);
  };
  for (int64_t r0 = p.start[e]; r0 < p.start[e + 1]; r0 += block) {
    const int64_t n = std::min(block, p.start[e + 1] - r0);
    const acc_t beta = r0 == p.start[e] ? acc_t(0) : acc_t(1);
    rows(n, [&](int64_t i) {
      const int64_t t = p.pair_of[r0 + i] / k;
      to_acc(A.xp + t * D, s.xs.data() + i * D, D);
      to_acc(A.dop + t * D, s.dys.data() + i * D, D);
    });
    // h = xs W_gu^T (the recomputed gate/up); dA = dout W_d (the gradient of a, before the weight).
    if (n <= kSmallRows)
      gemm_nt_few<acc_t>(n, 2 * I, D, s.xs.data(), D, gu, s.h.data(), 2 * I);
    else
      gemm<acc_t>(false, true, n, 2 * I, D, s.xs.data(), D, gu, D, acc_t(0), s.h.data(), 2 * I);
    gemm<acc_t>(false, false, n, I, D, s.dys.data(), D, dn, I, acc_t(0), s.a.data(), I);
    // Per row: dweights = dA . a; then h <- dh = [dg, du] and the dA buffer <- w * a (for dW_d).
    rows(n, [&](int64_t i) {
      const int64_t q = p.pair_of[r0 + i];
      const acc_t w = A.wts[q];
      acc_t* g = s.h.data() + i * 2 * I;
      acc_t* u = g + I;
      acc_t* da = s.a.data() + i * I;
      Vec dot(acc_t(0));
      int64_t c = 0;
      const Vec one(acc_t(1)), vw(w);
      for (; c + Vec::size() <= I; c += Vec::size()) {
        const Vec gv = Vec::loadu(g + c), uv = Vec::loadu(u + c), dav = Vec::loadu(da + c);
        const Vec sig = (one + gv.neg().exp()).reciprocal(), sv = gv * sig, av = sv * uv, dsc = vw * dav;
        dot = dot + dav * av;
        (dsc * uv * sig * (one + gv * (one - sig))).store(g + c);
        (dsc * sv).store(u + c);
        (vw * av).store(da + c);
      }
      acc_t tail = 0;
      for (; c < I; ++c) {
        const acc_t gv = g[c], uv = u[c], dav = da[c];
        const acc_t sig = acc_t(1) / (acc_t(1) + std::exp(-gv)), sv = gv * sig, av = sv * uv, dsc = w * dav;
        tail += dav * av;
        g[c] = dsc * uv * sig * (acc_t(1) + gv * (acc_t(1) - sig));
        u[c] = dsc * sv;
        da[c] = w * av;
      }
      A.dwts[q] = at::vec::vec_reduce_all<acc_t>([](Vec x, Vec y) { return x + y; }, dot) + tail;
    });
    // dW_d += dout^T (w a); dW_gu += dh^T xs; dx rows = dh W_gu.
    gemm<acc_t>(true, false, D, I, n, s.dys.data(), D, s.a.data(), I, beta, dd, I);
    gemm<acc_t>(true, false, 2 * I, D, n, s.h.data(), 2 * I, s.xs.data(), D, beta, dgu, D);
    gemm<acc_t>(false, false, n, D, 2 * I, s.h.data(), 2 * I, gu, D, acc_t(0), A.dx_sorted + r0 * D, D);
  }
}

template <typename scalar_t, typename acc_t>
void bwd_kernel(const BwdArgs<scalar_t, acc_t>& A, scalar_t* dxp) {
  const Plan& p = A.p;
  const int64_t D = A.sh.D, I = A.sh.I, threads = at::get_num_threads();
  const bool serial = 16 * p.N * D * I < kSerialFlops;
  std::vector<int64_t> big, small, idle;
  for (int64_t e = 0; e < p.E; ++e) {
    const int64_t n = p.rows(e);
    if (n == 0)
      idle.push_back(e);
    else if (!serial && threads > 1 && n >= 64 && n * 4 * threads > p.N)  // > 1/(4 threads) of the rows: own phase
      big.push_back(e);
    else
      small.push_back(e);
  }
  std::stable_sort(small.begin(), small.end(), [&](int64_t a, int64_t b) { return p.rows(a) > p.rows(b); });
  // Experts nobody chose get zero weight gradients.
  at::parallel_for(0, static_cast<int64_t>(idle.size()), serial ? int64_t(1) << 40 : 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      std::fill_n(A.dwgu + idle[i] * 2 * I * D, 2 * I * D, acc_t(0));
      std::fill_n(A.dwd + idle[i] * D * I, D * I, acc_t(0));
    }
  });
  Scratch<acc_t> s;
  for (int64_t e : big) expert_bwd<scalar_t, acc_t>(A, e, s, true);
  run_items(static_cast<int64_t>(small.size()), serial, [] { return Scratch<acc_t>(); },
            [&](int64_t i, Scratch<acc_t>& sc) { expert_bwd<scalar_t, acc_t>(A, small[i], sc, false); });
  gather_sum<scalar_t, acc_t>(p, A.dx_sorted, nullptr, D, dxp);
}

}  // namespace

at::Tensor fused_moe_fwd(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down,
                         const at::Tensor& weights, const at::Tensor& ids) {
  const Shapes sh = check_args(x, w_gate_up, w_down, weights, ids);
  const at::Tensor idc = ids.contiguous();
  const Plan p = make_plan(idc, sh.E);
  at::Tensor out = at::empty({sh.T, sh.D}, x.options());
  if (p.N == 0 || sh.I == 0 || sh.D == 0) return out.zero_();
  const at::Tensor xc = x.contiguous(), wgu = w_gate_up.contiguous(), wd = w_down.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "glm5_fused_moe_fwd", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const at::Tensor w = weights.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
    fwd_kernel<scalar_t, acc_t>(p, sh, xc.const_data_ptr<scalar_t>(), wgu.const_data_ptr<scalar_t>(),
                                wd.const_data_ptr<scalar_t>(), w.const_data_ptr<acc_t>(), out.data_ptr<scalar_t>());
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_moe_bwd(const at::Tensor& dout, const at::Tensor& x,
                                                                         const at::Tensor& w_gate_up,
                                                                         const at::Tensor& w_down,
                                                                         const at::Tensor& weights,
                                                                         const at::Tensor& ids) {
  const Shapes sh = check_args(x, w_gate_up, w_down, weights, ids);
  TORCH_CHECK_VALUE(dout.sizes() == x.sizes(), "dout must have shape [T,D] = ", x.sizes(), " like x, got ", dout.sizes());
  TORCH_CHECK_TYPE(dout.scalar_type() == x.scalar_type(), "dout must have the dtype of x (", x.scalar_type(), "), got ",
                   dout.scalar_type());
  TORCH_CHECK_VALUE(dout.device() == x.device(), "dout must be on ", x.device(), " like x, got ", dout.device());
  const at::Tensor idc = ids.contiguous();
  const Plan p = make_plan(idc, sh.E);
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor dwgu = at::empty_like(w_gate_up, at::MemoryFormat::Contiguous);
  at::Tensor dwd = at::empty_like(w_down, at::MemoryFormat::Contiguous);
  at::Tensor dwts = at::empty_like(weights, at::MemoryFormat::Contiguous);
  if (p.N == 0 || sh.I == 0 || sh.D == 0) return {dx.zero_(), dwgu.zero_(), dwd.zero_(), dwts.zero_()};
  const at::Tensor xc = x.contiguous(), dc = dout.contiguous(), wgu = w_gate_up.contiguous(), wd = w_down.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "glm5_fused_moe_bwd", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    constexpr auto acc_type = c10::CppTypeToScalarType<acc_t>::value;
    constexpr bool direct = std::is_same_v<scalar_t, acc_t>;  // dW written straight into the outputs
    const at::Tensor w = weights.to(acc_type).contiguous();
    at::Tensor dwts_acc = at::empty({p.N}, x.options().dtype(acc_type));
    at::Tensor dwgu_acc = direct ? dwgu : at::empty(dwgu.sizes(), x.options().dtype(acc_type));
    at::Tensor dwd_acc = direct ? dwd : at::empty(dwd.sizes(), x.options().dtype(acc_type));
    const Workspace dx_buf(p.N * sh.D * sizeof(acc_t));  // every row written once
    acc_t* const dx_sorted = dx_buf.as<acc_t>();
    BwdArgs<scalar_t, acc_t> A{p, sh, xc.const_data_ptr<scalar_t>(), dc.const_data_ptr<scalar_t>(),
                               wgu.const_data_ptr<scalar_t>(), wd.const_data_ptr<scalar_t>(), w.const_data_ptr<acc_t>(),
                               dwts_acc.data_ptr<acc_t>(), dx_sorted, dwgu_acc.data_ptr<acc_t>(),
                               dwd_acc.data_ptr<acc_t>()};
    bwd_kernel<scalar_t, acc_t>(A, dx.data_ptr<scalar_t>());
    if constexpr (!direct) {
      dwgu.copy_(dwgu_acc);
      dwd.copy_(dwd_acc);
    }
    dwts.copy_(dwts_acc.view(weights.sizes()));
  });
  return {dx, dwgu, dwd, dwts};
}

}  // namespace cpu
}  // namespace glm5

TORCH_LIBRARY_IMPL(glm5, CPU, m) {
  m.impl("fused_moe_fwd", &glm5::cpu::fused_moe_fwd);
  m.impl("fused_moe_bwd", &glm5::cpu::fused_moe_bwd);
}
