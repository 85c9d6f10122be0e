#include "alloc.h"

#include <cstdlib>
#include <new>

namespace nbx {
namespace {

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_allocations{0};
std::atomic<int64_t> g_largest{0};

void RaiseTo(std::atomic<int64_t>& counter, int64_t value) {
  int64_t seen = counter.load(std::memory_order_relaxed);
  while (value > seen &&
         !counter.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

}  // namespace

AllocStats GetAllocStats() {
  AllocStats s;
  s.live = g_live.load();
  s.peak = g_peak.load();
  s.allocations = g_allocations.load();
  s.largest_request = g_largest.load();
  return s;
}

void ResetAllocPeak() { g_peak.store(g_live.load()); }

bool Workspace::Allocate(size_t bytes, const char* tag, Workspace* out,
                         std::string* error) {
  out->Release();
  RaiseTo(g_largest, static_cast<int64_t>(bytes));
  if (bytes == 0) return true;
  constexpr size_t kAlign = 64;
  size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, rounded);
  if (p == nullptr) {
    *error = std::string("could not allocate ") + std::to_string(bytes) +
             " bytes of " + tag;
    return false;
  }
  out->ptr_ = p;
  out->bytes_ = bytes;
  int64_t live = g_live.fetch_add(static_cast<int64_t>(bytes)) +
                 static_cast<int64_t>(bytes);
  RaiseTo(g_peak, live);
  g_allocations.fetch_add(1);
  return true;
}

void Workspace::Release() {
  if (ptr_ != nullptr) {
    std::free(ptr_);
    g_live.fetch_sub(static_cast<int64_t>(bytes_));
    ptr_ = nullptr;
    bytes_ = 0;
  }
}

}  // namespace nbx
