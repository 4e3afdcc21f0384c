// topk_indices on the CPU: one row per task, threshold-and-radix selection
// (radix_select.h), no sort unless sorted=True.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu/checks.h"
#include "cpu/radix_select.h"

namespace glm5 {
namespace cpu {

at::Tensor topk_indices(const at::Tensor& scores, int64_t k, bool sorted) {
  TORCH_CHECK(scores.dim() >= 1, "scores must have shape [..., T], got a 0-d tensor");
  GLM5_CHECK_FLOAT(scores, "scores");
  const int64_t T = scores.size(-1);
  TORCH_CHECK(k >= 1 && k <= T, "k must be in [1, T=", T, "], got ", k);
  TORCH_CHECK(T < (int64_t(1) << 31), "scores: T must be < 2^31 for int32 indices, got ", T);
  const at::Tensor s = scores.contiguous();
  std::vector<int64_t> out_shape(scores.sizes().begin(), scores.sizes().end());
  out_shape.back() = k;
  at::Tensor out = at::empty(out_shape, scores.options().dtype(at::kInt));
  const int64_t rows = s.numel() / std::max<int64_t>(T, 1);
  if (rows == 0) return out;
  int32_t* out_ptr = out.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, s.scalar_type(), "glm5_topk_indices", [&] {
    const scalar_t* src = s.const_data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      Candidates cand(T);
      for (int64_t r = begin; r < end; ++r) topk_row(src + r * T, T, k, sorted, out_ptr + r * k, cand);
    });
  });
  return out;
}

}  // namespace cpu
}  // namespace glm5

TORCH_LIBRARY_IMPL(glm5, CPU, m) { m.impl("topk_indices", &glm5::cpu::topk_indices); }
