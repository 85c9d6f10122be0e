// Pinned scopes: host arrays made readable by the GPU in place.
//
// A scope pins a set of host arrays (an arena: every expert of every
// projection) with ONE no-copy wrap per underlying host allocation — never
// one per array, which exhausts Metal at a few hundred wraps — rounded out to
// Apple's 16 KiB pages.  An allocation longer than maxBufferLength is covered
// by overlapping views, each array inside one of them.  Memory the device
// will not wrap is staged: copied into a shared buffer counted in the account
// (tag "staging"); too many live wraps is an error by name.
//
// `GpuAddress(p)` = its view's GPU address + (p - the view's host base),
// valid exactly while the scope is held: tables hold GPU addresses only
// (a host pointer is the CPU mapping, not a GPU address).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "metal/device.h"
#include "metal/runtime.h"

namespace nbx::metal {

struct HostRange {
  const char* ptr;
  int64_t bytes;
};

class PinnedScope {
 public:
  PinnedScope() = default;
  ~PinnedScope() { Unpin(); }
  PinnedScope(PinnedScope&& o) noexcept { *this = std::move(o); }
  PinnedScope& operator=(PinnedScope&& o) noexcept;
  PinnedScope(const PinnedScope&) = delete;
  PinnedScope& operator=(const PinnedScope&) = delete;

  // Pins `ranges` on the active device; false and why (nothing stays pinned).
  // *exhausted (when given) says whether the account refused a staging copy
  // (RESOURCE_EXHAUSTED) rather than the ranges being unpinnable.
  static bool Pin(const std::vector<HostRange>& ranges, PinnedScope* out, std::string* error,
                  bool* exhausted = nullptr);

  // The GPU address of [p, p + bytes), which must lie inside a pinned range;
  // 0 when it does not.
  uint64_t GpuAddress(const void* p, int64_t bytes) const;
  // Every wrap and staging buffer: what a command buffer reading through the
  // scope must make resident.
  std::vector<Buffer> resources() const;
  // Whether every wrap still maps the memory it was made of.
  bool Current() const;
  int64_t wraps() const { return static_cast<int64_t>(views_.size()); }
  int64_t staged() const { return static_cast<int64_t>(staging_.size()); }
  void Unpin();

 private:
  struct View {
    const char* host;  // the wrap's host base (page-aligned)
    Buffer wrap;
  };
  struct Staged {
    const char* host;  // the array's host pointer
    int64_t bytes;
    int64_t offset;    // of its copy in staging_buf_
  };
  std::vector<View> views_;
  std::vector<Staged> staging_;
  DeviceBuffer staging_buf_;  // every staged copy of the scope: one request to the account
};

}  // namespace nbx::metal
