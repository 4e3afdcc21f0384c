// Group-wise asymmetric quantisation (activation compression) on the CPU.
//
// quantize_groupwise: per group of group_size consecutive elements, zero = min,
// scale = (max - min) / (2^bits - 1), q = round_half_even((x - zero) / scale)
// or floor(v + u) with u from a counter-based hash of (seed, element index)
// (csrc/quantize_common.h), clamped and packed 8/(bits) codes a byte, first
// element in the lowest bits (glm5_ops/reference.py documents the layout).
// dequantize writes zero + q * scale straight into the requested dtype.
//
// One task per run of groups (at::parallel_for); each group is three short
// loops the compiler vectorises: 8-lane min/max, code computation, packing.
// Results do not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "quantize_common.h"

namespace glm5 {
namespace cpu {
namespace {

// Elements per parallel task (about 64 KiB of fp32 input).
constexpr int64_t kGrainElems = 16384;

inline void group_min_max(const float* x, int64_t n, float& mn_out, float& mx_out) {
  float mn[8], mx[8];
  for (int l = 0; l < 8; ++l) mn[l] = mx[l] = x[0];
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) {
      mn[l] = std::min(mn[l], x[j + l]);
      mx[l] = std::max(mx[l], x[j + l]);
    }
  for (; j < n; ++j) {
    mn[0] = std::min(mn[0], x[j]);
    mx[0] = std::max(mx[0], x[j]);
  }
  for (int l = 1; l < 8; ++l) {
    mn[0] = std::min(mn[0], mn[l]);
    mx[0] = std::max(mx[0], mx[l]);
  }
  mn_out = mn[0];
  mx_out = mx[0];
}

template <int BITS, typename scalar_t>
void quantize_range(const scalar_t* x, uint8_t* packed, float* scale, float* zero, int64_t g0, int64_t g1,
                    int64_t gs, bool stochastic, uint32_t key) {
  constexpr int kPer = 8 / BITS;
  constexpr float kLevels = float((1 << BITS) - 1);
  std::vector<float> buf(std::is_same_v<scalar_t, float> ? 0 : gs);
  std::vector<uint8_t> codes(gs);
  uint8_t* c = codes.data();
  for (int64_t g = g0; g < g1; ++g) {
    const float* xg;
    if constexpr (std::is_same_v<scalar_t, float>) {
      xg = x + g * gs;
    } else {
      const scalar_t* src = x + g * gs;
      for (int64_t j = 0; j < gs; ++j) buf[j] = static_cast<float>(src[j]);
      xg = buf.data();
    }
    float lo, hi;
    group_min_max(xg, gs, lo, hi);
    const float sc = (hi - lo) / kLevels;
    zero[g] = lo;
    scale[g] = sc;
    if (!(sc > 0.0f)) {  // constant group (or NaN): every code is 0, as in the reference
      std::fill(c, c + gs, uint8_t(0));
    } else if (!stochastic) {
      for (int64_t j = 0; j < gs; ++j) {
        const float q = std::nearbyint((xg[j] - lo) / sc);  // half to even (default rounding mode)
        c[j] = static_cast<uint8_t>(std::min(std::max(q, 0.0f), kLevels));
      }
    } else {
      const int64_t n0 = g * gs;
      if ((n0 >> 32) == ((n0 + gs - 1) >> 32)) {  // the usual case: 32-bit counters, vectorised
        const uint32_t hk = quant::hi_key(key, n0), lo32 = static_cast<uint32_t>(n0);
        for (int64_t j = 0; j < gs; ++j) {
          const float u = quant::uniform_lo(key, hk, lo32 + static_cast<uint32_t>(j));
          const float q = std::floor((xg[j] - lo) / sc + u);
          c[j] = static_cast<uint8_t>(std::min(std::max(q, 0.0f), kLevels));
        }
      } else {
        for (int64_t j = 0; j < gs; ++j) {
          const float q = std::floor((xg[j] - lo) / sc + quant::uniform(key, n0 + j));
          c[j] = static_cast<uint8_t>(std::min(std::max(q, 0.0f), kLevels));
        }
      }
    }
    uint8_t* out = packed + g * (gs / kPer);
    if constexpr (kPer == 1) {
      std::copy(c, c + gs, out);
    } else {
      for (int64_t i = 0; i < gs / kPer; ++i) {
        uint8_t b = 0;
        for (int k = 0; k < kPer; ++k) b |= static_cast<uint8_t>(c[i * kPer + k] << (k * BITS));
        out[i] = b;
      }
    }
  }
}

template <int BITS, typename out_t>
void dequantize_range(const uint8_t* packed, const float* scale, const float* zero, out_t* out, int64_t g0,
                      int64_t g1, int64_t gs) {
  constexpr int kPer = 8 / BITS;
  constexpr int kMask = (1 << BITS) - 1;
  for (int64_t g = g0; g < g1; ++g) {
    const float sc = scale[g], lo = zero[g];
    const uint8_t* in = packed + g * (gs / kPer);
    out_t* o = out + g * gs;
    for (int64_t i = 0; i < gs / kPer; ++i) {
      const int b = in[i];
      for (int k = 0; k < kPer; ++k) {
        const float q = static_cast<float>((b >> (k * BITS)) & kMask);
        o[i * kPer + k] = static_cast<out_t>(lo + q * sc);
      }
    }
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_groupwise(const at::Tensor& x_in, int64_t bits,
                                                                  int64_t group_size, bool stochastic,
                                                                  int64_t seed) {
  quant::check_quantize_args(x_in, bits, group_size);
  const at::Tensor x = x_in.contiguous();
  const quant::QuantizeOutputs outs = quant::quantize_outputs(x, bits, group_size);
  const at::Tensor &packed = outs.packed, &scale = outs.scale, &zero = outs.zero;
  const int64_t G = outs.groups;
  if (G == 0) return {packed, scale, zero};
  const uint32_t key = quant::seed_key(seed);
  const int64_t grain = std::max<int64_t>(1, kGrainElems / group_size);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "glm5_quantize_groupwise", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    uint8_t* pp = packed.data_ptr<uint8_t>();
    float* sp = scale.data_ptr<float>();
    float* zp = zero.data_ptr<float>();
    quant::with_bits(bits, [&](auto b) {
      at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) {
        quantize_range<decltype(b)::value, scalar_t>(xp, pp, sp, zp, g0, g1, group_size, stochastic, key);
      });
    });
  });
  return {packed, scale, zero};
}

at::Tensor dequantize(const at::Tensor& packed_in, const at::Tensor& scale_in, const at::Tensor& zero_in,
                      int64_t bits, int64_t group_size, c10::SymIntArrayRef shape_sym, at::ScalarType dtype) {
  const at::IntArrayRef shape = C10_AS_INTARRAYREF_SLOW(shape_sym);
  const int64_t numel =
      quant::check_dequantize_args(packed_in, scale_in, zero_in, bits, group_size, shape, dtype);
  at::Tensor out = at::empty(shape, packed_in.options().dtype(dtype));
  const int64_t G = numel / group_size;
  if (G == 0) return out;
  const at::Tensor packed = packed_in.contiguous(), scale = scale_in.contiguous(), zero = zero_in.contiguous();
  const int64_t grain = std::max<int64_t>(1, kGrainElems / group_size);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "glm5_dequantize", [&] {
    const uint8_t* pp = packed.const_data_ptr<uint8_t>();
    const float* sp = scale.const_data_ptr<float>();
    const float* zp = zero.const_data_ptr<float>();
    scalar_t* op = out.data_ptr<scalar_t>();
    quant::with_bits(bits, [&](auto b) {
      at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) {
        dequantize_range<decltype(b)::value, scalar_t>(pp, sp, zp, op, g0, g1, group_size);
      });
    });
  });
  return out;
}

}  // namespace cpu
}  // namespace glm5

TORCH_LIBRARY_IMPL(glm5, CPU, m) {
  m.impl("quantize_groupwise", &glm5::cpu::quantize_groupwise);
  m.impl("dequantize", &glm5::cpu::dequantize);
}
