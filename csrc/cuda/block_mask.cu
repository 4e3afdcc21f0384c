// block_topk_mask on CUDA: the block-level predictor (glm5_ops/reference.py
// block_topk_mask defines the selection; ties may break either way).
//
// 1. Pooling (pool_kernel): qbar [B,Qb,H,D] = per-block query means, and per
//    key block kbar [B,Kb,Hkv,D] (mean) or kmax/kmin (Quest), all fp32, one
//    thread per output element (reads q and k once; partial last blocks).
// 2. Per batch element, query blocks in groups whose [H, nq, Kb] score rows
//    fit a 256 MiB workspace: scores = qbar . kbar as one batched fp32 GEMM
//    (at::matmul; GQA by viewing the G query heads of a kv head as extra rows;
//    minmax: relu(q) kmax + min(q,0) kmin, two GEMMs). fp32, so unless TF32
//    matmul is enabled globally the ranking matches the reference's up to
//    rounding of near-ties.
// 3. mask_kernel sets -inf on blocks that are not candidates (causal: after
//    the block's diagonal; mandatory sink/local blocks are added separately),
//    the radix top-k of topk.cu picks the topk_blocks best (-inf never chosen,
//    so #chosen = min(topk_blocks, #candidates)), mark_kernel flags them, and
//    compact_kernel (one block per row) writes mandatory | chosen ascending
//    with a block-wide prefix scan, then 0 padding and kv_num_blocks.
// Memory: O(B*(Qb*H + Kb*Hkv)*D) pooled + the bounded workspace; no [S,T].
// Expected cost: dominated by reading q and k once (pooling); the GEMM and
// top-k work on Qb x Kb rows (bs^2 times fewer than the token-level scores).
// Next step: fuse scoring and selection per row when Kb fits shared memory.
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

constexpr int kThreads = 256;
constexpr int64_t kWorkspaceBytes = int64_t(256) << 20;

unsigned grid_for(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>(ceil_div(n, kThreads), 1, int64_t(65535) * 16));
}

// x [B,N,H,D] contiguous -> out fp32 [B,ceil(N/bs),H,D]: mean (mode 0), max (1)
// or min (2) over each block of bs rows (the last one partial).
template <typename T>
__global__ void pool_kernel(const T* __restrict__ x, float* __restrict__ out, int64_t B, int64_t N, int64_t H,
                            int64_t D, int64_t bs, int mode) {
  const int64_t nb = (N + bs - 1) / bs, total = B * nb * H * D;
  for (int64_t o = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; o < total; o += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = o % D, h = (o / D) % H, j = (o / (D * H)) % nb, b = o / (D * H * nb);
    const int64_t r0 = j * bs, r1 = std::min(N, r0 + bs);
    float acc = mode == 0 ? 0.f : (mode == 1 ? -INFINITY : INFINITY);
    const T* px = x + ((b * N + r0) * H + h) * D + d;
    for (int64_t r = r0; r < r1; ++r, px += H * D) {
      const float v = to_float(*px);
      // NaN propagates, as in the reference's amax/amin (fmaxf/fminf would drop it)
      acc = mode == 0 ? acc + v : (mode == 1 ? ((v > acc || v != v) ? v : acc) : ((v < acc || v != v) ? v : acc));
    }
    out[o] = mode == 0 ? __fdiv_rn(acc, static_cast<float>(r1 - r0)) : acc;  // exact division under fast-math
  }
}

struct MaskArgs {
  int64_t S, T, bs, Kb, Qb, H, sink, local;
  int causal;
  const int64_t* q_start;  // [B] or nullptr: T - S
};

// The key block holding query block i's last query (clamped to Kb - 1; floor
// division, so a negative position gives a negative diagonal: nothing allowed).
__device__ __forceinline__ int64_t diag_block(const MaskArgs& a, int64_t b, int64_t i) {
  const int64_t qs = a.q_start != nullptr ? a.q_start[b] : a.T - a.S;
  const int64_t last = qs + std::min((i + 1) * a.bs, a.S) - 1;
  const int64_t d = last >= 0 ? last / a.bs : -((-last + a.bs - 1) / a.bs);
  return std::min(d, a.Kb - 1);
}

__device__ __forceinline__ bool allowed(const MaskArgs& a, int64_t j, int64_t diag) { return !a.causal || j <= diag; }
__device__ __forceinline__ bool mandatory(const MaskArgs& a, int64_t j, int64_t diag) {
  return allowed(a, j, diag) && (j < a.sink || (j <= diag && j > diag - a.local));
}

// sc [rows = H*nq, Kb], row (h, i - i0) of batch b: -inf where block j is not a candidate.
__global__ void mask_kernel(float* __restrict__ sc, int64_t nq, int64_t i0, int64_t b, MaskArgs a) {
  const int64_t total = a.H * nq * a.Kb;
  for (int64_t o = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; o < total; o += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = o % a.Kb, i = i0 + (o / a.Kb) % nq;
    const int64_t diag = diag_block(a, b, i);
    if (!allowed(a, j, diag) || mandatory(a, j, diag)) sc[o] = -INFINITY;
  }
}

__global__ void mark_kernel(const int32_t* __restrict__ sel, int64_t rows, int64_t kk, int64_t Kb,
                            uint8_t* __restrict__ flags) {
  for (int64_t o = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; o < rows * kk; o += int64_t(gridDim.x) * blockDim.x) {
    const int32_t j = sel[o];
    if (j >= 0 && j < Kb) flags[(o / kk) * Kb + j] = 1;
  }
}

// Block-wide exclusive prefix sum of v; *total = the sum. Every thread calls it.
__device__ __forceinline__ int block_excl_prefix(int v, int* buf, int* total) {
  constexpr int kW = kThreads / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFullMask, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) buf[warp] = x;
  __syncthreads();
  int before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kW; ++w) {
    const int t = buf[w];
    all += t;
    if (w < warp) before += t;
  }
  __syncthreads();
  *total = all;
  return before + x - v;
}

// One block per row (h, i - i0) of batch b: the selected blocks ascending, then 0s.
__global__ void __launch_bounds__(kThreads) compact_kernel(const uint8_t* __restrict__ flags, int64_t nq, int64_t i0,
                                                           int64_t b, MaskArgs a, int64_t width,
                                                           int32_t* __restrict__ num, int32_t* __restrict__ idx) {
  __shared__ int buf[32];
  const int64_t row = blockIdx.x, h = row / nq, i = i0 + row % nq;
  const int64_t diag = diag_block(a, b, i);
  const int64_t out_row = (b * a.H + h) * a.Qb + i;
  int32_t* dst = idx + out_row * width;
  int64_t count = 0;
  for (int64_t j0 = 0; j0 < a.Kb; j0 += kThreads) {
    const int64_t j = j0 + threadIdx.x;
    const int f = j < a.Kb && (flags[row * a.Kb + j] != 0 || mandatory(a, j, diag));
    int total;
    const int pos = block_excl_prefix(f, buf, &total);
    if (f && count + pos < width) dst[count + pos] = static_cast<int32_t>(j);
    count += total;
  }
  for (int64_t w = count + threadIdx.x; w < width; w += kThreads) dst[w] = 0;
  if (threadIdx.x == 0) num[out_row] = static_cast<int32_t>(std::min(count, width));
}

std::tuple<at::Tensor, at::Tensor> block_topk_mask(const at::Tensor& q_in, const at::Tensor& k_in, int64_t block_size,
                                                   int64_t topk_blocks, bool causal, int64_t sink_blocks,
                                                   int64_t local_blocks, c10::string_view pooling,
                                                   const c10::optional<at::Tensor>& q_start) {
  const int64_t bs = check_block_topk_args(q_in, k_in, block_size, topk_blocks, sink_blocks, local_blocks, pooling);
  check_q_start(q_start, q_in.size(0), q_in.device());
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous();
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), D = q.size(3), T = k.size(1), Hkv = k.size(2);
  const int64_t G = H / Hkv, Qb = ceil_div(S, bs), Kb = ceil_div(T, bs);
  const int64_t width = block_topk_width(Kb, topk_blocks, sink_blocks, local_blocks);
  const auto i32 = q.options().dtype(at::kInt);
  at::Tensor num = at::empty({B, H, Qb}, i32);
  at::Tensor idx = at::empty({B, H, Qb, width}, i32);
  if (B * H * Qb == 0) return {num, idx};
  if (Kb == 0) {  // no keys: nothing to select
    num.zero_();
    return {num, idx};
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor qs;
  if (q_start.has_value()) qs = q_start->to(q.device(), at::kLong).contiguous();

  const auto f32 = q.options().dtype(at::kFloat);
  const bool minmax = pooling == "minmax";
  at::Tensor qbar = at::empty({B, Qb, H, D}, f32);
  at::Tensor kp0 = at::empty({B, Kb, Hkv, D}, f32);  // mean, or max
  at::Tensor kp1 = minmax ? at::empty({B, Kb, Hkv, D}, f32) : at::Tensor();  // min
  auto pool = [&](const at::Tensor& x, at::Tensor& out, int mode) {
    const int64_t n = out.numel();
    if (n == 0) return;
    switch (x.scalar_type()) {
      case at::kFloat:
        pool_kernel<float><<<grid_for(n), kThreads, 0, stream>>>(x.const_data_ptr<float>(), out.data_ptr<float>(),
                                                                 x.size(0), x.size(1), x.size(2), x.size(3), bs, mode);
        break;
      case at::kHalf:
        pool_kernel<__half><<<grid_for(n), kThreads, 0, stream>>>(
            static_cast<const __half*>(x.const_data_ptr()), out.data_ptr<float>(), x.size(0), x.size(1), x.size(2),
            x.size(3), bs, mode);
        break;
      case at::kBFloat16:
        pool_kernel<__nv_bfloat16><<<grid_for(n), kThreads, 0, stream>>>(
            static_cast<const __nv_bfloat16*>(x.const_data_ptr()), out.data_ptr<float>(), x.size(0), x.size(1),
            x.size(2), x.size(3), bs, mode);
        break;
      default: TORCH_CHECK_TYPE(false, "q must be fp32, fp16 or bf16, got ", x.scalar_type());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  pool(q, qbar, 0);
  pool(k, kp0, minmax ? 1 : 0);
  if (minmax) pool(k, kp1, 2);

  MaskArgs a;
  a.S = S, a.T = T, a.bs = bs, a.Kb = Kb, a.Qb = Qb, a.H = H, a.sink = sink_blocks, a.local = local_blocks;
  a.causal = causal;
  a.q_start = qs.defined() ? qs.const_data_ptr<int64_t>() : nullptr;
  const int64_t kk = std::min(topk_blocks, Kb);
  const int64_t per_qblock = H * Kb * int64_t(sizeof(float) + 1);
  const int64_t group = std::clamp<int64_t>(kWorkspaceBytes / std::max<int64_t>(per_qblock, 1), 1, Qb);
  for (int64_t b = 0; b < B; ++b) {
    const at::Tensor kb0 = kp0[b].permute({1, 2, 0});  // [Hkv, D, Kb]
    const at::Tensor kb1 = minmax ? kp1[b].permute({1, 2, 0}) : at::Tensor();
    for (int64_t i0 = 0; i0 < Qb; i0 += group) {
      const int64_t nq = std::min(group, Qb - i0), rows = H * nq;
      // [nq, H, D] -> [H, nq, D] -> [Hkv, G*nq, D]: rows ordered (h, i)
      const at::Tensor qc = qbar[b].narrow(0, i0, nq).permute({1, 0, 2}).reshape({Hkv, G * nq, D});
      at::Tensor sc = minmax ? at::matmul(qc.clamp_min(0), kb0) + at::matmul(qc.clamp_max(0), kb1)
                             : at::matmul(qc, kb0);
      sc = sc.reshape({rows, Kb}).contiguous();
      mask_kernel<<<grid_for(rows * Kb), kThreads, 0, stream>>>(sc.data_ptr<float>(), nq, i0, b, a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      at::Tensor flags = at::zeros({rows, Kb}, q.options().dtype(at::kByte));
      if (kk > 0) {
        at::Tensor sel = at::empty({rows, kk}, i32);
        TopkRows m;
        m.in = sc.const_data_ptr();
        m.in_stride = Kb;
        m.T = Kb;
        m.out = sel.data_ptr<int32_t>();
        m.k = kk;
        launch_topk(at::kFloat, m, rows, /*sort=*/false, stream);
        mark_kernel<<<grid_for(rows * kk), kThreads, 0, stream>>>(sel.const_data_ptr<int32_t>(), rows, kk, Kb,
                                                                  flags.data_ptr<uint8_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      TORCH_CHECK(rows < (int64_t(1) << 31), "block_topk_mask (CUDA): too many rows in one group");
      compact_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
          flags.const_data_ptr<uint8_t>(), nq, i0, b, a, width, num.data_ptr<int32_t>(), idx.data_ptr<int32_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  return {num, idx};
}

}  // namespace
}  // namespace cuda
}  // namespace glm5

TORCH_LIBRARY_IMPL(glm5, CUDA, m) { m.impl("block_topk_mask", &glm5::cuda::block_topk_mask); }
