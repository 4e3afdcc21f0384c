// gemv(x[M,K], w[N,K], bias?[N]) -> [M,N] = x @ w^T + bias, x and w both fp32
// or both bf16, fp32 accumulation, for few rows M (decode; glm5_ops/plan.py
// chooses when a linear layer takes it instead of the BLAS GEMM).
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

constexpr int64_t kTileRows = 8;                  // weight rows per tile (gemv_tiles.h's widest)
constexpr int64_t kMinBytesPerThread = 1 << 16;   // below this a second thread costs more than it reads

void check_args(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() == 2, "x must have shape [M,K], got ", x.sizes());
  TORCH_CHECK_VALUE(w.dim() == 2 && w.size(1) == x.size(1), "w must have shape [N,K=", x.size(1), "], got ",
                    w.sizes());
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

template <typename W>
void run(const float* x, int64_t ldx, int64_t M, int64_t K, const W* w, const float* bias, int64_t N, float* y) {
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  const int64_t tile_bytes = kTileRows * std::max<int64_t>(K, 1) * int64_t(sizeof(W));
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / tile_bytes);
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    gemv::rows<W>(x, ldx, M, K, w, nullptr, bias, t0 * kTileRows, std::min(N, t1 * kTileRows), y, N);
  });
}

at::Tensor gemv_op(const at::Tensor& x_in, const at::Tensor& w_in, const c10::optional<at::Tensor>& bias_in) {
  check_args(x_in, w_in, bias_in);
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w_in.size(0);
  const at::Tensor w = w_in.contiguous();
  c10::optional<at::Tensor> bias;
  if (bias_in.has_value()) bias = bias_in->to(at::kFloat).contiguous();
  auto y = at::empty({M, N}, x_in.options().dtype(at::kFloat));
  if (M > 0 && N > 0) {
    const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    if (w.scalar_type() == at::kFloat) {
      const at::Tensor x = x_in.contiguous();
      run<float>(x.data_ptr<float>(), K, M, K, w.data_ptr<float>(), bp, N, y.data_ptr<float>());
    } else {
      const at::Tensor xf = x_in.to(at::kFloat).contiguous();
      const int64_t ldx = gemv::split_len(K);
      std::vector<float> xs(size_t(M * ldx));
      for (int64_t m = 0; m < M; ++m) gemv::split_pairs(xf.data_ptr<float>() + m * K, K, xs.data() + m * ldx);
      run<gemv::bf16_bits>(xs.data(), ldx, M, K, reinterpret_cast<const gemv::bf16_bits*>(w.data_ptr()), bp, N,
                           y.data_ptr<float>());
    }
  }
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

}  // namespace
}  // namespace cpu
}  // namespace glm5

TORCH_LIBRARY_IMPL(glm5, CPU, m) { m.impl("gemv", &glm5::cpu::gemv_op); }
