// Every op schema of the lab, in one place (pytorch/extension-cpp style).
// Kernels register per backend in csrc/cpu/*.cpp (CPU) and csrc/cuda/*.cu
// (CUDA); the Python API in glm5_ops/ wraps these with argument checks,
// register_fake and autograd. An op whose kernel has not landed for a device
// raises NotImplementedError from the dispatcher; glm5_ops re-raises it with
// the op and backend named.
//
// Shapes: B batch, S queries, T keys, H heads, D head dim, E experts.
// See docs/ARCHITECTURE.md ("The op contract") and glm5_ops/reference.py (the spec).

#include <torch/library.h>

TORCH_LIBRARY(glm5, m) {
  // --- Similarity predictor (DSA lightning indexer) and top-k selection ---
  // q[B,S,H,D], w[B,S,H], k[B,T,D] -> fp32 scores[B,S,T]
  m.def("indexer_scores(Tensor q, Tensor w, Tensor k, bool causal, Tensor? q_start) -> Tensor");
  // scores[..., T] -> int32[..., k]; -1 pads rows with fewer than k selectable entries
  m.def("topk_indices(Tensor scores, int k, bool sorted) -> Tensor");
  // fused indexer + running top-k -> int32[B,S,topk]
  m.def("indexer_topk(Tensor q, Tensor w, Tensor k, int topk, bool causal, Tensor? q_start) -> Tensor");
  // block-level predictor -> (kv_num_blocks int32[B,H,Qb], kv_indices int32[B,H,Qb,maxKV])
  m.def("block_topk_mask(Tensor q, Tensor k, int block_size, int topk_blocks, bool causal, "
        "int sink_blocks, int local_blocks, str pooling, Tensor? q_start) -> (Tensor, Tensor)");

  // --- Sparse attention ---
  // -> (out[B,S,Hq,Dv], lse fp32[B,S,Hq])
  m.def("sparse_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor indices, float scale, "
        "bool causal, Tensor? q_start) -> (Tensor, Tensor)");
  // -> (dq, dk, dv)
  m.def("sparse_attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor indices, "
        "Tensor out, Tensor lse, float scale, bool causal, Tensor? q_start) -> (Tensor, Tensor, Tensor)");
  m.def("block_sparse_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor kv_num_blocks, "
        "Tensor kv_indices, int block_size, float scale, bool causal, Tensor? q_start) -> (Tensor, Tensor)");
  // The CPU kernel's cost model (csrc/cpu/lane_costs.h) for head group `group` and `queries` per call:
  // (lane tiles' rate relative to the gathered path, the fraction of its span a query block must select
  // to run on lane tiles; > 1: never). glm5_ops/plan.py chooses a DSA chunk's form from it.
  m.def("cpu_lane_costs(int group, int queries) -> (float, float)");
  m.def("block_sparse_attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor kv_num_blocks, "
        "Tensor kv_indices, Tensor out, Tensor lse, int block_size, float scale, bool causal, Tensor? q_start) "
        "-> (Tensor, Tensor, Tensor)");

  // --- Mixture of Experts (HF layout: w_gate_up[E,2I,D], w_down[E,D,I]) ---
  // -> (weights fp32[T,k], ids int32[T,k])
  m.def("moe_route(Tensor h, Tensor gate_w, Tensor bias, int top_k, int n_group, int topk_group, "
        "float routed_scaling_factor, bool norm_topk_prob) -> (Tensor, Tensor)");
  // -> (x_sorted[N,D], expert_offsets int32[E+1], slot_token int32[N], token_slot int32[T,k])
  m.def("moe_dispatch(Tensor x, Tensor ids, int num_experts, int align) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_combine(Tensor y_sorted, Tensor token_slot, Tensor weights) -> Tensor");
  m.def("fused_moe_fwd(Tensor x, Tensor w_gate_up, Tensor w_down, Tensor weights, Tensor ids) -> Tensor");
  // -> (dx, dw_gate_up, dw_down, dweights)
  m.def("fused_moe_bwd(Tensor dout, Tensor x, Tensor w_gate_up, Tensor w_down, Tensor weights, "
        "Tensor ids) -> (Tensor, Tensor, Tensor, Tensor)");

  // --- Activation compression ---
  // -> (packed uint8, scale fp32[groups], zero fp32[groups])
  m.def("quantize_groupwise(Tensor x, int bits, int group_size, bool stochastic, int seed) -> (Tensor, Tensor, Tensor)");
  m.def("dequantize(Tensor packed, Tensor scale, Tensor zero, int bits, int group_size, SymInt[] shape, "
        "ScalarType dtype) -> Tensor");

  // --- Decode linear layers ---
  // x[M,K], w[N,K] (both fp32 or both bf16), bias?[N] (x's dtype) -> [M,N] = x @ w^T + bias, fp32
  // accumulation; a matrix-vector kernel for few rows (glm5_ops/plan.py decides when it runs)
  m.def("gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor");

  // --- Per-token layers for inference (one kernel where torch runs a composite) ---
  // x[..., D], weight[D] (x's dtype) -> weight * to_dtype(x * rsqrt(mean(x^2) + eps)), normalised in fp32
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  // GLM-5's interleaved RoPE on the first rotary_dim channels of x[B,S,(H,)D], cos/sin[B,S,rotary_dim/2],
  // written de-interleaved (transformers' layout); later channels copied
  m.def("rope(Tensor x, Tensor cos, Tensor sin, int rotary_dim) -> Tensor");

  // --- INT8 inference (per-row symmetric int8: x ~ q * scale, q in [-127, 127]) ---
  // x[..., K] -> (q int8[..., K], scale fp32[...])
  m.def("int8_quantize_rows(Tensor x) -> (Tensor, Tensor)");
  // x[M,K] float, w int8[N,K], scale fp32[N], bias[N] -> [M,N] x.dtype: weight-only int8
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias) -> Tensor");
  // every head's own product: x[H,M,K] float, w int8[H,N,K], scale fp32[H,N] -> [H,M,N] x.dtype,
  // y[h] = x[h] @ (w[h] * scale[h])^T (MLA's W_UK/W_UV from an int8 kv_b_proj at decode). w's and
  // scale's rows must be contiguous; their heads may be any distance apart (views of kv_b_proj)
  m.def("int8_linear_heads(Tensor x, Tensor w, Tensor scale) -> Tensor");
  // the same with x quantised per row at run time (dynamic W8A8, int32 accumulation)
  m.def("w8a8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias) -> Tensor");
  // fused_moe_fwd with int8 experts: w_gate_up int8[E,2I,D], gate_up_scale fp32[E,2I],
  // w_down int8[E,D,I], down_scale fp32[E,D] -> [T,D] x.dtype; w8a8: an expert's rows (when it has
  // more than a few) are quantised per row at run time and multiplied in int8, as in w8a8_linear
  // packed: w_gate_up and w_down in the packed row layout of glm5_ops.int8.pack_rows (the CPU
  // decode kernel reads it as one stream); the CPU kernel only, where the VNNI decode kernel runs
  m.def("fused_moe_int8(Tensor x, Tensor w_gate_up, Tensor gate_up_scale, Tensor w_down, Tensor down_scale, "
        "Tensor weights, Tensor ids, bool w8a8, bool packed=False) -> Tensor");
  // which kernel serves int8 decode rows of K elements here: "vnni_digits" (int8 digits of the
  // activations, vpdpbusd), "avx512_fp32" or "portable_fp32" (int8 weights widened to fp32)
  m.def("int8_decode_kernel(int K) -> str");
  // which kernel serves weight-only int8 prefill (more than 16 rows) of fp32 rows of K elements
  // into N outputs here: "vnni_digits_gemm" (the digits in oneDNN's int8 GEMM) or
  // "dequantise_gemm" (the weight dequantised once, the BLAS GEMM)
  m.def("int8_prefill_kernel(int K, int N) -> str");

  // --- The paged cache ---
  // pool[P,D] (mutated), slots int64[N] in [0, P), values[N,D] (pool's dtype): pool[slots[i]] = values[i].
  // An op of its own so torch.compile writes the cache in place (an index_copy_ into a view of the
  // pool made it copy the whole pool every step: models/glm5/cache.py)
  m.def("cache_write(Tensor(a!) pool, Tensor slots, Tensor values) -> ()");
}

// The Python module glm5_ops._C: importing it runs the registrations above
// (and those of the kernel files linked beside it). It carries build facts.
#include <Python.h>

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C",
                                   "glm5 kernel lab ops (registered under torch.ops.glm5)", -1, nullptr};
  PyObject* mod = PyModule_Create(&def);
  if (mod == nullptr) return nullptr;
#ifdef GLM5_WITH_CUDA
  PyModule_AddIntConstant(mod, "WITH_CUDA", 1);
#else
  PyModule_AddIntConstant(mod, "WITH_CUDA", 0);
#endif
  return mod;
}
