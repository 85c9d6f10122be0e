// The one place handler memory comes from.
//
// Every byte a handler needs beyond XLA's own buffers is taken through
// `Workspace::Allocate`, an owning handle that gives the bytes back on every
// exit path (errors included).  The counters here are the seed of the
// per-device account: live and peak bytes, allocation count, largest request.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace nbx {

struct AllocStats {
  int64_t live = 0;
  int64_t peak = 0;
  int64_t allocations = 0;
  int64_t largest_request = 0;
};

// Snapshot of the counters (thread-safe).
AllocStats GetAllocStats();
// Sets peak := live.
void ResetAllocPeak();

// Owning handle over one 64-byte-aligned block.  Move-only.
class Workspace {
 public:
  Workspace() = default;
  ~Workspace() { Release(); }
  Workspace(Workspace&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  Workspace& operator=(Workspace&& o) noexcept {
    if (this != &o) {
      Release();
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      o.ptr_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  // Allocates `bytes` for `tag` ("workspace", ...).  On failure returns false
  // and writes a message naming the request into `*error`.
  static bool Allocate(size_t bytes, const char* tag, Workspace* out,
                       std::string* error);

  void* data() const { return ptr_; }
  size_t size() const { return bytes_; }

 private:
  void Release();
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace nbx
