// topk_indices on the CPU: one row per task, threshold-and-radix selection
// (radix_select.h), no sort unless sorted=True.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/parallel.h"
#include "cpu/radix_select.h"

namespace glm5 {
namespace cpu {

at::Tensor topk_indices(const at::Tensor& scores, int64_t k, bool sorted) {
  at::Tensor out = topk_output(scores, k);
  const int64_t T = scores.size(-1);
  const at::Tensor s = scores.contiguous();
  const int64_t rows = s.numel() / std::max<int64_t>(T, 1);
  if (rows == 0) return out;
#ifdef GLM5_PLANT_OOB
  // Test-only (GLM5_PLANT_OOB=1, never in a real build): reads one byte past the
  // end of scores, which a normal run does not notice. scripts/sanitize.sh must
  // catch it; docs/FUZZING.md shows the report.
  volatile const char glm5_planted = static_cast<const char*>(s.const_data_ptr())[s.nbytes()];
  (void)glm5_planted;
#endif
  int32_t* out_ptr = out.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, s.scalar_type(), "glm5_topk_indices", [&] {
    const scalar_t* src = s.const_data_ptr<scalar_t>();
    parallel_dynamic(
        rows, [&] { return Candidates(T); },
        [&](int64_t r, Candidates& cand) { topk_row(src + r * T, T, k, sorted, out_ptr + r * k, cand); });
  });
  return out;
}

}  // namespace cpu
}  // namespace glm5

TORCH_LIBRARY_IMPL(glm5, CPU, m) { m.impl("topk_indices", &glm5::cpu::topk_indices); }
