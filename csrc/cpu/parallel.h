// Dynamic scheduling over at::parallel_for: each worker thread takes the next
// item from a shared counter. at::parallel_for alone splits the range in equal
// static halves, which loses to uneven items (causal query blocks see more keys
// the later they sit) and to a core busy with another process.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace glm5 {
namespace cpu {

// Runs body(item, scratch) for item in [0, n); make_scratch() builds one
// scratch per worker thread (buffers reused across that worker's items).
template <typename MakeScratch, typename Body>
void parallel_dynamic(int64_t n, MakeScratch make_scratch, Body body) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    auto scratch = make_scratch();
    for (int64_t item = next.fetch_add(1); item < n; item = next.fetch_add(1)) body(item, scratch);
  });
}

// Static strided scheduling: worker w runs items w, w + W, w + 2W, ... with
// make_scratch(w). For bodies that accumulate into a per-worker buffer (the
// attention backward's dK/dV): with a shared counter which items land in which
// buffer changes run to run, so the summed gradient did too (ulp-level, but a
// resumed training run must equal an uninterrupted one bit for bit). Fixed
// strides make it a function of the thread count alone, and interleaving keeps
// causal blocks (later ones see more keys) about as balanced as the counter.
template <typename MakeScratch, typename Body>
void parallel_strided(int64_t n, MakeScratch make_scratch, Body body) {
  if (n <= 0) return;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      auto scratch = make_scratch(w);
      for (int64_t item = w; item < n; item += workers) body(item, scratch);
    }
  });
}

}  // namespace cpu
}  // namespace glm5
