// The CPU sparse-attention kernel's cost model: when a query block runs on
// lane tiles (sparse_attention.cpp, lane_min_density) and how fast those run
// against the gathered path. The one home of these numbers: the model's
// choice of form for a DSA chunk (glm5_ops/plan.py) reads them through the
// glm5::cpu_lane_costs op, so the two cannot disagree.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

#include <c10/util/Exception.h>

namespace glm5 {
namespace cpu {
namespace lane_costs {

// The gathered path's measured rate relative to lane tiles, by head group
// G = Hq / Hkv (2-core Xeon, Dk = 96, Dv = 64, T = 4K): a block goes to lane
// tiles when it selected more than this fraction of its span's (query, key)
// pairs, for the largest listed group not above G.
constexpr int64_t kGroups[] = {1, 2, 4, 8, 16};
constexpr double kMinDensity[] = {0.16, 0.3, 0.5, 0.58, 0.9};

// Lane tiles over MLA's expanded K/V compute at ~0.85 of the rate the
// gathered absorbed path reaches, per spanned or selected pair (~206 against
// ~242 GFLOP/s on the 2-core Xeon, 8K prefill chunks, head-major K/V;
// measured per chunk, chunk 4 expanded lost 10%).
constexpr double kLaneRate = 0.85;

// The fraction of a block's span it must select to run on lane tiles, for
// head group G and S queries per call (> 1: never). GLM5_SPARSE_LANE_BLOCKS=
// always / never forces the choice (tests cover both paths on every shape).
inline double lane_min_density(int64_t G, int64_t S) {
  const char* env = std::getenv("GLM5_SPARSE_LANE_BLOCKS");
  const std::string mode = env ? env : "auto";
  TORCH_CHECK(mode == "auto" || mode == "always" || mode == "never",
              "GLM5_SPARSE_LANE_BLOCKS must be auto, always or never, got '", mode, "'");
  if (mode == "always") return 0.0;
  if (mode == "never" || S == 1) return 2.0;  // decode: one query, no block to share rows
  double density = kMinDensity[0];
  for (size_t i = 0; i < sizeof(kGroups) / sizeof(kGroups[0]); ++i)
    if (G >= kGroups[i]) density = kMinDensity[i];
  return density;
}

}  // namespace lane_costs
}  // namespace cpu
}  // namespace glm5
