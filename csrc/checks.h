// Argument checks shared by the CPU and CUDA kernels. The Python API checks
// first and names the argument; these guard direct torch.ops.glm5 calls with
// the same messages, so every backend rejects the same inputs the same way.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace glm5 {

inline bool is_kernel_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

#define GLM5_CHECK_FLOAT(t, name) \
  TORCH_CHECK(::glm5::is_kernel_float((t).scalar_type()), name " must be fp32, fp16 or bf16, got ", (t).scalar_type())

// indexer_scores / indexer_topk: q[B,S,H,D], w[B,S,H], k[B,T,D] (dtype of q), q_start[B].
inline void check_indexer_args(const at::Tensor& q, const at::Tensor& w, const at::Tensor& k,
                               const c10::optional<at::Tensor>& q_start) {
  TORCH_CHECK(q.dim() == 4, "q must have shape [B,S,H,D], got a tensor of rank ", q.dim());
  TORCH_CHECK(w.dim() == 3, "w must have shape [B,S,H], got a tensor of rank ", w.dim());
  TORCH_CHECK(k.dim() == 3, "k must have shape [B,T,D], got a tensor of rank ", k.dim());
  GLM5_CHECK_FLOAT(q, "q");
  GLM5_CHECK_FLOAT(w, "w");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "k must have the dtype of q (", q.scalar_type(), "), got ",
              k.scalar_type());
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), D = q.size(3);
  TORCH_CHECK(w.size(0) == B && w.size(1) == S && w.size(2) == H, "w must have shape [B,S,H] = [", B, ",", S, ",", H,
              "], got ", w.sizes());
  TORCH_CHECK(k.size(0) == B && k.size(2) == D, "k must have shape [B,T,D] = [", B, ",T,", D, "], got ", k.sizes());
  TORCH_CHECK(k.size(1) >= 1, "k must hold at least one key (T >= 1)");
  TORCH_CHECK(k.size(1) < (int64_t(1) << 31), "k: T must be < 2^31 for int32 indices, got ", k.size(1));
  TORCH_CHECK(w.device() == q.device() && k.device() == q.device(), "q, w and k must be on one device, got q on ",
              q.device(), ", w on ", w.device(), ", k on ", k.device());
  if (q_start.has_value()) {
    TORCH_CHECK(q_start->dim() == 1 && q_start->size(0) == B, "q_start must have shape [B] = [", B, "], got ",
                q_start->sizes());
    TORCH_CHECK(q_start->scalar_type() == at::kLong || q_start->scalar_type() == at::kInt,
                "q_start must be int32 or int64, got ", q_start->scalar_type());
  }
}

inline void check_topk_count(int64_t topk, int64_t T, const char* name) {
  TORCH_CHECK(topk >= 1 && topk <= T, name, " must be in [1, T=", T, "], got ", topk);
}

// topk_indices: checks scores[..., T] and k, returns the int32 output [..., k].
inline at::Tensor topk_output(const at::Tensor& scores, int64_t k) {
  TORCH_CHECK(scores.dim() >= 1, "scores must have shape [..., T], got a 0-d tensor");
  GLM5_CHECK_FLOAT(scores, "scores");
  const int64_t T = scores.size(-1);
  check_topk_count(k, T, "k");
  TORCH_CHECK(T < (int64_t(1) << 31), "scores: T must be < 2^31 for int32 indices, got ", T);
  std::vector<int64_t> shape(scores.sizes().begin(), scores.sizes().end());
  shape.back() = k;
  return at::empty(shape, scores.options().dtype(at::kInt));
}

}  // namespace glm5
