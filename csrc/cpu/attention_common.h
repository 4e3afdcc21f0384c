// What the CPU attention kernels share: fp32 views of q, k, v with their
// strides, the per-batch query offsets, per-worker gradient buffers, and the
// output conversion. The math lives in attention_tiles.h.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "checks.h"

namespace glm5 {
namespace cpu {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// fp32 q, k, v (converted once when the inputs are fp16/bf16; fp32 inputs are
// read in place, k and v with their own strides, so v may be a view of k).
struct AttentionInputs {
  at::Tensor q, k, v;
  int64_t B, S, Hq, Dk, T, Hkv, Dv, G;
  const float *qp, *kp, *vp;
  int64_t ksb, kst, ksh, vsb, vst, vsh;
  std::vector<int64_t> q_start;  // last key visible to query s of batch b is q_start[b] + s

  AttentionInputs(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                  const c10::optional<at::Tensor>& qs)
      : q(q_.to(at::kFloat).contiguous()), k(as_fp32(k_)), v(as_fp32(v_)) {
    B = q.size(0), S = q.size(1), Hq = q.size(2), Dk = q.size(3);
    T = k.size(1), Hkv = k.size(2), Dv = v.size(3), G = Hq / Hkv;
    qp = q.const_data_ptr<float>(), kp = k.const_data_ptr<float>(), vp = v.const_data_ptr<float>();
    ksb = k.stride(0), kst = k.stride(1), ksh = k.stride(2);
    vsb = v.stride(0), vst = v.stride(1), vsh = v.stride(2);
    q_start.assign(B, T - S);
    if (qs.has_value()) {
      const at::Tensor h = qs->to(at::kCPU, at::kLong).contiguous();
      std::copy(h.const_data_ptr<int64_t>(), h.const_data_ptr<int64_t>() + B, q_start.begin());
    }
  }
  const float* krow(int64_t b, int64_t t, int64_t g) const { return kp + b * ksb + t * kst + g * ksh; }
  const float* vrow(int64_t b, int64_t t, int64_t g) const { return vp + b * vsb + t * vst + g * vsh; }
  const float* qrow(int64_t b, int64_t s, int64_t h) const { return qp + ((b * S + s) * Hq + h) * Dk; }

 private:
  static at::Tensor as_fp32(const at::Tensor& x) {
    return x.scalar_type() == at::kFloat && x.stride(3) == 1 ? x : x.to(at::kFloat).contiguous();
  }
};

// fp32 result -> the dtype the op returns (a no-op for fp32).
inline at::Tensor to_dtype(const at::Tensor& x32, at::ScalarType dtype) {
  return x32.scalar_type() == dtype ? x32 : x32.to(dtype);
}

// dK and dV are scattered from every query that selected a key, so each
// worker thread accumulates into its own zeroed fp32 [B,T,Hkv,D] pair and the
// pairs are summed at the end in worker order (no atomics). With
// parallel_strided worker w always gets the same items, so the result is
// deterministic for a given thread count.
// Memory: workers x B*T*Hkv*(Dk+Dv) x 4 bytes.
struct KVGradBuffers {
  std::vector<at::Tensor> dk, dv;
  KVGradBuffers(const AttentionInputs& in, int64_t items) {
    const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
    for (int64_t w = 0; w < workers; ++w) {
      dk.push_back(at::zeros({in.B, in.T, in.Hkv, in.Dk}, at::kFloat));
      dv.push_back(at::zeros({in.B, in.T, in.Hkv, in.Dv}, at::kFloat));
    }
  }
  // Worker w's buffers (parallel_strided's worker index, from its scratch constructor).
  std::pair<float*, float*> claim(int64_t w) {
    TORCH_CHECK(w < static_cast<int64_t>(dk.size()), "internal: more workers than gradient buffers");
    return {dk[w].data_ptr<float>(), dv[w].data_ptr<float>()};
  }
  std::pair<at::Tensor, at::Tensor> sum() {
    for (size_t w = 1; w < dk.size(); ++w) {
      dk[0].add_(dk[w]);
      dv[0].add_(dv[w]);
    }
    return {dk[0], dv[0]};
  }
};

// Per-row rowsum(dO * O): the softmax backward's correction term.
inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace cpu
}  // namespace glm5
