// The DSA lightning indexer on the CPU:
//   score[b,s,t] = sum_h w[b,s,h] * relu(q[b,s,h,:] . k[b,t,:])
// A block of queries (all their heads: Sb*H rows) is multiplied against a key
// chunk with one sgemm into a cache-sized tile; relu and the head weights are
// applied while the tile is hot and only the head-reduced [Sb, Tc] scores
// survive, so no [S,H,T] tensor ever exists. indexer_topk goes further: it
// streams key chunks through a running top-k per query (candidates above the
// current k-th key), so its memory is O(S*topk), never O(S*T). Key chunks that
// are entirely in every query's causal future are skipped.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>

#include "cpu/checks.h"
#include "cpu/radix_select.h"

namespace glm5 {
namespace cpu {
namespace {

constexpr int64_t kKeyChunk = 512;    // keys per tile
constexpr int64_t kTileRows = 256;    // query-head rows per tile (Sb * H)

struct IndexerProblem {
  int64_t B, S, H, D, T;
  bool causal;
  std::vector<int64_t> q_start;  // per batch element; last key visible to query s is q_start + s
  const float* q;  // [B,S,H,D]
  const float* w;  // [B,S,H]
  const float* k;  // [B,T,D]
  int64_t queries_per_block() const { return std::max<int64_t>(1, kTileRows / H); }
  // One past the last key any of queries [s0, s1) may see.
  int64_t key_end(int64_t b, int64_t s1) const {
    if (!causal) return T;
    return std::clamp<int64_t>(q_start[b] + s1, 0, T);
  }
  int64_t last_visible(int64_t b, int64_t s) const {
    return causal ? q_start[b] + s : T;  // T: nothing masked (and no overflow)
  }
};

// Converts the inputs to contiguous fp32 once (a no-op for fp32 inputs) and
// keeps them alive while the raw pointers are in use.
struct Fp32Inputs {
  at::Tensor q, w, k;
  Fp32Inputs(const at::Tensor& q_, const at::Tensor& w_, const at::Tensor& k_)
      : q(q_.to(at::kFloat).contiguous()), w(w_.to(at::kFloat).contiguous()), k(k_.to(at::kFloat).contiguous()) {}
};

IndexerProblem make_problem(const Fp32Inputs& in, bool causal, const c10::optional<at::Tensor>& q_start) {
  const auto& q = in.q;
  IndexerProblem p{q.size(0), q.size(1), q.size(2), q.size(3), in.k.size(1), causal, {}, nullptr, nullptr, nullptr};
  TORCH_CHECK(in.w.dim() == 3 && in.w.size(0) == p.B && in.w.size(1) == p.S && in.w.size(2) == p.H,
              "w must have shape [B,S,H] = [", p.B, ",", p.S, ",", p.H, "], got ", in.w.sizes());
  TORCH_CHECK(in.k.size(0) == p.B && in.k.size(2) == p.D, "k must have shape [B,T,D] = [", p.B, ",T,", p.D,
              "], got ", in.k.sizes());
  p.q_start.assign(p.B, p.T - p.S);
  if (q_start.has_value()) {
    TORCH_CHECK(q_start->dim() == 1 && q_start->size(0) == p.B, "q_start must have shape [B] = [", p.B, "], got ",
                q_start->sizes());
    const at::Tensor qs = q_start->to(at::kCPU, at::kLong).contiguous();
    std::copy(qs.const_data_ptr<int64_t>(), qs.const_data_ptr<int64_t>() + p.B, p.q_start.begin());
  }
  p.q = in.q.const_data_ptr<float>();
  p.w = in.w.const_data_ptr<float>();
  p.k = in.k.const_data_ptr<float>();
  return p;
}

void check_inputs(const at::Tensor& q, const at::Tensor& w, const at::Tensor& k) {
  GLM5_CHECK_RANK(q, 4, "q", "[B,S,H,D]");
  GLM5_CHECK_RANK(w, 3, "w", "[B,S,H]");
  GLM5_CHECK_RANK(k, 3, "k", "[B,T,D]");
  GLM5_CHECK_FLOAT(q, "q");
  GLM5_CHECK_FLOAT(w, "w");
  GLM5_CHECK_FLOAT(k, "k");
}

// Scores of queries [s0, s1) of batch b against keys [t0, t1) into
// dst[(s - s0) * dst_stride + (t - t0)], -inf where causally masked.
// `logits` is scratch for the [(s1-s0)*H, t1-t0] per-head product.
void score_tile(const IndexerProblem& p, int64_t b, int64_t s0, int64_t s1, int64_t t0, int64_t t1, float* logits,
                float* dst, int64_t dst_stride) {
  const int64_t rows = (s1 - s0) * p.H, cols = t1 - t0;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor qb = at::from_blob(const_cast<float*>(p.q + (b * p.S + s0) * p.H * p.D), {rows, p.D}, f32);
  at::Tensor kc = at::from_blob(const_cast<float*>(p.k + (b * p.T + t0) * p.D), {cols, p.D}, f32);
  at::Tensor lg = at::from_blob(logits, {rows, cols}, f32);
  at::mm_out(lg, qb, kc.t());
  for (int64_t s = s0; s < s1; ++s) {
    float* out = dst + (s - s0) * dst_stride;
    const float* wr = p.w + (b * p.S + s) * p.H;
    const float* lr = logits + (s - s0) * p.H * cols;
    for (int64_t t = 0; t < cols; ++t) out[t] = wr[0] * std::max(lr[t], 0.f);
    for (int64_t h = 1; h < p.H; ++h) {
      const float wh = wr[h];
      const float* l = lr + h * cols;
      for (int64_t t = 0; t < cols; ++t) out[t] += wh * std::max(l[t], 0.f);
    }
    // Causal: keys after the query's own position are -inf.
    const int64_t first_masked = std::max<int64_t>(p.last_visible(b, s) + 1 - t0, 0);
    for (int64_t t = first_masked; t < cols; ++t) out[t] = -std::numeric_limits<float>::infinity();
  }
}

// Running top-k of one query: candidates whose key beats the current k-th.
struct RunningTopk {
  int64_t count = 0;
  uint32_t floor_key = 0;  // keys at or below it can no longer enter
};

}  // namespace

at::Tensor indexer_scores(const at::Tensor& q, const at::Tensor& w, const at::Tensor& k, bool causal,
                          const c10::optional<at::Tensor>& q_start) {
  check_inputs(q, w, k);
  const Fp32Inputs in(q, w, k);
  const IndexerProblem p = make_problem(in, causal, q_start);
  at::Tensor out = at::empty({p.B, p.S, p.T}, q.options().dtype(at::kFloat));
  const int64_t qpb = p.queries_per_block(), nqb = (p.S + qpb - 1) / qpb;
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, p.B * nqb, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> logits(qpb * p.H * kKeyChunk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / nqb, s0 = (task % nqb) * qpb, s1 = std::min(s0 + qpb, p.S);
      const int64_t t_end = p.key_end(b, s1);
      float* dst = out_ptr + (b * p.S + s0) * p.T;
      for (int64_t t0 = 0; t0 < t_end; t0 += kKeyChunk)
        score_tile(p, b, s0, s1, t0, std::min(t0 + kKeyChunk, t_end), logits.data(), dst + t0, p.T);
      for (int64_t s = s0; s < s1; ++s)  // the skipped, fully masked chunks
        std::fill(dst + (s - s0) * p.T + t_end, dst + (s - s0 + 1) * p.T, -std::numeric_limits<float>::infinity());
    }
  });
  return out;
}

at::Tensor indexer_topk(const at::Tensor& q, const at::Tensor& w, const at::Tensor& k, int64_t topk, bool causal,
                        const c10::optional<at::Tensor>& q_start) {
  check_inputs(q, w, k);
  TORCH_CHECK(topk >= 1 && topk <= k.size(1), "topk must be in [1, T=", k.size(1), "], got ", topk);
  TORCH_CHECK(k.size(1) < (int64_t(1) << 31), "k: T must be < 2^31 for int32 indices, got ", k.size(1));
  const Fp32Inputs in(q, w, k);
  const IndexerProblem p = make_problem(in, causal, q_start);
  at::Tensor out = at::empty({p.B, p.S, topk}, q.options().dtype(at::kInt));
  const int64_t qpb = p.queries_per_block(), nqb = (p.S + qpb - 1) / qpb;
  // Candidate buffer per query: the kept top-k plus room for two chunks; when
  // the next chunk would not fit, shrink back to the top-k and raise the floor.
  const int64_t cap = 2 * topk + 2 * kKeyChunk;
  int32_t* out_ptr = out.data_ptr<int32_t>();
  at::parallel_for(0, p.B * nqb, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> logits(qpb * p.H * kKeyChunk), scores(qpb * kKeyChunk);
    std::vector<uint32_t> keys(qpb * cap), kept_keys(topk);
    std::vector<int32_t> idx(qpb * cap), kept_idx(topk);
    std::vector<RunningTopk> run(qpb);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / nqb, s0 = (task % nqb) * qpb, s1 = std::min(s0 + qpb, p.S);
      const int64_t t_end = p.key_end(b, s1);
      std::fill(run.begin(), run.end(), RunningTopk{});
      for (int64_t t0 = 0; t0 < t_end; t0 += kKeyChunk) {
        const int64_t t1 = std::min(t0 + kKeyChunk, t_end);
        score_tile(p, b, s0, s1, t0, t1, logits.data(), scores.data(), kKeyChunk);
        for (int64_t s = s0; s < s1; ++s) {
          RunningTopk& r = run[s - s0];
          uint32_t* kq = keys.data() + (s - s0) * cap;
          int32_t* iq = idx.data() + (s - s0) * cap;
          if (r.count + (t1 - t0) > cap) {  // shrink to the current top-k
            r.count = radix_select(kq, iq, r.count, topk, kept_idx.data(), kept_keys.data());
            std::copy(kept_keys.begin(), kept_keys.begin() + r.count, kq);
            std::copy(kept_idx.begin(), kept_idx.begin() + r.count, iq);
            if (r.count == topk) r.floor_key = *std::min_element(kq, kq + r.count);
          }
          const float* sr = scores.data() + (s - s0) * kKeyChunk;
          for (int64_t t = 0; t < t1 - t0; ++t) {
            const uint32_t key = radix_key(sr[t]);
            if (key > r.floor_key) {
              kq[r.count] = key;
              iq[r.count] = static_cast<int32_t>(t0 + t);
              ++r.count;
            }
          }
        }
      }
      for (int64_t s = s0; s < s1; ++s) {
        int32_t* dst = out_ptr + (b * p.S + s) * topk;
        const int64_t got = radix_select(keys.data() + (s - s0) * cap, idx.data() + (s - s0) * cap,
                                         run[s - s0].count, topk, dst);
        std::fill(dst + got, dst + topk, -1);
      }
    }
  });
  return out;
}

}  // namespace cpu
}  // namespace glm5

TORCH_LIBRARY_IMPL(glm5, CPU, m) {
  m.impl("indexer_scores", &glm5::cpu::indexer_scores);
  m.impl("indexer_topk", &glm5::cpu::indexer_topk);
}
