// block_topk_mask on the CPU: the block-level predictor (MoBA mean pooling or
// Quest min/max bounds) and the per-row selection, in FlexAttention's layout.
//
// Pooling and the [B,H,Qb,Kb] block scores are ATen ops (a reduction and a
// batched matmul over block means: Qb*Kb*D per head, a few percent of the
// attention the mask saves at any useful density); the selection is one
// pass per (b, h, query block) row: mandatory sink/local blocks, then the
// topk_blocks best-scoring allowed others (ties: lower block index), written
// ascending and padded with 0. Semantics: glm5_ops/reference.py block_topk_mask.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "checks.h"

namespace glm5 {
namespace cpu {
namespace {

// x [B,N,H,D] -> per-block reduction over rows [B,ceil(N/bs),H,D] (the last block partial).
at::Tensor pool_blocks(const at::Tensor& x, int64_t bs, const char* how) {
  bs = std::max<int64_t>(1, std::min(bs, x.size(1)));  // one block of N rows either way: pad no further
  const int64_t N = x.size(1), nb = (N + bs - 1) / bs, pad = nb * bs - N;
  const std::string mode(how);
  if (mode == "mean") {
    at::Tensor sums = at::constant_pad_nd(x, {0, 0, 0, 0, 0, pad}, 0).view({x.size(0), nb, bs, x.size(2), x.size(3)}).sum(2);
    at::Tensor counts = at::clamp_max(N - at::arange(nb, x.options()) * bs, bs);
    return sums / counts.view({1, nb, 1, 1});
  }
  const double fill = mode == "max" ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity();
  at::Tensor padded = at::constant_pad_nd(x, {0, 0, 0, 0, 0, pad}, fill).view({x.size(0), nb, bs, x.size(2), x.size(3)});
  return mode == "max" ? std::get<0>(padded.max(2)) : std::get<0>(padded.min(2));
}

// kv-head pooled keys [B,Kb,Hkv,D] -> one per query head [B,H,Kb,D].
at::Tensor per_query_head(const at::Tensor& kb, int64_t G) {
  return kb.repeat_interleave(G, 2).permute({0, 2, 1, 3});
}

std::tuple<at::Tensor, at::Tensor> block_topk_mask_cpu(const at::Tensor& q, const at::Tensor& k, int64_t block_size,
                                                       int64_t topk_blocks, bool causal, int64_t sink_blocks,
                                                       int64_t local_blocks, c10::string_view pooling,
                                                       const c10::optional<at::Tensor>& q_start) {
  const int64_t bs = check_block_topk_args(q, k, block_size, topk_blocks, sink_blocks, local_blocks, pooling);
  check_q_start(q_start, q.size(0), q.device());
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), T = k.size(1), G = H / k.size(2);
  const int64_t Qb = (S + bs - 1) / bs, Kb = (T + bs - 1) / bs;
  const int64_t width = block_topk_width(Kb, topk_blocks, sink_blocks, local_blocks);
  const at::Tensor qf = q.to(at::kFloat), kf = k.to(at::kFloat);
  const at::Tensor qbar = pool_blocks(qf, bs, "mean").permute({0, 2, 1, 3});  // [B,H,Qb,D]
  at::Tensor score;                                                         // [B,H,Qb,Kb]
  if (pooling == "mean") {
    score = at::matmul(qbar, per_query_head(pool_blocks(kf, bs, "mean"), G).transpose(2, 3));
  } else {  // Quest: sum_d max(q_d * kmin_d, q_d * kmax_d)
    score = at::matmul(qbar.clamp_min(0), per_query_head(pool_blocks(kf, bs, "max"), G).transpose(2, 3)) +
            at::matmul(qbar.clamp_max(0), per_query_head(pool_blocks(kf, bs, "min"), G).transpose(2, 3));
  }
  score = score.contiguous();
  std::vector<int64_t> qs(B, T - S);
  if (q_start.has_value()) {
    const at::Tensor h = q_start->to(at::kCPU, at::kLong).contiguous();
    std::copy(h.const_data_ptr<int64_t>(), h.const_data_ptr<int64_t>() + B, qs.begin());
  }
  at::Tensor num = at::empty({B, H, Qb}, q.options().dtype(at::kInt));
  at::Tensor idx = at::zeros({B, H, Qb, width}, q.options().dtype(at::kInt));
  const float* sp = score.const_data_ptr<float>();
  int32_t* np = num.data_ptr<int32_t>();
  int32_t* ip = idx.data_ptr<int32_t>();

  at::parallel_for(0, B * H * Qb, 16, [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> cand;
    std::vector<char> chosen(Kb);
    for (int64_t row = lo; row < hi; ++row) {
      const int64_t i = row % Qb, b = row / (H * Qb);
      const int64_t last = qs[b] + std::min((i + 1) * bs, S) - 1;  // absolute position of the block's last query
      const int64_t diag = std::min(last >= 0 ? last / bs : -1, Kb - 1);  // floor division; -1: nothing allowed
      const int64_t allowed_end = causal ? diag + 1 : Kb;               // blocks [0, allowed_end)
      std::fill(chosen.begin(), chosen.end(), 0);
      cand.clear();
      for (int64_t j = 0; j < std::max<int64_t>(allowed_end, 0); ++j) {
        const bool mandatory = j < sink_blocks || (j <= diag && j > diag - local_blocks);
        if (mandatory) chosen[j] = 1; else cand.push_back(j);
      }
      const float* sr = sp + row * Kb;
      const int64_t take = std::min<int64_t>(topk_blocks, cand.size());
      std::partial_sort(cand.begin(), cand.begin() + take, cand.end(), [&](int64_t a, int64_t c) {
        return sr[a] > sr[c] || (sr[a] == sr[c] && a < c);
      });
      for (int64_t e = 0; e < take; ++e) chosen[cand[e]] = 1;
      int32_t n = 0;
      for (int64_t j = 0; j < Kb; ++j)
        if (chosen[j]) ip[row * width + n++] = static_cast<int32_t>(j);
      np[row] = n;
    }
  });
  return {num, idx};
}

}  // namespace

TORCH_LIBRARY_IMPL(glm5, CPU, m) { m.impl("block_topk_mask", &block_topk_mask_cpu); }

}  // namespace cpu
}  // namespace glm5
