// INT8 inference on CUDA (spec: glm5_ops/reference.py; CPU: csrc/cpu/int8.cpp).
//
// int8_quantize_rows  one warp per row: max|x| by shuffles, scale = max / 127,
//   q = rint(x / scale) with the _rn intrinsics, so --use_fast_math cannot change
//   the rounding: codes and scales equal the reference bit for bit, except that
//   fast-math flushes fp32 subnormals (a row whose scale would be subnormal,
//   max|x| < ~1.5e-36, gets scale 0 and codes 0).
// int8_linear, M <= 16 (decode: the weight bytes are the traffic): a GEMV. Each
//   warp streams 4 weight rows with 16-byte loads (K % 16 == 0 and an aligned
//   base; else byte loads), widens them to fp32 and FMAs them against the x rows
//   staged in shared memory (fp32, 32 KiB per pass; chunks read rotated per lane
//   pair, free of bank conflicts). K is split across blockIdx.y when there are
//   too few row blocks to fill the GPU; the fp32 partials [S,M,N] are summed in
//   split order by a second kernel, which applies scale and bias once. The split
//   depends on N, K and the SM count only, so a row's bits never depend on M.
// int8_linear, M > 16, and w8a8_linear: a simple tiled kernel (not tuned, no
//   tensor cores): 32 rows x 64 weight rows per block, 32-deep K tiles in shared
//   memory; weight-only widens the int8 tile to fp32 on load (the scale is applied
//   per output at the end), W8A8 keeps both tiles int8 and sums exact int32 dot
//   products with __dp4a. W8A8 rows are quantised first by the kernel above.
//   W8A8's epilogue acc * sx * scale (+ bias) runs in float64 like the oracle
//   (__dmul_rn/__dadd_rn: no FMA contraction), so fp32 outputs match it exactly.
// fused_moe_int8  pairs (t, j) sorted by expert (at::sort, stable; offsets by
//   searchsorted; no host sync but the one that rejects bad ids), then the same
//   tiled kernel over (expert, 32-row tile) blocks found by binary search in a
//   device-side table of cumulative tiles: gate/up with x rows gathered by token
//   and a fused SwiGLU epilogue (local columns interleave gate row i and up row
//   I+i, so a thread holds both) writing a fp32 [P,I]; then down into fp32 [P,D];
//   then a gather sums each token's k slots in slot order, in float64 (no atomics:
//   deterministic). w8a8: experts with more than W8A8_MIN_ROWS = 16 pairs (as the
//   oracle) run the int8 instantiations on the per-token codes of x and the per-
//   pair codes of a, the others the fp32 ones. Their gate/up/silu use the oracle's
//   rounding steps (float64 epilogue, libdevice's accurate expf, _rn ops), so a
//   is quantised from the same fp32 values as the oracle on CUDA.
// Only fp32/fp16/bf16 are instantiated: GLM5_CHECK_FLOAT rejects float64 first.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "checks.h"

#define GLM5_DISPATCH_X(TYPE, NAME, ...)                      \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

extern "C" __device__ float __nv_expf(float);  // libdevice's accurate expf (fast-math maps expf to __expf)

namespace glm5 {
namespace cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int64_t kGemvMaxRows = 16;   // int8_linear rows served by the GEMV (csrc/cpu/int8.cpp's kGemvRows)
constexpr int64_t kW8A8MinRows = 16;   // reference.W8A8_MIN_ROWS
constexpr int kQuantWarps = 8;
constexpr int kGemvRowsPerWarp = 4, kGemvWarps = 8, kGemvStage = 8192, kGemvStep = 512;  // 32 lanes x 16 B
constexpr int BM = 32, BN = 64, BK = 32, kTileThreads = 256;

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ float byte_f(int word, int b) { return static_cast<float>((word << (24 - 8 * b)) >> 24); }

// ---------------------------------------------------------------- quantise --

template <typename scalar_t>
__global__ void quantize_rows_kernel(const scalar_t* __restrict__ x, int8_t* __restrict__ q, float* __restrict__ s,
                                     int64_t R, int64_t K) {
  const int lane = threadIdx.x & 31;
  const int64_t r = int64_t(blockIdx.x) * kQuantWarps + (threadIdx.x >> 5);
  if (r >= R) return;  // whole warps leave together
  const scalar_t* xr = x + r * K;
  float amax = 0.f;
  for (int64_t k = lane; k < K; k += 32) amax = fmaxf(amax, fabsf(static_cast<float>(xr[k])));
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
  const float sc = __fdiv_rn(amax, 127.f);
  if (lane == 0) s[r] = sc;
  for (int64_t k = lane; k < K; k += 32) {
    const float v = sc > 0.f ? fminf(fmaxf(rintf(__fdiv_rn(static_cast<float>(xr[k]), sc)), -127.f), 127.f) : 0.f;
    q[r * K + k] = static_cast<int8_t>(v);
  }
}

// x [R, K] (contiguous) -> (codes int8 [R, K], scales fp32 [R]); K = 0: scales 0
std::pair<at::Tensor, at::Tensor> quantize_2d(const at::Tensor& x, int64_t R, int64_t K) {
  at::Tensor q = at::empty({R, K}, x.options().dtype(at::kChar)), s = at::zeros({R}, x.options().dtype(at::kFloat));
  if (R == 0 || K == 0) return {q, s};
  const int64_t blocks = (R + kQuantWarps - 1) / kQuantWarps;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "x: too many rows (", R, ") for one launch");
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  GLM5_DISPATCH_X(x.scalar_type(), "glm5_int8_quantize_rows_cuda", [&] {
    quantize_rows_kernel<scalar_t><<<blocks, kQuantWarps * 32, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), q.data_ptr<int8_t>(), s.data_ptr<float>(), R, K);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {q, s};
}

// -------------------------------------------------------------------- GEMV --

template <typename scalar_t, int MB>
__global__ void __launch_bounds__(kGemvWarps * 32)
gemv_kernel(const scalar_t* __restrict__ x, int M, int64_t K, const int8_t* __restrict__ w, int64_t N, int64_t kc,
            float* __restrict__ part, bool vec) {
  constexpr int KS = kGemvStage / MB;  // staged columns per pass, a multiple of kGemvStep
  __shared__ __align__(16) float xs[kGemvStage];
  const int lane = threadIdx.x & 31;
  const int64_t n0 = (int64_t(blockIdx.x) * kGemvWarps + (threadIdx.x >> 5)) * kGemvRowsPerWarp;
  const int64_t kb0 = int64_t(blockIdx.y) * kc, kend = imin(K, kb0 + kc);
  float acc[kGemvRowsPerWarp][MB];
  const int8_t* wr[kGemvRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kGemvRowsPerWarp; ++r) {
    wr[r] = n0 + r < N ? w + (n0 + r) * K : nullptr;
#pragma unroll
    for (int m = 0; m < MB; ++m) acc[r][m] = 0.f;
  }
  const int rot = (lane >> 1) & 3;  // lanes 2i, 2i+1 start at chunk i % 4: the 8 lanes of a phase hit 8 bank quads
  for (int64_t kb = kb0; kb < kend; kb += KS) {
    const int64_t len = imin(KS, kend - kb);
    __syncthreads();
    for (int i = threadIdx.x; i < MB * KS; i += blockDim.x) {
      const int m = i / KS, kk = i % KS;
      xs[i] = m < M && kk < len ? static_cast<float>(x[int64_t(m) * K + kb + kk]) : 0.f;
    }
    __syncthreads();
    for (int64_t k = lane * 16; k < len; k += kGemvStep) {
      int4 wv[kGemvRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kGemvRowsPerWarp; ++r) {
        wv[r] = make_int4(0, 0, 0, 0);
        if (wr[r] == nullptr) continue;
        const int8_t* p = wr[r] + kb + k;
        if (vec) {  // K % 16 == 0, aligned base: k..k+15 lies inside the row
          wv[r] = __ldg(reinterpret_cast<const int4*>(p));
        } else {
          int b[4] = {0, 0, 0, 0};
#pragma unroll
          for (int j = 0; j < 16; ++j)
            if (k + j < len) b[j >> 2] |= int(uint8_t(p[j])) << (8 * (j & 3));
          wv[r] = make_int4(b[0], b[1], b[2], b[3]);
        }
      }
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int c = (jj + rot) & 3;
#pragma unroll
        for (int m = 0; m < MB; ++m) {
          const float4 xv = *reinterpret_cast<const float4*>(&xs[m * KS + k + 4 * c]);
#pragma unroll
          for (int r = 0; r < kGemvRowsPerWarp; ++r) {
            const int wd = c == 0 ? wv[r].x : c == 1 ? wv[r].y : c == 2 ? wv[r].z : wv[r].w;
            float a = acc[r][m];
            a = fmaf(byte_f(wd, 0), xv.x, a);
            a = fmaf(byte_f(wd, 1), xv.y, a);
            a = fmaf(byte_f(wd, 2), xv.z, a);
            acc[r][m] = fmaf(byte_f(wd, 3), xv.w, a);
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kGemvRowsPerWarp; ++r)
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      float v = acc[r][m];
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
      if (lane == 0 && m < M && n0 + r < N) part[(int64_t(blockIdx.y) * M + m) * N + n0 + r] = v;
    }
}

// y[m, n] = (sum over splits, in order) * scale[n] + bias[n], cast once.
template <typename out_t>
__global__ void gemv_finish_kernel(const float* __restrict__ part, int S, int64_t MN, int64_t N,
                                   const float* __restrict__ scale, const float* __restrict__ bias, out_t* __restrict__ y) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < MN; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i % N;
    float v = 0.f;
    for (int s = 0; s < S; ++s) v += part[s * MN + i];
    v *= scale[n];
    if (bias) v += bias[n];
    y[i] = static_cast<out_t>(v);
  }
}

// ------------------------------------------------------------ tiled GEMM --
// out[r, :] = a[src(r), :] @ (w[e] * w_scale[e])^T for the rows r of expert e.

struct TileArgs {
  const void* a;              // in_t [*, K] (fp32 path) or int8 codes [*, K] (Q8)
  const float* a_scale;       // Q8: per source row
  const int64_t* rows;        // sorted row -> source row * row_div (null: identity)
  int64_t row_div;
  const int32_t* offsets;     // [E+1] rows of each expert (null: one expert, rows [0, M))
  const int32_t* tile_end;    // [E] cumulative row tiles
  int E;
  int64_t M, lo, hi;          // experts with lo < rows <= hi only
  const int8_t* w;            // [E, Nw, K]
  const float* w_scale;       // [E, Nw]
  int64_t Nw, K;
  const float* bias;          // [Nw] or null (plain epilogue)
  void* out;                  // plain: out_t [*, Nw]; SwiGLU: fp32 [*, Nw/2]
  bool vec;                   // 4-byte word loads (K % 4 == 0, aligned bases)
};

__device__ __forceinline__ int load_word(const int8_t* row, int64_t k, int64_t K, bool vec) {
  if (vec) return k < K ? __ldg(reinterpret_cast<const int*>(row + k)) : 0;
  int v = 0;
  for (int b = 0; b < 4 && k + b < K; ++b) v |= int(uint8_t(row[k + b])) << (8 * b);
  return v;
}

__device__ __forceinline__ float silu_mul(float g, float u) {  // torch: g / (1 + exp(-g)), then * u
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.f, __nv_expf(-g))), u);
}

template <typename in_t, bool Q8, bool SWIGLU, typename out_t>
__global__ void __launch_bounds__(kTileThreads) tile_kernel(const TileArgs p) {
  using acc_t = std::conditional_t<Q8, int, float>;
  __shared__ int64_t src[BM];
  __shared__ __align__(16) float As[BK][BM + 1];   // Q8: rows 0..7 hold int words
  __shared__ __align__(16) float Bs[BK][BN + 4];
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  // Which expert and rows: binary search of the cumulative tile table.
  int e = 0;
  int64_t r0, r1;
  const int64_t tb = blockIdx.x;
  if (p.offsets) {
    int lo = 0, hi = p.E;
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (p.tile_end[mid] > tb) hi = mid; else lo = mid + 1;
    }
    if (lo == p.E) return;  // past the last tile (the grid is an upper bound)
    e = lo;
    const int64_t beg = p.offsets[e], end = p.offsets[e + 1];
    if (end - beg <= p.lo || end - beg > p.hi) return;  // the other path's expert
    r0 = beg + (tb - (e ? p.tile_end[e - 1] : 0)) * BM;
    r1 = imin(end, r0 + BM);
  } else {
    r0 = tb * BM;
    r1 = imin(p.M, r0 + BM);
  }
  if (tid < BM) src[tid] = r0 + tid < r1 ? (p.rows ? p.rows[r0 + tid] / p.row_div : r0 + tid) : -1;
  const int64_t I = p.Nw / 2;
  // Weight row of local column c: SwiGLU interleaves gate i and up I + i.
  auto wrow = [&](int c) -> int64_t {
    if (SWIGLU) {
      const int64_t i = int64_t(blockIdx.y) * (BN / 2) + (c >> 1);
      return i < I ? ((c & 1) ? I + i : i) : -1;
    }
    const int64_t n = int64_t(blockIdx.y) * BN + c;
    return n < p.Nw ? n : -1;
  };
  const int8_t* wbase = p.w + int64_t(e) * p.Nw * p.K;
  acc_t acc[2][4] = {};
  __syncthreads();
  for (int64_t k0 = 0; k0 < p.K; k0 += BK) {
    if constexpr (Q8) {
      const int row = tid >> 3, kw = tid & 7;
      const int64_t s = src[row];
      const int8_t* a = static_cast<const int8_t*>(p.a);
      reinterpret_cast<int*>(As[kw])[row] = s >= 0 ? load_word(a + s * p.K, k0 + 4 * kw, p.K, p.vec) : 0;
    } else {
      const in_t* a = static_cast<const in_t*>(p.a);
#pragma unroll
      for (int i = 0; i < BM * BK / kTileThreads; ++i) {
        const int el = tid + kTileThreads * i, row = el >> 5, kk = el & 31;
        const int64_t s = src[row], k = k0 + kk;
        As[kk][row] = s >= 0 && k < p.K ? static_cast<float>(a[s * p.K + k]) : 0.f;
      }
    }
#pragma unroll
    for (int i = 0; i < BN * BK / 4 / kTileThreads; ++i) {
      const int el = tid + kTileThreads * i, c = el >> 3, kw = el & 7;
      const int64_t n = wrow(c);
      const int wd = n >= 0 ? load_word(wbase + n * p.K, k0 + 4 * kw, p.K, p.vec) : 0;
      if constexpr (Q8) {
        reinterpret_cast<int*>(Bs[kw])[c] = wd;
      } else {
#pragma unroll
        for (int b = 0; b < 4; ++b) Bs[4 * kw + b][c] = byte_f(wd, b);
      }
    }
    __syncthreads();
    if constexpr (Q8) {
#pragma unroll
      for (int kw = 0; kw < BK / 4; ++kw) {
        const int* ar = reinterpret_cast<const int*>(As[kw]);
        const int4 b = *reinterpret_cast<const int4*>(&reinterpret_cast<const int*>(Bs[kw])[4 * tx]);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int av = ar[2 * ty + i];
          acc[i][0] = __dp4a(av, b.x, acc[i][0]);
          acc[i][1] = __dp4a(av, b.y, acc[i][1]);
          acc[i][2] = __dp4a(av, b.z, acc[i][2]);
          acc[i][3] = __dp4a(av, b.w, acc[i][3]);
        }
      }
    } else {
#pragma unroll 8
      for (int kk = 0; kk < BK; ++kk) {
        const float4 b = *reinterpret_cast<const float4*>(&Bs[kk][4 * tx]);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float av = As[kk][2 * ty + i];
          acc[i][0] = fmaf(av, b.x, acc[i][0]);
          acc[i][1] = fmaf(av, b.y, acc[i][1]);
          acc[i][2] = fmaf(av, b.z, acc[i][2]);
          acc[i][3] = fmaf(av, b.w, acc[i][3]);
        }
      }
    }
    __syncthreads();
  }
  const float* ws = p.w_scale + int64_t(e) * p.Nw;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t r = r0 + 2 * ty + i;
    if (r >= r1) continue;
    const double sa = Q8 ? static_cast<double>(p.a_scale[src[2 * ty + i]]) : 1.0;
    // One output: fp32 acc * scale, or (Q8) float64 acc * sa * scale (+ bias) like the oracle.
    auto value = [&](acc_t v, int64_t n, bool with_bias) -> float {
      if constexpr (Q8) {
        double d = __dmul_rn(__dmul_rn(static_cast<double>(v), sa), static_cast<double>(ws[n]));
        if (with_bias) d = __dadd_rn(d, static_cast<double>(p.bias[n]));
        return static_cast<float>(d);
      } else {
        const float f = __fmul_rn(v, ws[n]);
        return with_bias ? __fadd_rn(f, p.bias[n]) : f;
      }
    };
    if constexpr (SWIGLU) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int64_t ia = int64_t(blockIdx.y) * (BN / 2) + 2 * tx + q;
        if (ia >= I) continue;
        const float g = value(acc[i][2 * q], ia, false), u = value(acc[i][2 * q + 1], I + ia, false);
        static_cast<float*>(p.out)[r * I + ia] = silu_mul(g, u);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t n = int64_t(blockIdx.y) * BN + 4 * tx + j;
        if (n < p.Nw) static_cast<out_t*>(p.out)[r * p.Nw + n] = static_cast<out_t>(value(acc[i][j], n, p.bias != nullptr));
      }
    }
  }
}

template <typename in_t, bool Q8, bool SWIGLU, typename out_t>
void launch_tiles(const TileArgs& p, int64_t row_tiles, cudaStream_t stream) {
  const int64_t col_tiles = SWIGLU ? (p.Nw / 2 + BN / 2 - 1) / (BN / 2) : (p.Nw + BN - 1) / BN;
  if (row_tiles == 0 || col_tiles == 0 || p.K == 0) return;
  TORCH_CHECK(row_tiles < (int64_t(1) << 31) && col_tiles <= 65535, "int8 GEMM: too many tiles (", row_tiles, " x ",
              col_tiles, ") for one launch");
  tile_kernel<in_t, Q8, SWIGLU, out_t><<<dim3(unsigned(row_tiles), unsigned(col_tiles)), kTileThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool aligned(const at::Tensor& t, int bytes) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % bytes == 0; }

// fused_moe_int8's int8 pass: the rows' codes and scales, experts with more than kW8A8MinRows rows.
TileArgs with_codes(TileArgs p, const std::pair<at::Tensor, at::Tensor>& qs) {
  p.a = qs.first.const_data_ptr();
  p.a_scale = qs.second.const_data_ptr<float>();
  p.lo = kW8A8MinRows;
  p.hi = INT64_MAX;
  p.vec = p.vec && aligned(qs.first, 4);
  return p;
}

// -------------------------------------------------------------- combine --

// out[t, d] = sum_j w[t, j] * o[row_of[t*k + j], d], slots in order, float64.
template <typename out_t>
__global__ void combine_kernel(const float* __restrict__ o, const int64_t* __restrict__ row_of,
                               const double* __restrict__ w, out_t* __restrict__ out, int64_t k, int64_t D) {
  const int64_t t = blockIdx.x, d = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (d >= D) return;
  double acc = 0.0;
  for (int64_t j = 0; j < k; ++j) acc += w[t * k + j] * static_cast<double>(o[row_of[t * k + j] * D + d]);
  out[t * D + d] = static_cast<out_t>(static_cast<float>(acc));
}

// ------------------------------------------------------------------ checks --

void check_device(const at::Tensor& t, const at::Tensor& x, const char* name) {
  TORCH_CHECK_VALUE(t.device() == x.device(), name, " must be on ", x.device(), " like x, got ", t.device());
}

at::Tensor bias_or_zeros(const at::Tensor& x, int64_t M, int64_t N, const c10::optional<at::Tensor>& bias) {
  at::Tensor y = at::zeros({M, N}, x.options().dtype(at::kFloat));
  if (bias.has_value()) y += bias->to(at::kFloat);
  return y.to(x.scalar_type());
}

// ------------------------------------------------------------------- ops --

std::tuple<at::Tensor, at::Tensor> int8_quantize_rows(const at::Tensor& x_in) {
  GLM5_CHECK_FLOAT(x_in, "x");
  TORCH_CHECK_VALUE(x_in.dim() >= 1, "x must have shape [..., K], got a 0-d tensor");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const int64_t K = x.size(-1);
  const at::IntArrayRef rows = x.sizes().slice(0, x.dim() - 1);
  auto [q, s] = quantize_2d(x, c10::multiply_integers(rows), K);
  return {q.view(x.sizes()), s.view(rows)};
}

at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& scale_in,
                       const c10::optional<at::Tensor>& bias_in) {
  check_int8_linear_args(x_in, w_in, scale_in, bias_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w_in.size(0);
  if (M == 0 || N == 0 || K == 0) return bias_or_zeros(x_in, M, N, bias_in);
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), scale = scale_in.contiguous();
  const at::Tensor bias = bias_in.has_value() ? bias_in->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({M, N}, x.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (M > kGemvMaxRows) {
    TileArgs p{x.const_data_ptr(), nullptr, nullptr, 1, nullptr, nullptr, 1, M, -1, INT64_MAX,
               w.const_data_ptr<int8_t>(), scale.const_data_ptr<float>(), N, K, bp, y.data_ptr(),
               K % 4 == 0 && aligned(w, 4)};
    GLM5_DISPATCH_X(x.scalar_type(), "glm5_int8_linear_cuda", [&] {
      launch_tiles<scalar_t, false, false, scalar_t>(p, (M + BM - 1) / BM, stream);
    });
    return y;
  }
  // GEMV: split K (in whole 512-column steps) until there are about 2 blocks per SM.
  const int64_t row_blocks = (N + kGemvWarps * kGemvRowsPerWarp - 1) / (kGemvWarps * kGemvRowsPerWarp);
  const int64_t steps = (K + kGemvStep - 1) / kGemvStep;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = std::min<int64_t>({steps, 32, std::max<int64_t>(1, (2 * sms + row_blocks - 1) / row_blocks)});
  const int64_t kc = (steps + want - 1) / want * kGemvStep;
  const int64_t S = (K + kc - 1) / kc;
  TORCH_CHECK(row_blocks < (int64_t(1) << 31), "int8_linear: N=", N, " too large for one launch");
  at::Tensor part = at::empty({S, M, N}, x.options().dtype(at::kFloat));
  const bool vec = K % 16 == 0 && aligned(w, 16);
  const dim3 grid{static_cast<unsigned>(row_blocks), static_cast<unsigned>(S)};
  GLM5_DISPATCH_X(x.scalar_type(), "glm5_int8_linear_gemv_cuda", [&] {
    auto run = [&](auto mb) {
      gemv_kernel<scalar_t, decltype(mb)::value><<<grid, kGemvWarps * 32, 0, stream>>>(
          x.const_data_ptr<scalar_t>(), int(M), K, w.const_data_ptr<int8_t>(), N, kc, part.data_ptr<float>(), vec);
    };
    if (M <= 1) run(std::integral_constant<int, 1>());
    else if (M <= 2) run(std::integral_constant<int, 2>());
    else if (M <= 4) run(std::integral_constant<int, 4>());
    else if (M <= 8) run(std::integral_constant<int, 8>());
    else run(std::integral_constant<int, 16>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t blocks = std::min<int64_t>((M * N + 255) / 256, 65536);
    gemv_finish_kernel<scalar_t><<<unsigned(blocks), 256, 0, stream>>>(
        part.const_data_ptr<float>(), int(S), M * N, N, scale.const_data_ptr<float>(), bp, y.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return y;
}

// Each head's weight-only product, one int8_linear launch per head (MLA: 16-128 heads of
// 64 x 512 at decode; a launch of its own per head is the simple correct form).
at::Tensor int8_linear_heads(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  check_int8_linear_heads_args(x, w, scale);
  at::Tensor y = at::empty({x.size(0), x.size(1), w.size(1)}, x.options());
  for (int64_t h = 0; h < x.size(0); ++h) y[h].copy_(int8_linear(x[h], w[h], scale[h], c10::nullopt));
  return y;
}

at::Tensor w8a8_linear(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& scale_in,
                       const c10::optional<at::Tensor>& bias_in) {
  check_int8_linear_args(x_in, w_in, scale_in, bias_in);
  TORCH_CHECK_VALUE(x_in.size(1) <= 131072, "x must have K <= 131072 (int32 accumulation of int8 products), got K=",
                    x_in.size(1));
  const c10::cuda::CUDAGuard guard(x_in.device());
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w_in.size(0);
  if (M == 0 || N == 0 || K == 0) return bias_or_zeros(x_in, M, N, bias_in);
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), scale = scale_in.contiguous();
  const at::Tensor bias = bias_in.has_value() ? bias_in->to(at::kFloat).contiguous() : at::Tensor();
  const auto [qx, sx] = quantize_2d(x, M, K);
  at::Tensor y = at::empty({M, N}, x.options());
  TileArgs p{qx.const_data_ptr(), sx.const_data_ptr<float>(), nullptr, 1, nullptr, nullptr, 1, M, -1, INT64_MAX,
             w.const_data_ptr<int8_t>(), scale.const_data_ptr<float>(), N, K,
             bias.defined() ? bias.const_data_ptr<float>() : nullptr, y.data_ptr(),
             K % 4 == 0 && aligned(w, 4) && aligned(qx, 4)};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  GLM5_DISPATCH_X(x.scalar_type(), "glm5_w8a8_linear_cuda", [&] {
    launch_tiles<int8_t, true, false, scalar_t>(p, (M + BM - 1) / BM, stream);
  });
  return y;
}

at::Tensor fused_moe_int8(const at::Tensor& x_in, const at::Tensor& w_gate_up_in, const at::Tensor& gu_scale_in,
                          const at::Tensor& w_down_in, const at::Tensor& down_scale_in, const at::Tensor& weights_in,
                          const at::Tensor& ids_in, bool w8a8, bool packed) {
  check_fused_moe_int8_args(x_in, w_gate_up_in, gu_scale_in, w_down_in, down_scale_in, weights_in, ids_in);
  TORCH_CHECK_VALUE(!packed, "fused_moe_int8: packed=True is the CPU kernel's layout; pass plain rows on CUDA "
                    "(glm5_ops.int8.unpack_rows)");
  const int64_t T = x_in.size(0), D = x_in.size(1);
  const int64_t E = w_gate_up_in.size(0), I2 = w_gate_up_in.size(1), I = I2 / 2;
  const int64_t k = ids_in.size(1), P = T * k;
  check_device(w_gate_up_in, x_in, "w_gate_up");
  check_device(gu_scale_in, x_in, "gate_up_scale");
  check_device(w_down_in, x_in, "w_down");
  check_device(down_scale_in, x_in, "down_scale");
  check_device(weights_in, x_in, "weights");
  check_device(ids_in, x_in, "ids");
  TORCH_CHECK_VALUE(E < (int64_t(1) << 31) && P < (int64_t(1) << 31), "fused_moe_int8: E and T*k must be < 2^31");
  const c10::cuda::CUDAGuard guard(x_in.device());
  if (P == 0) return at::zeros({T, D}, x_in.options());
  // Pairs sorted by expert (stable: token order within an expert), then one sync: bad ids.
  const auto sorted = at::sort(ids_in.reshape({-1}), /*stable=*/true, 0, false);
  const at::Tensor& sid = std::get<0>(sorted);
  const at::Tensor& order = std::get<1>(sorted);  // int64: sorted row -> pair t*k + j
  const at::Tensor ends = at::cat({sid.narrow(0, 0, 1), sid.narrow(0, P - 1, 1)}).cpu();
  const int32_t lo_id = ends.data_ptr<int32_t>()[0], hi_id = ends.data_ptr<int32_t>()[1];
  TORCH_CHECK_VALUE(lo_id >= 0 && hi_id < E, "ids must be expert ids in [0, E=", E, "), got ", lo_id < 0 ? lo_id : hi_id);
  if (D == 0 || I == 0) return at::zeros({T, D}, x_in.options());
  const at::Tensor x = x_in.contiguous(), wgu = w_gate_up_in.contiguous(), wd = w_down_in.contiguous();
  const at::Tensor gus = gu_scale_in.contiguous(), ds = down_scale_in.contiguous();
  const at::Tensor weights = weights_in.to(at::kDouble).contiguous();
  const at::Tensor offsets = at::searchsorted(sid, at::arange(E + 1, sid.options()), /*out_int32=*/true);
  const at::Tensor tile_end =
      at::cumsum(at::floor_divide(offsets.narrow(0, 1, E) - offsets.narrow(0, 0, E) + (BM - 1), BM), 0, at::kInt);
  const int64_t row_tiles = (P + BM - 1) / BM + std::min(E, P);  // >= sum over experts of ceil(rows / BM)
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t fp_hi = w8a8 ? kW8A8MinRows : INT64_MAX;

  // gate/up + SwiGLU -> a [P, I] fp32 (sorted rows)
  at::Tensor a = at::empty({P, I}, x.options().dtype(at::kFloat));
  TileArgs gu{x.const_data_ptr(), nullptr, order.const_data_ptr<int64_t>(), k, offsets.const_data_ptr<int32_t>(),
              tile_end.const_data_ptr<int32_t>(), int(E), P, -1, fp_hi, wgu.const_data_ptr<int8_t>(),
              gus.const_data_ptr<float>(), I2, D, nullptr, a.data_ptr(), D % 4 == 0 && aligned(wgu, 4)};
  GLM5_DISPATCH_X(x.scalar_type(), "glm5_fused_moe_int8_cuda", [&] {
    launch_tiles<scalar_t, false, true, float>(gu, row_tiles, stream);
  });
  if (w8a8)  // per-token codes of x (the oracle quantises x[token].float(): the same rows)
    launch_tiles<int8_t, true, true, float>(with_codes(gu, quantize_2d(x, T, D)), row_tiles, stream);
  // down -> o [P, D] fp32 (sorted rows)
  at::Tensor o = at::empty({P, D}, x.options().dtype(at::kFloat));
  TileArgs dn{a.const_data_ptr(), nullptr, nullptr, 1, offsets.const_data_ptr<int32_t>(),
              tile_end.const_data_ptr<int32_t>(), int(E), P, -1, fp_hi, wd.const_data_ptr<int8_t>(),
              ds.const_data_ptr<float>(), D, I, nullptr, o.data_ptr(), I % 4 == 0 && aligned(wd, 4)};
  launch_tiles<float, false, false, float>(dn, row_tiles, stream);
  if (w8a8)  // per-pair codes of a
    launch_tiles<int8_t, true, false, float>(with_codes(dn, quantize_2d(a, P, I)), row_tiles, stream);
  // combine: out[t] = sum_j weights[t,j] * o[row of pair (t,j)], slots in order
  const at::Tensor row_of = at::empty({P}, order.options()).scatter_(0, order, at::arange(P, order.options()));
  at::Tensor out = at::empty({T, D}, x.options());
  TORCH_CHECK(T < (int64_t(1) << 31) && (D + 255) / 256 <= 65535, "fused_moe_int8: [T,D] too large for one launch");
  const dim3 grid{static_cast<unsigned>(T), static_cast<unsigned>((D + 255) / 256)};
  GLM5_DISPATCH_X(x.scalar_type(), "glm5_fused_moe_int8_combine_cuda", [&] {
    combine_kernel<scalar_t><<<grid, 256, 0, stream>>>(o.const_data_ptr<float>(), row_of.const_data_ptr<int64_t>(),
                                                       weights.const_data_ptr<double>(), out.data_ptr<scalar_t>(), k, D);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace
}  // namespace cuda
}  // namespace glm5

TORCH_LIBRARY_IMPL(glm5, CUDA, m) {
  m.impl("int8_quantize_rows", &glm5::cuda::int8_quantize_rows);
  m.impl("int8_linear", &glm5::cuda::int8_linear);
  m.impl("int8_linear_heads", &glm5::cuda::int8_linear_heads);
  m.impl("w8a8_linear", &glm5::cuda::w8a8_linear);
  m.impl("fused_moe_int8", &glm5::cuda::fused_moe_int8);
}
