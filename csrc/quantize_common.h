// Shared by the CPU (csrc/cpu/quantize.cpp) and CUDA (csrc/cuda/quantize.cu)
// group-wise quantisation kernels: argument checks and the counter-based RNG
// of stochastic rounding. glm5_ops/triton/quantize.py implements the same
// hash, so the three kernels draw the same u for the same (seed, element).
//
// Layout (glm5_ops/reference.py is the spec): groups of group_size consecutive
// elements; element n's code sits in byte n / (8/bits) at bit offset
// (n % (8/bits)) * bits, first element in the lowest bits; x ≈ zero[g] + q * scale[g].
#pragma once

#include <type_traits>

#include <ATen/ATen.h>

#include <cstdint>

#ifdef __CUDACC__
#define GLM5_HD __host__ __device__ __forceinline__
#else
#define GLM5_HD inline
#endif

namespace glm5 {
namespace quant {

// lowbias32 (Chris Wellons' hash-prospector): a 32-bit integer bijection with
// good avalanche, only 32-bit multiplies and shifts, so it vectorises.
GLM5_HD uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The per-call key, from the 64-bit seed.
GLM5_HD uint32_t seed_key(int64_t seed) {
  const uint64_t s = static_cast<uint64_t>(seed);
  return hash32(static_cast<uint32_t>(s) ^ hash32(static_cast<uint32_t>(s >> 32) ^ 0x9e3779b9u));
}

// u in [0, 1) for element n (its index in the flattened tensor), 24 bits: a
// function of (key, n) only, so the result does not depend on how the work is
// split across threads or blocks. hi_key(key, n) changes only every 2^32
// elements, so loops hoist it and run uniform_lo on 32-bit lanes.
GLM5_HD uint32_t hi_key(uint32_t key, int64_t n) {
  return hash32(static_cast<uint32_t>(static_cast<uint64_t>(n) >> 32) ^ key);
}

GLM5_HD float uniform_lo(uint32_t key, uint32_t hk, uint32_t n_lo) {
  const uint32_t h = hash32(hash32(n_lo + hk) ^ key);
  return static_cast<float>(static_cast<int32_t>(h >> 8)) * (1.0f / 16777216.0f);  // signed: vectorises
}

GLM5_HD float uniform(uint32_t key, int64_t n) {
  return uniform_lo(key, hi_key(key, n), static_cast<uint32_t>(n));
}

inline void check_bits_group(int64_t bits, int64_t group_size) {
  TORCH_CHECK_VALUE(bits == 8 || bits == 4 || bits == 2, "bits must be one of (8, 4, 2), got ", bits);
  TORCH_CHECK_VALUE(group_size > 0 && group_size % (8 / bits) == 0, "group_size must be a positive multiple of ",
                    8 / bits, " for ", bits, "-bit packing, got ", group_size);
}

inline void check_quantize_args(const at::Tensor& x, int64_t bits, int64_t group_size) {
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()), "x must be a floating-point tensor, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1, "x must have at least one dimension (groups run along the last one), got a 0-d tensor");
  check_bits_group(bits, group_size);
  TORCH_CHECK_VALUE(x.size(-1) % group_size == 0, "group_size must divide the last dimension of x (",
                    x.size(-1), "), got ", group_size);
}

// Returns numel of the dequantised tensor.
inline int64_t check_dequantize_args(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& zero,
                                     int64_t bits, int64_t group_size, at::IntArrayRef shape,
                                     at::ScalarType dtype) {
  check_bits_group(bits, group_size);
  TORCH_CHECK_VALUE(!shape.empty(), "shape must have at least one dimension, got []");
  TORCH_CHECK_VALUE(shape.back() % group_size == 0, "group_size must divide the last dimension of shape (",
                    shape.back(), "), got ", group_size);
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                   "dtype must be fp32, fp16 or bf16, got ", dtype);
  TORCH_CHECK_TYPE(packed.scalar_type() == at::kByte, "packed must be uint8, got ", packed.scalar_type());
  int64_t numel = 1;
  for (int64_t s : shape) {
    TORCH_CHECK_VALUE(s >= 0, "shape must be non-negative, got ", shape);
    numel *= s;
  }
  TORCH_CHECK_VALUE(packed.numel() == numel * bits / 8, "packed must hold ", numel * bits / 8, " bytes for shape ",
                    shape, " at ", bits, " bits, got ", packed.numel());
  const int64_t G = numel / group_size;
  TORCH_CHECK_VALUE(scale.numel() == G && zero.numel() == G, "scale and zero must have G=", G,
                    " entries, got ", scale.numel(), " and ", zero.numel());
  TORCH_CHECK_TYPE(scale.scalar_type() == at::kFloat && zero.scalar_type() == at::kFloat,
                   "scale and zero must be fp32, got ", scale.scalar_type(), " and ", zero.scalar_type());
  TORCH_CHECK_VALUE(packed.device() == scale.device() && packed.device() == zero.device(),
                    "packed, scale and zero must be on one device, got ", packed.device(), ", ", scale.device(),
                    " and ", zero.device());
  return numel;
}

// The three outputs of quantize_groupwise for x (checked by check_quantize_args):
// packed codes (bits/8 bytes a value), and fp32 scale and zero per group.
struct QuantizeOutputs {
  at::Tensor packed, scale, zero;
  int64_t groups;
};
inline QuantizeOutputs quantize_outputs(const at::Tensor& x, int64_t bits, int64_t group_size) {
  const int64_t numel = x.numel(), G = numel / group_size;
  return {at::empty({numel * bits / 8}, x.options().dtype(at::kByte)), at::empty({G}, x.options().dtype(at::kFloat)),
          at::empty({G}, x.options().dtype(at::kFloat)), G};
}

// Calls f with the bit width as a compile-time constant (8, 4 or 2).
template <typename F>
void with_bits(int64_t bits, F&& f) {
  if (bits == 8) f(std::integral_constant<int, 8>{});
  else if (bits == 4) f(std::integral_constant<int, 4>{});
  else f(std::integral_constant<int, 2>{});
}

}  // namespace quant
}  // namespace glm5
