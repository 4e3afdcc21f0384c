// The radix top-k launcher of topk.cu, shared with indexer.cu (the fused
// indexer_topk runs it on its bounded scores workspace).
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace glm5 {
namespace cuda {

// Which input row, how much of it, and which output row each block handles.
// Plain mode (fused == 0): row r reads in[r * in_stride, + T) and writes
// out[r * k, + k). Fused mode: row r is query s = sa + r % gs of batch
// b = b0 + r / gs, its input row is r of the workspace, its length is the
// query's causal horizon (keys after it are never read) and it writes
// out[(b * S + s) * k, + k).
struct TopkRows {
  const void* in = nullptr;
  int64_t in_stride = 0;
  int64_t T = 0;
  int32_t* out = nullptr;
  int64_t k = 0;
  int fused = 0;
  int causal = 0;
  const int64_t* q_start = nullptr;  // [B] or nullptr: T - S
  int64_t b0 = 0, sa = 0, gs = 1, S = 1;
};

// Largest k sorted inside the kernel (block-wide bitonic sort in shared memory).
constexpr int64_t kTopkSortCap = 4096;

// Launches the top-k kernel over `rows` rows of dtype `dtype` on `stream`.
// sort: order each row's chosen slots by value, descending (k <= kTopkSortCap).
void launch_topk(at::ScalarType dtype, const TopkRows& rows_map, int64_t rows, bool sort, cudaStream_t stream);

}  // namespace cuda
}  // namespace glm5
