// The account: every byte a handler allocates, per device, against a budget.
//
// One process-wide ledger.  Handlers allocate ONLY through `Workspace`, an
// owning handle that returns its bytes on every exit path (errors included).
// A request that would take a device past its budget waits a bounded time
// for concurrent calls to return bytes when it could fit at all, and is
// otherwise refused; a refusal is recorded (`LastRefusal`) and its message
// ends with the advice of `WhatWouldHaveFit`: how many bands the work must be
// cut into and how large a budget would have taken it whole.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace nbx {

// A device: platform ("cpu", "cuda") and ordinal.
struct Device {
  std::string platform = "cpu";
  int ordinal = 0;
  std::string Name() const { return platform + ":" + std::to_string(ordinal); }
};

// The shape of the work behind a request, when known: the request is
// `fixed_bytes` plus an equal share per row of a leading axis of `rows`
// (e.g. the tokens T of a (T, H) problem).
struct WorkShape {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t fixed_bytes = 0;
  bool known() const { return rows > 0; }
};

struct DeviceStats {
  int64_t live = 0;
  int64_t peak = 0;
  int64_t budget = 0;
  int64_t refusals = 0;
  int64_t largest_request = 0;
  int64_t allocations = 0;
  int64_t cached = 0;  // idle blocks kept for reuse (count against the budget)
  std::map<std::string, int64_t> live_by_tag;
};

struct Refusal {
  Device device;
  std::string tag;
  int64_t requested = 0;
  int64_t free = 0;
  int64_t total = 0;
  int64_t shortfall = 0;
  WorkShape shape;
  std::string message;  // the full text the handler returned
};

// A size in bytes as the account counts it: past int64 (a saturated layout,
// SIZE_MAX) it is the whole int64 range, larger than any budget, never a
// wrapped small number.
inline int64_t SaturatedBytes(size_t bytes) {
  return bytes > static_cast<size_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(bytes);
}

// How FormatBytes rounds to its printed digits: to the nearest (a figure),
// up (an amount that must be enough: needed, short by, a budget to set) or
// down (an amount that is at most what there is: free).
enum class Round { kNearest, kUp, kDown };

// "1.5 GB", "300.0 MB", "12.0 kB", "512 bytes" (decimal units).
std::string FormatBytes(double bytes, Round round = Round::kNearest);

// The advice that ends every refusal; empty when requested fits in free.
std::string WhatWouldHaveFit(int64_t requested, int64_t free, int64_t total,
                             const WorkShape& shape);

class Account {
 public:
  static constexpr int64_t kUnlimited = INT64_MAX;
  static Account& Get();

  void SetBudget(const Device& d, int64_t bytes);
  // How long a request that fits the budget but not the headroom waits for
  // concurrent calls to return bytes before it is refused.
  void SetWaitMillis(int64_t ms);
  DeviceStats Stats(const Device& d);
  std::vector<std::pair<std::string, DeviceStats>> AllStats();
  void ResetPeak();
  std::optional<Refusal> LastRefusal();

  // Counts `bytes` against d's budget or returns false with the refusal text.
  // `*reuse` receives an idle block of exactly `bytes` when one is cached
  // (else nullptr): repeated calls of one op skip the page faults of fresh
  // memory.
  bool Reserve(const Device& d, int64_t bytes, const char* tag,
               const WorkShape& shape, std::string* error, void** reuse);
  // Returns `bytes` (the block at `ptr`) and frees the block or keeps it idle
  // for reuse while it fits the budget (at most kIdleBlocks per device).
  void Release(const Device& d, int64_t bytes, const char* tag, void* ptr);
  // Frees every idle block.
  void DropCached();
  // How d's blocks are freed (default std::free: Workspace's aligned_alloc).
  // The Metal ledger's blocks are shared-storage buffers (metal/runtime.cc);
  // it is called with the account's lock held.
  void SetBlockFree(const Device& d, void (*free_block)(void*));

  static constexpr int kIdleBlocks = 4;
  static constexpr int64_t kMinIdleBytes = 1 << 20;

 private:
  Account() = default;
};

// Owning handle over one 64-byte-aligned block counted in the account.
class Workspace {
 public:
  Workspace() = default;
  ~Workspace() { Release(); }
  Workspace(Workspace&& o) noexcept { *this = std::move(o); }
  Workspace& operator=(Workspace&& o) noexcept;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  // On refusal returns false, `*error` holds the message (with advice).
  static bool Allocate(const Device& d, size_t bytes, const char* tag,
                       const WorkShape& shape, Workspace* out,
                       std::string* error);

  void* data() const { return ptr_; }
  size_t size() const { return bytes_; }

 private:
  void Release();
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  const char* tag_ = "";
  Device device_;
};

}  // namespace nbx
