// FlashAttention-2 forward tiles with the queries as the vector lanes: the
// score tile is [key][Mp] (Mp = the block's M queries rounded up to the vector
// width), computed by tiles::dots_t from the block's transposed, scaled Q, so
// each key element is broadcast once per vector of queries, whichever head.
// Block-sparse attention runs every selected key block this way; token-level
// sparse attention runs query blocks whose selections are dense this way too,
// with a per-key bitmask of the queries that chose the key.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/attention_common.h"
#include "cpu/attention_tiles.h"

namespace glm5 {
namespace cpu {
namespace lanes {

using tiles::Vec;

// The running state of one (query block, head): scale * Q^T [Dk][Mp], the
// score tile [kTile][Mp], O [M][Dv], and the online softmax's m, l, alpha [Mp].
struct LaneState {
  int64_t Mp;
  std::vector<float> qt, s, o, m, l, alpha;
  LaneState(int64_t max_queries, int64_t Dk, int64_t Dv, int64_t kTile)
      : Mp((max_queries + tiles::W - 1) / tiles::W * tiles::W), qt(Dk * Mp), s(kTile * Mp), o(max_queries * Dv),
        m(Mp), l(Mp), alpha(Mp) {}

  // Starts a block: its M query rows (row stride ld) transposed into qt.
  void begin(const float* q_rows, int64_t ld, int64_t M, int64_t Dk, float scale) {
    tiles::transpose_rows(q_rows, ld, M, Dk, scale, Mp, qt.data());
    std::fill(o.begin(), o.end(), 0.f);
    std::fill(m.begin(), m.end(), kNegInf);
    std::fill(l.begin(), l.end(), 0.f);
  }
  // out row r (stride ld_out) = O / l and lse[r * ld_lse] = m + log l (-inf
  // and 0 for a query that saw no key).
  // 1/l and the lse are computed a vector of rows at a time (a scalar logf
  // per row cost ~2% of the block-sparse forward), into alpha and s.
  void finish(int64_t M, int64_t Dv, float* out, int64_t ld_out, float* lse, int64_t ld_lse) {
    const Vec zero(0.f), ninf(kNegInf);
    for (int64_t r = 0; r < Mp; r += tiles::W) {
      const Vec lv = Vec::loadu(l.data() + r), seen = lv > zero;
      Vec::blendv(zero, Vec(1.f) / lv, seen).store(alpha.data() + r);
      Vec::blendv(ninf, Vec::loadu(m.data() + r) + lv.log(), seen).store(s.data() + r);
    }
    for (int64_t r = 0; r < M; ++r) {
      const Vec inv(alpha[r]);
      const float* src = o.data() + r * Dv;
      float* dst = out + r * ld_out;
      int64_t d = 0;
      for (; d + tiles::W <= Dv; d += tiles::W) (Vec::loadu(src + d) * inv).store(dst + d);
      for (; d < Dv; ++d) dst[d] = src[d] * alpha[r];
      lse[r * ld_lse] = s[r];
    }
  }
};

// Prefetches the k and v rows of positions [t0, t1) of kv head g into L2
// while the current tile computes: a head's rows sit Hkv * D apart in the
// usual [B,T,Hkv,D] layout, too sparse for the hardware prefetcher.
inline void prefetch_positions(const AttentionInputs& in, int64_t b, int64_t g, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    tiles::prefetch_row(in.krow(b, t, g), in.Dk);
    tiles::prefetch_row(in.vrow(b, t, g), in.Dv);
  }
}

// On a tile that crosses the diagonal, the queries [r, r_end) see only keys
// j < keys_seen(...) of the tile (off = position of lane 0 - position of key
// 0): the products stop there, which skips the upper triangle at the
// granularity of a vector of queries (~30% of a diagonal tile). The scores
// left unwritten must be set to -inf by the tile's mask.
inline int64_t keys_seen(int64_t off, int64_t r_end, int64_t nt) { return std::clamp<int64_t>(off + r_end, 0, nt); }

// -inf at (key j, lane r < Mp) where key j lies after lane r's position
// (lane r sits at off + r keys from key 0; padding lanes continue the sequence).
inline void mask_future(float* s, int64_t Mp, int64_t nt, int64_t off) {
  for (int64_t j = 0; j < nt; ++j) {
    const int64_t r0 = std::clamp<int64_t>(j - off, 0, Mp);  // first lane that sees key j
    std::fill(s + j * Mp, s + j * Mp + r0, kNegInf);
  }
}

// -inf at (key j, lane r < Mp <= 64) where bit r of bits[j] is clear: the
// queries that did not select key j (padding lanes never did).
inline void mask_lanes(float* s, int64_t Mp, int64_t nt, const uint64_t* bits) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  for (int64_t j = 0; j < nt; ++j)
    for (int64_t r = 0; r < Mp; r += 16) {
      float* x = s + j * Mp + r;
      _mm512_storeu_ps(x, _mm512_mask_mov_ps(ninf, static_cast<__mmask16>(bits[j] >> r), _mm512_loadu_ps(x)));
    }
#else
  for (int64_t j = 0; j < nt; ++j)
    for (int64_t r = 0; r < Mp; ++r)
      if (!((bits[j] >> r) & 1)) s[j * Mp + r] = kNegInf;
#endif
}

// One key tile of nt rows for the block's M queries: S = (scale Q) K^T, the
// masking (mask(s) returns whether it set any -inf), the online softmax, and
// O = alpha * O + P V. On a diagonal tile (some key after lane 0's position;
// off as in keys_seen) each product works per vector of queries (dots_t: its
// widest step, two vectors) and stops at keys_seen; what it leaves unwritten
// the mask sets to -inf, so p = 0 there and it is never read.
template <typename Mask>
void attend_tile(LaneState& st, int64_t M, const float* const* krows, const float* const* vrows, int64_t nt,
                 int64_t Dk, int64_t Dv, bool diagonal, int64_t off, Mask mask) {
  const int64_t Mp = st.Mp;
  auto seen = [&](int64_t r_end) { return diagonal ? keys_seen(off, r_end, nt) : nt; };
  const int64_t step = diagonal ? tiles::W : Mp;
  for (int64_t r = 0; r < Mp; r += 2 * step) {
    const int64_t n = std::min(2 * step, Mp - r), N = seen(r + n);
    if (N > 0) tiles::dots_t(st.qt.data() + r, Mp, n, krows, N, Dk, st.s.data() + r, Mp);
  }
  const bool masked = mask(st.s.data());
  for (int64_t r = 0; r < Mp; r += step)
    tiles::online_softmax_cols(st.s.data() + r, Mp, seen(r + step), step, st.m.data() + r, st.l.data() + r,
                               st.alpha.data() + r, masked);
  // Rows that see no key of the tile (N = 0) have alpha = 1 (or O = 0).
  for (int64_t r = 0; r < M; r += step) {
    const int64_t n = std::min(step, M - r), N = seen(r + n);
    if (N > 0)
      tiles::gather(st.s.data() + r, 1, Mp, n, vrows, N, Dv, st.o.data() + r * Dv, Dv, st.alpha.data() + r);
  }
}

}  // namespace lanes
}  // namespace cpu
}  // namespace glm5
