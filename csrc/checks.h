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

// q_start: absolute position of query 0 per batch element, int32/int64 [B] on q's device.
inline void check_q_start(const c10::optional<at::Tensor>& q_start, int64_t B, const at::Device& device) {
  if (!q_start.has_value()) return;
  TORCH_CHECK(q_start->dim() == 1 && q_start->size(0) == B, "q_start must have shape [B] = [", B, "], got ",
              q_start->sizes());
  TORCH_CHECK(q_start->scalar_type() == at::kLong || q_start->scalar_type() == at::kInt,
              "q_start must be int32 or int64, got ", q_start->scalar_type());
  TORCH_CHECK(q_start->device() == device, "q_start must be on ", device, " like q, got ", q_start->device());
}

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
  check_q_start(q_start, B, q.device());
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

// --- Attention (sparse_attention*, block_sparse_attention*, block_topk_mask) ---

// q[B,S,Hq,Dk], k[B,T,Hkv,Dk], v[B,T,Hkv,Dv]: one float dtype, one device, Hkv | Hq,
// unit stride along the head dim (v may be a strided view of k, as in MLA).
inline void check_attention_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4, "q must have shape [B,S,Hq,Dk], got a tensor of rank ", q.dim());
  TORCH_CHECK(k.dim() == 4, "k must have shape [B,T,Hkv,Dk], got a tensor of rank ", k.dim());
  TORCH_CHECK(v.dim() == 4, "v must have shape [B,T,Hkv,Dv], got a tensor of rank ", v.dim());
  GLM5_CHECK_FLOAT(q, "q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "k and v must have the dtype of q (", q.scalar_type(), "), got ", k.scalar_type(), " and ",
              v.scalar_type());
  const int64_t B = q.size(0), Hq = q.size(2), Dk = q.size(3), T = k.size(1), Hkv = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == Dk, "k must have shape [B,T,Hkv,Dk] = [", B, ",T,Hkv,", Dk, "], got ",
              k.sizes());
  TORCH_CHECK(v.size(0) == B && v.size(1) == T && v.size(2) == Hkv, "v must have shape [B,T,Hkv,Dv] = [", B, ",", T,
              ",", Hkv, ",Dv], got ", v.sizes());
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0, "the kv heads of k (Hkv=", Hkv, ") must divide the query heads of q (Hq=",
              Hq, ")");
  TORCH_CHECK(T < (int64_t(1) << 31), "k: T must be < 2^31 for int32 indices, got ", T);
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), "q, k and v must be on one device, got q on ",
              q.device(), ", k on ", k.device(), ", v on ", v.device());
  TORCH_CHECK(q.is_contiguous(), "q must be contiguous");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "k and v must have unit stride along the head dim");
}

// sparse_attention: indices int32 [B,S,topk] on q's device.
inline void check_sparse_indices(const at::Tensor& q, const at::Tensor& indices) {
  TORCH_CHECK(indices.dim() == 3 && indices.size(0) == q.size(0) && indices.size(1) == q.size(1),
              "indices must have shape [B,S,topk] = [", q.size(0), ",", q.size(1), ",topk], got ", indices.sizes());
  TORCH_CHECK(indices.scalar_type() == at::kInt, "indices must be int32, got ", indices.scalar_type());
  TORCH_CHECK(indices.device() == q.device(), "indices must be on ", q.device(), " like q, got ", indices.device());
  TORCH_CHECK(indices.is_contiguous(), "indices must be contiguous");
}

// block_sparse_attention: kv_num_blocks int32 [B,Hq,Qb], kv_indices int32 [B,Hq,Qb,W]
// (the Python API expands broadcast masks and checks the entries).
inline void check_block_mask(const at::Tensor& q, const at::Tensor& k, const at::Tensor& kv_num_blocks,
                             const at::Tensor& kv_indices, int64_t block_size) {
  TORCH_CHECK(block_size >= 1, "block_size must be positive, got ", block_size);
  const int64_t B = q.size(0), Hq = q.size(2), Qb = (q.size(1) + block_size - 1) / block_size;
  TORCH_CHECK(kv_num_blocks.dim() == 3 && kv_num_blocks.size(0) == B && kv_num_blocks.size(1) == Hq &&
                  kv_num_blocks.size(2) == Qb,
              "kv_num_blocks must have shape [B,Hq,Qb] = [", B, ",", Hq, ",", Qb, "], got ", kv_num_blocks.sizes());
  TORCH_CHECK(kv_indices.dim() == 4 && kv_indices.size(0) == B && kv_indices.size(1) == Hq &&
                  kv_indices.size(2) == Qb,
              "kv_indices must have shape [B,Hq,Qb,maxKV] = [", B, ",", Hq, ",", Qb, ",maxKV], got ",
              kv_indices.sizes());
  TORCH_CHECK(kv_num_blocks.scalar_type() == at::kInt && kv_indices.scalar_type() == at::kInt,
              "kv_num_blocks and kv_indices must be int32, got ", kv_num_blocks.scalar_type(), " and ",
              kv_indices.scalar_type());
  TORCH_CHECK(kv_num_blocks.device() == q.device() && kv_indices.device() == q.device(),
              "the block mask must be on ", q.device(), " like q");
  TORCH_CHECK(kv_num_blocks.is_contiguous() && kv_indices.is_contiguous(), "the block mask must be contiguous");
  (void)k;
}

// Backward: dout like out [B,S,Hq,Dv] (dtype of q), lse fp32 [B,S,Hq].
inline void check_attention_grads(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& v,
                                  const at::Tensor& out, const at::Tensor& lse) {
  const std::vector<int64_t> o_shape{q.size(0), q.size(1), q.size(2), v.size(3)};
  TORCH_CHECK(dout.sizes() == at::IntArrayRef(o_shape), "dout must have shape [B,S,Hq,Dv] = ", at::IntArrayRef(o_shape),
              ", got ", dout.sizes());
  TORCH_CHECK(out.sizes() == dout.sizes(), "out must have shape ", dout.sizes(), ", got ", out.sizes());
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) && lse.size(2) == q.size(2),
              "lse must have shape [B,S,Hq] = [", q.size(0), ",", q.size(1), ",", q.size(2), "], got ", lse.sizes());
  TORCH_CHECK(lse.scalar_type() == at::kFloat, "lse must be fp32, got ", lse.scalar_type());
  TORCH_CHECK(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "dout and out must have the dtype of q (", q.scalar_type(), ")");
  TORCH_CHECK(dout.device() == q.device() && out.device() == q.device() && lse.device() == q.device(),
              "dout, out and lse must be on ", q.device(), " like q");
}

// block_topk_mask: q[B,S,H,D], k[B,T,Hkv,D], counts >= 0, pooling "mean" | "minmax".
inline void check_block_topk_args(const at::Tensor& q, const at::Tensor& k, int64_t block_size, int64_t topk_blocks,
                                  int64_t sink_blocks, int64_t local_blocks, c10::string_view pooling) {
  TORCH_CHECK(q.dim() == 4, "q must have shape [B,S,H,D], got a tensor of rank ", q.dim());
  TORCH_CHECK(k.dim() == 4, "k must have shape [B,T,Hkv,D], got a tensor of rank ", k.dim());
  GLM5_CHECK_FLOAT(q, "q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "k must have the dtype of q (", q.scalar_type(), "), got ",
              k.scalar_type());
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3), "k must have shape [B,T,Hkv,D] = [", q.size(0),
              ",T,Hkv,", q.size(3), "], got ", k.sizes());
  TORCH_CHECK(k.size(2) >= 1 && q.size(2) % k.size(2) == 0, "the kv heads of k (Hkv=", k.size(2),
              ") must divide the query heads of q (H=", q.size(2), ")");
  TORCH_CHECK(k.device() == q.device(), "q and k must be on one device, got ", q.device(), " and ", k.device());
  TORCH_CHECK(block_size >= 1, "block_size must be positive, got ", block_size);
  TORCH_CHECK(topk_blocks >= 0 && sink_blocks >= 0 && local_blocks >= 0,
              "topk_blocks, sink_blocks and local_blocks must be >= 0, got ", topk_blocks, ", ", sink_blocks, ", ",
              local_blocks);
  TORCH_CHECK(pooling == "mean" || pooling == "minmax", "pooling must be 'mean' or 'minmax', got '", pooling, "'");
}

}  // namespace glm5
