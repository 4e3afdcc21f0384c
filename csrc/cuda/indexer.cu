// The DSA lightning indexer on CUDA:
//   score[b,s,t] = sum_h w[b,s,h] * relu(q[b,s,h,:] . k[b,t,:])
//
// indexer_scores. One thread block (256 threads, 8 warps) computes the
// head-reduced scores of a query block against a tile of BN = 128 keys:
//  - the query block is QB = max(1, 128 / H) consecutive queries of one batch
//    element with all their heads: rows (s, h) of q, contiguous in memory, so
//    the block's A operand is R = QB*H rows x D (H need not be a multiple of
//    16: rows past R are zero; H > 128 runs several 128-row M tiles and sums
//    their head-partial results in shared memory);
//  - the product C[R, BN] = A . K^T runs over D in chunks of BK = 64 (padded
//    to 16 with zeros, any D): bf16/fp16 on tensor cores with WMMA 16x16x16
//    (fp32 accumulate; each warp owns 32 x 64 of the 128 x 128 tile, the next
//    D chunk is loaded into registers while the current one multiplies);
//    fp32 with a SIMT tile (8 x 8 outputs per thread, fp32 FMA, exact);
//  - the accumulator tile goes to shared memory (aliasing the operand tiles),
//    relu and the head weights are applied there, and each output (s, t) sums
//    its H rows: only [QB, BN] scores are written, coalesced along t;
//  - causal: a tile whose first key lies after the last query's horizon is
//    skipped (written as -inf for indexer_scores); partial tiles mask per
//    element. q_start is read on the device (no host sync).
//
// indexer_topk (fused). Never materialises [B,S,T]: queries are processed in
// groups whose fp32 scores fit a bounded workspace (<= 256 MiB, or one row
// when a row alone is larger): the scores kernel above fills the group's
// [rows, T] workspace (skipping fully masked key tiles, writing nothing
// there), then the radix top-k kernel of topk.cu selects from each row,
// reading only the keys inside the query's causal horizon. Memory: the
// int32 [B,S,topk] output plus the workspace.
//
// Resources (ptxas, sm_90a): 128 registers (launch bounds 256 x 2 blocks/SM;
// a few bytes of spill in the bf16 instance), 68.6 KB dynamic shared memory.
// Expected limits, to check on the GPU: every block reloads its A tile and
// its key tile from L2 (~32 MAC per byte at H=32, D=128), and the tensor-core
// work is mma.sync through WMMA, not wgmma, so this is a correct baseline, not
// a DeepGEMM-class kernel; the next steps are keeping A resident across key
// tiles, cp.async/TMA double buffering and a warp-level head reduction.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <mma.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>

#include "checks.h"
#include "cuda/common.cuh"
#include "cuda/topk.cuh"

namespace glm5 {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int BM = 128;        // (query, head) rows per M tile
constexpr int BN = 128;        // keys per tile
constexpr int BK = 64;         // D chunk (tensor-core path)
constexpr int LDA = BK + 8;    // 16-bit elements per shared row (bank-conflict padding, 16-byte multiple)
constexpr int BKF = 16;        // D chunk (fp32 SIMT path)
constexpr int LDF = BM + 4;    // floats per shared row of the transposed fp32 operand tiles
constexpr int LDC = BN + 4;    // floats per shared row of the accumulator tile
constexpr size_t kSmemBytes = sizeof(float) * (BM * LDC + BM + BN);
static_assert(2 * BM * LDA * 2 <= BM * LDC * 4, "operand tiles alias the accumulator tile");
static_assert(2 * BKF * LDF * 4 <= BM * LDC * 4, "operand tiles alias the accumulator tile");
static_assert(BM == BN, "the fp32 loaders assume square tiles");

constexpr int64_t kWorkspaceBytes = int64_t(256) << 20;

struct ScoreParams {
  const void* q;      // [B,S,H,D]
  const float* w;     // [B,S,H] fp32
  const void* k;      // [B,T,D]
  int64_t B, S, H, D, T;
  int causal;
  const int64_t* q_start;  // [B] or nullptr: T - S
  float* out;              // row of (b, s): ((b - b0) * (sb - sa) + (s - sa)) * out_stride
  int64_t out_stride;
  int64_t b0, sa, sb;      // batch elements [b0, b0 + nb), queries [sa, sb)
  int64_t QB;              // queries per block
  int64_t n_ttiles, n_qblocks;
  int fill_masked;         // write -inf over skipped (fully masked) tiles
  int vec;                 // 16-byte operand loads allowed (D % 8 == 0, 16-byte aligned bases)
};

// 8 consecutive 16-bit elements row[d0, d0 + 8), zeros past D or for a dead row.
__device__ __forceinline__ uint4 load_pack16(const uint16_t* __restrict__ row, bool row_ok, int64_t d0, int64_t D,
                                             bool vec) {
  if (!row_ok || d0 >= D) return make_uint4(0u, 0u, 0u, 0u);
  if (vec) return __ldg(reinterpret_cast<const uint4*>(row + d0));  // D % 8 == 0: the whole pack is in range
  uint16_t e[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = d0 + i < D ? row[d0 + i] : uint16_t(0);
  uint4 r;
  r.x = e[0] | (uint32_t(e[1]) << 16);
  r.y = e[2] | (uint32_t(e[3]) << 16);
  r.z = e[4] | (uint32_t(e[5]) << 16);
  r.w = e[6] | (uint32_t(e[7]) << 16);
  return r;
}

// C[BM, BN] (rows r0 + [0, mrows) of the block's A, keys [0, nt) of its tile)
// into Cs, on tensor cores. Ends with a barrier.
template <typename T_>
__device__ __forceinline__ void tile_product(const ScoreParams& p, const T_* __restrict__ arows,
                                             const T_* __restrict__ krows, int mrows, int nt, unsigned char* smem) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  using namespace nvcuda;
  T_* As = reinterpret_cast<T_*>(smem);
  T_* Bs = As + BM * LDA;
  float* Cs = reinterpret_cast<float*>(smem);
  const int tid = threadIdx.x, warp = tid >> 5;
  const int wm = warp & 3, wn = warp >> 2;  // warp tile: rows wm*32 + [0,32), keys wn*64 + [0,64)
  const int64_t D = p.D, Dp = (D + 15) / 16 * 16;
  const bool vec = p.vec != 0;
  const uint16_t* a16 = reinterpret_cast<const uint16_t*>(arows);
  const uint16_t* b16 = reinterpret_cast<const uint16_t*>(krows);

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  constexpr int kPacks = BM * BK / 8 / kThreads;  // 4 packs of 8 per thread and operand
  uint4 ra[kPacks], rb[kPacks];
  auto load = [&](int64_t kc) {
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int pk = tid + j * kThreads, r = pk / (BK / 8), c = (pk % (BK / 8)) * 8;
      ra[j] = load_pack16(a16 + static_cast<int64_t>(r) * D, r < mrows, kc + c, D, vec);
      rb[j] = load_pack16(b16 + static_cast<int64_t>(r) * D, r < nt, kc + c, D, vec);
    }
  };
  load(0);
  for (int64_t kc = 0; kc < Dp; kc += BK) {
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int pk = tid + j * kThreads, r = pk / (BK / 8), c = (pk % (BK / 8)) * 8;
      *reinterpret_cast<uint4*>(As + r * LDA + c) = ra[j];
      *reinterpret_cast<uint4*>(Bs + r * LDA + c) = rb[j];
    }
    __syncthreads();
    if (kc + BK < Dp) load(kc + BK);  // in flight while this chunk multiplies
    const int ksteps = static_cast<int>(std::min<int64_t>(BK, Dp - kc) / 16);
#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks) {
      if (ks < ksteps) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T_, wmma::row_major> af[2];
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T_, wmma::col_major> bf[4];
#pragma unroll
        for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(af[i], As + (wm * 32 + i * 16) * LDA + ks * 16, LDA);
#pragma unroll
        for (int j = 0; j < 4; ++j) wmma::load_matrix_sync(bf[j], Bs + (wn * 64 + j * 16) * LDA + ks * 16, LDA);
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) wmma::mma_sync(acc[i][j], af[i], bf[j], acc[i][j]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
      wmma::store_matrix_sync(Cs + (wm * 32 + i * 16) * LDC + wn * 64 + j * 16, acc[i][j], LDC, wmma::mem_row_major);
  __syncthreads();
#endif
}

// The same in fp32 on the SIMT cores: each thread owns rows ty + 16i and keys
// tx + 16j (i, j < 8). Ends with a barrier.
template <>
__device__ __forceinline__ void tile_product<float>(const ScoreParams& p, const float* __restrict__ arows,
                                                    const float* __restrict__ krows, int mrows, int nt,
                                                    unsigned char* smem) {
  float* As = reinterpret_cast<float*>(smem);  // [BKF][LDF], transposed
  float* Bs = As + BKF * LDF;
  float* Cs = reinterpret_cast<float*>(smem);
  const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
  const int64_t D = p.D;
  float c[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) c[i][j] = 0.f;
  for (int64_t kc = 0; kc < D; kc += BKF) {
#pragma unroll
    for (int j = 0; j < BM * BKF / kThreads; ++j) {
      const int e = tid + j * kThreads, r = e / BKF, d = e % BKF;
      const bool dk = kc + d < D;
      As[d * LDF + r] = (r < mrows && dk) ? __ldg(arows + static_cast<int64_t>(r) * D + kc + d) : 0.f;
      Bs[d * LDF + r] = (r < nt && dk) ? __ldg(krows + static_cast<int64_t>(r) * D + kc + d) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BKF; ++kk) {
      float a[8], b[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i] = As[kk * LDF + ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 8; ++j) b[j] = Bs[kk * LDF + tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) c[i][j] = fmaf(a[i], b[j], c[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) Cs[(ty + 16 * i) * LDC + tx + 16 * j] = c[i][j];
  __syncthreads();
}

template <typename T_>
__global__ void __launch_bounds__(kThreads, 2) scores_kernel(ScoreParams p, int64_t blk_offset) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int64_t blk = blk_offset + blockIdx.x;
  const int64_t tt = blk % p.n_ttiles, rest = blk / p.n_ttiles;
  const int64_t qb = rest % p.n_qblocks, z = rest / p.n_qblocks;
  const int64_t b = p.b0 + z;
  const int64_t s_begin = p.sa + qb * p.QB;
  const int nq = static_cast<int>(std::min<int64_t>(s_begin + p.QB, p.sb) - s_begin);
  const int64_t t0 = tt * BN;
  const int nt = static_cast<int>(std::min<int64_t>(BN, p.T - t0));
  const int64_t qs = p.causal ? (p.q_start != nullptr ? p.q_start[b] : p.T - p.S) : 0;
  float* out = p.out + (z * (p.sb - p.sa) + (s_begin - p.sa)) * p.out_stride + t0;  // (query s_begin, key t0)
  const float kNegInf = -std::numeric_limits<float>::infinity();
  const int tid = threadIdx.x;

  if (p.causal && t0 > qs + s_begin + nq - 1) {  // every key of the tile is in every query's future
    if (p.fill_masked)
      for (int o = tid; o < nq * BN; o += kThreads) {
        const int q = o / BN, t = o % BN;
        if (t < nt) out[q * p.out_stride + t] = kNegInf;
      }
    return;
  }

  const int64_t H = p.H, R = nq * H;
  const int n_mtiles = static_cast<int>((R + BM - 1) / BM);  // > 1 only when H > BM (then nq == 1)
  float* Cs = reinterpret_cast<float*>(smem);
  float* wsm = Cs + BM * LDC;
  float* acc = wsm + BM;
  const T_* qrows = static_cast<const T_*>(p.q) + (b * p.S + s_begin) * H * p.D;
  const float* wrows = p.w + (b * p.S + s_begin) * H;
  const T_* krows = static_cast<const T_*>(p.k) + (b * p.T + t0) * p.D;

  auto emit = [&](int q, int t, float v) {
    if (p.causal && t0 + t > qs + s_begin + q) v = kNegInf;
    out[q * p.out_stride + t] = v;
  };

  for (int mt = 0; mt < n_mtiles; ++mt) {
    const int64_t r0 = static_cast<int64_t>(mt) * BM;
    const int mrows = static_cast<int>(std::min<int64_t>(BM, R - r0));
    tile_product<T_>(p, qrows + r0 * p.D, krows, mrows, nt, smem);
    for (int r = tid; r < BM; r += kThreads) wsm[r] = r < mrows ? wrows[r0 + r] : 0.f;
    __syncthreads();
    const int q_lo = static_cast<int>(r0 / H);
    const int q_hi = static_cast<int>(std::min<int64_t>(nq, (r0 + mrows + H - 1) / H));
    for (int o = tid; o < (q_hi - q_lo) * BN; o += kThreads) {
      const int q = q_lo + o / BN, t = o % BN;
      if (t >= nt) continue;
      const int r_begin = static_cast<int>(std::max<int64_t>(q * H - r0, 0));
      const int r_end = static_cast<int>(std::min<int64_t>((q + 1) * H - r0, mrows));
      float v = 0.f;
      for (int r = r_begin; r < r_end; ++r) {
        const float c = Cs[r * LDC + t];
        v = fmaf(wsm[r], c < 0.f ? 0.f : c, v);  // relu that keeps NaN, as torch.relu does (fmaxf drops it)
      }
      if (n_mtiles == 1) {
        emit(q, t, v);
      } else {
        acc[t] = (mt == 0 ? 0.f : acc[t]) + v;
      }
    }
    __syncthreads();  // Cs and wsm are rewritten by the next M tile
  }
  if (n_mtiles > 1)
    for (int t = tid; t < nt; t += kThreads) emit(0, t, acc[t]);
}

struct Inputs {
  at::Tensor q, w, k, q_start;
  int64_t B, S, H, D, T;
  Inputs(const at::Tensor& q_, const at::Tensor& w_, const at::Tensor& k_, const c10::optional<at::Tensor>& qs)
      : q(q_.contiguous()), w(w_.to(at::kFloat).contiguous()), k(k_.contiguous()) {
    B = q.size(0), S = q.size(1), H = q.size(2), D = q.size(3), T = k.size(1);
    if (qs.has_value()) q_start = qs->to(q.device(), at::kLong).contiguous();
  }
  int64_t queries_per_block() const { return H <= BM ? std::max<int64_t>(1, BM / H) : 1; }
};

template <typename T_>
void set_smem_limit() {
  // Once per device (the attribute is per device context).
  static std::atomic<uint64_t> done{0};
  const int dev = c10::cuda::current_device();
  const uint64_t bit = uint64_t(1) << (dev & 63);
  if (!(done.load() & bit)) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(scores_kernel<T_>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kSmemBytes)));
    done.fetch_or(bit);
  }
}

// Scores of batch elements [b0, b0 + nb), queries [sa, sb) into out (see ScoreParams).
void run_scores(const Inputs& in, bool causal, int64_t b0, int64_t nb, int64_t sa, int64_t sb, float* out,
                int64_t out_stride, bool fill_masked, cudaStream_t stream) {
  if (nb <= 0 || sb <= sa || in.T <= 0) return;
  ScoreParams p;
  p.q = in.q.const_data_ptr();
  p.w = in.w.const_data_ptr<float>();
  p.k = in.k.const_data_ptr();
  p.B = in.B, p.S = in.S, p.H = in.H, p.D = in.D, p.T = in.T;
  p.causal = causal;
  p.q_start = in.q_start.defined() ? in.q_start.const_data_ptr<int64_t>() : nullptr;
  p.out = out;
  p.out_stride = out_stride;
  p.b0 = b0, p.sa = sa, p.sb = sb;
  p.QB = in.queries_per_block();
  int64_t t_end = in.T;
  if (causal && !fill_masked && p.q_start == nullptr)  // horizon known on the host: launch no dead tiles
    t_end = std::clamp<int64_t>(in.T - in.S + sb, 0, in.T);
  if (t_end == 0) return;
  p.n_ttiles = ceil_div(t_end, BN);
  p.n_qblocks = ceil_div(sb - sa, p.QB);
  p.fill_masked = fill_masked;
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  p.vec = in.D % 8 == 0 && aligned(p.q) && aligned(p.k);
  const int64_t blocks = p.n_ttiles * p.n_qblocks * nb;
  const int64_t kMaxGrid = (int64_t(1) << 31) - 1;
  for (int64_t off = 0; off < blocks; off += kMaxGrid) {
    const unsigned grid = static_cast<unsigned>(std::min(kMaxGrid, blocks - off));
    switch (in.q.scalar_type()) {
      case at::kFloat:
        set_smem_limit<float>();
        scores_kernel<float><<<grid, kThreads, kSmemBytes, stream>>>(p, off);
        break;
      case at::kHalf:
        set_smem_limit<__half>();
        scores_kernel<__half><<<grid, kThreads, kSmemBytes, stream>>>(p, off);
        break;
      case at::kBFloat16:
        set_smem_limit<__nv_bfloat16>();
        scores_kernel<__nv_bfloat16><<<grid, kThreads, kSmemBytes, stream>>>(p, off);
        break;
      default: TORCH_CHECK_TYPE(false, "q must be fp32, fp16 or bf16, got ", in.q.scalar_type());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

at::Tensor indexer_scores(const at::Tensor& q, const at::Tensor& w, const at::Tensor& k, bool causal,
                          const c10::optional<at::Tensor>& q_start) {
  check_indexer_args(q, w, k, q_start);
  const c10::cuda::CUDAGuard guard(q.device());
  const Inputs in(q, w, k, q_start);
  at::Tensor out = at::empty({in.B, in.S, in.T}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return out;
  run_scores(in, causal, 0, in.B, 0, in.S, out.data_ptr<float>(), in.T, /*fill_masked=*/true,
             at::cuda::getCurrentCUDAStream());
  return out;
}

at::Tensor indexer_topk(const at::Tensor& q, const at::Tensor& w, const at::Tensor& k, int64_t topk, bool causal,
                        const c10::optional<at::Tensor>& q_start) {
  check_indexer_args(q, w, k, q_start);
  check_topk_count(topk, k.size(1), "topk");
  const c10::cuda::CUDAGuard guard(q.device());
  const Inputs in(q, w, k, q_start);
  at::Tensor out = at::empty({in.B, in.S, topk}, q.options().dtype(at::kInt));
  if (out.numel() == 0) return out;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // Query groups whose scores fit the workspace: whole batch elements when a
  // batch element's [S, T] fits, else a run of queries of one batch element
  // (a multiple of the block's query count where possible).
  const int64_t cap_rows = std::max<int64_t>(1, kWorkspaceBytes / (in.T * int64_t(sizeof(float))));
  int64_t nb, gs;
  if (in.S <= cap_rows) {
    nb = std::min<int64_t>(in.B, cap_rows / in.S);
    gs = in.S;
  } else {
    nb = 1;
    const int64_t qb = in.queries_per_block();
    gs = cap_rows >= qb ? cap_rows / qb * qb : cap_rows;
  }
  at::Tensor ws = at::empty({nb * gs, in.T}, q.options().dtype(at::kFloat));
  TopkRows m;
  m.in = ws.const_data_ptr();
  m.in_stride = in.T;
  m.T = in.T;
  m.out = out.data_ptr<int32_t>();
  m.k = topk;
  m.fused = 1;
  m.causal = causal;
  m.q_start = in.q_start.defined() ? in.q_start.const_data_ptr<int64_t>() : nullptr;
  m.S = in.S;
  for (int64_t b0 = 0; b0 < in.B; b0 += nb) {
    const int64_t nbb = std::min(nb, in.B - b0);
    for (int64_t sa = 0; sa < in.S; sa += gs) {
      const int64_t sb = std::min(sa + gs, in.S);
      run_scores(in, causal, b0, nbb, sa, sb, ws.data_ptr<float>(), in.T, /*fill_masked=*/false, stream);
      m.b0 = b0;
      m.sa = sa;
      m.gs = sb - sa;
      launch_topk(at::kFloat, m, nbb * (sb - sa), /*sort=*/false, stream);
    }
  }
  return out;
}

}  // namespace
}  // namespace cuda
}  // namespace glm5

TORCH_LIBRARY_IMPL(glm5, CUDA, m) {
  m.impl("indexer_scores", &glm5::cuda::indexer_scores);
  m.impl("indexer_topk", &glm5::cuda::indexer_topk);
}
