// Token-level sparse attention (DSA) and block-sparse attention on CUDA:
// sparse_attention_fwd/bwd, block_sparse_attention_fwd/bwd. Semantics:
// glm5_ops/reference.py (sparse_attention, block_sparse_attention).
//
// One engine serves both ops. A work unit (one thread block) is a set of up to
// M "rows" (query-head pairs) that share one list of keys:
//  - sparse:       all G = Hq/Hkv heads of kv head hk for one query (b, s)
//                  (FlashMLA sparse-prefill style: a gathered key row serves
//                  G heads, so MLA's absorbed form is compute-bound); G > M
//                  is split into ceil(G/M) units; rows past G are masked;
//  - block-sparse: up to M consecutive queries of one query block, one head h,
//                  keys = the concatenation of its selected key blocks (key j
//                  is position kv_indices[j / bs] * bs + j % bs; partial last
//                  blocks and tiny blocks pack into full key tiles).
// Causal masking is per (row, key): key t counts for row r iff t <= hz0 + r*hstep
// (hstep = 0 for sparse, 1 for block-sparse). -1 indices, keys past T, keys past
// the unit's last horizon and bad block entries never load (zero-filled rows).
// Entries outside [-1, T) are skipped here without a host sync (the CPU kernels
// raise; the Python API rejects them before either runs).
//
// Forward, fp16/bf16 (fwd_mma): 8 warps, M = 16*MT rows (MT 1 or 4), key tiles
// of 64 gathered rows copied into shared memory with cp.async (16-byte chunks,
// zero-filled past D and for dead keys; a scalar path when strides are not
// 16-byte multiples). S = Q K^T and O += P V on tensor cores with
// mma.sync.m16n8k16 (fp32 accumulate, ldmatrix operands), online softmax in
// fp32 (exp2 domain). Warp (rg, cg) owns rows 16*rg.. and, in S, keys
// cg*64/NC.. (NC = 8/MT column groups); row max/sum partials and P (16-bit)
// go through shared memory so that in P V the same warp owns Dv columns
// cg*DVC/NC.. of the same rows (the row statistics never leave the warps that
// own the rows). Q stays resident in shared memory for the whole unit. Dv is
// processed in chunks of DVC (128 or 512) columns; Dv > 512 runs more blocks
// (grid.y) that recompute S. When v is a view of k with the same strides
// (MLA: v = k[..., :Dv]) the V operand is read from the K tile: one gather.
// Shared memory (MLA, Dk=576, Dv=512, MT=4): Q 73 KB + K 73 KB (+ V 65 KB
// when not aliased) + P 9 KB: one block per SM.
// Forward, fp32 (fwd_simt): exact fp32 FMA, M = 16 rows, 32-key tiles; warp w
// owns rows w and w+8, lane n owns key n in S and columns lane+32j in P V.
//
// Backward (bwd_simt, every dtype, fp32 math): recomputes P = exp(s - lse)
// from the saved lse, delta = rowsum(dO * O) at the start of each unit, then
// per 16-key tile dP = dO V^T, dS = P (dP - delta); dq accumulates in shared
// memory (each row belongs to exactly one unit: no atomics, one store); dk and
// dv go to fp32 workspaces [B,T,Hkv,D] with atomicAdd (keys shared between
// units: other queries' selections, or other query blocks), skipped for keys
// no row of the tile can see, then cast to k's / v's dtype. Atomics rather than
// a transposed selection (per key, the queries that chose it): one engine for
// both ops, no extra index pass; the cost is non-deterministic summation order
// of dk/dv and atomic traffic of (Dk+Dv) per (unit, key).
//
// Expected limits (to measure on the GPU) and next steps:
//  - fwd_mma loads each key tile synchronously (no double buffering; K then V
//    as two cp.async groups so S starts before V lands) and uses mma.sync, not
//    wgmma: expect well under FlashMLA's 640 TFLOPS; next: TMA/cp.async
//    pipelining with two K buffers (BN=32 at MLA sizes), wgmma with 2 consumer
//    warpgroups, and a producer warp for the gather.
//  - G < 16 (e.g. GQA with 8 heads per kv head) wastes M rows: the next step
//    packs neighbouring queries that share keys, or uses M=8 (m16n8 with A^T).
//  - The backward is SIMT fp32: correct but far from tensor-core speed (the
//    next step is the same mma engine for dS/dq/dk/dv and, for dk/dv, the
//    transposed selection instead of atomics).
//  - Shared memory bounds the head dims: Dk <= ~590 with Dv = 512 not aliased
//    (larger with aliasing or smaller Dv) in the forward, 192(Dk+1) + 128(Dv+1)
//    bytes <= ~225 KB in the backward; beyond, NotImplementedError names the
//    sizes (the next step would split Dk in the S product).
// Host side: no synchronisation; q_start is read on the device.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <type_traits>

#include "checks.h"
#include "cuda/common.cuh"

namespace glm5 {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ------------------------------------------------------------- work units --

struct AttnParams {
  const void* q;  // [B,S,Hq,Dk] contiguous
  const void* k;  // [B,T,Hkv,Dk], strides k_s*
  const void* v;  // [B,T,Hkv,Dv], strides v_s*
  void* out;      // fwd: [B,S,Hq,Dv]
  float* lse;     // fwd: [B,S,Hq]
  const void* dout;  // bwd: [B,S,Hq,Dv] contiguous
  const void* o;     // bwd: out of the forward
  const float* lse_in;  // bwd
  void* dq;             // bwd: [B,S,Hq,Dk]
  float* dk_ws;         // bwd: fp32 [B,T,Hkv,Dk]
  float* dv_ws;         // bwd: fp32 [B,T,Hkv,Dv]
  int64_t B, S, Hq, Hkv, G, Dk, Dv, T;
  int64_t k_sb, k_st, k_sh, v_sb, v_st, v_sh;
  float scale;
  int causal;
  const int64_t* q_start;  // [B] or nullptr: T - S
  int sparse;              // 1: token-level (indices), 0: block mask
  const int32_t* indices;  // [B,S,topk]
  int64_t topk;
  const int32_t* kv_num;  // [B,Hq,Qb]
  const int32_t* kv_idx;  // [B,Hq,Qb,W]
  int64_t W, bs, Qb;
  int64_t M;         // rows per unit (the kernel's)
  int64_t n_chunks;  // units per (b, s, hk) [sparse] or per (b, h, query block) [block]
  int alias;         // v is k[..., :Dv] with k's strides
  int vec_q, vec_k, vec_v;  // 16-byte cp.async allowed
};

struct Unit {
  int64_t b, hk;
  int64_t row0, rstride;  // row r is q row (row0 + r*rstride) of the [B*S*Hq] row space
  int nrows;
  int64_t hz0;  // causal horizon of row r: hz0 + r*hstep
  int hstep;
  const int32_t* keys;
  int64_t nkeys;
};

__device__ __forceinline__ Unit decode(const AttnParams& p, int64_t u) {
  Unit x;
  const int64_t rc = u % p.n_chunks;
  u /= p.n_chunks;
  if (p.sparse) {
    const int64_t hk = u % p.Hkv;
    u /= p.Hkv;
    const int64_t s = u % p.S, b = u / p.S;
    const int64_t h0 = hk * p.G + rc * p.M;
    x.b = b;
    x.hk = hk;
    x.row0 = (b * p.S + s) * p.Hq + h0;
    x.rstride = 1;
    x.nrows = static_cast<int>(std::min<int64_t>(p.M, p.G - rc * p.M));
    const int64_t qs = p.q_start != nullptr ? p.q_start[b] : p.T - p.S;
    x.hz0 = qs + s;
    x.hstep = 0;
    x.keys = p.indices + (b * p.S + s) * p.topk;
    x.nkeys = p.topk;
  } else {
    const int64_t qb = u % p.Qb;
    u /= p.Qb;
    const int64_t h = u % p.Hq, b = u / p.Hq;
    const int64_t s0 = qb * p.bs + rc * p.M;
    x.b = b;
    x.hk = h / p.G;
    x.row0 = (b * p.S + s0) * p.Hq + h;
    x.rstride = p.Hq;
    x.nrows = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(p.M, std::min<int64_t>(p.bs, p.S - qb * p.bs) - rc * p.M)));
    const int64_t qs = p.q_start != nullptr ? p.q_start[b] : p.T - p.S;
    x.hz0 = qs + s0;
    x.hstep = 1;
    const int64_t mrow = (b * p.Hq + h) * p.Qb + qb;
    x.keys = p.kv_idx + mrow * p.W;
    // never read past the row, whatever a direct caller passes
    x.nkeys = std::min<int64_t>(std::max<int32_t>(p.kv_num[mrow], 0), p.W) * p.bs;
  }
  return x;
}

// Key position of entry j < nkeys of the unit's list, or -1 (skip slot,
// out-of-range entry, or past every row's causal horizon).
__device__ __forceinline__ int key_pos(const AttnParams& p, const Unit& x, int64_t j) {
  int64_t t;
  if (p.sparse) {
    t = x.keys[j];
  } else {
    const int64_t blk = x.keys[j / p.bs];
    t = blk >= 0 ? blk * p.bs + j % p.bs : -1;
  }
  if (t < 0 || t >= p.T) return -1;
  if (p.causal && t > x.hz0 + static_cast<int64_t>(x.nrows - 1) * x.hstep) return -1;
  return static_cast<int>(t);
}

__device__ __forceinline__ bool row_sees(const AttnParams& p, const Unit& x, int r, int t) {
  return t >= 0 && (!p.causal || t <= x.hz0 + static_cast<int64_t>(r) * x.hstep);
}

// --------------------------------------------------------- PTX helpers --

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16 bytes global -> shared; bytes < 16 zero-fills the rest (0: all zeros).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(ptr)));
}
__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], const void* ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(ptr)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(ptr)));
}

// c[16x8] += a[16x16] (row) * b[16x8] (col), fp32 accumulate.
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as a packed 16-bit pair, lower column in the low half (mma order).
__device__ __forceinline__ uint32_t pack2(__nv_bfloat16*, float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  uint32_t r;
  memcpy(&r, &h, 4);
  return r;
}
__device__ __forceinline__ uint32_t pack2(__half*, float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  uint32_t r;
  memcpy(&r, &h, 4);
  return r;
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Rows [0, nrows) of a 16-bit tile into shared memory (row stride ld elements):
// columns [0, ncols) from src(r) (nullptr: a zero row), zeros up to fill (a
// multiple of 8). vec: src rows and strides are 16-byte aligned -> cp.async.
template <typename F>
__device__ __forceinline__ void load_tile16(uint16_t* dst, int ld, int nrows, int ncols, int fill, bool vec,
                                            const void* any_ptr, F&& src) {
  const int cpr = fill / 8;  // 16-byte chunks per row
  for (int e = threadIdx.x; e < nrows * cpr; e += kThreads) {
    const int r = e / cpr, c = (e - r * cpr) * 8;
    const uint16_t* row = static_cast<const uint16_t*>(src(r));
    const int n = row != nullptr ? max(0, min(8, ncols - c)) : 0;
    uint16_t* d = dst + r * ld + c;
    if (vec) {
      cp_async16(d, n > 0 ? static_cast<const void*>(row + c) : any_ptr, n * 2);
    } else {
      uint16_t tmp[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) tmp[i] = i < n ? row[c + i] : uint16_t(0);
      uint4 w;
      memcpy(&w, tmp, 16);
      *reinterpret_cast<uint4*>(d) = w;
    }
  }
}

// ----------------------------------------------- forward, tensor cores --

constexpr int kBN = 64;  // keys per tile (fwd_mma)

struct MmaSmem {
  int64_t q, k, v, p, mx, sum, t, total;  // byte offsets
  int ldk, ldv;                           // row strides (elements)
};

__host__ __device__ inline MmaSmem mma_smem(int MT, int DVC, int64_t Dk, bool alias) {
  const int M = 16 * MT, NC = 8 / MT;
  const int dkp = static_cast<int>((Dk + 15) / 16 * 16);
  MmaSmem s;
  s.ldk = dkp + 8;  // +16 bytes per row: conflict-free ldmatrix
  s.ldv = alias ? s.ldk : DVC + 8;
  s.q = 0;
  s.k = s.q + int64_t(M) * s.ldk * 2;
  s.v = s.k + int64_t(kBN) * s.ldk * 2;
  s.p = s.v + (alias ? 0 : int64_t(kBN) * s.ldv * 2);
  s.mx = s.p + int64_t(M) * (kBN + 8) * 2;
  s.sum = s.mx + int64_t(NC) * M * 4;
  s.t = s.sum + int64_t(NC) * M * 4;
  s.total = s.t + kBN * 4;
  return s;
}

template <typename T, int MT, int DVC>
__global__ void __launch_bounds__(kThreads, 1) fwd_mma(AttnParams p) {
  constexpr int M = 16 * MT, NC = 8 / MT, KPW = kBN / NC, NTS = KPW / 8, CPW = DVC / NC, NTO = CPW / 8;
  constexpr int LDP = kBN + 8;
  static_assert(NTO % 2 == 0 && (NTS == 1 || NTS % 2 == 0), "warp tiles");
  extern __shared__ __align__(16) unsigned char smem[];
  const Unit x = decode(p, blockIdx.x);
  if (x.nrows <= 0) return;
  const bool alias = p.alias != 0;
  const MmaSmem L = mma_smem(MT, DVC, p.Dk, alias);
  const int Dk = static_cast<int>(p.Dk), Dkp = L.ldk - 8, ldk = L.ldk, ldv = L.ldv;
  const int64_t dv0 = int64_t(blockIdx.y) * DVC;
  const int dvn = static_cast<int>(std::min<int64_t>(DVC, p.Dv - dv0));  // V columns of this chunk
  T* sQ = reinterpret_cast<T*>(smem + L.q);
  T* sK = reinterpret_cast<T*>(smem + L.k);
  T* sV = alias ? sK + dv0 : reinterpret_cast<T*>(smem + L.v);  // aliased: V channel c is K column c
  T* sP = reinterpret_cast<T*>(smem + L.p);
  float* sMax = reinterpret_cast<float*>(smem + L.mx);
  float* sSum = reinterpret_cast<float*>(smem + L.sum);
  int* sT = reinterpret_cast<int*>(smem + L.t);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int rg = warp % MT, cg = warp / MT, g = lane >> 2, tig = lane & 3;
  const T* qg = static_cast<const T*>(p.q);
  const T* kg = static_cast<const T*>(p.k) + x.b * p.k_sb + x.hk * p.k_sh;
  const T* vg = static_cast<const T*>(p.v) + x.b * p.v_sb + x.hk * p.v_sh + dv0;

  load_tile16(reinterpret_cast<uint16_t*>(sQ), ldk, M, Dk, Dkp, p.vec_q, p.q, [&](int r) -> const void* {
    return r < x.nrows ? static_cast<const void*>(qg + (x.row0 + r * x.rstride) * p.Dk) : nullptr;
  });
  cp_async_commit();

  const float sl2 = p.scale * kLog2e;
  const float kNegInf = -std::numeric_limits<float>::infinity();
  float m_i[2] = {kNegInf, kNegInf}, l_i[2] = {0.f, 0.f};  // rows 16rg+g, 16rg+g+8 (log2 domain)
  float acc_o[NTO][4];
#pragma unroll
  for (int n = 0; n < NTO; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[n][e] = 0.f;

  for (int64_t j0 = 0; j0 < x.nkeys; j0 += kBN) {
    int live = 0;
    if (tid < kBN) {
      const int t = j0 + tid < x.nkeys ? key_pos(p, x, j0 + tid) : -1;
      sT[tid] = t;
      live = t >= 0;
    }
    if (!__syncthreads_or(live)) continue;  // a tile with no visible key (also a barrier for sT)

    load_tile16(reinterpret_cast<uint16_t*>(sK), ldk, kBN, Dk, Dkp, p.vec_k, p.k, [&](int r) -> const void* {
      const int t = sT[r];
      return t >= 0 ? static_cast<const void*>(kg + t * p.k_st) : nullptr;
    });
    cp_async_commit();
    if (!alias) {
      load_tile16(reinterpret_cast<uint16_t*>(sV), ldv, kBN, dvn, DVC, p.vec_v, p.v, [&](int r) -> const void* {
        const int t = sT[r];
        return t >= 0 ? static_cast<const void*>(vg + t * p.v_st) : nullptr;
      });
      cp_async_commit();
      cp_async_wait<1>();  // Q and K have landed; V may still be in flight
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    // S[16 rows of rg, KPW keys of cg] = Q K^T over Dkp (zero-padded columns)
    float acc_s[NTS][4];
#pragma unroll
    for (int j = 0; j < NTS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_s[j][e] = 0.f;
    const T* qa = sQ + (rg * 16 + (lane & 15)) * ldk + (lane >> 4) * 8;
    for (int kk = 0; kk < Dkp; kk += 16) {
      uint32_t a[4];
      ldsm_x4(a, qa + kk);
      if constexpr (NTS == 1) {
        uint32_t b[2];
        ldsm_x2(b, sK + (cg * KPW + (lane & 7)) * ldk + kk + ((lane >> 3) & 1) * 8);
        mma16816<T>(acc_s[0], a, b[0], b[1]);
      } else {
#pragma unroll
        for (int jp = 0; jp < NTS / 2; ++jp) {
          uint32_t b[4];
          ldsm_x4(b, sK + (cg * KPW + jp * 16 + (lane & 7) + (lane >> 4) * 8) * ldk + kk + ((lane >> 3) & 1) * 8);
          mma16816<T>(acc_s[2 * jp], a, b[0], b[1]);
          mma16816<T>(acc_s[2 * jp + 1], a, b[2], b[3]);
        }
      }
    }

    // mask, scale (log2 domain), partial row max over this warp's keys
    float mx[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int j = 0; j < NTS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = rg * 16 + g + (e >> 1) * 8;
        const int kc = cg * KPW + j * 8 + 2 * tig + (e & 1);
        const float s = row_sees(p, x, r, sT[kc]) ? acc_s[j][e] * sl2 : kNegInf;
        acc_s[j][e] = s;
        mx[e >> 1] = fmaxf(mx[e >> 1], s);
      }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(kFullMask, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(kFullMask, mx[i], 2));
      if (tig == 0) sMax[cg * M + rg * 16 + g + i * 8] = mx[i];
    }
    __syncthreads();

    float alpha[2], m_use[2], rs[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = rg * 16 + g + i * 8;
      float mt = kNegInf;
#pragma unroll
      for (int c = 0; c < NC; ++c) mt = fmaxf(mt, sMax[c * M + r]);
      const float m_new = fmaxf(m_i[i], mt);
      m_use[i] = m_new == kNegInf ? 0.f : m_new;  // no visible key yet: keep exp2 finite
      alpha[i] = exp2f(m_i[i] - m_use[i]);         // 0 while m_i = -inf (O and l are 0)
      m_i[i] = m_new;
    }
#pragma unroll
    for (int j = 0; j < NTS; ++j) {
      const int kc = cg * KPW + j * 8 + 2 * tig;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float p0 = exp2f(acc_s[j][2 * i] - m_use[i]), p1 = exp2f(acc_s[j][2 * i + 1] - m_use[i]);
        rs[i] += p0 + p1;
        *reinterpret_cast<uint32_t*>(sP + (rg * 16 + g + i * 8) * LDP + kc) = pack2(static_cast<T*>(nullptr), p0, p1);
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      rs[i] += __shfl_xor_sync(kFullMask, rs[i], 1);
      rs[i] += __shfl_xor_sync(kFullMask, rs[i], 2);
      if (tig == 0) sSum[cg * M + rg * 16 + g + i * 8] = rs[i];
    }
    if (!alias) cp_async_wait<0>();
    __syncthreads();

#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = rg * 16 + g + i * 8;
      float ts = 0.f;
#pragma unroll
      for (int c = 0; c < NC; ++c) ts += sSum[c * M + r];  // same order in every warp of the row group
      l_i[i] = alpha[i] * l_i[i] + ts;
    }
#pragma unroll
    for (int n = 0; n < NTO; ++n) {
      acc_o[n][0] *= alpha[0];
      acc_o[n][1] *= alpha[0];
      acc_o[n][2] *= alpha[1];
      acc_o[n][3] *= alpha[1];
    }

    // O[16 rows of rg, CPW columns of cg] += P V
    const T* pa = sP + (rg * 16 + (lane & 15)) * LDP + (lane >> 4) * 8;
#pragma unroll
    for (int kk = 0; kk < kBN; kk += 16) {
      uint32_t a[4];
      ldsm_x4(a, pa + kk);
#pragma unroll
      for (int np = 0; np < NTO / 2; ++np) {
        const int col = cg * CPW + np * 16;
        if (dv0 + col < p.Dv) {  // warp-uniform; reads stay below round16(Dv) <= the tile's width
          uint32_t b[4];
          ldsm_x4_t(b, sV + (kk + (lane & 7) + ((lane >> 3) & 1) * 8) * ldv + col + (lane >> 4) * 8);
          mma16816<T>(acc_o[2 * np], a, b[0], b[1]);
          mma16816<T>(acc_o[2 * np + 1], a, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // sT, sK, sV, sP are rewritten by the next tile
  }
  cp_async_wait<0>();  // Q's group when every tile was skipped

  T* og = static_cast<T*>(p.out);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = rg * 16 + g + i * 8;
    if (r >= x.nrows) continue;
    const float inv = l_i[i] > 0.f ? 1.f / l_i[i] : 0.f;
    T* orow = og + (x.row0 + r * x.rstride) * p.Dv + dv0;
#pragma unroll
    for (int n = 0; n < NTO; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = cg * CPW + n * 8 + 2 * tig + e;
        if (dv0 + c < p.Dv) orow[c] = from_float<T>(acc_o[n][2 * i + e] * inv);
      }
    if (blockIdx.y == 0 && cg == 0 && tig == 0)
      p.lse[x.row0 + r * x.rstride] = l_i[i] > 0.f ? (m_i[i] + log2f(l_i[i])) * kLn2 : kNegInf;
  }
}

// ----------------------------------------------------- forward, fp32 --

constexpr int kFM = 16;    // rows per unit (fwd_simt, bwd_simt)
constexpr int kFBN = 32;   // keys per tile (fwd_simt)
constexpr int kFDV = 512;  // Dv columns per block (fwd_simt)

__host__ __device__ inline int64_t simt_fwd_smem(int64_t Dk, int64_t Dv, bool alias) {
  const int64_t dvc = std::min<int64_t>(Dv, kFDV);
  return 4 * ((kFM + kFBN) * (Dk + 1) + (alias ? 0 : kFBN * (dvc + 1)) + kFBN);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) fwd_simt(AttnParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const Unit x = decode(p, blockIdx.x);
  if (x.nrows <= 0) return;
  const bool alias = p.alias != 0;
  const int Dk = static_cast<int>(p.Dk), ldk = Dk + 1;
  const int64_t dv0 = int64_t(blockIdx.y) * kFDV;
  const int dvc = static_cast<int>(std::min<int64_t>(kFDV, p.Dv - dv0));
  const int ldv = alias ? ldk : static_cast<int>(std::min<int64_t>(p.Dv, kFDV)) + 1;
  float* sQ = reinterpret_cast<float*>(smem);
  float* sK = sQ + kFM * ldk;
  float* sV = alias ? sK + dv0 : sK + kFBN * ldk;
  int* sT = reinterpret_cast<int*>(sK + kFBN * ldk + (alias ? 0 : kFBN * ldv));

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const T* qg = static_cast<const T*>(p.q);
  const T* kg = static_cast<const T*>(p.k) + x.b * p.k_sb + x.hk * p.k_sh;
  const T* vg = static_cast<const T*>(p.v) + x.b * p.v_sb + x.hk * p.v_sh + dv0;
  for (int e = tid; e < kFM * Dk; e += kThreads) {
    const int r = e / Dk, c = e - r * Dk;
    sQ[r * ldk + c] = r < x.nrows ? to_float(qg[(x.row0 + r * x.rstride) * p.Dk + c]) : 0.f;
  }
  const float sl2 = p.scale * kLog2e;
  const float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int NJ = kFDV / 32;
  float m_i[2] = {kNegInf, kNegInf}, l_i[2] = {0.f, 0.f}, acc[2][NJ];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j) acc[i][j] = 0.f;

  for (int64_t j0 = 0; j0 < x.nkeys; j0 += kFBN) {
    int live = 0;
    if (tid < kFBN) {
      const int t = j0 + tid < x.nkeys ? key_pos(p, x, j0 + tid) : -1;
      sT[tid] = t;
      live = t >= 0;
    }
    if (!__syncthreads_or(live)) continue;
    for (int e = tid; e < kFBN * Dk; e += kThreads) {
      const int n = e / Dk, c = e - n * Dk, t = sT[n];
      sK[n * ldk + c] = t >= 0 ? to_float(kg[t * p.k_st + c]) : 0.f;
    }
    if (!alias)
      for (int e = tid; e < kFBN * dvc; e += kThreads) {
        const int n = e / dvc, c = e - n * dvc, t = sT[n];
        sV[n * ldv + c] = t >= 0 ? to_float(vg[t * p.v_st + c]) : 0.f;
      }
    __syncthreads();
    const int t = sT[lane];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = warp + 8 * i;
      float s = 0.f;
      for (int d = 0; d < Dk; ++d) s = fmaf(sQ[r * ldk + d], sK[lane * ldk + d], s);
      s = row_sees(p, x, r, t) ? s * sl2 : kNegInf;
      float mt = s;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(kFullMask, mt, o));
      const float m_new = fmaxf(m_i[i], mt), m_use = m_new == kNegInf ? 0.f : m_new;
      const float alpha = exp2f(m_i[i] - m_use), pr = exp2f(s - m_use);
      float ts = pr;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ts += __shfl_xor_sync(kFullMask, ts, o);
      l_i[i] = alpha * l_i[i] + ts;
      m_i[i] = m_new;
#pragma unroll
      for (int j = 0; j < NJ; ++j) acc[i][j] *= alpha;
      for (int n = 0; n < kFBN; ++n) {
        const float pn = __shfl_sync(kFullMask, pr, n);
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const int c = lane + 32 * j;
          if (c < dvc) acc[i][j] = fmaf(pn, sV[n * ldv + c], acc[i][j]);
        }
      }
    }
    __syncthreads();
  }
  T* og = static_cast<T*>(p.out);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = warp + 8 * i;
    if (r >= x.nrows) continue;
    const float inv = l_i[i] > 0.f ? 1.f / l_i[i] : 0.f;
    T* orow = og + (x.row0 + r * x.rstride) * p.Dv + dv0;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int c = lane + 32 * j;
      if (c < dvc) orow[c] = from_float<T>(acc[i][j] * inv);
    }
    if (blockIdx.y == 0 && lane == 0)
      p.lse[x.row0 + r * x.rstride] = l_i[i] > 0.f ? (m_i[i] + log2f(l_i[i])) * kLn2 : kNegInf;
  }
}

// ------------------------------------------------------------ backward --

constexpr int kBBN = 16;  // keys per tile (bwd_simt); thread (r, n) = (tid / 16, tid % 16)
constexpr int kLDS = kBBN + 1;

__host__ __device__ inline int64_t simt_bwd_smem(int64_t Dk, int64_t Dv, bool alias) {
  return 4 * (kFM * (Dk + 1) * 2 + kBBN * (Dk + 1) + kFM * (Dv + 1) + (alias ? 0 : kBBN * (Dv + 1)) +
              2 * kFM * kLDS + 2 * kFM + 2 * kBBN);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) bwd_simt(AttnParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const Unit x = decode(p, blockIdx.x);
  if (x.nrows <= 0) return;
  const bool alias = p.alias != 0;
  const int Dk = static_cast<int>(p.Dk), Dv = static_cast<int>(p.Dv), ldk = Dk + 1;
  const int ldv = alias ? ldk : Dv + 1;
  float* sQ = reinterpret_cast<float*>(smem);
  float* sdQ = sQ + kFM * ldk;
  float* sK = sdQ + kFM * ldk;
  float* sdO = sK + kBBN * ldk;
  float* sV = alias ? sK : sdO + kFM * (Dv + 1);
  float* sP = (alias ? sdO + kFM * (Dv + 1) : sV + kBBN * ldv);
  float* sdS = sP + kFM * kLDS;
  float* sLse = sdS + kFM * kLDS;
  float* sDelta = sLse + kFM;
  int* sT = reinterpret_cast<int*>(sDelta + kFM);
  int* sAny = sT + kBBN;
  const int ldo = Dv + 1;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const T* qg = static_cast<const T*>(p.q);
  const T* dog = static_cast<const T*>(p.dout);
  const T* og = static_cast<const T*>(p.o);
  const T* kg = static_cast<const T*>(p.k) + x.b * p.k_sb + x.hk * p.k_sh;
  const T* vg = static_cast<const T*>(p.v) + x.b * p.v_sb + x.hk * p.v_sh;
  const float kNegInf = -std::numeric_limits<float>::infinity();

  for (int e = tid; e < kFM * Dk; e += kThreads) {
    const int r = e / Dk, c = e - r * Dk;
    sQ[r * ldk + c] = r < x.nrows ? to_float(qg[(x.row0 + r * x.rstride) * p.Dk + c]) : 0.f;
    sdQ[r * ldk + c] = 0.f;
  }
  for (int e = tid; e < kFM * Dv; e += kThreads) {
    const int r = e / Dv, c = e - r * Dv;
    sdO[r * ldo + c] = r < x.nrows ? to_float(dog[(x.row0 + r * x.rstride) * p.Dv + c]) : 0.f;
  }
  // delta_r = sum_c dO[r,c] * O[r,c] (O as stored), lse_r; warp w: rows w, w + 8
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = warp + 8 * i;
    float d = 0.f;
    if (r < x.nrows) {
      const T* orow = og + (x.row0 + r * x.rstride) * p.Dv;
      const T* drow = dog + (x.row0 + r * x.rstride) * p.Dv;
      for (int c = lane; c < Dv; c += 32) d = fmaf(to_float(drow[c]), to_float(orow[c]), d);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(kFullMask, d, o);
    if (lane == 0) {
      sDelta[r] = d;
      sLse[r] = r < x.nrows ? p.lse_in[x.row0 + r * x.rstride] : kNegInf;
    }
  }

  const int tr = tid / kBBN, tn = tid % kBBN;  // this thread's (row, key) in the score tile
  for (int64_t j0 = 0; j0 < x.nkeys; j0 += kBBN) {
    int live = 0;
    if (tid < kBBN) {
      const int t = j0 + tid < x.nkeys ? key_pos(p, x, j0 + tid) : -1;
      sT[tid] = t;
      sAny[tid] = 0;
      live = t >= 0;
    }
    if (!__syncthreads_or(live)) continue;
    for (int e = tid; e < kBBN * Dk; e += kThreads) {
      const int n = e / Dk, c = e - n * Dk, t = sT[n];
      sK[n * ldk + c] = t >= 0 ? to_float(kg[t * p.k_st + c]) : 0.f;
    }
    if (!alias)
      for (int e = tid; e < kBBN * Dv; e += kThreads) {
        const int n = e / Dv, c = e - n * Dv, t = sT[n];
        sV[n * ldv + c] = t >= 0 ? to_float(vg[t * p.v_st + c]) : 0.f;
      }
    __syncthreads();
    {
      const float lse = sLse[tr];
      float pr = 0.f, ds = 0.f;
      if (tr < x.nrows && lse != kNegInf && row_sees(p, x, tr, sT[tn])) {
        float s = 0.f, dp = 0.f;
        for (int d = 0; d < Dk; ++d) s = fmaf(sQ[tr * ldk + d], sK[tn * ldk + d], s);
        for (int d = 0; d < Dv; ++d) dp = fmaf(sdO[tr * ldo + d], sV[tn * ldv + d], dp);
        pr = __expf(s * p.scale - lse);
        ds = pr * (dp - sDelta[tr]) * p.scale;  // dS, with the softmax scale folded in
        sAny[tn] = 1;
      }
      sP[tr * kLDS + tn] = pr;
      sdS[tr * kLDS + tn] = ds;
    }
    __syncthreads();
    for (int e = tid; e < kFM * Dk; e += kThreads) {  // dQ += dS K
      const int r = e / Dk, c = e - r * Dk;
      float a = 0.f;
#pragma unroll
      for (int n = 0; n < kBBN; ++n) a = fmaf(sdS[r * kLDS + n], sK[n * ldk + c], a);
      sdQ[r * ldk + c] += a;
    }
    float* dkb = p.dk_ws + (x.b * p.T * p.Hkv + x.hk) * p.Dk;
    float* dvb = p.dv_ws + (x.b * p.T * p.Hkv + x.hk) * p.Dv;
    for (int e = tid; e < kBBN * Dk; e += kThreads) {  // dK[t] += dS^T Q
      const int n = e / Dk, c = e - n * Dk;
      if (!sAny[n]) continue;
      float a = 0.f;
#pragma unroll
      for (int r = 0; r < kFM; ++r) a = fmaf(sdS[r * kLDS + n], sQ[r * ldk + c], a);
      atomicAdd(dkb + int64_t(sT[n]) * p.Hkv * p.Dk + c, a);
    }
    for (int e = tid; e < kBBN * Dv; e += kThreads) {  // dV[t] += P^T dO
      const int n = e / Dv, c = e - n * Dv;
      if (!sAny[n]) continue;
      float a = 0.f;
#pragma unroll
      for (int r = 0; r < kFM; ++r) a = fmaf(sP[r * kLDS + n], sdO[r * ldo + c], a);
      atomicAdd(dvb + int64_t(sT[n]) * p.Hkv * p.Dv + c, a);
    }
    __syncthreads();
  }
  T* dqg = static_cast<T*>(p.dq);
  for (int e = tid; e < x.nrows * Dk; e += kThreads) {
    const int r = e / Dk, c = e - r * Dk;
    dqg[(x.row0 + r * x.rstride) * p.Dk + c] = from_float<T>(sdQ[r * ldk + c]);
  }
}

// ---------------------------------------------------------------- host --

int64_t smem_optin() {
  return static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin);
}

// Raises the dynamic shared memory limit of a kernel to the device's maximum,
// once per kernel and device (cudaFuncSetAttribute is per device context).
template <auto Kernel>
void allow_max_smem() {
  static std::atomic<uint64_t> done{0};
  const uint64_t bit = uint64_t(1) << (c10::cuda::current_device() & 63);
  if (!(done.load() & bit)) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem_optin())));
    done.fetch_or(bit);
  }
}

template <auto Kernel>
void launch(const AttnParams& p, int64_t units, int64_t ychunks, int64_t smem, cudaStream_t stream) {
  allow_max_smem<Kernel>();
  TORCH_CHECK(units < (int64_t(1) << 31), "attention (CUDA): too many work units (", units, ")");
  Kernel<<<dim3(static_cast<unsigned>(units), static_cast<unsigned>(ychunks)), kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

struct Problem {
  AttnParams p{};
  at::Tensor q_start;  // int64 copy (kept alive for the launch)
  const char* op;
  int64_t need_rows;   // G (sparse) or block_size (block)
  int64_t units_per_chunk;  // units without the row-chunk factor
};

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

Problem make_problem(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                     bool causal, const c10::optional<at::Tensor>& q_start) {
  Problem pr;
  pr.op = op;
  AttnParams& p = pr.p;
  p.q = q.const_data_ptr();
  p.k = k.const_data_ptr();
  p.v = v.const_data_ptr();
  p.B = q.size(0), p.S = q.size(1), p.Hq = q.size(2), p.Dk = q.size(3);
  p.T = k.size(1), p.Hkv = k.size(2), p.Dv = v.size(3);
  p.G = p.Hq / p.Hkv;
  p.k_sb = k.stride(0), p.k_st = k.stride(1), p.k_sh = k.stride(2);
  p.v_sb = v.stride(0), p.v_st = v.stride(1), p.v_sh = v.stride(2);
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  if (q_start.has_value()) pr.q_start = q_start->to(q.device(), at::kLong).contiguous();
  p.q_start = pr.q_start.defined() ? pr.q_start.const_data_ptr<int64_t>() : nullptr;
  // const pointers: data_ptr() would materialise a lazily cloned storage
  p.alias = p.v == p.k && p.v_sb == p.k_sb && p.v_st == p.k_st && p.v_sh == p.k_sh && p.Dv <= p.Dk;
  p.vec_q = aligned16(p.q) && p.Dk % 8 == 0;
  // a size-1 dimension is only indexed at 0: its stride never enters an address
  const auto ok8 = [](int64_t size, int64_t stride) { return size == 1 || stride % 8 == 0; };
  p.vec_k = aligned16(p.k) && ok8(p.B, p.k_sb) && ok8(p.T, p.k_st) && ok8(p.Hkv, p.k_sh);
  p.vec_v = aligned16(p.v) && ok8(p.B, p.v_sb) && ok8(p.T, p.v_st) && ok8(p.Hkv, p.v_sh);
  return pr;
}

void set_sparse(Problem& pr, const at::Tensor& indices) {
  pr.p.sparse = 1;
  pr.p.indices = indices.const_data_ptr<int32_t>();
  pr.p.topk = indices.size(2);
  pr.need_rows = pr.p.G;
  pr.units_per_chunk = pr.p.B * pr.p.S * pr.p.Hkv;
}

void set_block(Problem& pr, const at::Tensor& num, const at::Tensor& idx, int64_t block_size) {
  pr.p.sparse = 0;
  pr.p.kv_num = num.const_data_ptr<int32_t>();
  pr.p.kv_idx = idx.const_data_ptr<int32_t>();
  pr.p.W = idx.size(3);
  pr.p.bs = block_size;
  pr.p.Qb = num.size(2);
  pr.need_rows = block_size;
  pr.units_per_chunk = pr.p.B * pr.p.Hq * pr.p.Qb;
}

void too_big(const Problem& pr, int64_t need) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, pr.op, " (CUDA): head dims Dk=", pr.p.Dk, ", Dv=", pr.p.Dv,
                              (pr.p.alias ? " (v aliasing k)" : ""), " need ", need,
                              " bytes of shared memory per block, over this GPU's ", smem_optin());
}

template <typename T, int MT>
void launch_mma(Problem& pr, int dvc, int64_t smem, cudaStream_t stream) {
  AttnParams& p = pr.p;
  p.M = 16 * MT;
  p.n_chunks = ceil_div(pr.need_rows, p.M);
  const int64_t units = pr.units_per_chunk * p.n_chunks;
  if (dvc == 128)
    launch<fwd_mma<T, MT, 128>>(p, units, std::max<int64_t>(1, ceil_div(p.Dv, 128)), smem, stream);
  else
    launch<fwd_mma<T, MT, 512>>(p, units, std::max<int64_t>(1, ceil_div(p.Dv, 512)), smem, stream);
}

template <typename T>
void forward_typed(Problem& pr, cudaStream_t stream) {
  AttnParams& p = pr.p;
  const int64_t cap = smem_optin();
  if constexpr (std::is_same_v<T, float>) {
    const int64_t smem = simt_fwd_smem(p.Dk, p.Dv, p.alias);
    if (smem > cap) too_big(pr, smem);
    p.M = kFM;
    p.n_chunks = ceil_div(pr.need_rows, p.M);
    launch<fwd_simt<float>>(p, pr.units_per_chunk * p.n_chunks, std::max<int64_t>(1, ceil_div(p.Dv, kFDV)), smem,
                            stream);
  } else {
    const int dvc = p.Dv <= 128 ? 128 : 512;
    int mt = pr.need_rows <= 16 ? 1 : 4;
    int64_t smem = mma_smem(mt, dvc, p.Dk, p.alias).total;
    if (smem > cap && mt == 4) {  // fewer rows per block before giving up
      mt = 1;
      smem = mma_smem(mt, dvc, p.Dk, p.alias).total;
    }
    if (smem > cap) too_big(pr, smem);
    if (mt == 1)
      launch_mma<T, 1>(pr, dvc, smem, stream);
    else
      launch_mma<T, 4>(pr, dvc, smem, stream);
  }
}

std::tuple<at::Tensor, at::Tensor> forward(Problem& pr, const at::Tensor& q) {
  AttnParams& p = pr.p;
  at::Tensor out = at::empty({p.B, p.S, p.Hq, p.Dv}, q.options());
  at::Tensor lse = at::empty({p.B, p.S, p.Hq}, q.options().dtype(at::kFloat));
  if (p.B * p.S * p.Hq == 0) return {out, lse};
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  switch (q.scalar_type()) {
    case at::kFloat: forward_typed<float>(pr, stream); break;
    case at::kHalf: forward_typed<__half>(pr, stream); break;
    case at::kBFloat16: forward_typed<__nv_bfloat16>(pr, stream); break;
    default: TORCH_CHECK_TYPE(false, pr.op, ": q must be fp32, fp16 or bf16, got ", q.scalar_type());
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(Problem& pr, const at::Tensor& dout, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& out, const at::Tensor& lse) {
  AttnParams& p = pr.p;
  const at::Tensor dout_c = dout.contiguous(), out_c = out.contiguous(), lse_c = lse.contiguous();
  at::Tensor dq = at::empty_like(q, at::MemoryFormat::Contiguous);
  at::Tensor dk_ws = at::zeros(k.sizes(), k.options().dtype(at::kFloat));
  at::Tensor dv_ws = at::zeros(v.sizes(), v.options().dtype(at::kFloat));
  if (p.B * p.S * p.Hq > 0) {
    at::globalContext().alertNotDeterministic(pr.op);  // dk/dv: fp32 atomicAdd, order varies run to run
    p.dout = dout_c.const_data_ptr();
    p.o = out_c.const_data_ptr();
    p.lse_in = lse_c.const_data_ptr<float>();
    p.dq = dq.data_ptr();
    p.dk_ws = dk_ws.data_ptr<float>();
    p.dv_ws = dv_ws.data_ptr<float>();
    const int64_t smem = simt_bwd_smem(p.Dk, p.Dv, p.alias);
    if (smem > smem_optin()) too_big(pr, smem);
    p.M = kFM;
    p.n_chunks = ceil_div(pr.need_rows, p.M);
    const int64_t units = pr.units_per_chunk * p.n_chunks;
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    switch (q.scalar_type()) {
      case at::kFloat: launch<bwd_simt<float>>(p, units, 1, smem, stream); break;
      case at::kHalf: launch<bwd_simt<__half>>(p, units, 1, smem, stream); break;
      case at::kBFloat16: launch<bwd_simt<__nv_bfloat16>>(p, units, 1, smem, stream); break;
      default: TORCH_CHECK_TYPE(false, pr.op, ": q must be fp32, fp16 or bf16, got ", q.scalar_type());
    }
  }
  // dk/dv: new tensors of k's / v's shape and dtype (contiguous), whatever their strides
  at::Tensor dk = k.scalar_type() == at::kFloat ? dk_ws : dk_ws.to(k.scalar_type());
  at::Tensor dv = v.scalar_type() == at::kFloat ? dv_ws : dv_ws.to(v.scalar_type());
  return {dq, dk, dv};
}

// ------------------------------------------------------------------ ops --

std::tuple<at::Tensor, at::Tensor> sparse_attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& indices, double scale, bool causal,
                                                        const c10::optional<at::Tensor>& q_start) {
  check_attention_qkv(q, k, v);
  check_sparse_indices(q, indices);
  check_q_start(q_start, q.size(0), q.device());
  const c10::cuda::CUDAGuard guard(q.device());
  Problem pr = make_problem("sparse_attention_fwd", q, k, v, scale, causal, q_start);
  set_sparse(pr, indices);
  return forward(pr, q);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attention_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& indices,
    const at::Tensor& out, const at::Tensor& lse, double scale, bool causal,
    const c10::optional<at::Tensor>& q_start) {
  check_attention_qkv(q, k, v);
  check_sparse_indices(q, indices);
  check_attention_grads(dout, q, v, out, lse);
  check_q_start(q_start, q.size(0), q.device());
  const c10::cuda::CUDAGuard guard(q.device());
  Problem pr = make_problem("sparse_attention_bwd", q, k, v, scale, causal, q_start);
  set_sparse(pr, indices);
  return backward(pr, dout, q, k, v, out, lse);
}

std::tuple<at::Tensor, at::Tensor> block_sparse_attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, const at::Tensor& kv_num_blocks,
                                                              const at::Tensor& kv_indices, int64_t block_size,
                                                              double scale, bool causal,
                                                              const c10::optional<at::Tensor>& q_start) {
  check_attention_qkv(q, k, v);
  block_size = check_block_mask(q, k, kv_num_blocks, kv_indices, block_size);
  check_q_start(q_start, q.size(0), q.device());
  const c10::cuda::CUDAGuard guard(q.device());
  Problem pr = make_problem("block_sparse_attention_fwd", q, k, v, scale, causal, q_start);
  set_block(pr, kv_num_blocks, kv_indices, block_size);
  return forward(pr, q);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_sparse_attention_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& kv_num_blocks, const at::Tensor& kv_indices, const at::Tensor& out, const at::Tensor& lse,
    int64_t block_size, double scale, bool causal, const c10::optional<at::Tensor>& q_start) {
  check_attention_qkv(q, k, v);
  block_size = check_block_mask(q, k, kv_num_blocks, kv_indices, block_size);
  check_attention_grads(dout, q, v, out, lse);
  check_q_start(q_start, q.size(0), q.device());
  const c10::cuda::CUDAGuard guard(q.device());
  Problem pr = make_problem("block_sparse_attention_bwd", q, k, v, scale, causal, q_start);
  set_block(pr, kv_num_blocks, kv_indices, block_size);
  return backward(pr, dout, q, k, v, out, lse);
}

}  // namespace
}  // namespace cuda
}  // namespace glm5

TORCH_LIBRARY_IMPL(glm5, CUDA, m) {
  m.impl("sparse_attention_fwd", &glm5::cuda::sparse_attention_fwd);
  m.impl("sparse_attention_bwd", &glm5::cuda::sparse_attention_bwd);
  m.impl("block_sparse_attention_fwd", &glm5::cuda::block_sparse_attention_fwd);
  m.impl("block_sparse_attention_bwd", &glm5::cuda::block_sparse_attention_bwd);
}
