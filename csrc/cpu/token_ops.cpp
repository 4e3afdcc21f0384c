// rms_norm and rope: the network's per-token ops as one kernel each, for
// inference (glm5_ops/token_ops.py decides when they run; training keeps the
// differentiable composites). A decode step runs 33 RMSNorms and ~24 RoPEs on
// a few KB each: as torch composites that is 6 and ~11 dispatches a call,
// ~10 and ~15 us of framework time for well under 1 us of arithmetic.
//
// Both follow the composites' rounding: rms_norm normalises in fp32, rounds to
// x's dtype, then multiplies by the weight (transformers' order); rope rounds
// each product and each sum to x's dtype as the composite's separate tensor ops
// do, and contracts no product into an FMA (the pragma), so it equals the
// composite bit for bit. Each row's arithmetic depends on that row alone: a
// token gets the same bits alone as in any batch.
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace glm5 {
namespace cpu {
namespace {

constexpr int64_t kGrainRows = 64;
constexpr int64_t kLanes = 16;

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
                       t.scalar_type() == at::kHalf,
                   name, " must be fp32, bf16 or fp16, got ", t.scalar_type());
}

// y = weight * to_dtype(x * rsqrt(mean(x^2) + eps)) over the last dim.
at::Tensor rms_norm_op(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_float(x_in, "x");
  TORCH_CHECK_VALUE(x_in.dim() >= 1, "x must have at least one dim [..., D], got a scalar");
  const int64_t D = x_in.size(-1);
  TORCH_CHECK_VALUE(weight_in.dim() == 1 && weight_in.size(0) == D, "weight must have shape [D=", D, "], got ",
                    weight_in.sizes());
  TORCH_CHECK_TYPE(weight_in.scalar_type() == x_in.scalar_type(), "weight must have the dtype of x (",
                   x_in.scalar_type(), "), got ", weight_in.scalar_type());
  TORCH_CHECK_VALUE(weight_in.device() == x_in.device(), "x and weight must be on one device, got x on ",
                    x_in.device(), ", weight on ", weight_in.device());
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, "eps must be a finite number >= 0, got ", eps);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t rows = D ? x.numel() / D : 0;
  const float e = static_cast<float>(eps);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kGrainRows, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* xr = xp + r * D;
        // 16 partial sums in a fixed order (vectorisable without reassociating)
        float part[kLanes] = {};
        int64_t d = 0;
        for (; d + kLanes <= D; d += kLanes)
          for (int64_t j = 0; j < kLanes; ++j) part[j] += static_cast<float>(xr[d + j]) * static_cast<float>(xr[d + j]);
        for (; d < D; ++d) part[d % kLanes] += static_cast<float>(xr[d]) * static_cast<float>(xr[d]);
        float ss = 0.f;
        for (int64_t j = 0; j < kLanes; ++j) ss += part[j];
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + e);
        for (d = 0; d < D; ++d) {
          const scalar_t normed = static_cast<scalar_t>(static_cast<float>(xr[d]) * inv);
          yp[r * D + d] = static_cast<scalar_t>(static_cast<float>(wp[d]) * static_cast<float>(normed));
        }
      }
    });
  });
  return y;
}

// GLM-5's interleaved RoPE on the first rotary_dim channels of x [B,S,D] or
// [B,S,H,D] (cos, sin [B,S,rotary_dim/2]): pairs (x0,x1), (x2,x3)... rotated,
// written de-interleaved (first members, then second members, as
// transformers lays them out); channels past rotary_dim are copied.
at::Tensor rope_op(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in, int64_t rotary_dim) {
  check_float(x_in, "x");
  TORCH_CHECK_VALUE(x_in.dim() == 3 || x_in.dim() == 4, "x must have shape [B,S,D] or [B,S,H,D], got ",
                    x_in.sizes());
  const int64_t B = x_in.size(0), S = x_in.size(1), D = x_in.size(-1), R = rotary_dim, half = R / 2;
  TORCH_CHECK_VALUE(R >= 0 && R % 2 == 0 && R <= D, "rotary_dim must be even and in [0, D=", D, "], got ", R);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{cos_in, "cos"}, {sin_in, "sin"}}) {
    TORCH_CHECK_VALUE(t.dim() == 3 && t.size(0) == B && t.size(1) == S && t.size(2) == half, name,
                      " must have shape [B=", B, ",S=", S, ",rotary_dim/2=", half, "], got ", t.sizes());
    TORCH_CHECK_TYPE(t.scalar_type() == x_in.scalar_type(), name, " must have the dtype of x (", x_in.scalar_type(),
                     "), got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.device() == x_in.device(), "x and ", name, " must be on one device, got x on ",
                      x_in.device(), ", ", name, " on ", t.device());
  }
  const at::Tensor x = x_in.dim() == 3 ? x_in.unsqueeze(2) : x_in;   // [B,S,H,D] view, any strides
  const at::Tensor cs = cos_in.contiguous(), sn = sin_in.contiguous();
  const int64_t H = x.size(2);
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t sb = x.stride(0), ss = x.stride(1), sh = x.stride(2), sd = x.stride(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* cp = cs.const_data_ptr<scalar_t>();
    const scalar_t* spp = sn.const_data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    auto round = [](float v) { return static_cast<float>(static_cast<scalar_t>(v)); };
    at::parallel_for(0, B * S, kGrainRows, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / S, s = t % S;
        const scalar_t* c = cp + t * half;
        const scalar_t* sv = spp + t * half;
        for (int64_t h = 0; h < H; ++h) {
          const scalar_t* xr = xp + b * sb + s * ss + h * sh;
          scalar_t* yr = yp + (t * H + h) * D;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = static_cast<float>(xr[2 * i * sd]), x2 = static_cast<float>(xr[(2 * i + 1) * sd]);
            const float ci = static_cast<float>(c[i]), si = static_cast<float>(sv[i]);
            yr[i] = static_cast<scalar_t>(round(x1 * ci) - round(x2 * si));
            yr[half + i] = static_cast<scalar_t>(round(x2 * ci) + round(x1 * si));
          }
          for (int64_t d = R; d < D; ++d) yr[d] = xr[d * sd];
        }
      }
    });
  });
  return x_in.dim() == 3 ? y.squeeze(2) : y;
}

}  // namespace
}  // namespace cpu
}  // namespace glm5

TORCH_LIBRARY_IMPL(glm5, CPU, m) {
  m.impl("rms_norm", &glm5::cpu::rms_norm_op);
  m.impl("rope", &glm5::cpu::rope_op);
}
