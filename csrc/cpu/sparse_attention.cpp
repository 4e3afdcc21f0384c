// Token-level sparse attention (DSA) on the CPU, forward and backward.
//
// One query (b, s) is processed with all its heads: its selected keys are
// filtered once (-1 and causally future slots dropped), then for each kv head
// g the G = Hq/Hkv query heads that read it form the M rows of every product,
// so each selected key row is fetched once and serves all G heads (FlashMLA's
// sparse-prefill layout: MQA/MLA with G = 16..128 makes this compute-bound).
// Keys stream in tiles of kTile: S = Q K^T (scaled Q), online softmax,
// O += P V, all in fp32 through the register-blocked kernels of
// attention_tiles.h, which read k and v rows in place (no gather copy for
// fp32; v may alias k, as in MLA's absorbed form). Nothing of size T per
// query exists: scratch is O(G * kTile + G * D) per query of a work item.
// A work item (forward and backward) is a block of queries that sweep their
// selected keys together, chunk of positions by chunk (KeyBlocking), so rows
// chosen by several queries of the block are fetched from L3 once. Forward
// query blocks whose selections cover most of their span of keys run on lane
// tiles instead (lane blocks, lane_tiles.h).
//
// Backward recomputes P from the saved lse (FlashAttention-2):
//   dP = dO V^T, dS = P * (dP - rowsum(dO * O)), dQ = scale * dS K,
//   dK += dS^T (scale * Q), dV += P^T dO
// dQ is owned by the item; dK and dV go to per-worker buffers (attention_common.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/attention_common.h"
#include "cpu/attention_tiles.h"
#include "cpu/lane_costs.h"
#include "cpu/lane_tiles.h"
#include "cpu/parallel.h"

namespace glm5 {
namespace cpu {
namespace {

constexpr int64_t kTile = 64;  // selected keys per tile

// The contributing key positions of query (b, s), in slot order. Entries
// outside [-1, T) are refused here too (the Python API checks them first): a
// raw torch.ops call must not read, or bucket, outside k.
int64_t visible_keys(const int32_t* slots, int64_t topk, bool causal, int64_t pos, int64_t T, int32_t* keys) {
  // Branch-free compaction (every slot is written, the count advances on the
  // visible ones), one bounds check after: ~4x faster than a branch per slot
  // on random selections, where it cost ~5% of a lane-tiled prefill chunk.
  const int64_t last = causal ? std::min(pos, T - 1) : T - 1;
  int64_t n = 0;
  int32_t top = -1, bottom = -1;
  for (int64_t j = 0; j < topk; ++j) {
    const int32_t t = slots[j];
    top = std::max(top, t);
    bottom = std::min(bottom, t);
    keys[n] = t;
    n += (t >= 0) & (t <= last);
  }
  TORCH_CHECK_VALUE(top < T && bottom >= -1, "indices entries must be -1 or key positions in [0, T=", T, "), got ",
                    top < T ? bottom : top);
  return n;
}

// Two layouts for the [G heads x kTile keys] score tile. Few heads (MHA,
// small GQA groups): rows per head, S = Q K^T by dot products (tiles::dots).
// Many heads (G >= one vector: MQA/MLA): [key][Gp] with Gp = G rounded up to
// the vector width, computed vectorised across heads from a transposed Q
// (tiles::dots_t), which needs no horizontal sums. Element (h, j) of the tile
// sits at h * wi + j * wj either way, which is all the products need.
// A head group of a split query (HeadSplit) keeps its kv head's layout with
// its own G; by_key groups of at most W/2 heads take the half-width products.
struct Layout {
  bool by_key;
  int64_t G, Gp;
  explicit Layout(int64_t G_) : Layout(G_, G_ >= tiles::W) {}
  Layout(int64_t G_, bool by_key_)
      : by_key(by_key_), G(G_), Gp(by_key ? (G_ + tiles::W - 1) / tiles::W * tiles::W : G_) {}
  int64_t wi() const { return by_key ? 1 : kTile; }
  int64_t wj() const { return by_key ? Gp : 1; }
  bool half() const { return by_key && tiles::kHalfDots && 2 * G <= tiles::W; }
};

struct Scratch {
  Layout lay;
  // keys: the visible keys of each query of the item, grouped by chunk
  // (bounds[i][c] the start of chunk c); unsorted, cursor: scratch
  std::vector<int32_t> keys, unsorted, bounds, cursor;
  std::vector<const float*> krows, vrows, next;
  std::vector<float*> dkrows, dvrows;
  // qs: scale * Q rows of one kv head, [G][Dk] (by_key: transposed [Dk][Gp], zero padded)
  // dot: dO the same way, [G][Dv] or [Dv][Gp]; s, dp: score tiles
  // o, m, l: running output rows [G][Dv], max and sum [Gp] of each of the item's queries
  // lse, delta: [Gp] per query (backward; padding heads 0)
  std::vector<float> qs, dot, s, dp, o, m, l, alpha, lse, delta;
  Scratch(const AttentionInputs& in, int64_t topk, int64_t queries = 1, int64_t chunks = 1)
      : lay(in.G), keys(topk * queries), unsorted(topk), bounds(queries * (chunks + 1)), cursor(chunks),
        krows(kTile), vrows(kTile), next(kTile), dkrows(kTile), dvrows(kTile), qs(lay.Gp * in.Dk, 0.f),
        dot(lay.Gp * in.Dv, 0.f), s(lay.Gp * kTile), dp(lay.Gp * kTile), o(queries * in.G * in.Dv),
        m(queries * lay.Gp), l(queries * lay.Gp), alpha(lay.Gp), lse(queries * lay.Gp, 0.f),
        delta(queries * lay.Gp, 0.f) {}

  // G rows of D values (row stride D) into buf, scaled, in this layout.
  // (lay: the query's, or a head group's of a split query.)
  void load_rows(const float* src, int64_t D, float scale, std::vector<float>& buf) const {
    load_rows(lay, src, D, scale, buf);
  }
  static void load_rows(const Layout& lay, const float* src, int64_t D, float scale, std::vector<float>& buf) {
    if (lay.by_key) return tiles::transpose_rows(src, D, lay.G, D, scale, lay.Gp, buf.data());
    for (int64_t i = 0; i < lay.G * D; ++i) buf[i] = src[i] * scale;
  }
  // scores[h, j] = sum_d A[h, d] * rows[j][d] for the tile's nt keys.
  void scores(const std::vector<float>& A, const float* const* rows, int64_t nt, int64_t D, float* out) const {
    scores(lay, A, rows, nt, D, out);
  }
  // next[0..n_next): rows to prefetch while computing (dots_t_half spreads them over its passes).
  static void scores(const Layout& lay, const std::vector<float>& A, const float* const* rows, int64_t nt, int64_t D,
                     float* out, const float* const* next = nullptr, int64_t n_next = 0) {
    if (lay.half())
      tiles::dots_t_half(A.data(), lay.Gp, rows, nt, D, out, lay.Gp, next, n_next);
    else if (lay.by_key)
      tiles::dots_t(A.data(), lay.Gp, lay.Gp, rows, nt, D, out, lay.Gp);
    else
      tiles::dots(A.data(), D, lay.G, rows, nt, D, out, kTile);
  }
};

// The blocking of both passes (see sparse_attention_fwd_cpu): chunks of 2^shift
// consecutive key positions (a power of two, so a key's chunk is a shift)
// whose rows for one kv head fill ~kChunkBytes, and blocks of `queries`
// queries whose running state (G output rows each) fills ~kStateBytes; the
// two together stay inside a 2 MiB L2. Keys that fit one chunk, or blocks of
// one query (decode, or state too large to share L2), fall back to a single
// chunk: one query per item, its rows prefetched from L3.
struct KeyBlocking {
  static constexpr int64_t kChunkBytes = 1 << 20, kStateBytes = 512 << 10, kMaxQueries = 64;
  int shift = 0;
  int64_t chunks = 1, queries = 1;
  explicit KeyBlocking(const AttentionInputs& in) {
    const bool v_in_k = in.vp == in.kp && in.vst == in.kst && in.vsh == in.ksh;
    const int64_t row_bytes = 4 * (in.Dk + (v_in_k ? 0 : in.Dv));
    while ((int64_t{2} << shift) * row_bytes <= kChunkBytes || (int64_t{1} << shift) < kTile) ++shift;
    chunks = (in.T + (int64_t{1} << shift) - 1) >> shift;
    if (chunks > 1) {  // at least 4 items per worker, for the dynamic balance
      const int64_t per_worker = (in.B * in.S + 4 * at::get_num_threads() - 1) / (4 * at::get_num_threads());
      queries = std::clamp<int64_t>(kStateBytes / (4 * in.G * in.Dv), 1, std::min(kMaxQueries, per_worker));
    }
    if (queries == 1) chunks = 1;
  }
  // keys[0..n) grouped by chunk into out (stable), bounds[c] = start of chunk c, bounds[chunks] = n.
  void group(const int32_t* keys, int64_t n, int32_t* out, int32_t* bounds, int32_t* cursor) const {
    std::fill(cursor, cursor + chunks, 0);
    for (int64_t j = 0; j < n; ++j) ++cursor[keys[j] >> shift];
    int32_t at = 0;
    for (int64_t c = 0; c < chunks; ++c) bounds[c] = at, at += cursor[c], cursor[c] = bounds[c];
    bounds[chunks] = at;
    for (int64_t j = 0; j < n; ++j) out[cursor[keys[j] >> shift]++] = keys[j];
  }
};

// The visible keys of queries s0 .. s0 + nq of batch b, each query's grouped
// by chunk: sc.keys[i * topk + ...], chunk c at [bounds[i][c], bounds[i][c + 1]).
// Queries marked in `done` (the forward's lane blocks) get no keys.
void group_block_keys(const AttentionInputs& in, const KeyBlocking& kb, const int32_t* idx, int64_t topk, bool causal,
                      int64_t b, int64_t s0, int64_t nq, Scratch& sc, const uint8_t* done = nullptr) {
  for (int64_t i = 0; i < nq; ++i) {
    int32_t *keys = sc.keys.data() + i * topk, *bounds = sc.bounds.data() + i * (kb.chunks + 1);
    const bool one_chunk = kb.chunks == 1;  // already in place: nothing to group
    const int64_t n = done && done[b * in.S + s0 + i]
                          ? 0
                          : visible_keys(idx + (b * in.S + s0 + i) * topk, topk, causal, in.q_start[b] + s0 + i,
                                         in.T, one_chunk ? keys : sc.unsorted.data());
    if (one_chunk)
      bounds[0] = 0, bounds[1] = static_cast<int32_t>(n);
    else
      kb.group(sc.unsorted.data(), n, keys, bounds, sc.cursor.data());
  }
}

// Calls run(i, keys, n) for each query i < nq of the block and its n > 0 keys
// in each chunk, chunk by chunk: the sweep that keeps a chunk's rows in L2.
template <typename Run>
void sweep_chunks(const KeyBlocking& kb, const Scratch& sc, int64_t topk, int64_t nq, Run run) {
  const int64_t C = kb.chunks;
  for (int64_t c = 0; c < C; ++c)
    for (int64_t i = 0; i < nq; ++i) {
      const int32_t* bounds = sc.bounds.data() + i * (C + 1);
      const int64_t n = bounds[c + 1] - bounds[c];
      if (n > 0) run(i, sc.keys.data() + i * topk + bounds[c], n);
    }
}

// Points krows/vrows at keys[t0, t0 + nt) of a run of n. With `prefetch`,
// asks for the run's next tile from L3 or DRAM: the one-chunk sweep. Chunked,
// most rows are L2 hits (fetched by an earlier query of the block), and a
// prefetch of each cost more than it hid (~4% slower). With `spread`, the
// next tile's k rows are only listed in sc.next (returned: how many) for the
// scores to prefetch as they compute (dots_t_half); else all asked for here.
int64_t set_tile(const AttentionInputs& in, int64_t b, int64_t g, const int32_t* keys, int64_t t0, int64_t nt,
                 int64_t n, bool prefetch, bool spread, Scratch& sc) {
  for (int64_t j = 0; j < nt; ++j) {
    sc.krows[j] = in.krow(b, keys[t0 + j], g);
    sc.vrows[j] = in.vrow(b, keys[t0 + j], g);
  }
  if (!prefetch) return 0;
  const int32_t* next = keys + t0 + nt;
  const int64_t n1 = std::min(kTile, n - t0 - nt);
  for (int64_t j = 0; j < n1; ++j) sc.next[j] = in.krow(b, next[j], g);
  const bool v_in_k = in.vp == in.kp && in.vst == in.kst && in.vsh == in.ksh;
  if (spread && v_in_k) return n1;
  tiles::prefetch_rows(sc.next.data(), n1, in.Dk);
  if (!v_in_k) {
    for (int64_t j = 0; j < n1; ++j) sc.next[j] = in.vrow(b, next[j], g);
    tiles::prefetch_rows(sc.next.data(), n1, in.Dv);
  }
  return 0;
}

// One tile of the online softmax for one query's heads: p written over sc.s,
// the running max m and sum l updated, and O = alpha * O + P V into o.
void attend_tile(Scratch& sc, const Layout& L, int64_t nt, int64_t Dv, float* o, float* m, float* l) {
  const float* alpha = nullptr;  // by_key: the rescaling rides on gather's load of O
  if (L.by_key) {
    // Token-level tiles hold visible keys only: no -inf scores.
    tiles::online_softmax_cols(sc.s.data(), L.Gp, nt, L.Gp, m, l, sc.alpha.data(), false);
    alpha = sc.alpha.data();
  } else {
    for (int64_t h = 0; h < L.G; ++h) tiles::online_softmax_row(sc.s.data() + h * kTile, nt, m[h], l[h], o + h * Dv, Dv);
  }
  tiles::gather(sc.s.data(), L.wi(), L.wj(), L.G, sc.vrows.data(), nt, Dv, o, Dv, alpha);
}

// Backward of the softmax on one tile of one query: p = exp(s - lse) over sc.s
// and ds = p * (dp - delta) over sc.dp, vectorised along the tile's rows.
void softmax_grad_tile(Scratch& sc, int64_t nt, const float* lse, const float* delta_h) {
  using tiles::Vec;
  const Layout& L = sc.lay;
  if (L.by_key) {  // rows are keys, lanes are heads (padding heads: p = 1, ds = 0)
    for (int64_t j = 0; j < nt; ++j)
      for (int64_t h = 0; h < L.Gp; h += tiles::W) {
        float *s = sc.s.data() + j * L.Gp + h, *dp = sc.dp.data() + j * L.Gp + h;
        const Vec p = tiles::exp_masked(Vec::loadu(s) - Vec::loadu(lse + h));
        p.store(s);
        (p * (Vec::loadu(dp) - Vec::loadu(delta_h + h))).store(dp);
      }
    return;
  }
  for (int64_t h = 0; h < L.G; ++h) {
    float *s = sc.s.data() + h * kTile, *dp = sc.dp.data() + h * kTile;
    tiles::exp_shifted(s, nt, lse[h]);
    const Vec delta(delta_h[h]);
    for (int64_t j = 0; j < nt; j += tiles::W) {
      const int64_t c = std::min<int64_t>(tiles::W, nt - j);
      (tiles::load(s + j, c) * (tiles::load(dp + j, c) - delta)).store(dp + j, c);
    }
  }
}

// Decode (one query, or fewer query blocks than threads) left threads idle:
// all of a query's heads sat in one work item. HeadSplit then cuts each block's
// heads into `pieces` groups, one work item each, all reading the same
// selected rows (the second reader finds them in L3). A group's products give
// each head exactly what the whole kv head's would: every head is its own FMA
// chain (one lane of dots_t / dots_t2 / dots_t_half, one row of dots and
// gather) and its own online softmax lane or row, whichever heads share the
// tile. So a head's output and lse are bit-identical split or not, and a
// request served alone gets the tokens it gets in a busy batch (where enough
// blocks exist and nothing splits). Groups are built from units of heads
// within a kv head: W/2 for the by_key layout with AVX-512's half-width
// products, W for by_key without them (a shorter group would pad its vector
// and save nothing), one head for the row layout.
struct HeadSplit {
  static constexpr double kMinFlops = 1 << 20;  // per block: below this, waking a thread costs more than it saves
  int64_t G, unit, units_per_g, units, pieces = 1;
  HeadSplit(const AttentionInputs& in, const Layout& lay, int64_t blocks, int64_t keys_per_block)
      : G(in.G), unit(!lay.by_key ? 1 : tiles::kHalfDots ? tiles::W / 2 : tiles::W),
        units_per_g((in.G + unit - 1) / unit), units(in.Hkv * units_per_g) {
    const int64_t threads = at::get_num_threads();
    const double flops = 2.0 * keys_per_block * in.Hq * (in.Dk + in.Dv);
    if (blocks < threads && flops >= kMinFlops) pieces = std::min(units, (threads + blocks - 1) / blocks);
  }
  // Calls run(g, h0, h1) for each kv head g that piece p touches, with the
  // heads [h0, h1) of g's G it covers; piece 0 of 1 is every head of every g.
  template <typename Run>
  void each_group(int64_t p, Run run) const {
    const int64_t u0 = p * units / pieces, u1 = (p + 1) * units / pieces;
    for (int64_t g = u0 / units_per_g; g * units_per_g < u1; ++g) {
      const int64_t first = std::max<int64_t>(u0 - g * units_per_g, 0);
      const int64_t last = std::min(u1 - g * units_per_g, units_per_g);
      run(g, first * unit, std::min(last * unit, G));
    }
  }
};

// Lane blocks: where the queries of a block of consecutive queries chose
// most of the keys in their span (prefill at a context a few times topk:
// DSA at 8K tokens and top-2048 selects 25-100% of the visible keys), the
// forward runs them as block-sparse attention does, the queries as the vector
// lanes over every key of the span, with a bitmask per key of the queries
// that chose it (lanes::mask_lanes). That reads each key row once per block
// and head instead of once per query, so it wins where the gathered path is
// bound by fetching rows (few heads per kv head, G). A block goes to lane
// tiles when the fraction of its span's (query, key) pairs it selected is
// above the gathered path's measured rate relative to lane tiles for its G:
// lane_costs::lane_min_density (lane_costs.h, also read by the model's plan).
constexpr int64_t kLaneQueries = 64;  // queries per lane block: one uint64_t of lanes per key

double lane_min_density(const AttentionInputs& in) { return lane_costs::lane_min_density(in.G, in.S); }

// A query block that runs on lane tiles: queries s0 .. s0 + M of batch b,
// the span [lo, hi] of keys they chose, and bit r of bits[t - lo] set when
// query r chose key t.
struct LaneBlock {
  int64_t b = 0, s0 = 0, M = 0, lo = 0, hi = -1;
  std::vector<uint64_t> bits;
};

// Whether block (b, s0, M) selected at least min_density of its span (see
// lane_min_density); if so fills blk and marks its queries done. keys: M * topk ints of scratch.
bool plan_lane_block(const AttentionInputs& in, double min_density, const int32_t* idx, int64_t topk, bool causal,
                     int64_t b, int64_t s0, int64_t M, std::vector<int32_t>& keys, LaneBlock& blk, uint8_t* done) {
  const int64_t first = in.q_start[b] + s0;
  int64_t lo = in.T, hi = -1, selected = 0, count[kLaneQueries];
  for (int64_t r = 0; r < M; ++r) {
    const int32_t* kr = keys.data() + r * topk;
    count[r] = visible_keys(idx + (b * in.S + s0 + r) * topk, topk, causal, first + r, in.T, keys.data() + r * topk);
    for (int64_t j = 0; j < count[r]; ++j) lo = std::min<int64_t>(lo, kr[j]), hi = std::max<int64_t>(hi, kr[j]);
    selected += count[r];
  }
  if (selected == 0) return false;
  // The pairs lane tiles compute: every lane of the block's vectors (padding
  // included) against the keys of the span it can see.
  const int64_t Mp = (M + tiles::W - 1) / tiles::W * tiles::W;
  double span_pairs = 0;
  for (int64_t r = 0; r < Mp; ++r)
    span_pairs += causal ? std::clamp<int64_t>(first + r - lo + 1, 0, hi - lo + 1) : hi - lo + 1;
  if (selected < min_density * span_pairs) return false;
  blk.bits.assign(hi - lo + 1, 0);
  for (int64_t r = 0; r < M; ++r) {
    const int32_t* kr = keys.data() + r * topk;
    for (int64_t j = 0; j < count[r]; ++j) {
      uint64_t& word = blk.bits[kr[j] - lo];
      // A key listed twice counts twice on the gathered path (like the
      // reference); a bit cannot, so such a block stays gathered.
      if (word >> r & 1) return blk.bits.clear(), false;
      word |= uint64_t{1} << r;
    }
  }
  blk.b = b, blk.s0 = s0, blk.M = M, blk.lo = lo, blk.hi = hi;
  std::fill(done + b * in.S + s0, done + b * in.S + s0 + M, uint8_t{1});
  return true;
}

struct LaneScratch {
  lanes::LaneState st;
  std::vector<const float*> krows, vrows;
  explicit LaneScratch(const AttentionInputs& in)
      : st(kLaneQueries, in.Dk, in.Dv, kTile), krows(kTile), vrows(kTile) {}
};

// Query head h of a lane block, FlashAttention-2 over the span's key tiles.
void run_lane_head(const AttentionInputs& in, const LaneBlock& blk, int64_t h, bool causal, float scale,
                   LaneScratch& sc, float* op, float* lp) {
  const int64_t b = blk.b, s0 = blk.s0, M = blk.M, g = h / in.G, first = in.q_start[b] + s0, Mp = sc.st.Mp;
  sc.st.begin(in.qrow(b, s0, h), in.Hq * in.Dk, M, in.Dk, scale);
  for (int64_t t0 = blk.lo; t0 <= blk.hi; t0 += kTile) {
    const int64_t nt = std::min(kTile, blk.hi + 1 - t0);
    const uint64_t* bits = blk.bits.data() + (t0 - blk.lo);
    uint64_t any = 0;
    for (int64_t j = 0; j < nt; ++j) any |= bits[j];
    if (!any) continue;
    for (int64_t j = 0; j < nt; ++j) sc.krows[j] = in.krow(b, t0 + j, g), sc.vrows[j] = in.vrow(b, t0 + j, g);
    lanes::prefetch_positions(in, b, g, t0 + kTile, std::min(blk.hi + 1, t0 + 2 * kTile));  // the next tile
    // Selections hold no future key, so the diagonal's triangle is skipped as in block-sparse.
    const bool diagonal = causal && t0 + nt - 1 > first;
    lanes::attend_tile(sc.st, M, sc.krows.data(), sc.vrows.data(), nt, in.Dk, in.Dv, diagonal, first - t0,
                       [&](float* s) {
                         lanes::mask_lanes(s, Mp, nt, bits);
                         return true;
                       });
  }
  const int64_t row0 = (b * in.S + s0) * in.Hq + h;  // query r is row0 + r * Hq
  sc.st.finish(M, in.Dv, op + row0 * in.Dv, in.Hq * in.Dv, lp + row0, in.Hq);
}

// Plans the lane blocks, runs them, and returns done: the queries they covered.
std::vector<uint8_t> run_lane_blocks(const AttentionInputs& in, const int32_t* idx, int64_t topk, bool causal,
                                     float scale, float* op, float* lp) {
  std::vector<uint8_t> done(in.B * in.S, 0);
  const double min_density = lane_min_density(in);
  if (min_density > 1.0) return done;
  const int64_t per_batch = (in.S + kLaneQueries - 1) / kLaneQueries;
  std::vector<LaneBlock> blocks(in.B * per_batch);
  parallel_dynamic(in.B * per_batch, [&] { return std::vector<int32_t>(kLaneQueries * topk); }, [&](int64_t item, auto& keys) {
    const int64_t b = item / per_batch, s0 = item % per_batch * kLaneQueries;
    plan_lane_block(in, min_density, idx, topk, causal, b, s0, std::min(kLaneQueries, in.S - s0), keys, blocks[item],
                    done.data());
  });
  // Drop the blocks left to the gathered path; the largest (the last, under causality) first.
  std::vector<const LaneBlock*> dense;
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it)
    if (it->M > 0) dense.push_back(&*it);
  // Head-major items: both workers read the same head's k/v rows at a time,
  // which then stay in L3 (a block taking all heads in turn streamed every
  // head's rows from DRAM per block: 20% slower).
  const int64_t n = static_cast<int64_t>(dense.size());
  parallel_dynamic(in.Hq * n, [&] { return LaneScratch(in); }, [&](int64_t item, LaneScratch& sc) {
    run_lane_head(in, *dense[item % n], item / n, causal, scale, sc, op, lp);
  });
  return done;
}

std::tuple<at::Tensor, at::Tensor> sparse_attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, const at::Tensor& indices,
                                                            double scale, bool causal,
                                                            const c10::optional<at::Tensor>& q_start) {
  check_attention_qkv(q, k, v);
  check_sparse_indices(q, indices);
  check_q_start(q_start, q.size(0), q.device());
  const AttentionInputs in(q, k, v, q_start);
  const int64_t topk = indices.size(2), G = in.G, Dk = in.Dk, Dv = in.Dv;
  at::Tensor out = at::empty({in.B, in.S, in.Hq, Dv}, q.options().dtype(at::kFloat));
  at::Tensor lse = at::empty({in.B, in.S, in.Hq}, q.options().dtype(at::kFloat));
  const int32_t* idx = indices.const_data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float sc_f = static_cast<float>(scale);

  // Dense query blocks first (lane blocks); the rest below skips what they did.
  const std::vector<uint8_t> done = run_lane_blocks(in, idx, topk, causal, sc_f, op, lp);
  // Key-range blocking: a work item is a block of QB consecutive queries, and
  // their selected keys are swept in chunks of consecutive positions sized to
  // stay in L2 (KeyBlocking), every query of the block taking its keys in the
  // chunk before the next chunk starts; each query keeps its running softmax
  // state across chunks. A selected row is then fetched from L3 once per
  // block instead of once per query that chose it: at the bench shape
  // (T = 16K, topk = 1K) each row serves ~QB/16 queries of a block.
  // With fewer blocks than threads (decode), an item is a block's head group (HeadSplit).
  const KeyBlocking kb(in);
  const int64_t QB = kb.queries, C = kb.chunks, n_blocks = (in.S + QB - 1) / QB;
  const HeadSplit split(in, Layout(G), in.B * n_blocks, topk * QB);
  const int64_t P = split.pieces;
  parallel_dynamic(in.B * n_blocks * P, [&] { return Scratch(in, topk, QB, C); }, [&](int64_t item, Scratch& sc) {
    const int64_t blk = item / P, b = blk / n_blocks, s0 = blk % n_blocks * QB, nq = std::min(QB, in.S - s0);
    if (std::all_of(&done[b * in.S + s0], &done[b * in.S + s0] + nq, [](uint8_t d) { return d; })) return;
    const int64_t ld = sc.lay.Gp;  // per-query stride of m and l (a group's Gp is at most this)
    group_block_keys(in, kb, idx, topk, causal, b, s0, nq, sc, done.data());
    split.each_group(item % P, [&](int64_t g, int64_t h0, int64_t h1) {
      const Layout L(h1 - h0, sc.lay.by_key);  // the whole kv head's layout when unsplit
      std::fill(sc.o.begin(), sc.o.end(), 0.f);
      std::fill(sc.m.begin(), sc.m.end(), kNegInf);
      std::fill(sc.l.begin(), sc.l.end(), 0.f);
      sweep_chunks(kb, sc, topk, nq, [&](int64_t i, const int32_t* keys, int64_t n) {
        float *o = sc.o.data() + i * G * Dv, *m = sc.m.data() + i * ld, *l = sc.l.data() + i * ld;
        Scratch::load_rows(L, in.qrow(b, s0 + i, g * G + h0), Dk, sc_f, sc.qs);
        for (int64_t t0 = 0; t0 < n; t0 += kTile) {
          const int64_t nt = std::min(kTile, n - t0);
          const int64_t n_next = set_tile(in, b, g, keys, t0, nt, n, C == 1, L.half(), sc);
          Scratch::scores(L, sc.qs, sc.krows.data(), nt, Dk, sc.s.data(), sc.next.data(), n_next);
          attend_tile(sc, L, nt, Dv, o, m, l);
        }
      });
      for (int64_t i = 0; i < nq; ++i) {
        if (done[b * in.S + s0 + i]) continue;  // written by its lane block
        for (int64_t h = 0; h < L.G; ++h) {
          const int64_t row = (b * in.S + s0 + i) * in.Hq + g * G + h0 + h;
          const float li = sc.l[i * ld + h], inv = li > 0.f ? 1.f / li : 0.f;
          for (int64_t d = 0; d < Dv; ++d) op[row * Dv + d] = sc.o[(i * G + h) * Dv + d] * inv;
          lp[row] = li > 0.f ? sc.m[i * ld + h] + std::log(li) : kNegInf;
        }
      }
    });
  });
  return {to_dtype(out, q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attention_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& indices,
    const at::Tensor& out, const at::Tensor& lse, double scale, bool causal, const c10::optional<at::Tensor>& q_start) {
  check_attention_qkv(q, k, v);
  check_sparse_indices(q, indices);
  check_q_start(q_start, q.size(0), q.device());
  check_attention_grads(dout, q, v, out, lse);
  const AttentionInputs in(q, k, v, q_start);
  const int64_t topk = indices.size(2), G = in.G, Dk = in.Dk, Dv = in.Dv;
  const at::Tensor do32 = dout.to(at::kFloat).contiguous(), o32 = out.to(at::kFloat).contiguous();
  const at::Tensor lse_c = lse.contiguous();
  at::Tensor dq = at::empty({in.B, in.S, in.Hq, Dk}, q.options().dtype(at::kFloat));
  const int32_t* idx = indices.const_data_ptr<int32_t>();
  const float *dop = do32.const_data_ptr<float>(), *oo = o32.const_data_ptr<float>();
  const float* lp = lse_c.const_data_ptr<float>();
  float* dqp = dq.data_ptr<float>();
  const float sc_f = static_cast<float>(scale);
  // The forward's key-range blocking (KeyBlocking): a block of queries sweeps
  // its keys chunk by chunk, so the k/v rows it reads and the dK/dV rows it
  // scatter-adds stay in L2 while the block's queries share them. dQ rows
  // accumulate in place across chunks; lse and delta = rowsum(dO * O) are
  // held per query of the block.
  const KeyBlocking kb(in);
  const int64_t QB = kb.queries, C = kb.chunks, n_blocks = (in.S + QB - 1) / QB;
  KVGradBuffers grads(in, in.B * n_blocks);

  struct BwdScratch : Scratch {
    float *dk, *dv;
    BwdScratch(const AttentionInputs& in, int64_t topk, int64_t QB, int64_t C, KVGradBuffers& g, int64_t w)
        : Scratch(in, topk, QB, C) {
      std::tie(dk, dv) = g.claim(w);
    }
  };
  parallel_strided(in.B * n_blocks, [&](int64_t w) { return BwdScratch(in, topk, QB, C, grads, w); }, [&](int64_t item, BwdScratch& sc) {
    const int64_t b = item / n_blocks, s0 = item % n_blocks * QB, nq = std::min(QB, in.S - s0);
    const Layout& L = sc.lay;
    group_block_keys(in, kb, idx, topk, causal, b, s0, nq, sc);
    for (int64_t g = 0; g < in.Hkv; ++g) {
      auto row0 = [&](int64_t i) { return (b * in.S + s0 + i) * in.Hq + g * G; };  // (b, s0 + i, head g*G)
      for (int64_t i = 0; i < nq; ++i) {
        std::fill(dqp + row0(i) * Dk, dqp + (row0(i) + G) * Dk, 0.f);
        for (int64_t h = 0; h < G; ++h) {
          sc.delta[i * L.Gp + h] = dot(dop + (row0(i) + h) * Dv, oo + (row0(i) + h) * Dv, Dv);
          sc.lse[i * L.Gp + h] = lp[row0(i) + h];
        }
      }
      sweep_chunks(kb, sc, topk, nq, [&](int64_t i, const int32_t* keys, int64_t n) {
        const float* dog = dop + row0(i) * Dv;
        float* dqg = dqp + row0(i) * Dk;
        sc.load_rows(in.qrow(b, s0 + i, g * G), Dk, sc_f, sc.qs);
        sc.load_rows(dog, Dv, 1.f, sc.dot);
        for (int64_t t0 = 0; t0 < n; t0 += kTile) {
          const int64_t nt = std::min(kTile, n - t0);
          set_tile(in, b, g, keys, t0, nt, n, C == 1, false, sc);
          for (int64_t j = 0; j < nt; ++j) {
            const int64_t r = (b * in.T + keys[t0 + j]) * in.Hkv + g;
            sc.dkrows[j] = sc.dk + r * Dk;
            sc.dvrows[j] = sc.dv + r * Dv;
          }
          sc.scores(sc.qs, sc.krows.data(), nt, Dk, sc.s.data());     // scale * q.k
          sc.scores(sc.dot, sc.vrows.data(), nt, Dv, sc.dp.data());   // dO . v
          softmax_grad_tile(sc, nt, sc.lse.data() + i * L.Gp, sc.delta.data() + i * L.Gp);
          tiles::gather(sc.dp.data(), L.wi(), L.wj(), G, sc.krows.data(), nt, Dk, dqg, Dk);
          const float* q_rows = in.qrow(b, s0 + i, g * G);  // dk += ds^T (scale * q): scale applied below
          tiles::scatter(sc.dp.data(), L.wi(), L.wj(), G, q_rows, Dk, nt, Dk, sc.dkrows.data());
          tiles::scatter(sc.s.data(), L.wi(), L.wj(), G, dog, Dv, nt, Dv, sc.dvrows.data());
        }
      });
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t e = row0(i) * Dk; e < (row0(i) + G) * Dk; ++e) dqp[e] *= sc_f;
    }
  });
  auto [dk, dv] = grads.sum();
  dk.mul_(sc_f);  // every dk contribution carries one factor of scale
  return {to_dtype(dq, q.scalar_type()), to_dtype(dk, k.scalar_type()), to_dtype(dv, v.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(glm5, CPU, m) {
  m.impl("sparse_attention_fwd", &sparse_attention_fwd_cpu);
  m.impl("sparse_attention_bwd", &sparse_attention_bwd_cpu);
}

// No tensor argument to dispatch on: one kernel for every backend (a fact of the CPU kernel, asked from anywhere).
std::tuple<double, double> cpu_lane_costs(int64_t group, int64_t queries) {
  TORCH_CHECK_VALUE(group >= 1, "cpu_lane_costs: group must be >= 1 (query heads per kv head), got ", group);
  TORCH_CHECK_VALUE(queries >= 1, "cpu_lane_costs: queries must be >= 1, got ", queries);
  return {lane_costs::kLaneRate, lane_costs::lane_min_density(group, queries)};
}

TORCH_LIBRARY_IMPL(glm5, CompositeExplicitAutograd, m) { m.impl("cpu_lane_costs", &cpu_lane_costs); }

}  // namespace cpu
}  // namespace glm5
