// glm5::cache_write: a forward's new cache rows stored into the paged pool.
//
// The arithmetic is index_copy_'s; what the op adds is a schema that says it
// mutates `pool`. Written as an index_copy_ into a view of the pool, the same
// store traced by torch.compile became "copy the pool, write the copy, copy it
// back" (functionalization of a mutated graph input's view): the whole cache
// twice per layer per decode step. A mutating custom op is written in place.
// Registered CompositeExplicitAutograd: one implementation for every device.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace glm5 {
namespace {

void cache_write_op(at::Tensor pool, const at::Tensor& slots, const at::Tensor& values) {
  TORCH_CHECK_VALUE(pool.dim() == 2, "pool must have shape [P,D], got shape ", pool.sizes());
  TORCH_CHECK_VALUE(at::has_internal_overlap(pool) != at::MemOverlap::Yes,
                    "pool must be writable row by row (no two elements in one memory location), got strides ",
                    pool.strides());
  TORCH_CHECK_VALUE(slots.dim() == 1, "slots must have shape [N], got shape ", slots.sizes());
  TORCH_CHECK_TYPE(slots.scalar_type() == at::kLong, "slots must be int64, got ", slots.scalar_type());
  TORCH_CHECK_VALUE(values.dim() == 2 && values.size(0) == slots.size(0) && values.size(1) == pool.size(1),
                    "values must have shape [N,D]=[", slots.size(0), ",", pool.size(1), "], got shape ",
                    values.sizes());
  TORCH_CHECK_TYPE(values.scalar_type() == pool.scalar_type(), "values must have pool's dtype ",
                   pool.scalar_type(), ", got ", values.scalar_type());
  TORCH_CHECK_VALUE(slots.device() == pool.device() && values.device() == pool.device(),
                    "slots and values must be on pool's device ", pool.device(), ", got ", slots.device(),
                    " and ", values.device());
  if (slots.numel() == 0) return;
  if (slots.is_cpu()) {   // on a GPU, index_copy_'s device-side assert (a host check would synchronise)
    const int64_t* s = slots.const_data_ptr<int64_t>();
    const int64_t stride = slots.stride(0);
    for (int64_t i = 0; i < slots.numel(); ++i) {
      TORCH_CHECK_VALUE(s[i * stride] >= 0 && s[i * stride] < pool.size(0), "slots must hold rows of pool in [0, P=",
                        pool.size(0), "), got ", s[i * stride], " at [", i, "]");
    }
  }
  if (pool.size(1) == 0) return;   // rows of no elements: nothing to store (their data may be null)
  if (pool.is_cpu() && pool.stride(1) == 1 && values.stride(1) == 1) {
    // Rows copied straight: a decode step writes one row per layer and cache, where
    // index_copy_'s TensorIterator setup (~8 us) is most of the op's time.
    const int64_t* s = slots.const_data_ptr<int64_t>();
    const int64_t row_bytes = pool.size(1) * pool.element_size();
    char* dst = static_cast<char*>(pool.data_ptr());
    const char* src = static_cast<const char*>(values.const_data_ptr());
    for (int64_t i = 0; i < slots.numel(); ++i) {
      std::memcpy(dst + s[i * slots.stride(0)] * pool.stride(0) * pool.element_size(),
                  src + i * values.stride(0) * values.element_size(), row_bytes);
    }
    return;
  }
  pool.index_copy_(0, slots, values);
}

}  // namespace
}  // namespace glm5

TORCH_LIBRARY_IMPL(glm5, CompositeExplicitAutograd, m) {
  m.impl("cache_write", &glm5::cache_write_op);
}
