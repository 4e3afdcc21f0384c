// A scratch buffer that survives between calls on the same thread.
//
// Large allocations come from fresh mmap'd pages (glibc maps anything over
// 32 MiB, and returns it on free), and first touching a 4 KiB page costs a
// fault: ~1 us in this VM. fused_moe's sorted-row buffer at a 2048-token
// chunk (E=64, top-6, D=1024) is 48 MiB, 12K faults, ~15% of the layer;
// reused, it costs nothing after the first call. Buffers up to kKeepBytes
// stay with their thread (one per thread that ever asked); larger ones are
// allocated per call and freed, as before.
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <memory>

namespace glm5 {
namespace cpu {

class Workspace {
 public:
  static constexpr size_t kKeepBytes = size_t(256) << 20;

  explicit Workspace(size_t bytes) {
    if (bytes > kKeepBytes) {
      own_.reset(new char[bytes]);
      ptr_ = own_.get();
      return;
    }
    Slot& s = slot();
    TORCH_CHECK(!s.busy, "internal: nested use of the thread's workspace");
    if (s.cap < bytes) s.buf.reset(new char[bytes]), s.cap = bytes;
    s.busy = true;
    ptr_ = s.buf.get();
    kept_ = &s;
  }
  ~Workspace() {
    if (kept_) kept_->busy = false;
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(ptr_);
  }

 private:
  struct Slot {
    std::unique_ptr<char[]> buf;
    size_t cap = 0;
    bool busy = false;
  };
  static Slot& slot() {
    thread_local Slot s;
    return s;
  }
  std::unique_ptr<char[]> own_;
  char* ptr_ = nullptr;
  Slot* kept_ = nullptr;
};

}  // namespace cpu
}  // namespace glm5
