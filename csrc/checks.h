// Memory guards shared by the CPU and CUDA kernels. The op contract is checked
// once, by the Python wrappers (docs/OPS.md), which name the argument; these
// compact checks only keep a direct torch.ops.glm5 call from reading or
// writing out of bounds (ranks, shapes, dtypes and devices the kernels index
// with, int32 ranges) or dividing by a zero-size axis, and raise instead.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

namespace glm5 {

inline bool is_kernel_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

#define GLM5_CHECK_FLOAT(t, name) \
  TORCH_CHECK_TYPE(::glm5::is_kernel_float((t).scalar_type()), name " must be fp32, fp16 or bf16, got ", (t).scalar_type())

// q_start: absolute position of query 0 per batch element, int32/int64 [B] on q's device.
inline void check_q_start(const c10::optional<at::Tensor>& q_start, int64_t B, const at::Device& device) {
  if (!q_start.has_value()) return;
  TORCH_CHECK_VALUE(q_start->dim() == 1 && q_start->size(0) == B, "q_start must have shape [B] = [", B, "], got ",
                    q_start->sizes());
  TORCH_CHECK_TYPE(q_start->scalar_type() == at::kLong || q_start->scalar_type() == at::kInt,
                   "q_start must be int32 or int64, got ", q_start->scalar_type());
  TORCH_CHECK_VALUE(q_start->device() == device, "q_start must be on ", device, " like q, got ", q_start->device());
}

// indexer_scores / indexer_topk: q[B,S,H,D], w[B,S,H], k[B,T,D] (dtype of q), q_start[B].
inline void check_indexer_args(const at::Tensor& q, const at::Tensor& w, const at::Tensor& k,
                               const c10::optional<at::Tensor>& q_start) {
  TORCH_CHECK_VALUE(q.dim() == 4, "q must have shape [B,S,H,D], got a tensor of rank ", q.dim());
  TORCH_CHECK_VALUE(w.dim() == 3, "w must have shape [B,S,H], got a tensor of rank ", w.dim());
  TORCH_CHECK_VALUE(k.dim() == 3, "k must have shape [B,T,D], got a tensor of rank ", k.dim());
  GLM5_CHECK_FLOAT(q, "q");
  GLM5_CHECK_FLOAT(w, "w");
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type(), "k must have the dtype of q (", q.scalar_type(), "), got ",
                   k.scalar_type());
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), D = q.size(3);
  TORCH_CHECK_VALUE(H >= 1 && D >= 1, "q must have at least one head (H >= 1) of dim D >= 1, got shape ", q.sizes());
  TORCH_CHECK_VALUE(w.size(0) == B && w.size(1) == S && w.size(2) == H, "w must have shape [B,S,H] = [", B, ",", S, ",", H,
                    "], got ", w.sizes());
  TORCH_CHECK_VALUE(k.size(0) == B && k.size(2) == D, "k must have shape [B,T,D] = [", B, ",T,", D, "], got ", k.sizes());
  TORCH_CHECK_VALUE(k.size(1) >= 1, "k must hold at least one key (T >= 1), got shape ", k.sizes());
  TORCH_CHECK_VALUE(k.size(1) < (int64_t(1) << 31), "k: T must be < 2^31 for int32 indices, got ", k.size(1));
  TORCH_CHECK_VALUE(w.device() == q.device() && k.device() == q.device(), "q, w and k must be on one device, got q on ",
                    q.device(), ", w on ", w.device(), ", k on ", k.device());
  check_q_start(q_start, B, q.device());
}

inline void check_topk_count(int64_t topk, int64_t T, const char* name) {
  TORCH_CHECK_VALUE(topk >= 1 && topk <= T, name, " must be in [1, T=", T, "], got ", topk);
}

// topk_indices: checks scores[..., T] and k, returns the int32 output [..., k].
inline at::Tensor topk_output(const at::Tensor& scores, int64_t k) {
  TORCH_CHECK_VALUE(scores.dim() >= 1, "scores must have shape [..., T], got a 0-d tensor");
  GLM5_CHECK_FLOAT(scores, "scores");
  const int64_t T = scores.size(-1);
  check_topk_count(k, T, "k");
  TORCH_CHECK_VALUE(T < (int64_t(1) << 31), "scores: T must be < 2^31 for int32 indices, got ", T);
  std::vector<int64_t> shape(scores.sizes().begin(), scores.sizes().end());
  shape.back() = k;
  return at::empty(shape, scores.options().dtype(at::kInt));
}

// --- Attention (sparse_attention*, block_sparse_attention*, block_topk_mask) ---

// q[B,S,Hq,Dk], k[B,T,Hkv,Dk], v[B,T,Hkv,Dv]: one float dtype, one device, Hkv | Hq,
// unit stride along the head dim (v may be a strided view of k, as in MLA).
inline void check_attention_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK_VALUE(q.dim() == 4, "q must have shape [B,S,Hq,Dk], got a tensor of rank ", q.dim());
  TORCH_CHECK_VALUE(k.dim() == 4, "k must have shape [B,T,Hkv,Dk], got a tensor of rank ", k.dim());
  TORCH_CHECK_VALUE(v.dim() == 4, "v must have shape [B,T,Hkv,Dv], got a tensor of rank ", v.dim());
  GLM5_CHECK_FLOAT(q, "q");
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                   "k and v must have the dtype of q (", q.scalar_type(), "), got ", k.scalar_type(), " and ",
                   v.scalar_type());
  const int64_t B = q.size(0), Hq = q.size(2), Dk = q.size(3), T = k.size(1), Hkv = k.size(2);
  TORCH_CHECK_VALUE(k.size(0) == B && k.size(3) == Dk, "k must have shape [B,T,Hkv,Dk] = [", B, ",T,Hkv,", Dk, "], got ",
                    k.sizes());
  TORCH_CHECK_VALUE(v.size(0) == B && v.size(1) == T && v.size(2) == Hkv, "v must have shape [B,T,Hkv,Dv] = [", B, ",", T,
                    ",", Hkv, ",Dv], got ", v.sizes());
  // A zero head dim would size the key blocking's chunks at zero rows (the backward never ended).
  TORCH_CHECK_VALUE(Hq >= 1 && Dk >= 1 && v.size(3) >= 1,
                    "q and v must have Hq >= 1 heads and head dims Dk, Dv >= 1, got Hq=", Hq, ", Dk=", Dk, ", Dv=", v.size(3));
  TORCH_CHECK_VALUE(T >= 1, "k must hold at least one key (T >= 1), got shape ", k.sizes());
  TORCH_CHECK_VALUE(Hkv >= 1 && Hq % Hkv == 0, "k must have kv heads Hkv >= 1 that divide the query heads of q (Hq=", Hq,
                    "), got Hkv=", Hkv);
  TORCH_CHECK_VALUE(T < (int64_t(1) << 31), "k: T must be < 2^31 for int32 indices, got ", T);
  TORCH_CHECK_VALUE(k.device() == q.device() && v.device() == q.device(), "q, k and v must be on one device, got q on ",
                    q.device(), ", k on ", k.device(), ", v on ", v.device());
  TORCH_CHECK_VALUE(q.is_contiguous(), "q must be contiguous, got strides ", q.strides());
  TORCH_CHECK_VALUE(k.stride(3) == 1 && v.stride(3) == 1, "k and v must have unit stride along the head dim, got ",
                    k.stride(3), " and ", v.stride(3));
}

// sparse_attention: indices int32 [B,S,topk] on q's device.
inline void check_sparse_indices(const at::Tensor& q, const at::Tensor& indices) {
  TORCH_CHECK_VALUE(indices.dim() == 3 && indices.size(0) == q.size(0) && indices.size(1) == q.size(1),
                    "indices must have shape [B,S,topk] = [", q.size(0), ",", q.size(1), ",topk], got ", indices.sizes());
  TORCH_CHECK_TYPE(indices.scalar_type() == at::kInt, "indices must be int32, got ", indices.scalar_type());
  TORCH_CHECK_VALUE(indices.device() == q.device(), "indices must be on ", q.device(), " like q, got ", indices.device());
  TORCH_CHECK_VALUE(indices.is_contiguous(), "indices must be contiguous, got strides ", indices.strides());
}

// block_sparse_attention: kv_num_blocks int32 [B,Hq,Qb], kv_indices int32 [B,Hq,Qb,W]
// (the Python API expands broadcast masks and checks the entries). Returns the block size to run
// with: any block_size >= max(S, T) gives one query block and one key block, the same mask as
// block_size = max(S, T), so a huge one never sizes the kernels' per-block scratch.
inline int64_t check_block_mask(const at::Tensor& q, const at::Tensor& k, const at::Tensor& kv_num_blocks,
                             const at::Tensor& kv_indices, int64_t block_size) {
  TORCH_CHECK_VALUE(block_size >= 1, "block_size must be positive, got ", block_size);
  // Qb without S + block_size - 1, which overflows for a block_size near 2^63.
  const int64_t B = q.size(0), Hq = q.size(2), Qb = q.size(1) == 0 ? 0 : (q.size(1) - 1) / block_size + 1;
  TORCH_CHECK_VALUE(kv_num_blocks.dim() == 3 && kv_num_blocks.size(0) == B && kv_num_blocks.size(1) == Hq &&
                  kv_num_blocks.size(2) == Qb,
                    "kv_num_blocks must have shape [B,Hq,Qb] = [", B, ",", Hq, ",", Qb, "], got ", kv_num_blocks.sizes());
  TORCH_CHECK_VALUE(kv_indices.dim() == 4 && kv_indices.size(0) == B && kv_indices.size(1) == Hq &&
                  kv_indices.size(2) == Qb,
                    "kv_indices must have shape [B,Hq,Qb,maxKV] = [", B, ",", Hq, ",", Qb, ",maxKV], got ",
                    kv_indices.sizes());
  TORCH_CHECK_TYPE(kv_num_blocks.scalar_type() == at::kInt && kv_indices.scalar_type() == at::kInt,
                   "kv_num_blocks and kv_indices must be int32, got ", kv_num_blocks.scalar_type(), " and ",
                   kv_indices.scalar_type());
  TORCH_CHECK_VALUE(kv_num_blocks.device() == q.device() && kv_indices.device() == q.device(),
                    "kv_num_blocks and kv_indices must be on ", q.device(), " like q, got ",
                    kv_num_blocks.device(), " and ", kv_indices.device());
  TORCH_CHECK_VALUE(kv_num_blocks.is_contiguous() && kv_indices.is_contiguous(),
                    "kv_num_blocks and kv_indices must be contiguous, got strides ", kv_num_blocks.strides(), " and ",
                    kv_indices.strides());
  return std::min(block_size, std::max(q.size(1), k.size(1)));
}

// Backward: dout like out [B,S,Hq,Dv] (dtype of q), lse fp32 [B,S,Hq].
inline void check_attention_grads(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& v,
                                  const at::Tensor& out, const at::Tensor& lse) {
  const std::vector<int64_t> o_shape{q.size(0), q.size(1), q.size(2), v.size(3)};
  TORCH_CHECK_VALUE(dout.sizes() == at::IntArrayRef(o_shape), "dout must have shape [B,S,Hq,Dv] = ", at::IntArrayRef(o_shape),
                    ", got ", dout.sizes());
  TORCH_CHECK_VALUE(out.sizes() == dout.sizes(), "out must have shape ", dout.sizes(), ", got ", out.sizes());
  TORCH_CHECK_VALUE(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) && lse.size(2) == q.size(2),
                    "lse must have shape [B,S,Hq] = [", q.size(0), ",", q.size(1), ",", q.size(2), "], got ", lse.sizes());
  TORCH_CHECK_TYPE(lse.scalar_type() == at::kFloat, "lse must be fp32, got ", lse.scalar_type());
  TORCH_CHECK_TYPE(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
                   "dout and out must have the dtype of q (", q.scalar_type(), "), got ", dout.scalar_type(), " and ",
                   out.scalar_type());
  TORCH_CHECK_VALUE(dout.device() == q.device() && out.device() == q.device() && lse.device() == q.device(),
                    "dout, out and lse must be on ", q.device(), " like q, got ", dout.device(), ", ", out.device(),
                    " and ", lse.device());
}

// block_topk_mask: q[B,S,H,D], k[B,T,Hkv,D], counts >= 0, pooling "mean" | "minmax". Returns the block
// size to run with, as check_block_mask does (block_size >= max(S, T) is one block either way).
inline int64_t check_block_topk_args(const at::Tensor& q, const at::Tensor& k, int64_t block_size, int64_t topk_blocks,
                                  int64_t sink_blocks, int64_t local_blocks, c10::string_view pooling) {
  TORCH_CHECK_VALUE(q.dim() == 4, "q must have shape [B,S,H,D], got a tensor of rank ", q.dim());
  TORCH_CHECK_VALUE(k.dim() == 4, "k must have shape [B,T,Hkv,D], got a tensor of rank ", k.dim());
  GLM5_CHECK_FLOAT(q, "q");
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type(), "k must have the dtype of q (", q.scalar_type(), "), got ",
                   k.scalar_type());
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && k.size(3) == q.size(3), "k must have shape [B,T,Hkv,D] = [", q.size(0),
                    ",T,Hkv,", q.size(3), "], got ", k.sizes());
  TORCH_CHECK_VALUE(q.size(2) >= 1 && q.size(3) >= 1 && k.size(1) >= 1,
                    "q must have H >= 1 heads of dim D >= 1 and k at least one key (T >= 1), got q ", q.sizes(), ", k ",
                    k.sizes());
  TORCH_CHECK_VALUE(k.size(2) >= 1 && q.size(2) % k.size(2) == 0,
                    "k must have kv heads Hkv >= 1 that divide the query heads of q (H=", q.size(2), "), got Hkv=",
                    k.size(2));
  TORCH_CHECK_VALUE(k.device() == q.device(), "q and k must be on one device, got ", q.device(), " and ", k.device());
  TORCH_CHECK_VALUE(block_size >= 1, "block_size must be positive, got ", block_size);
  TORCH_CHECK_VALUE(topk_blocks >= 0 && sink_blocks >= 0 && local_blocks >= 0,
                    "topk_blocks, sink_blocks and local_blocks must be >= 0, got ", topk_blocks, ", ", sink_blocks, ", ",
                    local_blocks);
  TORCH_CHECK_VALUE(pooling == "mean" || pooling == "minmax", "pooling must be 'mean' or 'minmax', got '", pooling, "'");
  return std::min(block_size, std::max(q.size(1), k.size(1)));
}

// block_topk_mask's output width min(Kb, sink + local + topk), without overflow for counts near 2^63.
inline int64_t block_topk_width(int64_t Kb, int64_t topk_blocks, int64_t sink_blocks, int64_t local_blocks) {
  return std::min(Kb, std::min(Kb, sink_blocks) + std::min(Kb, local_blocks) + std::min(Kb, topk_blocks));
}

// --- Mixture of Experts ---

inline bool is_moe_float(at::ScalarType t) { return is_kernel_float(t) || t == at::kDouble; }

// moe_route: h[T,D], gate_w[E,D], bias[E] (float dtypes), group-limited top-k arguments.
inline void check_route_args(const at::Tensor& h, const at::Tensor& gate_w, const at::Tensor& bias, int64_t top_k,
                             int64_t n_group, int64_t topk_group) {
  TORCH_CHECK_VALUE(h.dim() == 2, "h must have shape [T,D], got a tensor of rank ", h.dim());
  GLM5_CHECK_FLOAT(h, "h");
  GLM5_CHECK_FLOAT(gate_w, "gate_w");
  GLM5_CHECK_FLOAT(bias, "bias");
  const int64_t D = h.size(1);
  TORCH_CHECK_VALUE(gate_w.dim() == 2 && gate_w.size(1) == D, "gate_w must have shape [E,D=", D, "], got ", gate_w.sizes());
  const int64_t E = gate_w.size(0);
  TORCH_CHECK_VALUE(bias.dim() == 1 && bias.size(0) == E, "bias must have shape [E=", E, "], got ", bias.sizes());
  TORCH_CHECK_VALUE(n_group >= 1 && E % n_group == 0 && E / n_group >= 2, "n_group must divide E=", E,
                    " into groups of at least 2 experts, got n_group=", n_group);
  TORCH_CHECK_VALUE(topk_group >= 1 && topk_group <= n_group, "topk_group must be in [1, n_group=", n_group, "], got ",
                    topk_group);
  const int64_t per_group = E / n_group;
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= topk_group * per_group, "top_k must be in [1, topk_group * E / n_group = ",
                    topk_group * per_group, "], got ", top_k);
  TORCH_CHECK_VALUE(E < (int64_t(1) << 31), "gate_w: E must be < 2^31 for int32 ids, got ", E);
  TORCH_CHECK_VALUE(gate_w.device() == h.device() && bias.device() == h.device(),
                    "h, gate_w and bias must be on one device, got ", h.device(), ", ", gate_w.device(), " and ",
                    bias.device());
}

// fused_moe: x[T,D] (fp32/fp16/bf16/float64), w_gate_up[E,2I,D] and w_down[E,D,I] in x's dtype,
// weights [T,k] (float), ids int32 [T,k]; one device.
inline void check_fused_moe_args(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down,
                                 const at::Tensor& weights, const at::Tensor& ids) {
  TORCH_CHECK_VALUE(x.dim() == 2, "x must have shape [T,D], got a tensor of rank ", x.dim());
  const auto st = x.scalar_type();
  TORCH_CHECK_TYPE(is_moe_float(st), "x must be fp32, fp16, bf16 or float64, got ", st);
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK_VALUE(w_gate_up.dim() == 3 && w_gate_up.size(2) == D && w_gate_up.size(1) % 2 == 0,
                    "w_gate_up must have shape [E,2I,D=", D, "], got ", w_gate_up.sizes());
  const int64_t E = w_gate_up.size(0), I = w_gate_up.size(1) / 2;
  TORCH_CHECK_VALUE(w_down.dim() == 3 && w_down.size(0) == E && w_down.size(1) == D && w_down.size(2) == I,
                    "w_down must have shape [E=", E, ",D=", D, ",I=", I, "], got ", w_down.sizes());
  TORCH_CHECK_TYPE(w_gate_up.scalar_type() == st && w_down.scalar_type() == st,
                   "w_gate_up and w_down must have the dtype of x (", st, "), got ", w_gate_up.scalar_type(), " and ",
                   w_down.scalar_type());
  TORCH_CHECK_VALUE(ids.dim() == 2 && ids.size(0) == T, "ids must have shape [T=", T, ",k], got ", ids.sizes());
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kInt, "ids must be int32, got ", ids.scalar_type());
  TORCH_CHECK_VALUE(weights.sizes() == ids.sizes(), "weights must have shape [T,k] = ", ids.sizes(), " like ids, got ",
                    weights.sizes());
  TORCH_CHECK_TYPE(is_moe_float(weights.scalar_type()), "weights must be fp32, fp16, bf16 or float64, got ",
                   weights.scalar_type());
  TORCH_CHECK_VALUE(E >= 1 && E < (int64_t(1) << 31), "w_gate_up: E must be in [1, 2^31), got ", E);
  TORCH_CHECK_VALUE(T * ids.size(1) < (int64_t(1) << 31), "T*k must be < 2^31, got ", T * ids.size(1));
  const auto dev = x.device();
  TORCH_CHECK_VALUE(w_gate_up.device() == dev && w_down.device() == dev && weights.device() == dev && ids.device() == dev,
                    "x, w_gate_up, w_down, weights and ids must be on one device, got x on ", dev);
}

// moe_dispatch: x[T,D] (float), ids int32|int64 [T,k] on x's device, num_experts, align.
inline void check_dispatch_args(const at::Tensor& x, const at::Tensor& ids, int64_t num_experts, int64_t align) {
  TORCH_CHECK_VALUE(x.dim() == 2, "x must have shape [T,D], got a tensor of rank ", x.dim());
  TORCH_CHECK_TYPE(is_moe_float(x.scalar_type()), "x must be fp32, fp16, bf16 or float64, got ", x.scalar_type());
  const int64_t T = x.size(0);
  TORCH_CHECK_VALUE(ids.dim() == 2 && ids.size(0) == T, "ids must have shape [T=", T, ",k], got ", ids.sizes());
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong, "ids must be int32 (or int64), got ",
                   ids.scalar_type());
  TORCH_CHECK_VALUE(ids.device() == x.device(), "x and ids must be on one device, got x on ", x.device(), ", ids on ",
                    ids.device());
  // The counters and offsets [E+1] are sized by num_experts (glm5_ops/moe.py's MAX_EXPERTS).
  TORCH_CHECK_VALUE(num_experts >= 1 && num_experts <= (int64_t(1) << 20), "num_experts must be in [1, 2^20], got ",
                    num_experts);
  // The bounds the Python wrapper states (glm5_ops/moe.py MAX_ALIGN): align pads each expert's rows,
  // so one token with a huge align would allocate and zero-fill billions of rows; and the padded
  // sorted rows (at most T*k + E*(align-1)) must fit int32 offsets.
  TORCH_CHECK_VALUE(align >= 1 && align <= 4096, "align must be in [1, 4096], got ", align);
  TORCH_CHECK_VALUE(T * ids.size(1) + num_experts * (align - 1) < (int64_t(1) << 31),
                    "ids, num_experts and align must give T*k + num_experts*(align-1) sorted rows that fit int32, got "
                    "T=", T, ", k=", ids.size(1), ", num_experts=", num_experts, ", align=", align);
}

// moe_combine: y_sorted[N,D] (float), token_slot int32|int64 [T,k], weights [T,k] (float); one device.
inline void check_combine_args(const at::Tensor& y_sorted, const at::Tensor& token_slot, const at::Tensor& weights) {
  TORCH_CHECK_VALUE(y_sorted.dim() == 2, "y_sorted must have shape [N,D], got a tensor of rank ", y_sorted.dim());
  TORCH_CHECK_TYPE(is_moe_float(y_sorted.scalar_type()), "y_sorted must be fp32, fp16, bf16 or float64, got ",
                   y_sorted.scalar_type());
  TORCH_CHECK_VALUE(token_slot.dim() == 2, "token_slot must have shape [T,k], got a tensor of rank ", token_slot.dim());
  TORCH_CHECK_TYPE(token_slot.scalar_type() == at::kInt || token_slot.scalar_type() == at::kLong,
                   "token_slot must be int32 (or int64), got ", token_slot.scalar_type());
  TORCH_CHECK_VALUE(weights.sizes() == token_slot.sizes(), "weights must have shape [T,k] = ", token_slot.sizes(),
                    " like token_slot, got ", weights.sizes());
  TORCH_CHECK_TYPE(is_moe_float(weights.scalar_type()), "weights must be fp32, fp16, bf16 or float64, got ",
                   weights.scalar_type());
  TORCH_CHECK_VALUE(token_slot.device() == y_sorted.device() && weights.device() == y_sorted.device(),
                    "y_sorted, token_slot and weights must be on one device, got ", y_sorted.device(), ", ",
                    token_slot.device(), " and ", weights.device());
}

// int8_linear / w8a8_linear: x[M,K] (fp32/fp16/bf16), w int8[N,K], scale fp32[N], bias[N], one device.
inline void check_int8_linear_args(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                                   const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() == 2, "x must have shape [M,K], got ", x.sizes());
  GLM5_CHECK_FLOAT(x, "x");
  TORCH_CHECK_TYPE(w.scalar_type() == at::kChar, "w must be int8, got ", w.scalar_type());
  TORCH_CHECK_VALUE(w.dim() == 2 && w.size(1) == x.size(1), "w must have shape [N,K=", x.size(1), "], got ", w.sizes());
  TORCH_CHECK_TYPE(scale.scalar_type() == at::kFloat, "scale must be fp32, got ", scale.scalar_type());
  TORCH_CHECK_VALUE(scale.dim() == 1 && scale.size(0) == w.size(0), "scale must have shape [N=", w.size(0), "], got ",
                    scale.sizes());
  if (bias.has_value())
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == w.size(0), "bias must have shape [N=", w.size(0),
                      "], got ", bias->sizes());
  const bool one_device = w.device() == x.device() && scale.device() == x.device() &&
                          (!bias.has_value() || bias->device() == x.device());
  TORCH_CHECK_VALUE(one_device, "w, scale and bias must be on x's device ", x.device());
}

// int8_linear_heads: x[H,M,K] float, w int8[H,N,K], scale fp32[H,N]; w's and scale's rows contiguous
// (their heads any distance apart), all on x's device.
inline void check_int8_linear_heads_args(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK_VALUE(x.dim() == 3, "x must have shape [H,M,K], got ", x.sizes());
  GLM5_CHECK_FLOAT(x, "x");
  TORCH_CHECK_TYPE(w.scalar_type() == at::kChar, "w must be int8, got ", w.scalar_type());
  TORCH_CHECK_VALUE(w.dim() == 3 && w.size(0) == x.size(0) && w.size(2) == x.size(2), "w must have shape [H=",
                    x.size(0), ",N,K=", x.size(2), "], got ", w.sizes());
  TORCH_CHECK_TYPE(scale.scalar_type() == at::kFloat, "scale must be fp32, got ", scale.scalar_type());
  TORCH_CHECK_VALUE(scale.dim() == 2 && scale.size(0) == w.size(0) && scale.size(1) == w.size(1),
                    "scale must have shape [H=", w.size(0), ",N=", w.size(1), "], got ", scale.sizes());
  TORCH_CHECK_VALUE(w.device() == x.device() && scale.device() == x.device(), "w and scale must be on x's device ",
                    x.device());
}

// fused_moe_int8: x[T,D] (fp32/fp16/bf16), w_gate_up int8[E,2I,D] with gate_up_scale fp32[E,2I],
// w_down int8[E,D,I] with down_scale fp32[E,D], ids int32[T,k], weights [T,k].
inline void check_fused_moe_int8_args(const at::Tensor& x_in, const at::Tensor& w_gate_up_in,
                                      const at::Tensor& gu_scale_in, const at::Tensor& w_down_in,
                                      const at::Tensor& down_scale_in, const at::Tensor& weights_in,
                                      const at::Tensor& ids_in) {
  TORCH_CHECK_VALUE(x_in.dim() == 2, "x must have shape [T,D], got ", x_in.sizes());
  GLM5_CHECK_FLOAT(x_in, "x");
  const int64_t T = x_in.size(0), D = x_in.size(1);
  TORCH_CHECK_TYPE(w_gate_up_in.scalar_type() == at::kChar && w_down_in.scalar_type() == at::kChar,
                   "w_gate_up and w_down must be int8, got ", w_gate_up_in.scalar_type(), " and ",
                   w_down_in.scalar_type());
  TORCH_CHECK_VALUE(w_gate_up_in.dim() == 3 && w_gate_up_in.size(2) == D && w_gate_up_in.size(1) % 2 == 0 &&
                        w_gate_up_in.size(0) >= 1,
                    "w_gate_up must have shape [E,2I,D=", D, "], got ", w_gate_up_in.sizes());
  const int64_t E = w_gate_up_in.size(0), I2 = w_gate_up_in.size(1), I = I2 / 2;
  TORCH_CHECK_VALUE(w_down_in.sizes() == at::IntArrayRef({E, D, I}), "w_down must have shape [E,D,I]=[", E, ",", D,
                    ",", I, "], got ", w_down_in.sizes());
  TORCH_CHECK_TYPE(gu_scale_in.scalar_type() == at::kFloat && down_scale_in.scalar_type() == at::kFloat,
                   "gate_up_scale and down_scale must be fp32, got ", gu_scale_in.scalar_type(), " and ",
                   down_scale_in.scalar_type());
  TORCH_CHECK_VALUE(gu_scale_in.sizes() == at::IntArrayRef({E, I2}), "gate_up_scale must have shape [E,2I], got ",
                    gu_scale_in.sizes());
  TORCH_CHECK_VALUE(down_scale_in.sizes() == at::IntArrayRef({E, D}), "down_scale must have shape [E,D], got ",
                    down_scale_in.sizes());
  TORCH_CHECK_TYPE(ids_in.scalar_type() == at::kInt, "ids must be int32, got ", ids_in.scalar_type());
  TORCH_CHECK_VALUE(ids_in.dim() == 2 && ids_in.size(0) == T, "ids must have shape [T=", T, ",k], got ",
                    ids_in.sizes());
  TORCH_CHECK_VALUE(weights_in.sizes() == ids_in.sizes(), "weights must have shape [T,k] like ids, got ",
                    weights_in.sizes());
}

}  // namespace glm5
