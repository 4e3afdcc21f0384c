// SwiGLU's elementwise half, a = silu(g) * u: the one definition the MoE
// kernels share (fused_moe.cpp's fp32/bf16 experts, int8.cpp's int8 experts),
// so both precisions apply the same activation with the same rounding.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>

namespace glm5 {
namespace cpu {

// a[i] = g[i] / (1 + exp(-g[i])) * u[i] for i < n; a may not alias g or u.
template <typename T>
inline void swiglu(const T* g, const T* u, T* a, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  at::vec::map2<T>([](Vec gv, Vec uv) { return gv * (Vec(T(1)) + gv.neg().exp()).reciprocal() * uv; }, a, g, u, n);
}

}  // namespace cpu
}  // namespace glm5
