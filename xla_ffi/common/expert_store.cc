// Expert stores (expert_store.h).
#include "common/expert_store.h"

#include <cstring>
#include <map>
#include <mutex>

#include "account.h"

namespace ffi = xla::ffi;

namespace nbx::store {
namespace {

constexpr size_t kAlign = 64;
// the account's tag of every block (Stats tells resident from streamed)
constexpr const char* kTag = "mapped experts";

struct Slot {
  Workspace block;  // empty: not held
  bool resident = false;
  int pins = 0;
};

struct LeaseRecord {
  std::vector<int32_t> experts;  // one pin each
  bool opened = false;
};

struct Store {
  std::string name;
  int64_t E = 0;
  std::shared_ptr<const std::vector<ArraySpec>> arrays;
  std::vector<size_t> offsets;
  size_t block_bytes = 0;
  std::vector<Slot> slots;
  std::map<int32_t, LeaseRecord> leases;
  std::vector<int64_t> counts;  // [E]: routed slots per expert
  std::shared_ptr<FetchFn> fetch;  // reads what a call lacks (SetFetch)
  int64_t fast_calls = 0, fast_hits = 0;
  int32_t next_lease = 1;
  bool closed = false;
};

struct Registry {
  std::mutex mu;
  std::map<int64_t, std::unique_ptr<Store>> stores;
  int64_t next_id = 1;
};

Registry& R() {
  static Registry* r = new Registry();  // never destroyed: handlers may run at exit
  return *r;
}

Store* Find(int64_t id) {
  auto it = R().stores.find(id);
  return it == R().stores.end() ? nullptr : it->second.get();
}

// Frees slot e's block when nothing keeps it (unpinned, and streamed or closed).
void MaybeFree(Store& s, int64_t e) {
  Slot& slot = s.slots[e];
  if (slot.pins == 0 && (!slot.resident || s.closed)) slot.block = Workspace();
}

std::string ClosedError(const Store* s) {
  return "jax_nbx: the mapped experts " + (s ? "of " + s->name + " " : std::string()) +
         "are closed (unmapped); map them again";
}

// A new lease of `experts` (already pinned).
int32_t NewLease(Store& s, std::vector<int32_t> experts) {
  const int32_t lease = s.next_lease++;
  if (s.next_lease <= 0) s.next_lease = 1;
  s.leases[lease] = LeaseRecord{std::move(experts), false};
  return lease;
}

// A put's end for expert e, held: resident if asked (Finish settles it; a put
// never frees), pinned by `lease` when one is being built.
bool Keep(Store& s, int64_t e, bool resident, int32_t lease, std::string* error) {
  Slot& slot = s.slots[e];
  slot.resident = slot.resident || resident;
  if (lease <= 0) return true;
  auto it = s.leases.find(lease);
  if (it == s.leases.end() || it->second.opened) {
    *error = "jax_nbx: expert store put: lease " + std::to_string(lease) + " is not being built";
    return false;
  }
  ++slot.pins;
  it->second.experts.push_back(static_cast<int32_t>(e));
  return true;
}

void Unpin(Store& s, const LeaseRecord& rec) {
  for (int32_t e : rec.experts) {
    --s.slots[e].pins;
    MaybeFree(s, e);
  }
}

}  // namespace

size_t ArraySpec::bytes() const {
  size_t n = ffi::ByteWidth(type);
  for (int64_t d : dims) n *= static_cast<size_t>(d);
  return n;
}

struct Lease::End {
  int64_t id;
  int32_t lease;
  ~End() {
    std::lock_guard<std::mutex> lock(R().mu);
    Store* s = Find(id);
    if (s == nullptr) return;
    auto it = s->leases.find(lease);
    if (it == s->leases.end()) return;
    Unpin(*s, it->second);
    s->leases.erase(it);
  }
};

int64_t Create(const std::string& name, int64_t E, std::vector<ArraySpec> arrays) {
  auto s = std::make_unique<Store>();
  s->name = name;
  s->E = E;
  size_t off = 0;
  for (const ArraySpec& a : arrays) {
    s->offsets.push_back(off);
    off += (a.bytes() + kAlign - 1) / kAlign * kAlign;
  }
  s->block_bytes = off;
  s->arrays = std::make_shared<const std::vector<ArraySpec>>(std::move(arrays));
  s->slots.resize(static_cast<size_t>(E));
  s->counts.assign(static_cast<size_t>(E), 0);
  std::lock_guard<std::mutex> lock(R().mu);
  const int64_t id = R().next_id++;
  R().stores[id] = std::move(s);
  return id;
}

bool Put(int64_t id, int64_t e, const std::vector<std::pair<const void*, size_t>>& srcs,
         bool resident, int32_t lease, std::string* error) {
  size_t block_bytes;
  std::vector<size_t> offsets;
  {
    std::lock_guard<std::mutex> lock(R().mu);
    Store* s = Find(id);
    if (s == nullptr || s->closed) {
      *error = ClosedError(s);
      return false;
    }
    if (e < 0 || e >= s->E || srcs.size() != s->arrays->size()) {
      *error = "jax_nbx: expert store put: expert " + std::to_string(e) + " with " +
               std::to_string(srcs.size()) + " arrays; the store has " + std::to_string(s->E) +
               " experts of " + std::to_string(s->arrays->size());
      return false;
    }
    for (size_t i = 0; i < srcs.size(); ++i)
      if (srcs[i].second != (*s->arrays)[i].bytes()) {
        *error = "jax_nbx: expert " + std::to_string(e) + " of " + s->name + ": array " +
                 std::to_string(i) + " has " + std::to_string(srcs[i].second) +
                 " bytes; the store's experts have " + std::to_string((*s->arrays)[i].bytes());
        return false;
      }
    if (s->slots[e].block.data() != nullptr) return Keep(*s, e, resident, lease, error);
    block_bytes = s->block_bytes;
    offsets = s->offsets;
  }
  // the block is filled without the registry's lock: other calls lease and end meanwhile
  Workspace block;
  if (!Workspace::Allocate(Device{}, block_bytes, kTag, WorkShape{}, &block, error)) return false;
  char* base = static_cast<char*>(block.data());
  for (size_t i = 0; i < srcs.size(); ++i)
    std::memcpy(base + offsets[i], srcs[i].first, srcs[i].second);
  std::lock_guard<std::mutex> lock(R().mu);
  Store* s = Find(id);
  if (s == nullptr || s->closed) {
    *error = ClosedError(s);
    return false;
  }
  // (another put of e may have come first: then this block goes)
  if (s->slots[e].block.data() == nullptr) s->slots[e].block = std::move(block);
  return Keep(*s, e, resident, lease, error);
}

bool Has(int64_t id, int64_t e) {
  std::lock_guard<std::mutex> lock(R().mu);
  Store* s = Find(id);
  return s != nullptr && e >= 0 && e < s->E && s->slots[e].block.data() != nullptr;
}

int32_t Begin(int64_t id, const std::vector<int32_t>& experts, std::vector<int32_t>* missing,
              std::string* error) {
  std::lock_guard<std::mutex> lock(R().mu);
  Store* s = Find(id);
  if (s == nullptr || s->closed) {
    *error = ClosedError(s);
    return 0;
  }
  missing->clear();
  std::vector<int32_t> held;
  for (int32_t e : experts) {
    if (e < 0 || e >= s->E) {
      *error = "jax_nbx: expert " + std::to_string(e) + " is outside the " + std::to_string(s->E) +
               " experts of " + s->name;
      return 0;
    }
    (s->slots[e].block.data() != nullptr ? held : *missing).push_back(e);
  }
  for (int32_t e : held) ++s->slots[e].pins;
  return NewLease(*s, std::move(held));
}

bool Finish(int64_t id, int32_t lease, const std::vector<uint8_t>& keep,
            std::vector<int32_t>* resident, std::string* error) {
  std::lock_guard<std::mutex> lock(R().mu);
  Store* s = Find(id);
  if (s == nullptr || static_cast<int64_t>(keep.size()) != s->E || !s->leases.count(lease)) {
    *error = "jax_nbx: expert store finish: no such store or lease, or keep has " +
             std::to_string(keep.size()) + " flags";
    return false;
  }
  resident->clear();
  for (int64_t e = 0; e < s->E; ++e) {
    Slot& slot = s->slots[e];
    if (slot.block.data() == nullptr) continue;
    slot.resident = keep[e] != 0 && !s->closed;
    MaybeFree(*s, e);
    if (slot.resident) resident->push_back(static_cast<int32_t>(e));
  }
  return true;
}

int32_t TryAcquire(int64_t id, const int32_t* ids, int64_t n, bool skip_outside) {
  std::lock_guard<std::mutex> lock(R().mu);
  Store* s = Find(id);
  if (s == nullptr || s->closed) return 0;
  std::vector<int32_t> slots(static_cast<size_t>(s->E), 0);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t e = ids[i];
    if (e < 0 || e >= s->E) {
      if (!skip_outside) return 0;
      continue;
    }
    if (s->slots[e].block.data() == nullptr) return 0;
    ++slots[e];
  }
  std::vector<int32_t> experts;
  for (int64_t e = 0; e < s->E; ++e)
    if (slots[e]) {
      experts.push_back(static_cast<int32_t>(e));
      ++s->slots[e].pins;
      s->counts[e] += slots[e];
    }
  ++s->fast_calls;
  s->fast_hits += static_cast<int64_t>(experts.size());
  return NewLease(*s, std::move(experts));
}

void SetFetch(int64_t id, std::shared_ptr<FetchFn> fetch) {
  std::shared_ptr<FetchFn> old;  // released after the lock (it may hold a Python object)
  std::lock_guard<std::mutex> lock(R().mu);
  Store* s = Find(id);
  if (s == nullptr) return;
  old = std::move(s->fetch);
  s->fetch = std::move(fetch);
}

std::vector<int64_t> Counts(int64_t id) {
  std::lock_guard<std::mutex> lock(R().mu);
  Store* s = Find(id);
  return s == nullptr ? std::vector<int64_t>() : s->counts;
}

void AddCounts(int64_t id, const std::vector<int32_t>& experts, const std::vector<int64_t>& counts) {
  std::lock_guard<std::mutex> lock(R().mu);
  Store* s = Find(id);
  if (s == nullptr) return;
  for (size_t i = 0; i < experts.size() && i < counts.size(); ++i)
    if (experts[i] >= 0 && experts[i] < s->E) s->counts[experts[i]] += counts[i];
}

void Release(int64_t id, int32_t lease) {
  std::lock_guard<std::mutex> lock(R().mu);
  Store* s = Find(id);
  if (s == nullptr) return;
  auto it = s->leases.find(lease);
  if (it == s->leases.end() || it->second.opened) return;
  Unpin(*s, it->second);
  s->leases.erase(it);
}

const void* Lease::data(int64_t e, size_t i) const {
  if (e < 0 || e >= E_ || base_[e] == nullptr) return nullptr;
  return base_[e] + offset_[i];
}

bool Open(int64_t id, int32_t lease, std::shared_ptr<Lease>* out, std::string* error) {
  std::lock_guard<std::mutex> lock(R().mu);
  Store* s = Find(id);
  if (s == nullptr) {
    *error = "expert_store " + std::to_string(id) + " does not exist";
    return false;
  }
  auto it = s->leases.find(lease);
  if (it == s->leases.end() || it->second.opened) {
    *error = "lease " + std::to_string(lease) + " of the mapped experts of " + s->name +
             (it == s->leases.end() ? " does not exist" : " was already read") +
             ": each call's experts are leased by its own fetch";
    return false;
  }
  it->second.opened = true;
  auto l = std::make_shared<Lease>();
  l->arrays_ = s->arrays;
  l->offset_ = s->offsets;
  l->E_ = s->E;
  l->base_.assign(static_cast<size_t>(s->E), nullptr);
  for (int32_t e : it->second.experts)
    l->base_[e] = static_cast<const char*>(s->slots[e].block.data());
  l->end_ = std::shared_ptr<Lease::End>(new Lease::End{id, lease});
  *out = std::move(l);
  return true;
}

void Close(int64_t id) {
  std::lock_guard<std::mutex> lock(R().mu);
  Store* s = Find(id);
  if (s == nullptr) return;
  s->closed = true;
  for (auto& [lease, rec] : s->leases)
    if (!rec.opened) {  // fetched for a call that never ran: nothing will read them
      Unpin(*s, rec);
      rec.experts.clear();
    }
  for (int64_t e = 0; e < s->E; ++e) MaybeFree(*s, e);
}

StoreStats Stats(int64_t id) {
  std::lock_guard<std::mutex> lock(R().mu);
  StoreStats st;
  Store* s = Find(id);
  if (s == nullptr) return st;
  for (const Slot& slot : s->slots) {
    if (slot.block.data() == nullptr) continue;
    (slot.resident ? st.resident_bytes : st.streamed_bytes) += static_cast<int64_t>(slot.block.size());
    ++(slot.resident ? st.resident_experts : st.streamed_experts);
  }
  st.leases = static_cast<int64_t>(s->leases.size());
  st.fast_calls = s->fast_calls;
  st.fast_hits = s->fast_hits;
  st.closed = s->closed;
  return st;
}

Totals AllStores() {
  std::lock_guard<std::mutex> lock(R().mu);
  Totals t;
  for (const auto& [id, s] : R().stores) {
    if (!s->closed) {
      t.mapped += s->E * static_cast<int64_t>(s->block_bytes);
      ++t.stores;
    }
    for (const Slot& slot : s->slots)
      if (slot.block.data() != nullptr)
        (slot.resident && !s->closed ? t.resident : t.streamed) += static_cast<int64_t>(slot.block.size());
  }
  return t;
}

int64_t ExpertBytes(int64_t id) {
  std::lock_guard<std::mutex> lock(R().mu);
  Store* s = Find(id);
  return s == nullptr ? 0 : static_cast<int64_t>(s->block_bytes);
}

bool LeaseCall(int64_t id, const int32_t* ids, int64_t n, bool skip_outside,
               std::shared_ptr<Lease>* out, std::string* error, bool* exhausted) {
  *exhausted = false;
  int32_t lease = TryAcquire(id, ids, n, skip_outside);
  if (lease == 0) {  // something is not held: the store's fetch reads it (no lock held)
    std::shared_ptr<FetchFn> fetch;
    {
      std::lock_guard<std::mutex> lock(R().mu);
      Store* s = Find(id);
      if (s != nullptr) fetch = s->fetch;
    }
    if (!fetch) {
      *error = "expert_store " + std::to_string(id) + " has no reader (closed, or never opened)";
      return false;
    }
    lease = (*fetch)(ids, n, error, exhausted);
    if (lease == 0) return false;
  }
  return Open(id, lease, out, error);
}

}  // namespace nbx::store
