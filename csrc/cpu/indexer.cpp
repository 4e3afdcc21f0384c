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
#include <memory>

#include "checks.h"
#include "cpu/indexer_decode.h"
#include "cpu/parallel.h"
#include "cpu/radix_select.h"

namespace glm5 {
namespace cpu {
namespace {

constexpr int64_t kKeyChunk = 512;    // keys per tile
constexpr int64_t kTileRows = 256;    // query-head rows per tile (Sb * H)
// At most this many queries in a block: indexer_decode's scores instead of
// an sgemm (measured: bench/RESULTS.md, "indexer at decode").
constexpr int64_t kDecodeQueries = 4;

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
  p.q_start.assign(p.B, p.T - p.S);
  if (q_start.has_value()) {
    const at::Tensor qs = q_start->to(at::kCPU, at::kLong).contiguous();
    std::copy(qs.const_data_ptr<int64_t>(), qs.const_data_ptr<int64_t>() + p.B, p.q_start.begin());
  }
  p.q = in.q.const_data_ptr<float>();
  p.w = in.w.const_data_ptr<float>();
  p.k = in.k.const_data_ptr<float>();
  return p;
}

// Scores of queries [s0, s1) of batch b against keys [t0, t1) into
// dst[(s - s0) * dst_stride + (t - t0)], -inf where causally masked.
// `logits` is scratch for the [(s1-s0)*H, t1-t0] per-head product.
void score_tile(const IndexerProblem& p, int64_t b, int64_t s0, int64_t s1, int64_t t0, int64_t t1, float* logits,
                float* dst, int64_t dst_stride) {
  const int64_t rows = (s1 - s0) * p.H, cols = t1 - t0;
  if (s1 - s0 <= kDecodeQueries && indexer_decode::kAvailable && p.D <= indexer_decode::kMaxDim) {
    // Few queries (decode): no GEMM, whose packing of the key chunk costs more than the product.
    for (int64_t s = s0; s < s1; ++s) {
      float* out = dst + (s - s0) * dst_stride;
      indexer_decode::scores(p.q + (b * p.S + s) * p.H * p.D, p.w + (b * p.S + s) * p.H, p.H, p.D,
                             p.k + (b * p.T + t0) * p.D, cols, out);
      const int64_t first_masked = std::max<int64_t>(p.last_visible(b, s) + 1 - t0, 0);
      for (int64_t t = first_masked; t < cols; ++t) out[t] = -std::numeric_limits<float>::infinity();
    }
    return;
  }
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

// Per-thread scratch of the streaming top-k: the score tile and, per query of
// the block, a candidate buffer holding the kept top-k plus room for two key
// chunks. When the next chunk would not fit, the buffer shrinks back to the
// top-k and its floor (the k-th key) rises: later keys must beat it to enter.
// Sized for the queries a block really has (decode: 1, not queries_per_block)
// and left uninitialised (every slot is written before it is read): zero-filled
// vectors for 32 queries were ~1.8 MB of page faults and memset per call, which
// made a decode step's indexer_topk 6x its scores' time (bench/RESULTS.md).
struct StreamScratch {
  int64_t topk, cap;
  std::unique_ptr<float[]> logits, scores;
  std::unique_ptr<uint32_t[]> keys, kept_keys;
  std::unique_ptr<int32_t[]> idx, kept_idx;
  std::vector<int64_t> count;
  std::vector<uint32_t> floor_key;
  StreamScratch(const IndexerProblem& p, int64_t topk_)
      : topk(topk_), cap(2 * topk_ + 2 * kKeyChunk) {
    const int64_t rows = std::min(p.queries_per_block(), p.S);
    logits.reset(new float[rows * p.H * kKeyChunk]);
    scores.reset(new float[rows * kKeyChunk]);
    keys.reset(new uint32_t[rows * cap]);
    idx.reset(new int32_t[rows * cap]);
    kept_keys.reset(new uint32_t[topk_]);
    kept_idx.reset(new int32_t[topk_]);
    count.resize(rows);
    floor_key.resize(rows);
  }
  uint32_t* keys_of(int64_t i) { return keys.get() + i * cap; }
  int32_t* idx_of(int64_t i) { return idx.get() + i * cap; }
};

// Streams keys [t_begin, t_end) of batch b past queries [s0, s1), leaving each
// query's best candidates (a superset of its top-k over that range) in sc.
void stream_topk(const IndexerProblem& p, int64_t b, int64_t s0, int64_t s1, int64_t t_begin, int64_t t_end,
                 StreamScratch& sc) {
  std::fill(sc.count.begin(), sc.count.end(), 0);
  std::fill(sc.floor_key.begin(), sc.floor_key.end(), 0u);
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kKeyChunk) {
    const int64_t t1 = std::min(t0 + kKeyChunk, t_end);
    score_tile(p, b, s0, s1, t0, t1, sc.logits.get(), sc.scores.get(), kKeyChunk);
    for (int64_t i = 0; i < s1 - s0; ++i) {
      uint32_t* kq = sc.keys_of(i);
      int32_t* iq = sc.idx_of(i);
      int64_t& n = sc.count[i];
      if (n + (t1 - t0) > sc.cap) {
        n = radix_select(kq, iq, n, sc.topk, sc.kept_idx.get(), sc.kept_keys.get());
        std::copy(sc.kept_keys.get(), sc.kept_keys.get() + n, kq);
        std::copy(sc.kept_idx.get(), sc.kept_idx.get() + n, iq);
        if (n == sc.topk) sc.floor_key[i] = *std::min_element(kq, kq + n);
      }
      const uint32_t floor = sc.floor_key[i];
      const float* sr = sc.scores.get() + i * kKeyChunk;
      for (int64_t t = 0; t < t1 - t0; ++t) {  // branch-free append of keys above the floor
        const uint32_t key = radix_key(sr[t]);
        kq[n] = key;
        iq[n] = static_cast<int32_t>(t0 + t);
        n += key > floor;
      }
    }
  }
}

// With fewer query blocks than threads (decode: S = 1), the key range of each
// block is split so every thread has work; the splits' candidates are merged.
int64_t key_splits(const IndexerProblem& p, int64_t tasks) {
  const int64_t threads = at::get_num_threads();
  if (tasks >= threads) return 1;
  const int64_t chunks = (p.T + kKeyChunk - 1) / kKeyChunk;
  return std::max<int64_t>(1, std::min(threads / tasks, chunks / 4));
}

// Split `part` of `parts` of keys [0, t_end), on chunk boundaries.
std::pair<int64_t, int64_t> split_range(int64_t t_end, int64_t part, int64_t parts) {
  const int64_t chunks = (t_end + kKeyChunk - 1) / kKeyChunk;
  const int64_t c0 = chunks * part / parts, c1 = chunks * (part + 1) / parts;
  return {std::min(c0 * kKeyChunk, t_end), std::min(c1 * kKeyChunk, t_end)};
}

}  // namespace

at::Tensor indexer_scores(const at::Tensor& q, const at::Tensor& w, const at::Tensor& k, bool causal,
                          const c10::optional<at::Tensor>& q_start) {
  check_indexer_args(q, w, k, q_start);
  const Fp32Inputs in(q, w, k);
  const IndexerProblem p = make_problem(in, causal, q_start);
  at::Tensor out = at::empty({p.B, p.S, p.T}, q.options().dtype(at::kFloat));
  const int64_t qpb = p.queries_per_block(), nqb = (p.S + qpb - 1) / qpb;
  const int64_t nkc = (p.T + kKeyChunk - 1) / kKeyChunk;
  float* out_ptr = out.data_ptr<float>();
  // One work item per (query block, key chunk): decode-shaped calls use every thread too.
  // The tile scratch sized for the rows a block really has, uninitialised (see StreamScratch).
  const int64_t tile_floats = std::min(qpb, p.S) * p.H * kKeyChunk;
  parallel_dynamic(
      p.B * nqb * nkc, [&] { return std::unique_ptr<float[]>(new float[tile_floats]); },
      [&](int64_t item, std::unique_ptr<float[]>& logits) {
        const int64_t task = item / nkc, t0 = (item % nkc) * kKeyChunk, t1 = std::min(t0 + kKeyChunk, p.T);
        const int64_t b = task / nqb, s0 = (task % nqb) * qpb, s1 = std::min(s0 + qpb, p.S);
        const int64_t live_end = std::min(t1, p.key_end(b, s1));  // keys past every query of the block: -inf
        float* dst = out_ptr + (b * p.S + s0) * p.T + t0;
        if (t0 < live_end) score_tile(p, b, s0, s1, t0, live_end, logits.get(), dst, p.T);
        for (int64_t s = s0; s < s1; ++s) {
          float* row = dst + (s - s0) * p.T;
          std::fill(row + std::max<int64_t>(0, live_end - t0), row + (t1 - t0), -std::numeric_limits<float>::infinity());
        }
      });
  return out;
}

at::Tensor indexer_topk(const at::Tensor& q, const at::Tensor& w, const at::Tensor& k, int64_t topk, bool causal,
                        const c10::optional<at::Tensor>& q_start) {
  check_indexer_args(q, w, k, q_start);
  check_topk_count(topk, k.size(1), "topk");
  const Fp32Inputs in(q, w, k);
  const IndexerProblem p = make_problem(in, causal, q_start);
  at::Tensor out = at::empty({p.B, p.S, topk}, q.options().dtype(at::kInt));
  if (out.numel() == 0) return out;  // no queries: key_splits would divide by zero tasks
  const int64_t qpb = p.queries_per_block(), nqb = (p.S + qpb - 1) / qpb, tasks = p.B * nqb;
  const int64_t splits = key_splits(p, tasks);
  int32_t* out_ptr = out.data_ptr<int32_t>();
  if (splits == 1) {
    // Later query blocks see more keys (causal): hand them out first, dynamically.
    parallel_dynamic(tasks, [&] { return StreamScratch(p, topk); }, [&](int64_t item, StreamScratch& sc) {
      const int64_t task = tasks - 1 - item;
      const int64_t b = task / nqb, s0 = (task % nqb) * qpb, s1 = std::min(s0 + qpb, p.S);
      stream_topk(p, b, s0, s1, 0, p.key_end(b, s1), sc);
      for (int64_t s = s0; s < s1; ++s) {
        int32_t* dst = out_ptr + (b * p.S + s) * topk;
        const int64_t got = radix_select(sc.keys_of(s - s0), sc.idx_of(s - s0), sc.count[s - s0], topk, dst);
        std::fill(dst + got, dst + topk, -1);
      }
    });
    return out;
  }
  // Few queries (tasks * splits <= threads, so S is small): each split keeps
  // its own top-k of its key range, then one select over the splits' union.
  const int64_t qrows = std::min(qpb, p.S);   // queries a block really has (uninitialised: written before read)
  std::unique_ptr<uint32_t[]> part_keys(new uint32_t[tasks * splits * qrows * topk]);
  std::unique_ptr<int32_t[]> part_idx(new int32_t[tasks * splits * qrows * topk]);
  std::vector<int64_t> part_count(tasks * splits * qrows, 0);
  parallel_dynamic(tasks * splits, [&] { return StreamScratch(p, topk); }, [&](int64_t item, StreamScratch& sc) {
    const int64_t task = item / splits, b = task / nqb, s0 = (task % nqb) * qpb, s1 = std::min(s0 + qpb, p.S);
    const auto [t0, t1] = split_range(p.key_end(b, s1), item % splits, splits);
    stream_topk(p, b, s0, s1, t0, t1, sc);
    for (int64_t i = 0; i < s1 - s0; ++i) {
      const int64_t slot = item * qrows + i;
      part_count[slot] = radix_select(sc.keys_of(i), sc.idx_of(i), sc.count[i], topk, part_idx.get() + slot * topk,
                                      part_keys.get() + slot * topk);
    }
  });
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<uint32_t[]> keys(new uint32_t[splits * topk]);
    std::unique_ptr<int32_t[]> idx(new int32_t[splits * topk]);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / nqb, s0 = (task % nqb) * qpb, s1 = std::min(s0 + qpb, p.S);
      for (int64_t i = 0; i < s1 - s0; ++i) {
        int64_t n = 0;
        for (int64_t part = 0; part < splits; ++part) {
          const int64_t slot = (task * splits + part) * qrows + i;
          std::copy_n(part_keys.get() + slot * topk, part_count[slot], keys.get() + n);
          std::copy_n(part_idx.get() + slot * topk, part_count[slot], idx.get() + n);
          n += part_count[slot];
        }
        int32_t* dst = out_ptr + (b * p.S + s0 + i) * topk;
        const int64_t got = radix_select(keys.get(), idx.get(), n, topk, dst);
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
