// Device helpers shared by the CUDA kernels of the indexer family (topk.cu,
// indexer.cu): the order-preserving radix key, element loads for fp32/fp16/
// bf16, warp-aggregated slot allocation and a block-wide suffix scan.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include <ATen/ATen.h>

namespace glm5 {
namespace cuda {

constexpr unsigned kFullMask = 0xffffffffu;

// Unsigned order of keys equals float order (bit-identical to cpu::radix_key).
// NaN and -inf map to 0, the key that is never selected; every other float
// (+inf included) maps to >= 1.
__device__ __forceinline__ uint32_t radix_key(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint32_t key = u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) | 0x80000000u);
  return (key - 0x00800000u) <= (0xFF800000u - 0x00800000u) ? key : 0u;
}

// Whether radix_key(f) != 0, in one comparison: false for NaN and -inf only.
// (nvcc's --use_fast_math flushes denormals and relaxes division, it does not
// assume finite values, so the comparison keeps its IEEE meaning.)
__device__ __forceinline__ bool selectable(float f) { return f > __int_as_float(0xff800000); }

// An 11-bit coarse key of a selectable f: the top 11 bits of the
// order-preserving key of f rounded to fp16 (sign, 5 exponent, 5 mantissa
// bits). Rounding is monotone, so a larger coarse bin always means a larger
// fp32 key; fp16 spreads typical scores over many more bins than the top bits
// of the fp32 key would. Every selectable f lands in bin >= 31 (fp16 -inf,
// for very negative finite floats), so bin 0 can stand for "unselectable".
__device__ __forceinline__ uint32_t coarse_bin(float f) {
  const uint32_t h = __half_as_ushort(__float2half_rn(f));
  const uint32_t k16 = h ^ ((0u - (h >> 15)) & 0x7FFFu) ^ 0x8000u;  // negative: ~h; else h | 0x8000
  return k16 >> 5;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Every lane of the warp calls this (pred may be false): returns a slot from
// *counter for each lane with pred, one shared-memory atomic per warp.
__device__ __forceinline__ unsigned warp_alloc(bool pred, unsigned* counter) {
  const unsigned m = __ballot_sync(kFullMask, pred);
  if (m == 0u) return 0u;
  const int lane = threadIdx.x & 31;
  const int leader = __ffs(m) - 1;
  unsigned base = 0;
  if (lane == leader) base = atomicAdd(counter, static_cast<unsigned>(__popc(m)));
  base = __shfl_sync(kFullMask, base, leader);
  return base + static_cast<unsigned>(__popc(m & ((1u << lane) - 1u)));
}

// Block-wide exclusive suffix sum: the sum of v over the threads after this
// one; *total gets the sum over all. Every thread of the block calls it.
// warp_buf: 32 ints of shared memory. Ends with a barrier.
template <int BLOCK>
__device__ __forceinline__ unsigned block_excl_suffix(unsigned v, unsigned* warp_buf, unsigned* total) {
  constexpr int kWarps = BLOCK / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned y = __shfl_down_sync(kFullMask, x, o);
    if (lane + o < 32) x += y;
  }
  if (lane == 0) warp_buf[warp] = x;  // the warp's total
  __syncthreads();
  unsigned after = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const unsigned t = warp_buf[w];
    all += t;
    if (w > warp) after += t;
  }
  __syncthreads();
  *total = all;
  return x - v + after;
}

// The CUDA type of an ATen floating dtype.
template <typename T>
struct CudaType;
template <>
struct CudaType<float> {
  using type = float;
};
template <>
struct CudaType<at::Half> {
  using type = __half;
};
template <>
struct CudaType<at::BFloat16> {
  using type = __nv_bfloat16;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace cuda
}  // namespace glm5
