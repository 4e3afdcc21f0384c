// Group-wise activation quantisation on CUDA (layout: glm5_ops/reference.py).
//
// quantize_groupwise: one warp per group. The lanes stride over the group for
// min/max (warp-shuffle reductions), then each lane builds whole output bytes
// (8/bits codes each), so every byte is written once, with no atomics.
// dequantize: one thread per packed byte writes its 8/bits outputs straight in
// the requested dtype. Arithmetic uses the _rn intrinsics so --use_fast_math
// does not change the rounding: codes match the reference (and the CPU and
// Triton kernels) bit for bit, except that fast-math flushes fp32 subnormals
// (groups whose values or range are below ~1e-38 quantise to 0); stochastic rounding uses the counter-based
// hash of quantize_common.h, the same u as the CPU and Triton kernels.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "quantize_common.h"

namespace glm5 {
namespace cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

__device__ __forceinline__ float warp_min(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <int BITS, typename scalar_t>
__global__ void quantize_kernel(const scalar_t* __restrict__ x, uint8_t* __restrict__ packed,
                                float* __restrict__ scale, float* __restrict__ zero, int64_t G, int64_t gs,
                                bool stochastic, uint32_t key) {
  constexpr int kPer = 8 / BITS;
  constexpr float kLevels = float((1 << BITS) - 1);
  const int lane = threadIdx.x & 31;
  const int64_t g = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (g >= G) return;  // whole warps leave together
  const scalar_t* xg = x + g * gs;
  float lo = INFINITY, hi = -INFINITY;
  for (int64_t j = lane; j < gs; j += 32) {
    const float v = static_cast<float>(xg[j]);
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
  }
  lo = warp_min(lo);
  hi = warp_max(hi);
  const float sc = __fdiv_rn(__fsub_rn(hi, lo), kLevels);
  const bool has_range = sc > 0.0f;
  if (lane == 0) {
    scale[g] = sc;
    zero[g] = lo;
  }
  uint8_t* out = packed + g * (gs / kPer);
  for (int64_t i = lane; i < gs / kPer; i += 32) {
    int b = 0;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int64_t j = i * kPer + k;
      int q = 0;
      if (has_range) {
        const float v = __fdiv_rn(__fsub_rn(static_cast<float>(xg[j]), lo), sc);
        const float r = stochastic ? floorf(__fadd_rn(v, quant::uniform(key, g * gs + j))) : rintf(v);
        q = static_cast<int>(fminf(fmaxf(r, 0.0f), kLevels));
      }
      b |= q << (k * BITS);
    }
    out[i] = static_cast<uint8_t>(b);
  }
}

template <int BITS, typename out_t>
__global__ void dequantize_kernel(const uint8_t* __restrict__ packed, const float* __restrict__ scale,
                                  const float* __restrict__ zero, out_t* __restrict__ out, int64_t n_bytes,
                                  int64_t gs) {
  constexpr int kPer = 8 / BITS;
  constexpr int kMask = (1 << BITS) - 1;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_bytes;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t g = i * kPer / gs;  // a group holds whole bytes
    const float sc = scale[g], lo = zero[g];
    const int b = packed[i];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const float q = static_cast<float>((b >> (k * BITS)) & kMask);
      out[i * kPer + k] = static_cast<out_t>(__fadd_rn(lo, __fmul_rn(q, sc)));  // no FMA: as the reference
    }
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_groupwise(const at::Tensor& x_in, int64_t bits,
                                                                  int64_t group_size, bool stochastic,
                                                                  int64_t seed) {
  quant::check_quantize_args(x_in, bits, group_size);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const quant::QuantizeOutputs outs = quant::quantize_outputs(x, bits, group_size);
  const at::Tensor &packed = outs.packed, &scale = outs.scale, &zero = outs.zero;
  const int64_t G = outs.groups;
  if (G == 0) return {packed, scale, zero};
  const uint32_t key = quant::seed_key(seed);
  const int64_t blocks = (G + kWarpsPerBlock - 1) / kWarpsPerBlock;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "x: too many groups (", G, ") for one launch");
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "glm5_quantize_groupwise_cuda", [&] {
    quant::with_bits(bits, [&](auto b) {
      quantize_kernel<decltype(b)::value, scalar_t><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
          x.const_data_ptr<scalar_t>(), packed.data_ptr<uint8_t>(), scale.data_ptr<float>(),
          zero.data_ptr<float>(), G, group_size, stochastic, key);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {packed, scale, zero};
}

at::Tensor dequantize(const at::Tensor& packed_in, const at::Tensor& scale_in, const at::Tensor& zero_in,
                      int64_t bits, int64_t group_size, c10::SymIntArrayRef shape_sym, at::ScalarType dtype) {
  const at::IntArrayRef shape = C10_AS_INTARRAYREF_SLOW(shape_sym);
  const int64_t numel =
      quant::check_dequantize_args(packed_in, scale_in, zero_in, bits, group_size, shape, dtype);
  const c10::cuda::CUDAGuard guard(packed_in.device());
  at::Tensor out = at::empty(shape, packed_in.options().dtype(dtype));
  if (numel == 0) return out;
  const at::Tensor packed = packed_in.contiguous(), scale = scale_in.contiguous(), zero = zero_in.contiguous();
  const int64_t n_bytes = numel * bits / 8;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n_bytes + threads - 1) / threads, int64_t(1) << 20);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "glm5_dequantize_cuda", [&] {
    quant::with_bits(bits, [&](auto b) {
      dequantize_kernel<decltype(b)::value, scalar_t><<<blocks, threads, 0, stream>>>(
          packed.const_data_ptr<uint8_t>(), scale.const_data_ptr<float>(), zero.const_data_ptr<float>(),
          out.data_ptr<scalar_t>(), n_bytes, group_size);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

}  // namespace cuda
}  // namespace glm5

TORCH_LIBRARY_IMPL(glm5, CUDA, m) {
  m.impl("quantize_groupwise", &glm5::cuda::quantize_groupwise);
  m.impl("dequantize", &glm5::cuda::dequantize);
}
