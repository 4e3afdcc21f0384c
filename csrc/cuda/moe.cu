// Mixture-of-Experts on CUDA: router, dispatch/combine, fused SwiGLU experts.
//
// moe_route      logits = h @ gate_w^T by cuBLAS in fp32 (like the oracle), then
//                one warp per token: sigmoid, +bias, group scores (top-2 sum per
//                group), the topk_group best groups, top_k experts by repeated
//                warp arg-max on a 64-bit (order key, ~index) word, so ties go
//                to the lower id (the CPU kernel's order). Scores live in shared
//                memory (2E + n_group floats per warp).
// moe_dispatch   counting sort, same output as csrc/cpu/moe.cpp bit for bit: one
//                warp per chunk of 256 pairs builds the chunk's histogram (global
//                atomics into its own row), torch ops turn the [chunks, E]
//                histogram into padded offsets and per-chunk cursors, one host
//                sync reads N (and the first bad id), then each warp scatters its
//                chunk in order (__match_any_sync ranks equal experts within a
//                round of 32): stable, no general sort. Rows are copied with
//                16-byte vectors when aligned; padding rows are zero.
// moe_combine    out[t] = sum_j w[t,j] * y[token_slot[t,j]]: a gather, fp32 (fp64)
//                accumulation, slots in order; deterministic.
// fused_moe_fwd  dispatch (align 1) -> x_sorted -> [gate|up] = per-expert GEMM ->
//                SwiGLU kernel -> per-expert GEMM with W_down -> combine.
// fused_moe_bwd  recomputes gate/up; dhu = dout_sorted @ W_down[e] (per-expert
//                GEMM); one kernel per row fuses h, the SwiGLU backward and
//                dweights = dhu . h; dx = per-expert GEMM + combine (unit
//                weights); dW = per-expert GEMMs over the expert's rows.
//                In fp16/bf16 the intermediates between the GEMMs are 16-bit;
//                small calls run in fp32 instead (run_in_fp32).
//
// The per-expert GEMMs: torch's grouped GEMM (at::_grouped_mm, one launch for
// all experts; bf16 on sm90+, dims multiple of 8) where available, else one
// cuBLAS call per expert with rows (at::mm_out on row slices; costs a launch
// per expert, so decode-sized calls are launch bound). GLM5_MOE_GEMM=loop or
// =grouped forces one (grouped errors where it cannot run). The weight
// gradients always loop (the 2D x 2D grouped form's handling of empty groups
// is not documented). No custom tensor-core GEMM: the Triton backend is the
// one fused kernel (gather-on-load, no permuted copy).
//
// Argument checks: copies of csrc/cpu/moe.cpp's messages (there they are
// inline, not in checks.h); fold into checks.h when both exist.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#if __has_include(<ATen/ops/_grouped_mm.h>)
#include <ATen/ops/_grouped_mm.h>
#define GLM5_HAS_GROUPED_MM 1
#else
#define GLM5_HAS_GROUPED_MM 0
#endif

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "checks.h"

namespace glm5 {
namespace cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kChunk = 256;        // pairs per warp in dispatch (histogram row = chunk)
constexpr int kWarpsPerBlock = 8;


int blocks_for(int64_t n, int per_block) { return static_cast<int>((n + per_block - 1) / per_block); }

// ------------------------------------------------------------ small math --
// (argument checks: csrc/checks.h, shared with the CPU kernels)

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

template <typename T> __device__ __forceinline__ typename Acc<T>::type ld(const T* p) {
  return static_cast<typename Acc<T>::type>(*p);
}

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

// Unsigned order of the key = float order; -inf maps to 0x007fffff > 0, so 0
// can mean "not selectable". f must not be NaN.
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Warp arg-max of (key, lowest index): every lane passes its best word.
__device__ __forceinline__ uint64_t warp_max_u64(uint64_t v) {
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t w = __shfl_xor_sync(kFull, v, o);
    v = w > v ? w : v;
  }
  return v;
}

__device__ __forceinline__ uint64_t pack(uint32_t key, uint32_t idx) {
  return (uint64_t(key) << 32) | uint64_t(~idx);
}

// ---------------------------------------------------------------- routing --

// One warp per token. Shared memory per warp: sc[E] (sigmoid scores),
// ch[E] (choice; NaN = excluded: other group or already chosen), gs[n_group].
__global__ void route_kernel(const float* __restrict__ logits, const float* __restrict__ bias,
                             float* __restrict__ w_out, int32_t* __restrict__ id_out, int64_t T, int E, int n_group,
                             int topk_group, int top_k, float scale, bool norm) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= T) return;  // whole warps leave together
  float* sc = smem + int64_t(warp) * (2 * E + n_group);
  float* ch = sc + E;
  float* gs = ch + E;
  const float nan = __int_as_float(0x7fc00000);
  const float* row = logits + t * E;
  for (int e = lane; e < E; e += 32) {
    const float s = sigmoid(row[e]);
    float c = s + bias[e];
    if (c != c) c = -INFINITY;  // a NaN choice never beats a number
    sc[e] = s;
    ch[e] = c;
  }
  __syncwarp();
  const int per = E / n_group;
  if (topk_group < n_group) {
    for (int g = lane; g < n_group; g += 32) {  // sum of the group's two largest choices
      float a = -INFINITY, b = -INFINITY;
      for (int i = g * per; i < (g + 1) * per; ++i) {
        const float v = ch[i];
        b = fmaxf(b, fminf(a, v));
        a = fmaxf(a, v);
      }
      const float s = a + b;
      gs[g] = s == s ? s : -INFINITY;
    }
    __syncwarp();
    for (int r = 0; r < topk_group; ++r) {  // keep the best groups: mark them NaN
      uint64_t best = 0;
      for (int g = lane; g < n_group; g += 32) {
        const float v = gs[g];
        if (v == v) {
          const uint64_t w = pack(order_key(v), g);
          best = w > best ? w : best;
        }
      }
      best = warp_max_u64(best);
      if (lane == 0 && best != 0) gs[~uint32_t(best)] = nan;
      __syncwarp();
    }
    for (int e = lane; e < E; e += 32)
      if (gs[e / per] == gs[e / per]) ch[e] = nan;  // a group not kept
    __syncwarp();
  }
  for (int j = 0; j < top_k; ++j) {
    uint64_t best = 0;
    for (int e = lane; e < E; e += 32) {
      const float v = ch[e];
      if (v == v) {
        const uint64_t w = pack(order_key(v), e);
        best = w > best ? w : best;
      }
    }
    best = warp_max_u64(best);
    if (lane == 0) {  // best != 0: the checks leave at least top_k experts in the kept groups
      const uint32_t e = best != 0 ? ~uint32_t(best) : 0u;
      id_out[t * top_k + j] = static_cast<int32_t>(e);
      ch[e] = nan;
    }
    __syncwarp();
  }
  if (lane == 0) {
    float sum = 0.f;
    for (int j = 0; j < top_k; ++j) sum += sc[id_out[t * top_k + j]];
    const float denom = sum + 1e-20f;
    for (int j = 0; j < top_k; ++j) {
      const float w = sc[id_out[t * top_k + j]];
      w_out[t * top_k + j] = (norm ? w / denom : w) * scale;
    }
  }
}

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& h, const at::Tensor& gate_w, const at::Tensor& bias,
                                             int64_t top_k, int64_t n_group, int64_t topk_group,
                                             double routed_scaling_factor, bool norm_topk_prob) {
  check_route_args(h, gate_w, bias, top_k, n_group, topk_group);
  const int64_t T = h.size(0), D = h.size(1), E = gate_w.size(0);  // checked by check_route_args
  const c10::cuda::CUDAGuard guard(h.device());
  at::Tensor weights = at::empty({T, top_k}, h.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({T, top_k}, h.options().dtype(at::kInt));
  if (T == 0) return {weights, ids};

  // Shared memory per warp, kWarpsPerBlock warps (tokens) per block; opt-in
  // above 48 KiB, an error past the device's limit (E > ~3600 on an H200).
  const int64_t per_warp = (2 * E + n_group) * int64_t(sizeof(float));
  const int64_t limit = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
  TORCH_CHECK_NOT_IMPLEMENTED(per_warp <= limit, "moe_route on CUDA keeps a token's E scores in shared memory: E=", E,
                              " needs ", per_warp, " bytes, over the device's ", limit);
  const int64_t smem = per_warp * kWarpsPerBlock;
  TORCH_CHECK_NOT_IMPLEMENTED(smem <= limit, "moe_route on CUDA: E=", E, " needs ", smem,
                              " bytes of shared memory per block of ", kWarpsPerBlock, " tokens, over the device's ",
                              limit);
  if (smem > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  // fp32 GEMM like the oracle (bf16/fp16 products are exact in fp32).
  const at::Tensor logits = at::mm(h.to(at::kFloat), gate_w.to(at::kFloat).t()).contiguous();
  const at::Tensor b32 = bias.to(at::kFloat).contiguous();
  route_kernel<<<blocks_for(T, kWarpsPerBlock), 32 * kWarpsPerBlock, smem, at::cuda::getCurrentCUDAStream()>>>(
      logits.const_data_ptr<float>(), b32.const_data_ptr<float>(), weights.data_ptr<float>(), ids.data_ptr<int32_t>(),
      T, static_cast<int>(E), static_cast<int>(n_group), static_cast<int>(topk_group), static_cast<int>(top_k),
      static_cast<float>(routed_scaling_factor), norm_topk_prob);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {weights, ids};
}

// --------------------------------------------------------------- dispatch --

// One warp per chunk: hist[c, e] = pairs of chunk c with expert e; the first
// out-of-range pair index goes to *bad (initialised to P).
__global__ void hist_kernel(const int32_t* __restrict__ ids, int32_t* __restrict__ hist, int64_t P, int E,
                            int64_t n_chunks, unsigned long long* __restrict__ bad) {
  const int lane = threadIdx.x & 31;
  const int64_t c = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (c >= n_chunks) return;
  int32_t* hc = hist + c * E;
  for (int64_t p = c * kChunk + lane; p < min(P, (c + 1) * kChunk); p += 32) {
    const int32_t e = ids[p];
    if (e < 0 || e >= E)
      atomicMin(bad, static_cast<unsigned long long>(p));
    else
      atomicAdd(hc + e, 1);
  }
}

// One warp per chunk, pairs in order, 32 per round: equal experts in a round
// are ranked by lane (__match_any_sync); the lowest lane bumps the chunk's
// cursor. Stable: expert rows in (token, slot) order, like the CPU kernel.
__global__ void scatter_kernel(const int32_t* __restrict__ ids, int32_t* cursor, int64_t P, int E, int64_t k,
                               int64_t n_chunks, int32_t* __restrict__ slot_token, int32_t* __restrict__ token_slot) {
  const int lane = threadIdx.x & 31;
  const int64_t c = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (c >= n_chunks) return;
  volatile int32_t* cur = cursor + c * E;
  const int64_t end = min(P, (c + 1) * kChunk);
  for (int64_t p0 = c * kChunk; p0 < end; p0 += 32) {
    const int64_t p = p0 + lane;
    const bool valid = p < end;
    const int32_t e = valid ? ids[p] : -1;
    const unsigned peers = __match_any_sync(kFull, e);
    const int leader = __ffs(peers) - 1;
    const int rank = __popc(peers & ((1u << lane) - 1u));
    int32_t base = 0;
    if (valid && lane == leader) {
      base = cur[e];
      cur[e] = base + __popc(peers);
    }
    base = __shfl_sync(kFull, base, leader);
    if (valid) {
      const int32_t r = base + rank;
      token_slot[p] = r;
      slot_token[r] = static_cast<int32_t>(p / k);
    }
    __syncwarp();
  }
}

// dst[r] = src[slot_token[r]] (zeros where slot_token[r] < 0), rows of `units`
// elements of U; one block per row, grid-strided.
template <typename U>
__global__ void gather_rows_kernel(const U* __restrict__ src, U* __restrict__ dst, const int32_t* __restrict__ slot,
                                   int64_t N, int64_t units) {
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const int32_t s = slot[r];
    U* d = dst + r * units;
    if (s >= 0) {
      const U* sp = src + int64_t(s) * units;
      for (int64_t i = threadIdx.x; i < units; i += blockDim.x) d[i] = sp[i];
    } else {
      for (int64_t i = threadIdx.x; i < units; i += blockDim.x) d[i] = U{};
    }
  }
}

at::Tensor gather_rows(const at::Tensor& src, const at::Tensor& slot_token, int64_t N) {
  at::Tensor dst = at::empty({N, src.size(1)}, src.options());
  if (N == 0 || src.size(1) == 0) return dst;
  const int64_t row_bytes = src.size(1) * src.element_size();
  const auto sp = reinterpret_cast<uintptr_t>(src.const_data_ptr());
  const int grid = static_cast<int>(std::min<int64_t>(N, 65535 * 4));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int32_t* slot = slot_token.const_data_ptr<int32_t>();
  if (row_bytes % 16 == 0 && sp % 16 == 0) {
    gather_rows_kernel<uint4><<<grid, 128, 0, stream>>>(reinterpret_cast<const uint4*>(src.const_data_ptr()),
                                                        reinterpret_cast<uint4*>(dst.data_ptr()), slot, N,
                                                        row_bytes / 16);
  } else if (src.element_size() == 8) {
    gather_rows_kernel<uint64_t><<<grid, 128, 0, stream>>>(static_cast<const uint64_t*>(src.const_data_ptr()),
                                                           static_cast<uint64_t*>(dst.data_ptr()), slot, N,
                                                           row_bytes / 8);
  } else if (src.element_size() == 4) {
    gather_rows_kernel<uint32_t><<<grid, 128, 0, stream>>>(static_cast<const uint32_t*>(src.const_data_ptr()),
                                                           static_cast<uint32_t*>(dst.data_ptr()), slot, N,
                                                           row_bytes / 4);
  } else {
    gather_rows_kernel<uint16_t><<<grid, 128, 0, stream>>>(static_cast<const uint16_t*>(src.const_data_ptr()),
                                                           static_cast<uint16_t*>(dst.data_ptr()), slot, N,
                                                           row_bytes / 2);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return dst;
}

struct Plan {
  at::Tensor offsets;     // int32 [E+1] on the device
  at::Tensor slot_token;  // int32 [N]
  at::Tensor token_slot;  // int32 [T,k]
  std::vector<int64_t> host_offsets;  // [E+1]
  int64_t N = 0;
};

// The counting sort of moe_dispatch (validates ids; one host sync).
Plan make_plan(const at::Tensor& ids_in, int64_t E, int64_t align) {
  const at::Tensor ids = ids_in.to(at::kInt).contiguous();
  const int64_t T = ids.size(0), k = ids.size(1), P = T * k;
  const auto iopt = ids.options();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t n_chunks = std::max<int64_t>(1, (P + kChunk - 1) / kChunk);
  at::Tensor hist = at::zeros({n_chunks, E}, iopt);
  at::Tensor bad = at::full({1}, P, iopt.dtype(at::kLong));
  if (P > 0) {
    hist_kernel<<<blocks_for(n_chunks, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, stream>>>(
        ids.const_data_ptr<int32_t>(), hist.data_ptr<int32_t>(), P, static_cast<int>(E), n_chunks,
        reinterpret_cast<unsigned long long*>(bad.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const at::Tensor hist64 = hist.to(at::kLong);
  const at::Tensor counts = hist64.sum(0);
  const at::Tensor padded = (counts + (align - 1)).div(align, "floor") * align;
  at::Tensor offsets64 = at::zeros({E + 1}, counts.options());
  offsets64.narrow(0, 1, E).copy_(padded.cumsum(0));
  // One sync: the row count, the offsets (for per-expert GEMMs) and the first bad id.
  const at::Tensor host = at::cat({offsets64, bad}).cpu();
  const int64_t* hp = host.const_data_ptr<int64_t>();
  const int64_t first_bad = hp[E + 1];
  if (first_bad < P) {
    const int64_t v = ids.view({-1}).narrow(0, first_bad, 1).cpu().item<int64_t>();
    TORCH_CHECK_VALUE(false, "ids must be expert ids in [0, num_experts=", E, "), got ", v, " at [", first_bad / k, ",",
                      first_bad % k, "]");
  }
  Plan plan;
  plan.N = hp[E];
  TORCH_CHECK_VALUE(plan.N < (int64_t(1) << 31), "moe_dispatch: ", plan.N, " sorted rows do not fit int32 offsets");
  plan.host_offsets.assign(hp, hp + E + 1);
  plan.offsets = offsets64.to(at::kInt);
  // Chunk c writes expert e's pairs after those of the chunks before it.
  at::Tensor cursor = (offsets64.narrow(0, 0, E).unsqueeze(0) + hist64.cumsum(0) - hist64).to(at::kInt).contiguous();
  plan.slot_token = at::full({plan.N}, -1, iopt);
  plan.token_slot = at::empty({T, k}, iopt);
  if (P > 0) {
    scatter_kernel<<<blocks_for(n_chunks, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, stream>>>(
        ids.const_data_ptr<int32_t>(), cursor.data_ptr<int32_t>(), P, static_cast<int>(E), k, n_chunks,
        plan.slot_token.data_ptr<int32_t>(), plan.token_slot.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return plan;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_dispatch(const at::Tensor& x, const at::Tensor& ids,
                                                                        int64_t num_experts, int64_t align) {
  check_dispatch_args(x, ids, num_experts, align);
  const c10::cuda::CUDAGuard guard(x.device());
  Plan plan = make_plan(ids, num_experts, align);
  at::Tensor x_sorted = gather_rows(x.contiguous(), plan.slot_token, plan.N);
  return {x_sorted, plan.offsets, plan.slot_token, plan.token_slot};
}

// ---------------------------------------------------------------- combine --

// out[t, d] = sum_j w[t,j] * y[ts[t,j] * ldy + d] (w == nullptr: unit weights),
// acc_t accumulation, slots in order. Grid (T, D blocks of the block size).
template <typename scalar_t, typename acc_t>
__global__ void combine_kernel(const scalar_t* __restrict__ y, int64_t ldy, const int32_t* __restrict__ ts,
                               const acc_t* __restrict__ w, scalar_t* __restrict__ out, int64_t k, int64_t D) {
  const int64_t t = blockIdx.x;
  const int64_t d = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (d >= D) return;
  acc_t acc = 0;
  for (int64_t j = 0; j < k; ++j) {
    const acc_t v = static_cast<acc_t>(y[int64_t(ts[t * k + j]) * ldy + d]);
    acc += w ? w[t * k + j] * v : v;
  }
  out[t * D + d] = static_cast<scalar_t>(acc);
}

// y: [N, D] with row stride ldy (>= D); returns [T, D] in y's dtype.
at::Tensor combine(const at::Tensor& y, const at::Tensor& token_slot, const c10::optional<at::Tensor>& weights) {
  const int64_t T = token_slot.size(0), k = token_slot.size(1), D = y.size(1);
  at::Tensor out = at::empty({T, D}, y.options());
  if (T == 0 || D == 0) return out;
  if (k == 0) return out.zero_();
  TORCH_CHECK(y.stride(1) == 1, "combine: y rows must be contiguous");
  const bool f64 = y.scalar_type() == at::kDouble || (weights && weights->scalar_type() == at::kDouble);
  const at::Tensor w = weights ? weights->to(f64 ? at::kDouble : at::kFloat).contiguous() : at::Tensor();
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>((D + 255) / 256));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "glm5_moe_combine", [&] {
    auto launch = [&](auto acc_zero) {
      using acc_t = decltype(acc_zero);
      combine_kernel<scalar_t, acc_t><<<grid, 256, 0, stream>>>(
          y.const_data_ptr<scalar_t>(), y.stride(0), token_slot.const_data_ptr<int32_t>(),
          w.defined() ? w.const_data_ptr<acc_t>() : nullptr, out.data_ptr<scalar_t>(), k, D);
    };
    if (f64)
      launch(double(0));
    else
      launch(float(0));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor moe_combine(const at::Tensor& y_sorted, const at::Tensor& token_slot, const at::Tensor& weights) {
  check_combine_args(y_sorted, token_slot, weights);
  const c10::cuda::CUDAGuard guard(y_sorted.device());
  const int64_t N = y_sorted.size(0);
  const at::Tensor ts = token_slot.to(at::kInt).contiguous();
  if (ts.numel() > 0) {  // one sync: a bad row would read out of bounds
    const at::Tensor bad = ((ts < 0) | (ts >= N)).flatten().nonzero();
    if (bad.size(0) > 0) {
      const int64_t p = bad[0].item<int64_t>();
      TORCH_CHECK_VALUE(false, "token_slot entries must be rows of y_sorted in [0, N=", N, "), got ",
                        ts.flatten()[p].item<int64_t>(), " at [", p / ts.size(1), ",", p % ts.size(1), "]");
    }
  }
  return combine(y_sorted.contiguous(), ts, weights);
}

// ---------------------------------------------------------------- experts --

bool grouped_gemm_wanted(const at::Tensor& a, const at::Tensor& w3) {
  const char* env = std::getenv("GLM5_MOE_GEMM");
  const std::string mode = env ? env : "";
  TORCH_CHECK_VALUE(mode.empty() || mode == "loop" || mode == "grouped", "GLM5_MOE_GEMM must be 'loop' or 'grouped', got '",
                    mode, "'");
  if (mode == "loop") return false;
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  // bf16 only, 16-byte aligned pointers and row strides (every dim a multiple
  // of 8), fewer than 1024 groups (torch's sm90 kernel refuses more).
  const auto aligned16 = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0; };
  const bool ok = GLM5_HAS_GROUPED_MM && prop->major >= 9 && a.scalar_type() == at::kBFloat16 &&
                  a.size(1) % 8 == 0 && w3.size(1) % 8 == 0 && w3.size(2) % 8 == 0 && w3.size(0) < 1024 &&
                  aligned16(a) && aligned16(w3);
  TORCH_CHECK_VALUE(ok || mode != "grouped", "GLM5_MOE_GEMM=grouped: torch's grouped GEMM needs bf16 on sm90+ with dims "
                    "that are multiples of 8, 16-byte aligned data and E < 1024 (got ", a.scalar_type(), ", sm",
                    prop->major, prop->minor, ", K=", a.size(1), ", W ", w3.sizes(), ")");
  return ok;
}

// out[r] = a[r] @ w3[e] for the rows r of expert e (plan.offsets, no padding):
// a [N, K], w3 [E, K, Nout] (any strides cuBLAS takes). The result may have a
// padded row stride (grouped GEMM), rows contiguous.
at::Tensor expert_gemm(const at::Tensor& a, const at::Tensor& w3, const Plan& plan) {
  const int64_t E = w3.size(0);
#if GLM5_HAS_GROUPED_MM
  if (grouped_gemm_wanted(a, w3)) {
    const at::Tensor ends = plan.offsets.narrow(0, 1, E).contiguous();  // cumulative ends, int32
    return at::_grouped_mm(a, w3, ends);
  }
#else
  grouped_gemm_wanted(a, w3);
#endif
  at::Tensor out = at::empty({a.size(0), w3.size(2)}, a.options());
  for (int64_t e = 0; e < E; ++e) {
    const int64_t s = plan.host_offsets[e], n = plan.host_offsets[e + 1] - s;
    if (n == 0) continue;
    at::Tensor rows = out.narrow(0, s, n);  // contiguous rows: mm_out writes in place
    at::mm_out(rows, a.narrow(0, s, n), w3[e]);
  }
  return out;
}

// dw[e] = a[rows of e]^T @ b[rows of e] (zeros for an expert without rows).
void expert_wgrad(at::Tensor& dw, const at::Tensor& a, const at::Tensor& b, const Plan& plan) {
  for (int64_t e = 0; e < dw.size(0); ++e) {
    const int64_t s = plan.host_offsets[e], n = plan.host_offsets[e + 1] - s;
    at::Tensor out = dw[e];
    if (n > 0)
      at::mm_out(out, a.narrow(0, s, n).t(), b.narrow(0, s, n));
    else
      out.zero_();
  }
}

// h[r, n] = silu(gu[r, n]) * gu[r, I + n]; gu row stride ldg.
template <typename scalar_t>
__global__ void swiglu_kernel(const scalar_t* __restrict__ gu, int64_t ldg, scalar_t* __restrict__ h, int64_t N,
                              int64_t I) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t total = N * I;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / I, n = i % I;
    const acc_t g = ld(gu + r * ldg + n), u = ld(gu + r * ldg + I + n);
    h[i] = static_cast<scalar_t>(g * sigmoid(g) * u);
  }
}

// One block per sorted row r (weight w = wrow[r]), dhu = dout[tok] @ Wd[e]:
//   h = silu(a) b;  dh = w dhu;  dgu[r] = [dh b silu'(a) | dh silu(a)];
//   dwr[r] = sum_n dhu h   (dweights: dout . y = dout . (h Wd^T) = dhu . h).
template <typename scalar_t>
__global__ void swiglu_bwd_kernel(const scalar_t* __restrict__ gu, int64_t ldg, const scalar_t* __restrict__ dhu,
                                  int64_t ldd, const typename Acc<scalar_t>::type* __restrict__ wrow,
                                  scalar_t* __restrict__ h,
                                  scalar_t* __restrict__ dgu, typename Acc<scalar_t>::type* __restrict__ dwr,
                                  int64_t I) {
  using acc_t = typename Acc<scalar_t>::type;
  __shared__ acc_t red[32];
  const int64_t r = blockIdx.x;
  const acc_t w = wrow[r];
  acc_t part = 0;
  for (int64_t n = threadIdx.x; n < I; n += blockDim.x) {
    const acc_t a = ld(gu + r * ldg + n), b = ld(gu + r * ldg + I + n), d = ld(dhu + r * ldd + n);
    const acc_t sig = sigmoid(a), silu = a * sig;
    const acc_t hv = silu * b;
    part += d * hv;
    const acc_t dh = w * d;
    h[r * I + n] = static_cast<scalar_t>(hv);
    dgu[r * 2 * I + n] = static_cast<scalar_t>(dh * b * sig * (acc_t(1) + a * (acc_t(1) - sig)));
    dgu[r * 2 * I + I + n] = static_cast<scalar_t>(dh * silu);
  }
  for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(kFull, part, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = part;
  __syncthreads();
  if (threadIdx.x == 0) {
    acc_t s = 0;
    for (int i = 0; i < int(blockDim.x >> 5); ++i) s += red[i];
    dwr[r] = s;
  }
}

struct Fwd {
  Plan plan;
  at::Tensor x_sorted, gu;
};

Fwd gate_up(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& ids) {
  Fwd f;
  f.plan = make_plan(ids, w_gate_up.size(0), 1);
  f.x_sorted = gather_rows(x, f.plan.slot_token, f.plan.N);
  f.gu = expert_gemm(f.x_sorted, w_gate_up.transpose(1, 2), f.plan);  // [P, 2I]
  return f;
}

// Small 16-bit problems run in fp32, like the CPU kernel and the oracle. The
// tensor-core path rounds gate/up, h, y (and the backward's dhu, dgu, dy) to
// 16 bits between its GEMMs; with a handful of terms per dot product that
// rounding dominates the error (simulated: ~24% of D=7, I=5 bf16 calls exceed
// 2x the oracle's own 16-bit error). Such calls are launch bound, so fp32 costs
// nothing; the bound keeps the fp32 copy of all E experts' weights <= 16 MiB.
bool run_in_fp32(const at::Tensor& x, int64_t E, int64_t D, int64_t I, int64_t pairs) {
  const bool half = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
  return half && E * D * I <= (int64_t(1) << 22) && pairs * D * I <= (int64_t(1) << 24);
}

at::Tensor fused_moe_fwd(const at::Tensor& x_in, const at::Tensor& w_gate_up_in, const at::Tensor& w_down_in,
                         const at::Tensor& weights, const at::Tensor& ids) {
  check_fused_moe_args(x_in, w_gate_up_in, w_down_in, weights, ids);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), w_gate_up = w_gate_up_in.contiguous(), w_down = w_down_in.contiguous();
  const int64_t T = x.size(0), D = x.size(1), I = w_down.size(2);
  if (T == 0 || D == 0 || I == 0 || ids.size(1) == 0) {
    make_plan(ids, w_gate_up.size(0), 1);  // still reject bad ids
    return at::zeros({T, D}, x.options());
  }
  if (run_in_fp32(x, w_gate_up.size(0), D, I, T * ids.size(1)))
    return fused_moe_fwd(x.to(at::kFloat), w_gate_up.to(at::kFloat), w_down.to(at::kFloat), weights, ids)
        .to(x.scalar_type());
  Fwd f = gate_up(x, w_gate_up, ids);
  at::Tensor h = at::empty({f.plan.N, I}, x.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "glm5_swiglu", [&] {
    const int grid = static_cast<int>(std::min<int64_t>((f.plan.N * I + 255) / 256, 65535 * 8));
    swiglu_kernel<scalar_t><<<grid, 256, 0, stream>>>(f.gu.const_data_ptr<scalar_t>(), f.gu.stride(0),
                                                      h.data_ptr<scalar_t>(), f.plan.N, I);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  f.gu = at::Tensor();  // free [P, 2I] before the second GEMM
  const at::Tensor y = expert_gemm(h, w_down.transpose(1, 2), f.plan);  // [P, D]
  return combine(y, f.plan.token_slot, weights);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_moe_bwd(
    const at::Tensor& dout_in, const at::Tensor& x_in, const at::Tensor& w_gate_up_in, const at::Tensor& w_down_in,
    const at::Tensor& weights, const at::Tensor& ids) {
  check_fused_moe_args(x_in, w_gate_up_in, w_down_in, weights, ids);
  TORCH_CHECK_VALUE(dout_in.sizes() == x_in.sizes(), "dout must have shape [T,D] = ", x_in.sizes(), " like x, got ",
                    dout_in.sizes());
  TORCH_CHECK_VALUE(is_moe_float(dout_in.scalar_type()) && dout_in.device() == x_in.device(),
                    "dout must be a float tensor on ", x_in.device());
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), w_gate_up = w_gate_up_in.contiguous(), w_down = w_down_in.contiguous();
  const at::Tensor dout = dout_in.to(x.scalar_type()).contiguous();
  const int64_t T = x.size(0), D = x.size(1), I = w_down.size(2), k = ids.size(1);
  at::Tensor dw_gate_up = at::empty_like(w_gate_up), dw_down = at::empty_like(w_down);
  if (T == 0 || D == 0 || I == 0 || k == 0) {
    make_plan(ids, w_gate_up.size(0), 1);
    return {at::zeros_like(x), dw_gate_up.zero_(), dw_down.zero_(), at::zeros(ids.sizes(), weights.options())};
  }
  if (run_in_fp32(x, w_gate_up.size(0), D, I, T * k)) {
    const auto [dx, dwgu, dwd, dw] = fused_moe_bwd(dout.to(at::kFloat), x.to(at::kFloat), w_gate_up.to(at::kFloat),
                                                   w_down.to(at::kFloat), weights, ids);
    return {dx.to(x.scalar_type()), dwgu.to(w_gate_up.scalar_type()), dwd.to(w_down.scalar_type()), dw};
  }
  Fwd f = gate_up(x, w_gate_up, ids);
  const Plan& plan = f.plan;
  const int64_t N = plan.N;
  const at::Tensor dout_sorted = gather_rows(dout, plan.slot_token, N);
  const at::Tensor dhu = expert_gemm(dout_sorted, w_down, plan);  // [P, I] = dout[t] @ Wd[e]
  const at::Tensor ts_flat = plan.token_slot.view({-1}).to(at::kLong);
  // Per sorted row: its mixing weight, in the accumulation type.
  const at::ScalarType acc_type = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor wrow = at::zeros({N}, weights.options().dtype(acc_type))
                              .index_copy_(0, ts_flat, weights.reshape({-1}).to(acc_type));
  at::Tensor h = at::empty({N, I}, x.options()), dgu = at::empty({N, 2 * I}, x.options());
  at::Tensor dwr = at::empty({N}, x.options().dtype(acc_type));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "glm5_swiglu_bwd", [&] {
    using acc_t = typename Acc<scalar_t>::type;
    swiglu_bwd_kernel<scalar_t><<<static_cast<unsigned>(N), 256, 0, stream>>>(
        f.gu.const_data_ptr<scalar_t>(), f.gu.stride(0), dhu.const_data_ptr<scalar_t>(), dhu.stride(0),
        wrow.const_data_ptr<acc_t>(), h.data_ptr<scalar_t>(), dgu.data_ptr<scalar_t>(), dwr.data_ptr<acc_t>(), I);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  f.gu = at::Tensor();
  const at::Tensor dweights = dwr.index_select(0, ts_flat).view({T, k}).to(weights.scalar_type());
  // dx[t] = sum_j ([da|db] @ W_gate_up[e])[token_slot[t,j]]
  const at::Tensor dx_sorted = expert_gemm(dgu, w_gate_up, plan);  // [P, D]
  const at::Tensor dx = combine(dx_sorted, plan.token_slot, c10::nullopt);
  // dW_gate_up[e] = [da|db]^T x;  dW_down[e] = (w * dout)^T h, over the expert's rows.
  expert_wgrad(dw_gate_up, dgu, f.x_sorted, plan);
  const at::Tensor dy_sorted = (dout_sorted.to(acc_type) * wrow.unsqueeze(1)).to(x.scalar_type());
  expert_wgrad(dw_down, dy_sorted, h, plan);
  return {dx, dw_gate_up, dw_down, dweights};
}

}  // namespace
}  // namespace cuda
}  // namespace glm5

TORCH_LIBRARY_IMPL(glm5, CUDA, m) {
  m.impl("moe_route", &glm5::cuda::moe_route);
  m.impl("moe_dispatch", &glm5::cuda::moe_dispatch);
  m.impl("moe_combine", &glm5::cuda::moe_combine);
  m.impl("fused_moe_fwd", &glm5::cuda::fused_moe_fwd);
  m.impl("fused_moe_bwd", &glm5::cuda::fused_moe_bwd);
}
