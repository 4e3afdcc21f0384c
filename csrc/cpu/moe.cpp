// Mixture-of-Experts routing, dispatch and combine on the CPU.
//
// moe_route    the router logits h @ gate_w^T in fp32 (one sgemm; GEMV tiles for a
//              decode step's few tokens), then one pass per token (blocks of
//              tokens in parallel): sigmoid, +bias for the choice, group
//              scores (sum of the top-2 per group), keep the
//              topk_group best groups, pick top_k experts by insertion into a
//              k-long sorted list (k <= a dozen: no sort of the E scores),
//              weights from the un-biased scores. Slot order as the oracle:
//              decreasing biased score; equal scores keep the lower expert id
//              first.
// moe_dispatch counting sort of the (token, slot) pairs by expert: per-chunk
//              histograms, a prefix sum whose segments are padded to `align`
//              rows, a stable scatter (by token, then slot, inside each expert),
//              then a parallel row copy; padding rows are zero. No general sort.
// moe_combine  out[t] = sum_j weights[t,j] * y_sorted[token_slot[t,j]]: a gather
//              through the inverse permutation (deterministic, no atomics),
//              parallel over tokens, accumulated in fp32 (float64 for float64).
//
// Semantics (the spec): glm5_ops/reference.py moe_route / moe_dispatch /
// moe_combine. moe_dispatch matches the oracle bit for bit. moe_combine sums
// the slots in order (j = 0..k-1, fused multiply-adds): deterministic, but
// not the oracle's rounding, whose torch.sum order changes with D; they agree
// to a few fp32 ulps.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "checks.h"
#include "cpu/gemv_tiles.h"
#include "cpu/parallel.h"

namespace glm5 {
namespace cpu {
namespace {


// ---------------------------------------------------------------- routing --

// A running top-n of (value, index), sorted by decreasing value; equal values
// keep the earlier-inserted (lower) index first. n is small (<= a few dozen).
struct SmallTopK {
  float* val;
  int32_t* idx;
  int64_t n, count = 0;
  SmallTopK(float* v, int32_t* i, int64_t n_) : val(v), idx(i), n(n_) {}
  void push(float v, int32_t i) {
    if (count == n && !(v > val[n - 1])) return;  // the common case once the list is full (NaN included)
    if (std::isnan(v)) v = -std::numeric_limits<float>::infinity();  // NaN never beats a number
    int64_t pos = count < n ? count : n - 1;
    while (pos > 0 && val[pos - 1] < v) {
      val[pos] = val[pos - 1];
      idx[pos] = idx[pos - 1];
      --pos;
    }
    val[pos] = v;
    idx[pos] = i;
    if (count < n) ++count;
  }
};

struct RouteScratch {
  std::vector<float> scores, choice, group_val, top2, seeds;
  std::vector<int32_t> group_idx;
  std::vector<float> top_val;
  std::vector<int32_t> top_idx;
  std::vector<char> keep;
};

// h @ gate_w^T in fp32 [T, E]. A decode step's few tokens stream gate_w through the
// GEMV tiles on both threads (csrc/cpu/gemv_tiles.h): MKL's single-threaded sgemv took
// 24-28 us for the small preset's 256 KB router (cold), ~10 GB/s, in each of its 6 MoE layers.
at::Tensor router_logits(const at::Tensor& h, const at::Tensor& gate_w) {
  const int64_t T = h.size(0), D = h.size(1), E = gate_w.size(0);
  if (T > gemv::kGemvMaxRows || h.scalar_type() != at::kFloat || gate_w.scalar_type() != at::kFloat)
    return at::mm(h.to(at::kFloat), gate_w.to(at::kFloat).t()).contiguous();
  const at::Tensor x = h.contiguous(), w = gate_w.contiguous();
  at::Tensor logits = at::empty({T, E}, x.options());
  gemv::rows_parallel<float>(x.data_ptr<float>(), D, 1, T, D, w.data_ptr<float>(), 0, nullptr, 0, nullptr, E,
                             logits.data_ptr<float>());
  return logits;
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& h, const at::Tensor& gate_w, const at::Tensor& bias,
                                             int64_t top_k, int64_t n_group, int64_t topk_group,
                                             double routed_scaling_factor, bool norm_topk_prob) {
  check_route_args(h, gate_w, bias, top_k, n_group, topk_group);
  const int64_t T = h.size(0), E = gate_w.size(0), per_group = E / n_group;

  at::Tensor weights = at::empty({T, top_k}, h.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({T, top_k}, h.options().dtype(at::kInt));
  if (T == 0) return {weights, ids};

  // Router logits in fp32 like the oracle (transformers casts both to fp32):
  // one sgemm over all tokens. (Measured: an sgemm per block of 64-256 tokens
  // inside the selection loop, logits still in cache, was slower at D=1024
  // and D=6144: each block re-reads gate_w.)
  const at::Tensor logits = router_logits(h, gate_w);
  const at::Tensor b32 = bias.to(at::kFloat).contiguous();
  const float* lg = logits.const_data_ptr<float>();
  const float* bp = b32.const_data_ptr<float>();
  float* wp = weights.data_ptr<float>();
  int32_t* ip = ids.data_ptr<int32_t>();
  const bool group_limited = topk_group < n_group;
  const float scale = static_cast<float>(routed_scaling_factor);
  using Vec = at::vec::Vectorized<float>;

  // Blocks of tokens handed out dynamically (a core busy with other work does not stall the call).
  constexpr int64_t kTokensPerItem = 64;
  auto make_scratch = [&] {
    RouteScratch s;
    s.scores.resize(E);
    s.choice.resize(E);
    s.group_val.resize(n_group);
    s.top2.resize(2 * n_group);
    s.seeds.resize(2 * topk_group);
    s.group_idx.resize(n_group);
    s.top_val.resize(top_k);
    s.top_idx.resize(top_k);
    s.keep.assign(n_group, 1);
    return s;
  };
  parallel_dynamic((T + kTokensPerItem - 1) / kTokensPerItem, make_scratch, [&](int64_t item, RouteScratch& s) {
    float* sc = s.scores.data();
    float* ch = s.choice.data();
    for (int64_t t = item * kTokensPerItem, t1 = std::min(T, t + kTokensPerItem); t < t1; ++t) {
      const float* row = lg + t * E;
      // scores = sigmoid(logits) (torch's formula, vectorised); choice = scores + bias.
      int64_t e = 0;
      // A NaN choice becomes -inf: it never beats a number and never poisons a group score.
      const Vec ninf(-std::numeric_limits<float>::infinity());
      for (; e + Vec::size() <= E; e += Vec::size()) {
        const Vec x = Vec::loadu(row + e);
        const Vec y = (Vec(1.f) + x.neg().exp()).reciprocal();
        y.store(sc + e);
        const Vec c = y + Vec::loadu(bp + e);
        Vec::blendv(ninf, c, c == c).store(ch + e);
      }
      for (; e < E; ++e) {
        sc[e] = 1.f / (1.f + std::exp(-row[e]));
        ch[e] = sc[e] + bp[e];
        if (std::isnan(ch[e])) ch[e] = -std::numeric_limits<float>::infinity();
      }
      // Only experts with choice >= thr can make the top_k (-inf: no filter).
      float thr = -std::numeric_limits<float>::infinity();
      if (group_limited) {
        // Group score: the sum of its two largest choices (branch-free scan); keep the topk_group best groups.
        SmallTopK groups(s.group_val.data(), s.group_idx.data(), topk_group);
        for (int64_t g = 0; g < n_group; ++g) {
          float a = -std::numeric_limits<float>::infinity(), b = a;
          for (int64_t i = g * per_group; i < (g + 1) * per_group; ++i) {
            const float v = ch[i];
            b = std::max(b, std::min(a, v));
            a = std::max(a, v);
          }
          s.top2[2 * g] = a;
          s.top2[2 * g + 1] = b;
          groups.push(a + b, static_cast<int32_t>(g));
        }
        std::fill(s.keep.begin(), s.keep.end(), 0);
        for (int64_t i = 0; i < groups.count; ++i) s.keep[s.group_idx[i]] = 1;
        // The kept groups' top-2 values are real candidates: when there are at least top_k of
        // them, their top_k-th largest bounds the answer's smallest from below.
        if (top_k <= 2 * topk_group) {
          float* seeds = s.seeds.data();
          for (int64_t i = 0; i < groups.count; ++i) {
            seeds[2 * i] = s.top2[2 * s.group_idx[i]];
            seeds[2 * i + 1] = s.top2[2 * s.group_idx[i] + 1];
          }
          std::nth_element(seeds, seeds + top_k - 1, seeds + 2 * groups.count, std::greater<float>());
          thr = seeds[top_k - 1];
        }
      }
      SmallTopK top(s.top_val.data(), s.top_idx.data(), top_k);
      for (int64_t g = 0; g < n_group; ++g) {
        if (!s.keep[g]) continue;
        for (int64_t i = g * per_group; i < (g + 1) * per_group; ++i) {
          if (ch[i] >= thr) top.push(ch[i], static_cast<int32_t>(i));
        }
      }
      // Weights from the un-biased scores of the chosen experts.
      float* w = wp + t * top_k;
      int32_t* id = ip + t * top_k;
      float sum = 0.f;
      for (int64_t j = 0; j < top_k; ++j) {
        id[j] = s.top_idx[j];
        w[j] = sc[s.top_idx[j]];
        sum += w[j];
      }
      const float denom = sum + 1e-20f;
      for (int64_t j = 0; j < top_k; ++j) w[j] = (norm_topk_prob ? w[j] / denom : w[j]) * scale;
    }
  });
  return {weights, ids};
}

// --------------------------------------------------------------- dispatch --

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_dispatch(const at::Tensor& x, const at::Tensor& ids,
                                                                        int64_t num_experts, int64_t align) {
  check_dispatch_args(x, ids, num_experts, align);
  const int64_t T = x.size(0), D = x.size(1);
  const int64_t k = ids.size(1), P = T * k, E = num_experts;
  const at::Tensor id32 = ids.to(at::kInt).contiguous();
  const int32_t* idp = id32.const_data_ptr<int32_t>();

  // Histograms per chunk of pairs (chunks in pair order keep the scatter stable).
  const int64_t chunks = std::clamp<int64_t>(P / 16384, 1, at::get_num_threads());
  const int64_t chunk_len = (P + chunks - 1) / chunks;
  std::vector<int64_t> hist(chunks * E, 0);
  std::vector<int64_t> bad(chunks, -1);  // first out-of-range pair per chunk
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* hc = hist.data() + c * E;
      for (int64_t p = c * chunk_len, pe = std::min(P, (c + 1) * chunk_len); p < pe; ++p) {
        const int32_t e = idp[p];
        if (e < 0 || e >= E) {
          bad[c] = p;
          break;
        }
        ++hc[e];
      }
    }
  });
  for (int64_t c = 0; c < chunks; ++c) {
    TORCH_CHECK_VALUE(bad[c] < 0, "ids must be expert ids in [0, num_experts=", E, "), got ", idp[bad[c]], " at [",
                      bad[c] / k, ",", bad[c] % k, "]");
  }

  // Offsets: each expert's segment padded up to a multiple of align.
  at::Tensor offsets = at::empty({E + 1}, x.options().dtype(at::kInt));
  int32_t* op = offsets.data_ptr<int32_t>();
  std::vector<int64_t> counts(E, 0), start(E + 1, 0);
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t e = 0; e < E; ++e) counts[e] += hist[c * E + e];
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + (counts[e] + align - 1) / align * align;
  const int64_t N = start[E];
  TORCH_CHECK_VALUE(N < (int64_t(1) << 31), "moe_dispatch: ", N, " sorted rows do not fit int32 offsets");
  for (int64_t e = 0; e <= E; ++e) op[e] = static_cast<int32_t>(start[e]);

  // Cursors: chunk c writes expert e's pairs after those of chunks before it.
  for (int64_t e = 0; e < E; ++e) {
    int64_t cur = start[e];
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t n = hist[c * E + e];
      hist[c * E + e] = cur;
      cur += n;
    }
  }
  at::Tensor slot_token = at::empty({N}, x.options().dtype(at::kInt));
  at::Tensor token_slot = at::empty({T, k}, x.options().dtype(at::kInt));
  int32_t* stp = slot_token.data_ptr<int32_t>();
  int32_t* tsp = token_slot.data_ptr<int32_t>();
  for (int64_t e = 0; e < E; ++e) std::fill(stp + start[e] + counts[e], stp + start[e + 1], -1);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* cur = hist.data() + c * E;
      for (int64_t p = c * chunk_len, pe = std::min(P, (c + 1) * chunk_len); p < pe; ++p) {
        const int64_t r = cur[idp[p]]++;
        tsp[p] = static_cast<int32_t>(r);
        stp[r] = static_cast<int32_t>(p / k);
      }
    }
  });

  // The permuted copy of the activations (zero padding rows), parallel over rows.
  const at::Tensor xc = x.contiguous();
  at::Tensor x_sorted = at::empty({N, D}, x.options());
  const int64_t row_bytes = D * xc.element_size();
  const char* src = static_cast<const char*>(xc.const_data_ptr());
  char* dst = static_cast<char*>(x_sorted.data_ptr());
  const int64_t rows_per_item = std::max<int64_t>(1, 65536 / std::max<int64_t>(row_bytes, 1));
  // D = 0: nothing to copy (and an empty tensor's data pointer may be null, which memcpy must not get).
  if (row_bytes > 0) parallel_dynamic((N + rows_per_item - 1) / rows_per_item, [] { return 0; }, [&](int64_t item, int&) {
    for (int64_t r = item * rows_per_item, r1 = std::min(N, r + rows_per_item); r < r1; ++r) {
      if (stp[r] >= 0)
        std::memcpy(dst + r * row_bytes, src + stp[r] * row_bytes, row_bytes);
      else
        std::memset(dst + r * row_bytes, 0, row_bytes);
    }
  });
  return {x_sorted, offsets, slot_token, token_slot};
}

// ---------------------------------------------------------------- combine --

namespace {

// acc[i] += w * y[i] (the compiler vectorises it with fused multiply-adds).
template <typename acc_t>
inline void axpy(acc_t* __restrict acc, const acc_t* __restrict y, acc_t w, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += w * y[i];
}

}  // namespace

at::Tensor moe_combine(const at::Tensor& y_sorted, const at::Tensor& token_slot, const at::Tensor& weights) {
  check_combine_args(y_sorted, token_slot, weights);
  const int64_t N = y_sorted.size(0), D = y_sorted.size(1), T = token_slot.size(0), k = token_slot.size(1);
  const at::Tensor ts = token_slot.to(at::kInt).contiguous();
  const int32_t* tsp = ts.const_data_ptr<int32_t>();
  for (int64_t p = 0; p < T * k; ++p) {
    TORCH_CHECK_VALUE(tsp[p] >= 0 && tsp[p] < N, "token_slot entries must be rows of y_sorted in [0, N=", N, "), got ",
                      tsp[p], " at [", p / k, ",", p % k, "]");
  }
  const bool f64 = y_sorted.scalar_type() == at::kDouble || weights.scalar_type() == at::kDouble;
  const at::ScalarType acc_type = f64 ? at::kDouble : at::kFloat;
  const at::Tensor y = y_sorted.contiguous();
  const at::Tensor w = weights.to(acc_type).contiguous();
  at::Tensor out = at::empty({T, D}, y.options());
  if (T == 0 || D == 0) return out.zero_();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "glm5_moe_combine", [&] {
    const scalar_t* yp = y.const_data_ptr<scalar_t>();
    scalar_t* outp = out.data_ptr<scalar_t>();
    auto run = [&](auto acc_zero) {
      using acc_t = decltype(acc_zero);
      const acc_t* wp = w.const_data_ptr<acc_t>();
      constexpr bool direct = std::is_same_v<scalar_t, acc_t>;  // accumulate in the output row itself
      const int64_t per_item = std::max<int64_t>(1, 16384 / (D * k + 1));
      auto make_scratch = [&] { return std::vector<acc_t>(direct ? 0 : 2 * D); };
      parallel_dynamic((T + per_item - 1) / per_item, make_scratch, [&](int64_t item, std::vector<acc_t>& buf) {
        acc_t* acc_buf = buf.data();
        acc_t* row_buf = direct ? nullptr : buf.data() + D;
        for (int64_t t = item * per_item, t1 = std::min(T, t + per_item); t < t1; ++t) {
          acc_t* acc = direct ? reinterpret_cast<acc_t*>(outp + t * D) : acc_buf;
          std::fill(acc, acc + D, acc_t(0));
          for (int64_t j = 0; j < k; ++j) {
            const scalar_t* src = yp + int64_t(tsp[t * k + j]) * D;
            if constexpr (direct) {
              axpy<acc_t>(acc, reinterpret_cast<const acc_t*>(src), wp[t * k + j], D);
            } else {
              at::vec::convert(src, row_buf, D);
              axpy<acc_t>(acc, row_buf, wp[t * k + j], D);
            }
          }
          if constexpr (!direct) at::vec::convert(acc, outp + t * D, D);
        }
      });
    };
    if (f64)
      run(double(0));
    else
      run(float(0));
  });
  return out;
}

}  // namespace cpu
}  // namespace glm5

TORCH_LIBRARY_IMPL(glm5, CPU, m) {
  m.impl("moe_route", &glm5::cpu::moe_route);
  m.impl("moe_dispatch", &glm5::cpu::moe_dispatch);
  m.impl("moe_combine", &glm5::cpu::moe_combine);
}
