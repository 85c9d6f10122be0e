// A bounded LRU of pointer tables keyed by a fingerprint of every address
// they hold (the CUDA and Metal tables).  Values are shared: a table a call
// is using stays alive until that call drops it, even when evicted meanwhile;
// a value's destructor returns what it holds (device memory, pins, bytes in
// the account).  Not thread-safe: the owner locks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <unordered_map>
#include <vector>

namespace nbx {

// FNV-1a over the addresses, mixed (the fingerprint; equal keys are compared
// in full before a hit).
inline uint64_t Fingerprint(const std::vector<int64_t>& key, uint64_t seed = 0) {
  uint64_t h = 1469598103934665603ull ^ seed;
  for (int64_t a : key) {
    h ^= static_cast<uint64_t>(a);
    h *= 1099511628211ull;
    h ^= h >> 29;
  }
  return h;
}

template <typename V>
class FingerprintLru {
 public:
  explicit FingerprintLru(size_t capacity) : capacity_(capacity < 1 ? 1 : capacity) {}

  // The value cached under exactly `key`, moved to the front; else nullptr.
  std::shared_ptr<V> Find(const std::vector<int64_t>& key) {
    auto it = index_.find(Fingerprint(key));
    if (it == index_.end() || it->second->key != key) {
      ++misses_;
      return nullptr;
    }
    lru_.splice(lru_.begin(), lru_, it->second);
    ++hits_;
    return it->second->value;
  }
  // Caches `value` under `key` at the front, evicting the oldest past capacity.
  void Insert(const std::vector<int64_t>& key, std::shared_ptr<V> value) {
    const uint64_t h = Fingerprint(key);
    if (auto it = index_.find(h); it != index_.end()) Erase(it->second);  // collision: newer wins
    while (lru_.size() >= capacity_) Evict();
    lru_.push_front(Entry{h, key, std::move(value)});
    index_[h] = lru_.begin();
  }
  // Drops the entry cached under `key` (e.g. found stale); true if there was one.
  bool Remove(const std::vector<int64_t>& key) {
    auto it = index_.find(Fingerprint(key));
    if (it == index_.end() || it->second->key != key) return false;
    Erase(it->second);
    return true;
  }
  void SetCapacity(size_t n) {
    capacity_ = n < 1 ? 1 : n;
    while (lru_.size() > capacity_) Evict();
  }
  // Drops every entry; returns how many.
  size_t Clear() {
    const size_t n = lru_.size();
    while (!lru_.empty()) Evict();
    return n;
  }
  size_t size() const { return lru_.size(); }
  size_t capacity() const { return capacity_; }
  int64_t hits() const { return hits_; }
  int64_t misses() const { return misses_; }
  int64_t evictions() const { return evictions_; }
  void ForEach(const std::function<void(const V&)>& f) const {
    for (const Entry& e : lru_) f(*e.value);
  }

 private:
  struct Entry {
    uint64_t hash;
    std::vector<int64_t> key;
    std::shared_ptr<V> value;
  };
  using Iter = typename std::list<Entry>::iterator;
  void Erase(Iter it) {
    index_.erase(it->hash);
    lru_.erase(it);
  }
  void Evict() {
    ++evictions_;
    Erase(std::prev(lru_.end()));
  }

  size_t capacity_;
  std::list<Entry> lru_;
  std::unordered_map<uint64_t, Iter> index_;
  int64_t hits_ = 0, misses_ = 0, evictions_ = 0;
};

}  // namespace nbx
