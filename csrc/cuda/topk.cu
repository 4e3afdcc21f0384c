// topk_indices on CUDA: a radix select in the style of SGLang's fast_topk
// (docs/KERNELS.md, "Top-k selection"), one thread block per row.
//
// Per row (len elements, k wanted):
//  1. Coarse pass: an 11-bit histogram in shared memory of coarse_bin(x), the
//     top bits of the order-preserving key of x rounded to fp16 (common.cuh).
//     NaN and -inf (key 0) are not counted: they are never selected.
//  2. A block-wide suffix scan finds the threshold bin tb, the one holding the
//     k-th largest key. If the row has <= k selectable entries, all of them
//     are taken and -1 fills the rest.
//  3. Split pass: entries in bins above tb are written to the output at once
//     (a warp-aggregated shared-memory slot counter); entries of bin tb are
//     collected, as (fp32 key, index), into shared memory (4096 slots). When
//     bin tb holds exactly the number still needed it is taken whole.
//  4. Refinement: 8-bit radix passes over the candidates on the fp32 key,
//     from the highest bit in which the candidates differ (their min and max
//     key are tracked while collecting) down to bit 0, each writing the
//     candidates above its threshold digit, stopping early once the threshold
//     digit holds exactly the number still needed; when bin tb held more
//     than 4096 entries the same passes run over the row in global memory
//     instead (re-reading it, filtered by bin tb).
//     Whatever is still needed after the last pass are ties: any of them.
//  5. sorted=True with k <= 4096: a block-wide bitonic sort in shared memory
//     of (key, ~index) pairs: descending by value, ties by lower index first.
//     Larger k: sorted on the host side with ATen (rare path).
// Loads are 16-byte vectors (several in flight per thread) when the row
// allows. Cost model for one long row on one SM: the two passes are bound by
// instruction issue (~128 lanes/clock), not bytes, so the per-element work is
// kept to a key, a bin and one ballot (warps with nothing at or above the
// threshold bin skip the rest of the split pass). Rows up to 2^31 - 1 long,
// any k <= T. Launch: 1024 threads per row for rows >= 8192, 256 otherwise.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "checks.h"
#include "cuda/common.cuh"
#include "cuda/topk.cuh"

namespace glm5 {
namespace cuda {
namespace {

constexpr int kCoarseBins = 2048;
constexpr int kCandCap = 4096;  // threshold-bin candidates kept in shared memory
static_assert(kTopkSortCap <= kCandCap, "the sort reuses the candidate buffer");

// Calls f(i, value, ok) for every element of row[0, len), every thread of the
// block the same number of times (ok is false for the padding calls), so f
// may use full-warp collectives. vec: the row starts 16-byte aligned.
template <typename scalar_t, int BLOCK, typename F>
__device__ __forceinline__ void for_each_in_row(const scalar_t* __restrict__ row, int64_t len, bool vec, F&& f) {
  constexpr int VEC = 16 / sizeof(scalar_t);
  constexpr int U = 4;  // vector loads in flight per thread
  int64_t vend = 0;
  if (vec) {
    const int64_t nvec = len / VEC;
    const uint4* v = reinterpret_cast<const uint4*>(row);
    for (int64_t base = 0; base < nvec; base += static_cast<int64_t>(BLOCK) * U) {
      uint4 buf[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t j = base + u * BLOCK + threadIdx.x;
        buf[u] = j < nvec ? __ldg(v + j) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t j = base + u * BLOCK + threadIdx.x;
        const bool ok = j < nvec;
        const scalar_t* e = reinterpret_cast<const scalar_t*>(&buf[u]);
#pragma unroll
        for (int x = 0; x < VEC; ++x) f(j * VEC + x, to_float(e[x]), ok);
      }
    }
    vend = nvec * VEC;
  }
  for (int64_t base = vend; base < len; base += BLOCK) {
    const int64_t i = base + threadIdx.x;
    const bool ok = i < len;
    f(i, ok ? to_float(row[i]) : 0.f, ok);
  }
}

// Shared-memory scratch of one block.
struct Smem {
  unsigned hist[kCoarseBins];
  unsigned long long buf[kCandCap];  // candidates (key << 32 | index), then the sort
  unsigned warp_buf[32];
  unsigned n_out, n_cand, total, bin, above;
  uint32_t kmin, kmax;  // key range of the shared-memory candidates
};

// The bin holding the need-th largest entry of hist[0, NB) counted from the
// top: sm.bin gets it and sm.above the count in the bins above it; sm.total
// gets the sum of hist. Leaves sm.bin unset when the total is below need.
// Every thread calls it; ends with a barrier.
template <int NB, int BLOCK>
__device__ __forceinline__ void find_threshold(Smem& sm, unsigned need) {
  constexpr int BPT = NB >= BLOCK ? NB / BLOCK : 1;
  static_assert(NB % BPT == 0, "bins per thread");
  const int lo = threadIdx.x * BPT;
  unsigned local = 0;
  if (lo < NB) {
#pragma unroll
    for (int j = 0; j < BPT; ++j) local += sm.hist[lo + j];
  }
  unsigned total;
  unsigned above = block_excl_suffix<BLOCK>(local, sm.warp_buf, &total);
  if (threadIdx.x == 0) sm.total = total;
  if (lo < NB) {
#pragma unroll
    for (int j = BPT - 1; j >= 0; --j) {
      const unsigned h = sm.hist[lo + j];
      if (above < need && above + h >= need) {
        sm.bin = lo + j;
        sm.above = above;
      }
      above += h;
    }
  }
  __syncthreads();
}

// Candidates in shared memory: sm.buf[0, n).
template <int BLOCK>
struct SmemCandidates {
  const unsigned long long* buf;
  unsigned n;
  template <typename F>
  __device__ __forceinline__ void for_each(F&& f) const {
    for (unsigned base = 0; base < n; base += BLOCK) {
      const unsigned i = base + threadIdx.x;
      const bool ok = i < n;
      const unsigned long long e = ok ? buf[i] : 0ull;
      f(static_cast<uint32_t>(e >> 32), static_cast<int32_t>(e & 0xffffffffull), ok);
    }
  }
};

// Candidates re-read from the row: the entries of coarse bin tb.
template <typename scalar_t, int BLOCK>
struct RowCandidates {
  const scalar_t* row;
  int64_t len;
  bool vec;
  uint32_t tb;
  template <typename F>
  __device__ __forceinline__ void for_each(F&& f) const {
    const uint32_t bin = tb;
    for_each_in_row<scalar_t, BLOCK>(row, len, vec, [&](int64_t i, float v, bool ok) {
      f(radix_key(v), static_cast<int32_t>(i), ok && selectable(v) && coarse_bin(v) == bin);
    });
  }
};

// Chooses `need` (>= 1) of the candidates (more than `need` of them): 8-bit
// radix passes over the fp32 key bits below `top` (the bits at and above it
// are the same in every candidate: `prefix`), then ties. Writes out[] through
// the slot counter sm.n_out, which stops mattering past k.
template <int BLOCK, class Cands>
__device__ __forceinline__ void refine(Smem& sm, const Cands& cands, unsigned need, int32_t* __restrict__ out,
                                       unsigned k, int top, uint32_t prefix) {
  uint32_t mask = top >= 32 ? 0u : (0xffffffffu << top);
  prefix &= mask;
  while (top > 0) {
    const int shift = top > 8 ? top - 8 : 0;
    top = shift;
    for (int i = threadIdx.x; i < 256; i += BLOCK) sm.hist[i] = 0u;
    __syncthreads();
    cands.for_each([&](uint32_t key, int32_t, bool ok) {
      if (ok && (key & mask) == prefix) atomicAdd(&sm.hist[(key >> shift) & 255u], 1u);
    });
    __syncthreads();
    find_threshold<256, BLOCK>(sm, need);
    const uint32_t d = sm.bin;
    const unsigned above = sm.above;
    const unsigned cnt = sm.hist[d];
    if (above > 0) {
      cands.for_each([&](uint32_t key, int32_t idx, bool ok) {
        const bool sel = ok && (key & mask) == prefix && ((key >> shift) & 255u) > d;
        const unsigned slot = warp_alloc(sel, &sm.n_out);
        if (sel) out[slot] = idx;
      });
    }
    prefix |= d << shift;
    mask |= 255u << shift;  // bits of this pass (those above `top` before it were already in mask)
    need -= above;
    __syncthreads();  // sm.hist, sm.bin are rewritten next pass
    if (cnt == need) break;
  }
  // The rest: every candidate with the final prefix is at least as large as
  // the need-th; either exactly `need` of them remain, or they are all equal.
  cands.for_each([&](uint32_t key, int32_t idx, bool ok) {
    const bool sel = ok && (key & mask) == prefix;
    const unsigned slot = warp_alloc(sel, &sm.n_out);
    if (sel && slot < k) out[slot] = idx;
  });
}

template <typename scalar_t, int BLOCK>
__global__ void __launch_bounds__(BLOCK) topk_kernel(TopkRows m, int64_t rows, bool sort, bool vec_rows) {
  __shared__ Smem sm;
  const unsigned k = static_cast<unsigned>(m.k);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    // --- which row, how long, where to ---
    int64_t len = m.T, out_row = r;
    if (m.fused) {
      const int64_t b = m.b0 + r / m.gs, s = m.sa + r % m.gs;
      out_row = b * m.S + s;
      if (m.causal) {
        const int64_t qs = m.q_start != nullptr ? m.q_start[b] : m.T - m.S;
        len = std::min<int64_t>(std::max<int64_t>(qs + s + 1, 0), m.T);
      }
    }
    const scalar_t* row = static_cast<const scalar_t*>(m.in) + r * m.in_stride;
    int32_t* out = m.out + out_row * m.k;
    const bool vec = vec_rows;

    for (int i = threadIdx.x; i < kCoarseBins; i += BLOCK) sm.hist[i] = 0u;
    if (threadIdx.x == 0) {
      sm.n_out = 0u;
      sm.n_cand = 0u;
      sm.kmin = 0xffffffffu;
      sm.kmax = 0u;
    }
    __syncthreads();
    // --- 1. coarse histogram ---
    // Branch-free (a predicated shared atomic); unselectable entries and the
    // padding lanes are not counted.
    for_each_in_row<scalar_t, BLOCK>(row, len, vec, [&](int64_t, float v, bool ok) {
      const uint32_t bin = coarse_bin(v);
      if (ok && selectable(v)) atomicAdd(&sm.hist[bin], 1u);
    });
    __syncthreads();
    // --- 2. threshold bin ---
    find_threshold<kCoarseBins, BLOCK>(sm, k);
    const unsigned total = sm.total;
    unsigned got;
    if (total <= k) {  // every selectable entry is chosen
      for_each_in_row<scalar_t, BLOCK>(row, len, vec, [&](int64_t i, float v, bool ok) {
        const bool sel = ok && selectable(v);
        const unsigned slot = warp_alloc(sel, &sm.n_out);
        if (sel) out[slot] = static_cast<int32_t>(i);
      });
      got = total;
    } else {
      const uint32_t tb = sm.bin;
      const unsigned need = k - sm.above;
      const unsigned cnt = sm.hist[tb];
      const bool take_all = cnt == need;
      const bool fits = cnt <= static_cast<unsigned>(kCandCap);
      // --- 3. split ---
      // Most warps hold nothing at or above tb: one ballot and they move on.
      uint32_t my_min = 0xffffffffu, my_max = 0u;  // key range of this thread's candidates
      for_each_in_row<scalar_t, BLOCK>(row, len, vec, [&](int64_t i, float v, bool ok) {
        const uint32_t bin = ok && selectable(v) ? coarse_bin(v) : 0u;  // tb >= 31 > 0
        if (__ballot_sync(kFullMask, bin >= tb) == 0u) return;
        const bool sel = bin > tb || (take_all && bin == tb);
        const unsigned slot = warp_alloc(sel, &sm.n_out);
        if (sel) out[slot] = static_cast<int32_t>(i);
        if (!take_all && fits) {
          const bool cand = bin == tb;
          const unsigned c = warp_alloc(cand, &sm.n_cand);
          if (cand) {
            const uint32_t key = radix_key(v);
            sm.buf[c] = (static_cast<unsigned long long>(key) << 32) | static_cast<uint32_t>(i);
            my_min = min(my_min, key);
            my_max = max(my_max, key);
          }
        }
      });
      if (!take_all && fits) {
        const uint32_t lo = __reduce_min_sync(kFullMask, my_min);
        const uint32_t hi = __reduce_max_sync(kFullMask, my_max);
        if ((threadIdx.x & 31) == 0 && hi >= lo) {
          atomicMin(&sm.kmin, lo);
          atomicMax(&sm.kmax, hi);
        }
      }
      __syncthreads();
      // --- 4. refine within the threshold bin ---
      if (!take_all) {
        if (fits) {  // start below the bits every candidate shares
          const uint32_t diff = sm.kmin ^ sm.kmax;
          const int top = diff == 0u ? 0 : 32 - __clz(diff);
          refine<BLOCK>(sm, SmemCandidates<BLOCK>{sm.buf, cnt}, need, out, k, top, sm.kmax);
        } else {
          refine<BLOCK>(sm, RowCandidates<scalar_t, BLOCK>{row, len, vec, tb}, need, out, k, 32, 0u);
        }
      }
      got = k;
    }
    __syncthreads();  // out[] writes of the block visible to the block
    for (int64_t i = static_cast<int64_t>(got) + threadIdx.x; i < m.k; i += BLOCK) out[i] = -1;
    // --- 5. sort the chosen slots by value ---
    if (sort && got > 1) {
      unsigned P = 1;
      while (P < got) P <<= 1;
      for (unsigned i = threadIdx.x; i < P; i += BLOCK) {
        unsigned long long e = 0ull;  // padding sorts last (selected keys are >= 1)
        if (i < got) {
          const int32_t idx = out[i];
          e = (static_cast<unsigned long long>(radix_key(to_float(row[idx]))) << 32) |
              (0xffffffffu - static_cast<uint32_t>(idx));
        }
        sm.buf[i] = e;
      }
      for (unsigned size = 2; size <= P; size <<= 1) {
        for (unsigned stride = size >> 1; stride > 0; stride >>= 1) {
          __syncthreads();
          for (unsigned i = threadIdx.x; i < P / 2; i += BLOCK) {
            const unsigned lo = 2 * i - (i & (stride - 1));
            const unsigned hi = lo + stride;
            const bool desc = (lo & size) == 0;
            const unsigned long long a = sm.buf[lo], b = sm.buf[hi];
            if ((a < b) == desc) {
              sm.buf[lo] = b;
              sm.buf[hi] = a;
            }
          }
        }
      }
      __syncthreads();
      for (unsigned i = threadIdx.x; i < got; i += BLOCK)
        out[i] = static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(sm.buf[i] & 0xffffffffull));
    }
    __syncthreads();  // sm is reused by the next row
  }
}

template <typename scalar_t>
void launch_typed(const TopkRows& m, int64_t rows, bool sort, cudaStream_t stream) {
  const bool vec = (reinterpret_cast<uintptr_t>(m.in) % 16 == 0) &&
                   ((m.in_stride * static_cast<int64_t>(sizeof(scalar_t))) % 16 == 0);
  const int64_t grid = std::min<int64_t>(rows, int64_t(1) << 30);
  if (m.T >= 8192) {
    topk_kernel<scalar_t, 1024><<<static_cast<unsigned>(grid), 1024, 0, stream>>>(m, rows, sort, vec);
  } else {
    topk_kernel<scalar_t, 256><<<static_cast<unsigned>(grid), 256, 0, stream>>>(m, rows, sort, vec);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void launch_topk(at::ScalarType dtype, const TopkRows& m, int64_t rows, bool sort, cudaStream_t stream) {
  if (rows <= 0) return;
  TORCH_CHECK(!sort || m.k <= kTopkSortCap, "launch_topk: in-kernel sort supports k <= ", kTopkSortCap);
  switch (dtype) {
    case at::kFloat: launch_typed<float>(m, rows, sort, stream); break;
    case at::kHalf: launch_typed<__half>(m, rows, sort, stream); break;
    case at::kBFloat16: launch_typed<__nv_bfloat16>(m, rows, sort, stream); break;
    default: TORCH_CHECK_TYPE(false, "scores must be fp32, fp16 or bf16, got ", dtype);
  }
}

namespace {

at::Tensor topk_indices(const at::Tensor& scores, int64_t k, bool sorted) {
  const c10::cuda::CUDAGuard guard(scores.device());
  at::Tensor out = topk_output(scores, k);
  const int64_t T = scores.size(-1);
  const at::Tensor s = scores.contiguous();
  const int64_t rows = s.numel() / std::max<int64_t>(T, 1);
  if (rows == 0) return out;
  TopkRows m;
  m.in = s.const_data_ptr();
  m.in_stride = T;
  m.T = T;
  m.out = out.data_ptr<int32_t>();
  m.k = k;
  const bool sort_in_kernel = sorted && k <= kTopkSortCap;
  launch_topk(s.scalar_type(), m, rows, sort_in_kernel, at::cuda::getCurrentCUDAStream());
  if (sorted && !sort_in_kernel) {
    // Rare path (k > 4096): order by value with ATen; -1 slots (value -inf
    // here, below every chosen value) stay last.
    const at::Tensor idx = out.to(at::kLong);
    const at::Tensor vals = s.gather(-1, idx.clamp_min(0))
                                .to(at::kFloat)
                                .masked_fill(idx.lt(0), -std::numeric_limits<float>::infinity());
    const at::Tensor order = std::get<1>(vals.sort(/*stable=*/true, /*dim=*/-1, /*descending=*/true));
    out = out.gather(-1, order);
  }
  return out;
}

}  // namespace
}  // namespace cuda
}  // namespace glm5

TORCH_LIBRARY_IMPL(glm5, CUDA, m) { m.impl("topk_indices", &glm5::cuda::topk_indices); }
