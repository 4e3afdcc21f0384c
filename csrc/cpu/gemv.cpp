// gemv(x[M,K], w[N,K], bias?[N]) -> [M,N] = x @ w^T + bias, x and w both fp32
// or both bf16, fp32 accumulation, for few rows M (decode; glm5_ops/plan.py
// chooses when a linear layer takes it instead of the BLAS GEMM).
// Per head: gemv(x[H,M,K], w[H,N,K], None) -> [H,M,N], y[h] = x[h] @ w[h]^T; w's
// heads may sit any distance apart (rows contiguous), so MLA's W_UV, a strided
// view of kv_b_proj's weight, is read in place. At decode a head's product is
// tiny (MLA: 64 x 256): one call for all heads, their row tiles in one list
// split between the threads, where torch.bmm's per-head GEMMs took ~100 us a
// layer for 1 MB.
//
// The weight matrix is the traffic: every thread streams its own contiguous
// range of weight rows once (at::parallel_for's static split over row tiles)
// through the tiles of gemv_tiles.h. bf16 activations are widened to fp32 once
// (M*K against N*K weight elements), in the even/odd layout the bf16 tiles read.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemv_tiles.h"

namespace glm5 {
namespace cpu {
namespace {

void check_args(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  if (x.dim() == 3) {
    TORCH_CHECK_VALUE(w.dim() == 3 && w.size(0) == x.size(0) && w.size(2) == x.size(2), "w must have shape [H=",
                      x.size(0), ",N,K=", x.size(2), "] like x [H,M,K], got ", w.sizes());
    TORCH_CHECK_VALUE(!bias.has_value(), "bias must be None when x and w have heads [H,...]");
  } else {
    TORCH_CHECK_VALUE(x.dim() == 2, "x must have shape [M,K] or [H,M,K], got ", x.sizes());
    TORCH_CHECK_VALUE(w.dim() == 2 && w.size(1) == x.size(1), "w must have shape [N,K=", x.size(1), "], got ",
                      w.sizes());
  }
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                   "x must be fp32 or bf16, got ", x.scalar_type());
  TORCH_CHECK_TYPE(w.scalar_type() == x.scalar_type(), "w must have the dtype of x (", x.scalar_type(), "), got ",
                   w.scalar_type());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == w.size(0), "bias must have shape [N=", w.size(0),
                      "], got ", bias->sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "bias must have the dtype of x (", x.scalar_type(),
                     "), got ", bias->scalar_type());
  }
}

at::Tensor gemv_op(const at::Tensor& x_in, const at::Tensor& w_in, const c10::optional<at::Tensor>& bias_in) {
  check_args(x_in, w_in, bias_in);
  const bool heads = x_in.dim() == 3;
  const int64_t H = heads ? x_in.size(0) : 1, M = x_in.size(-2), K = x_in.size(-1), N = w_in.size(-2);
  // Rows must be contiguous; heads may be any distance apart (a strided view is read in place).
  const bool rows_ok = w_in.stride(-1) == 1 && (w_in.stride(-2) == K || N == 1);
  const at::Tensor w = rows_ok ? w_in : w_in.contiguous();
  const int64_t ws = heads ? w.stride(0) : 0;
  c10::optional<at::Tensor> bias;
  if (bias_in.has_value()) bias = bias_in->to(at::kFloat).contiguous();
  auto y = heads ? at::empty({H, M, N}, x_in.options().dtype(at::kFloat))
                 : at::empty({M, N}, x_in.options().dtype(at::kFloat));
  if (H > 0 && M > 0 && N > 0) {
    const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    if (w.scalar_type() == at::kFloat) {
      const at::Tensor x = x_in.contiguous();
      gemv::rows_parallel<float>(x.data_ptr<float>(), K, H, M, K, w.data_ptr<float>(), ws, nullptr, 0, bp, N,
                                 y.data_ptr<float>());
    } else {
      const at::Tensor xf = x_in.to(at::kFloat).contiguous();
      const int64_t ldx = gemv::split_len(K);
      std::vector<float> xs(size_t(H * M * ldx));
      for (int64_t m = 0; m < H * M; ++m) gemv::split_pairs(xf.data_ptr<float>() + m * K, K, xs.data() + m * ldx);
      gemv::rows_parallel<gemv::bf16_bits>(xs.data(), ldx, H, M, K,
                                           reinterpret_cast<const gemv::bf16_bits*>(w.data_ptr()), ws, nullptr, 0,
                                           bp, N, y.data_ptr<float>());
    }
  }
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

}  // namespace
}  // namespace cpu
}  // namespace glm5

TORCH_LIBRARY_IMPL(glm5, CPU, m) { m.impl("gemv", &glm5::cpu::gemv_op); }
