// Pointer tables on Metal: the GPU address of every expert array, [G][E]
// int64 in a shared buffer, built under a pinned scope (pins.h).
//
// Cached in a fingerprinted LRU (lru.h; 256 by default, as CUDA's) keyed by
// every array's host address and length; a table's pins live exactly as long
// as its cache entry (released on eviction, `Clear`, `ReleasePinned`).  A hit
// whose wraps no longer map their memory (freed and reallocated at the same
// address) is dropped and rebuilt, never used.  Tables that must not outlive
// a call (weights that live for one call, or staged copies, which are
// snapshots) never enter the cache.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "lru.h"
#include "metal/pins.h"
#include "metal/runtime.h"

namespace nbx::metal {

struct Table {
  PinnedScope pins;
  DeviceBuffer addresses;  // [n] int64 GPU addresses, in the order asked for
  int64_t n = 0;
  bool cached = false;
};

struct TableStats {
  int64_t entries, hits, misses, evictions, stale, bytes, wraps, capacity;
};

class Tables {
 public:
  static Tables& Get();
  // The table of `arrays` (their GPU addresses in that order).  `cache`:
  // look it up in and add it to the LRU; else a table for this call only.
  // *exhausted (when given): the failure is the account's refusal (of a
  // staging copy or of the table's buffer), not arrays that cannot be pinned.
  bool Lookup(const std::vector<HostRange>& arrays, bool cache, std::shared_ptr<Table>* out,
              std::string* error, bool* exhausted = nullptr);
  // Drops every cached table and the pins it holds; returns how many.
  int64_t ReleasePinned();
  void SetCapacity(int64_t n);
  TableStats Stats();

 private:
  Tables() : lru_(256) {}
  std::mutex mu_;
  FingerprintLru<Table> lru_;
  int64_t stale_ = 0;
};

}  // namespace nbx::metal
