// Top-k selection on the CPU without sorting: map scores to order-preserving
// uint32 keys, guess a threshold from a sample, keep the few candidates above
// it in one pass, then finish with up to three radix-histogram passes over the
// candidates (11 + 11 + 10 bits). See docs/KERNELS.md, "Top-k selection".
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace glm5 {
namespace cpu {

// Unsigned order of keys equals float order. NaN and -inf map to 0, the key
// that is never selected; every other float (+inf included) maps to >= 1.
inline uint32_t radix_key(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t key = u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) | 0x80000000u);
  // -inf -> 0x007FFFFF, negative NaNs below it, positive NaNs above +inf (0xFF800000).
  const bool selectable = (key - 0x00800000u) <= (0xFF800000u - 0x00800000u);
  return selectable ? key : 0u;
}

// Per-thread candidate storage, sized once per row length. Left uninitialised
// (new T[n], not std::vector's zero fill): a row keeps ~1.25k of its T entries,
// so only those pages are ever touched. The zero fill wrote all 8T bytes per
// call, and where malloc handed back fresh pages (each call at 8x262144) every
// one of them page-faulted: 480 faults per call, ~0.3 ms of a 1.46 ms call.
struct Candidates {
  std::unique_ptr<uint32_t[]> key;
  std::unique_ptr<int32_t[]> idx;
  // One spare slot: the branch-free collection writes one past the last kept.
  explicit Candidates(int64_t capacity = 0)
      : key(new uint32_t[capacity + 1]), idx(new int32_t[capacity + 1]) {}
};

// Selects the k largest keys among (key[i], idx[i]), i < n, all keys >= 1.
// Writes min(k, n) indices to out_idx (and their keys to out_key when given),
// in no particular order, and returns how many it wrote. Reorders the inputs.
inline int64_t radix_select(uint32_t* key, int32_t* idx, int64_t n, int64_t k, int32_t* out_idx,
                            uint32_t* out_key = nullptr) {
  int64_t written = 0;
  auto emit = [&](uint32_t kk, int32_t ii) {
    out_idx[written] = ii;
    if (out_key) out_key[written] = kk;
    ++written;
  };
  if (n <= k) {
    for (int64_t i = 0; i < n; ++i) emit(key[i], idx[i]);
    return n;
  }
  int64_t need = k;  // still to choose among the n remaining candidates
  static constexpr int kShift[3] = {21, 10, 0};
  static constexpr int kBits[3] = {11, 11, 10};
  for (int pass = 0; pass < 3 && need > 0; ++pass) {
    const int shift = kShift[pass];
    const uint32_t mask = (1u << kBits[pass]) - 1u;
    uint32_t hist[2048] = {0};
    for (int64_t i = 0; i < n; ++i) ++hist[(key[i] >> shift) & mask];
    // The bin holding the need-th largest key: everything above it is chosen.
    int64_t above = 0;
    int64_t bin = mask;
    while (above + static_cast<int64_t>(hist[bin]) < need) above += hist[bin--];
    // Branch-free split: write every element to both places, advance only
    // the cursor that should keep it (out_idx has room: written < k here).
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t d = (key[i] >> shift) & mask;
      const uint32_t kk = key[i];
      const int32_t ii = idx[i];
      out_idx[written] = ii;
      if (out_key) out_key[written] = kk;
      written += d > bin;
      key[kept] = kk;
      idx[kept] = ii;
      kept += d == bin;
    }
    need -= above;
    n = kept;
    if (n == need) break;
  }
  // Either the threshold bin holds exactly what is needed, or after the last
  // pass its keys are all equal (ties): any `need` of them will do.
  for (int64_t i = 0; i < need; ++i) emit(key[i], idx[i]);
  return written;
}

// A key threshold that about 1.25k + a few sigma of the row's keys reach,
// estimated from a strided sample; 1 (= every selectable key) when the row is
// too short or k too large for the estimate to save work. Only a guess: the
// caller falls back to 1 when fewer than k keys reach it.
template <typename scalar_t>
inline uint32_t sampled_threshold(const scalar_t* row, int64_t T, int64_t k) {
  if (T < 4096 || k * 8 > T) return 1u;
  const int64_t kSamples = std::clamp<int64_t>(T / 32, 128, 1024);  // sampling must stay cheap next to the scan
  uint32_t sample[1024];
  int64_t m = 0;
  const int64_t stride = T / kSamples;
  for (int64_t i = 0; i < kSamples; ++i) {
    const uint32_t key = radix_key(static_cast<float>(row[i * stride]));
    if (key) sample[m++] = key;
  }
  const double expect = static_cast<double>(kSamples) * static_cast<double>(k) / static_cast<double>(T);
  const int64_t rank = static_cast<int64_t>(expect * 1.25 + 4.0 * std::sqrt(expect) + 2.0);
  if (rank >= m) return 1u;
  std::nth_element(sample, sample + rank, sample + m, [](uint32_t a, uint32_t b) { return a > b; });
  return std::max<uint32_t>(sample[rank], 1u);
}

// Keeps (key, index) of every element whose key reaches theta; returns the count.
template <typename scalar_t>
inline int64_t collect_candidates(const scalar_t* row, int64_t T, uint32_t theta, Candidates& c) {
  int64_t n = 0;
  uint32_t* key = c.key.get();
  int32_t* idx = c.idx.get();
  for (int64_t i = 0; i < T; ++i) {  // branch-free: write always, keep if it reaches theta
    const uint32_t kk = radix_key(static_cast<float>(row[i]));
    key[n] = kk;
    idx[n] = static_cast<int32_t>(i);
    n += kk >= theta;
  }
  return n;
}

// Orders selected indices by score, descending (ties: lower index first).
template <typename scalar_t>
inline void sort_by_score(const scalar_t* row, int32_t* out, int64_t n) {
  std::vector<uint64_t> packed(n);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t kk = radix_key(static_cast<float>(row[out[i]]));
    packed[i] = (kk << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(out[i]));
  }
  std::sort(packed.begin(), packed.end(), [](uint64_t a, uint64_t b) { return a > b; });
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(packed[i]));
}

// The k largest selectable entries of one row; -1 fills the slots beyond them.
template <typename scalar_t>
inline void topk_row(const scalar_t* row, int64_t T, int64_t k, bool sorted, int32_t* out, Candidates& c) {
  const uint32_t theta = sampled_threshold(row, T, k);
  int64_t n = collect_candidates(row, T, theta, c);
  if (n < k && theta > 1u) n = collect_candidates(row, T, 1u, c);
  const int64_t got = radix_select(c.key.get(), c.idx.get(), n, k, out);
  if (sorted) sort_by_score(row, out, got);
  std::fill(out + got, out + k, -1);
}

}  // namespace cpu
}  // namespace glm5
