// Pointer tables on Metal (see tables.h).
#include "metal/tables.h"

#include <utility>

namespace nbx::metal {

Tables& Tables::Get() {
  static Tables* t = new Tables();  // never destroyed: handlers may run at exit
  return *t;
}

bool Tables::Lookup(const std::vector<HostRange>& arrays, bool cache, std::shared_ptr<Table>* out,
                    std::string* error, bool* exhausted) {
  bool refused = false;
  if (exhausted == nullptr) exhausted = &refused;
  *exhausted = false;
  std::vector<int64_t> key;
  key.reserve(2 * arrays.size());
  for (const HostRange& r : arrays) {
    key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(r.ptr)));
    key.push_back(r.bytes);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (cache) {
    if (std::shared_ptr<Table> hit = lru_.Find(key)) {
      if (hit->pins.Current()) {
        *out = std::move(hit);
        return true;
      }
      lru_.Remove(key);  // its memory was freed and reallocated: never used
      ++stale_;
    }
  }
  auto t = std::make_shared<Table>();
  if (!PinnedScope::Pin(arrays, &t->pins, error, exhausted)) return false;
  t->n = static_cast<int64_t>(arrays.size());
  std::vector<int64_t> gpu(arrays.size());
  for (size_t i = 0; i < arrays.size(); ++i) {
    gpu[i] = static_cast<int64_t>(t->pins.GpuAddress(arrays[i].ptr, arrays[i].bytes));
    if (gpu[i] == 0 && arrays[i].bytes > 0) {
      *error = "internal: array " + std::to_string(i) + " is not inside its pinned scope";
      return false;
    }
  }
  if (!gpu.empty()) {
    const int64_t bytes = static_cast<int64_t>(gpu.size() * sizeof(int64_t));
    if (!DeviceBuffer::Allocate(bytes, "tables", WorkShape{}, &t->addresses, error)) {
      *exhausted = true;
      return false;
    }
    Active()->Memcpy(t->addresses.buffer(), 0, gpu.data(), bytes);
  }
  t->cached = cache && t->pins.staged() == 0;  // staged copies are snapshots: this call only
  if (t->cached) lru_.Insert(key, t);
  *out = std::move(t);
  return true;
}

int64_t Tables::ReleasePinned() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(lru_.Clear());
}

void Tables::SetCapacity(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  lru_.SetCapacity(static_cast<size_t>(n < 1 ? 1 : n));
}

TableStats Tables::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  TableStats s{};
  s.entries = static_cast<int64_t>(lru_.size());
  s.hits = lru_.hits();
  s.misses = lru_.misses();
  s.evictions = lru_.evictions();
  s.stale = stale_;
  s.capacity = static_cast<int64_t>(lru_.capacity());
  lru_.ForEach([&](const Table& t) {
    s.bytes += t.addresses.buffer().length;
    s.wraps += t.pins.wraps();
  });
  return s;
}

}  // namespace nbx::metal
