// Block-sparse attention on the CPU (FlexAttention block-mask layout),
// forward and backward.
//
// One work item is one (b, query head h, query block i): its M <= block_size
// queries against the key blocks kv_indices[b,h,i,:kv_num_blocks[b,h,i]],
// FlashAttention-2 style: key sub-tiles of kTile rows, online softmax in fp32,
// nothing of size T per query. The queries of the block play the part the
// heads play in sparse_attention.cpp: the score tile is [key][Mp] (Mp = M
// rounded up to the vector width), computed by tiles::dots_t from the block's
// transposed, scaled Q, so each key element is broadcast once per vector of
// queries. Causality is token-level: inside a tile that crosses the
// diagonal, scores of keys after a query's position are set to -inf; tiles
// entirely in the future of the block's last query are skipped.
//
// Backward recomputes P from lse; dQ is owned by the item, dK/dV go to
// per-worker buffers (attention_common.h), as in sparse_attention.cpp.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/attention_common.h"
#include "cpu/attention_tiles.h"
#include "cpu/lane_tiles.h"
#include "cpu/parallel.h"

namespace glm5 {
namespace cpu {
namespace {

using tiles::Vec;
constexpr int64_t kTile = 64;  // keys per sub-tile

struct BlockProblem {
  const AttentionInputs& in;
  const int32_t *num, *idx;  // [B,Hq,Qb], [B,Hq,Qb,W]
  int64_t bs, Qb, Wd;
  bool causal;
};

// The entries the kernel will read: a direct torch.ops call bypasses the
// Python API's checks, and a negative block or a count past W would read
// outside k, v or kv_indices. One pass over the mask, negligible beside the
// attention. (The CUDA kernel skips such entries instead: checking there
// would cost a device-to-host sync per call.)
void check_mask_entries(const BlockProblem& P) {
  const int64_t rows = P.in.B * P.in.Hq * P.Qb, Qk = (P.in.T + P.bs - 1) / P.bs;
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t n = P.num[row];
    TORCH_CHECK_VALUE(n >= 0 && n <= P.Wd, "kv_num_blocks entries must be in [0, maxKV=", P.Wd, "], got ", n);
    for (int64_t e = 0; e < n; ++e) {
      const int64_t j = P.idx[row * P.Wd + e];
      TORCH_CHECK_VALUE(j >= 0 && j < Qk, "kv_indices: the first kv_num_blocks entries of each row must be key blocks in [0, ",
                        Qk, "), got ", j);
    }
  }
}

// The backward's buffers (the forward's are lanes::LaneState).
struct Scratch {
  int64_t Mp;
  std::vector<const float*> krows, vrows;
  std::vector<float*> dkrows, dvrows;
  // qt: scale * Q^T [Dk][Mp]; dot: dO^T [Dv][Mp]; s, dp: [kTile][Mp]; dqb: dQ [M][Dk]
  std::vector<float> qt, dot, s, dp, lse, delta, dqb;
  Scratch(const AttentionInputs& in, int64_t bs)
      : Mp((bs + tiles::W - 1) / tiles::W * tiles::W), krows(kTile), vrows(kTile), dkrows(kTile), dvrows(kTile),
        qt(in.Dk * Mp), dot(in.Dv * Mp), s(kTile * Mp), dp(kTile * Mp), lse(Mp), delta(Mp), dqb(bs * in.Dk) {}
};

// Prefetches the query rows of `item` (b, h, query block), one head's slice
// of each row, Hq*Dk apart: fetched on demand they stall the transposition.
void prefetch_queries(const BlockProblem& P, int64_t item) {
  const AttentionInputs& in = P.in;
  if (item >= in.B * in.Hq * P.Qb) return;
  const int64_t i = item % P.Qb, h = (item / P.Qb) % in.Hq, b = item / (P.Qb * in.Hq);
  for (int64_t s = i * P.bs; s < std::min(in.S, (i + 1) * P.bs); ++s) tiles::prefetch_row(in.qrow(b, s, h), in.Dk);
}

// Calls tile(t0, nt) for each key sub-tile of item (b, h, i) that some of
// its queries may see; `first` is the absolute position of the block's first query.
template <typename Tile>
void for_each_tile(const BlockProblem& P, int64_t b, int64_t h, int64_t i, int64_t first, int64_t M, Tile tile) {
  const AttentionInputs& in = P.in;
  const int64_t row = (b * in.Hq + h) * P.Qb + i;
  const int64_t last = first + M - 1;
  for (int64_t e = 0; e < P.num[row]; ++e) {
    const int64_t j = P.idx[row * P.Wd + e];
    const int64_t end = std::min(in.T, (j + 1) * P.bs);
    if (e + 1 < P.num[row]) {  // the next key block's rows, while this one computes
      const int64_t next = P.idx[row * P.Wd + e + 1] * P.bs;
      lanes::prefetch_positions(in, b, h / in.G, next, std::min(in.T, next + P.bs));
    }
    for (int64_t t0 = j * P.bs; t0 < end; t0 += kTile) {
      if (P.causal && t0 > last) break;
      const int64_t nt = std::min(kTile, end - t0);
      tile(t0, nt, P.causal && t0 + nt - 1 > first);  // diagonal: some query misses some key
    }
  }
}

std::tuple<at::Tensor, at::Tensor> block_sparse_attention_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_num_blocks,
    const at::Tensor& kv_indices, int64_t block_size, double scale, bool causal,
    const c10::optional<at::Tensor>& q_start) {
  check_attention_qkv(q, k, v);
  block_size = check_block_mask(q, k, kv_num_blocks, kv_indices, block_size);
  check_q_start(q_start, q.size(0), q.device());
  const AttentionInputs in(q, k, v, q_start);
  const BlockProblem P{in, kv_num_blocks.const_data_ptr<int32_t>(), kv_indices.const_data_ptr<int32_t>(), block_size,
                       kv_num_blocks.size(2), kv_indices.size(3), causal};
  check_mask_entries(P);
  const int64_t Dk = in.Dk, Dv = in.Dv;
  at::Tensor out = at::empty({in.B, in.S, in.Hq, Dv}, q.options().dtype(at::kFloat));
  at::Tensor lse = at::empty({in.B, in.S, in.Hq}, q.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();

  const int64_t workers = at::get_num_threads();  // a worker's next item is usually `workers` further on
  struct FwdScratch {
    lanes::LaneState st;
    std::vector<const float*> krows, vrows;
    FwdScratch(const AttentionInputs& in, int64_t bs) : st(bs, in.Dk, in.Dv, kTile), krows(kTile), vrows(kTile) {}
  };
  parallel_dynamic(in.B * in.Hq * P.Qb, [&] { return FwdScratch(in, block_size); }, [&](int64_t item, FwdScratch& sc) {
    const int64_t i = item % P.Qb, h = (item / P.Qb) % in.Hq, b = item / (P.Qb * in.Hq);
    const int64_t s0 = i * block_size, M = std::min(block_size, in.S - s0), g = h / in.G;
    const int64_t first = in.q_start[b] + s0;
    prefetch_queries(P, item + workers);
    sc.st.begin(in.qrow(b, s0, h), in.Hq * Dk, M, Dk, static_cast<float>(scale));
    for_each_tile(P, b, h, i, first, M, [&](int64_t t0, int64_t nt, bool diagonal) {
      for (int64_t j = 0; j < nt; ++j) sc.krows[j] = in.krow(b, t0 + j, g), sc.vrows[j] = in.vrow(b, t0 + j, g);
      const int64_t off = first - t0, Mp = sc.st.Mp;
      lanes::attend_tile(sc.st, M, sc.krows.data(), sc.vrows.data(), nt, Dk, Dv, diagonal, off, [&](float* s) {
        if (diagonal) lanes::mask_future(s, Mp, nt, off);
        return diagonal;
      });
    });
    const int64_t row0 = (b * in.S + s0) * in.Hq + h;  // query r is row0 + r * Hq
    sc.st.finish(M, Dv, op + row0 * Dv, in.Hq * Dv, lp + row0, in.Hq);
  });
  return {to_dtype(out, q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_sparse_attention_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& kv_num_blocks, const at::Tensor& kv_indices, const at::Tensor& out, const at::Tensor& lse,
    int64_t block_size, double scale, bool causal, const c10::optional<at::Tensor>& q_start) {
  check_attention_qkv(q, k, v);
  block_size = check_block_mask(q, k, kv_num_blocks, kv_indices, block_size);
  check_q_start(q_start, q.size(0), q.device());
  check_attention_grads(dout, q, v, out, lse);
  const AttentionInputs in(q, k, v, q_start);
  const BlockProblem P{in, kv_num_blocks.const_data_ptr<int32_t>(), kv_indices.const_data_ptr<int32_t>(), block_size,
                       kv_num_blocks.size(2), kv_indices.size(3), causal};
  check_mask_entries(P);
  const int64_t Dk = in.Dk, Dv = in.Dv, items = in.B * in.Hq * P.Qb;
  const at::Tensor do32 = dout.to(at::kFloat).contiguous(), o32 = out.to(at::kFloat).contiguous();
  const at::Tensor lse_c = lse.contiguous();
  at::Tensor dq = at::empty({in.B, in.S, in.Hq, Dk}, q.options().dtype(at::kFloat));
  const float *dop = do32.const_data_ptr<float>(), *oo = o32.const_data_ptr<float>();
  const float* lp = lse_c.const_data_ptr<float>();
  float* dqp = dq.data_ptr<float>();
  const float sc_f = static_cast<float>(scale);
  KVGradBuffers grads(in, items);

  struct BwdScratch : Scratch {
    float *dk, *dv;
    BwdScratch(const AttentionInputs& in, int64_t bs, KVGradBuffers& g, int64_t w) : Scratch(in, bs) {
      std::tie(dk, dv) = g.claim(w);
    }
  };
  parallel_strided(items, [&](int64_t w) { return BwdScratch(in, block_size, grads, w); }, [&](int64_t item, BwdScratch& sc) {
    const int64_t i = item % P.Qb, h = (item / P.Qb) % in.Hq, b = item / (P.Qb * in.Hq);
    const int64_t s0 = i * block_size, M = std::min(block_size, in.S - s0), g = h / in.G;
    const int64_t first = in.q_start[b] + s0, Mp = sc.Mp, ld_q = in.Hq * Dk, ld_o = in.Hq * Dv;
    const int64_t row0 = (b * in.S + s0) * in.Hq + h;  // (b, s0, h); query r is row0 + r * Hq
    const float* q_rows = in.qrow(b, s0, h);
    const float* do_rows = dop + row0 * Dv;
    tiles::transpose_rows(q_rows, ld_q, M, Dk, sc_f, Mp, sc.qt.data());
    tiles::transpose_rows(do_rows, ld_o, M, Dv, 1.f, Mp, sc.dot.data());
    std::fill(sc.lse.begin(), sc.lse.end(), 0.f);
    std::fill(sc.delta.begin(), sc.delta.end(), 0.f);
    for (int64_t r = 0; r < M; ++r) {
      const int64_t row = row0 + r * in.Hq;
      sc.delta[r] = dot(dop + row * Dv, oo + row * Dv, Dv);
      sc.lse[r] = std::isfinite(lp[row]) ? lp[row] : 0.f;  // an empty row has only -inf scores: p = 0
    }
    std::fill(sc.dqb.begin(), sc.dqb.end(), 0.f);
    for_each_tile(P, b, h, i, first, M, [&](int64_t t0, int64_t nt, bool diagonal) {
      for (int64_t j = 0; j < nt; ++j) {
        sc.krows[j] = in.krow(b, t0 + j, g), sc.vrows[j] = in.vrow(b, t0 + j, g);
        const int64_t r = (b * in.T + t0 + j) * in.Hkv + g;
        sc.dkrows[j] = sc.dk + r * Dk, sc.dvrows[j] = sc.dv + r * Dv;
      }
      tiles::dots_t(sc.qt.data(), Mp, Mp, sc.krows.data(), nt, Dk, sc.s.data(), Mp);
      if (diagonal) lanes::mask_future(sc.s.data(), Mp, nt, first - t0);
      tiles::dots_t(sc.dot.data(), Mp, Mp, sc.vrows.data(), nt, Dv, sc.dp.data(), Mp);
      for (int64_t j = 0; j < nt; ++j)
        for (int64_t r = 0; r < Mp; r += tiles::W) {
          float *s = sc.s.data() + j * Mp + r, *dp = sc.dp.data() + j * Mp + r;
          const Vec p = tiles::exp_masked(Vec::loadu(s) - Vec::loadu(sc.lse.data() + r));
          p.store(s);
          (p * (Vec::loadu(dp) - Vec::loadu(sc.delta.data() + r))).store(dp);
        }
      tiles::gather(sc.dp.data(), 1, Mp, M, sc.krows.data(), nt, Dk, sc.dqb.data(), Dk);
      tiles::scatter(sc.dp.data(), 1, Mp, M, q_rows, ld_q, nt, Dk, sc.dkrows.data());
      tiles::scatter(sc.s.data(), 1, Mp, M, do_rows, ld_o, nt, Dv, sc.dvrows.data());
    });
    for (int64_t r = 0; r < M; ++r)
      for (int64_t d = 0; d < Dk; ++d) dqp[(row0 + r * in.Hq) * Dk + d] = sc.dqb[r * Dk + d] * sc_f;
  });
  auto [dk, dv] = grads.sum();
  dk.mul_(sc_f);
  return {to_dtype(dq, q.scalar_type()), to_dtype(dk, k.scalar_type()), to_dtype(dv, v.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(glm5, CPU, m) {
  m.impl("block_sparse_attention_fwd", &block_sparse_attention_fwd_cpu);
  m.impl("block_sparse_attention_bwd", &block_sparse_attention_bwd_cpu);
}

}  // namespace cpu
}  // namespace glm5
