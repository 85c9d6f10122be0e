// Expert stores: the experts of a checkpoint read from its files, not held as
// JAX arrays (jax_nbx.loaders.map_moe).  Python reads an expert's arrays from
// the files (explicit reads, checked against the files' identity) and puts
// them here, one block per expert counted in the account under the tag
// "mapped experts", resident (kept) or streamed (freed when the last call
// reading it ends).  A handler run leases the experts its ids route to
// (LeaseCall: TryAcquire pins them when all are held, else the store's
// FetchFn, Python, reads what is missing through Begin / Put / Finish), opens
// the lease (the per-expert addresses the weight decoder takes instead of
// buffers) and ends it when it returns.  A pinned expert is never freed; a
// closed store refuses new puts and leases and frees its blocks as their
// leases end.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace nbx::store {

// One expert's array of one buffer group (abi.h's group order).
struct ArraySpec {
  xla::ffi::DataType type = xla::ffi::DataType::INVALID;
  std::vector<int64_t> dims;
  size_t bytes() const;
};

struct StoreStats {
  int64_t resident_bytes = 0, streamed_bytes = 0;  // blocks held, by kind
  int64_t resident_experts = 0, streamed_experts = 0;
  int64_t leases = 0;  // open leases
  int64_t fast_calls = 0, fast_hits = 0;  // TryAcquire's leases and the experts they held
  bool closed = false;
};

// A new store of E experts, each holding `arrays` (one per buffer group);
// `name` (the checkpoint) names it in errors.  Returns its id (> 0).
int64_t Create(const std::string& name, int64_t E, std::vector<ArraySpec> arrays);

// Expert e's arrays (srcs[i]: arrays[i]'s address and size in bytes, which
// must be its spec's) copied into one
// block; `resident`: kept until dropped, else freed when no lease holds it.
// An expert already held keeps its block (its kind updated).  false and
// `*error` when the account refuses the block, the store is closed or unknown.
// `lease` (> 0, from Begin): the expert is pinned by it too.
bool Put(int64_t id, int64_t e, const std::vector<std::pair<const void*, size_t>>& srcs,
         bool resident, int32_t lease, std::string* error);
bool Has(int64_t id, int64_t e);

// A call's lease in three steps, so that nothing it reads is freed before it
// holds it: Begin pins the experts of `experts` that are held and returns the
// lease (> 0) with the others in `*missing`; Put(..., lease) adds each one
// read to it; Finish makes each held expert resident iff keep[e] (those that
// stop being resident and are unpinned are freed) and fills `*resident`.
// 0 and `*error` when the store is closed or an expert is outside it.
int32_t Begin(int64_t id, const std::vector<int32_t>& experts, std::vector<int32_t>* missing,
              std::string* error);
bool Finish(int64_t id, int32_t lease, const std::vector<uint8_t>& keep,
            std::vector<int32_t>* resident, std::string* error);
// The lease of the experts `ids` route to (ids outside [0, E) skipped when
// `skip_outside`, else the answer is 0), when every one is held: pins them
// and counts each routed slot (Counts); else 0, nothing changed.
int32_t TryAcquire(int64_t id, const int32_t* ids, int64_t n, bool skip_outside);
// How often each expert was routed (TryAcquire's and AddCounts').
std::vector<int64_t> Counts(int64_t id);
void AddCounts(int64_t id, const std::vector<int32_t>& experts, const std::vector<int64_t>& counts);
// Ends a lease that no handler opened (a failed call): unpins its experts.
void Release(int64_t id, int32_t lease);

// A lease opened by a handler: the store's array specs and each leased
// expert's arrays; it ends (its experts unpinned) when the Lease goes.
class Lease {
 public:
  const std::vector<ArraySpec>& arrays() const { return *arrays_; }
  int64_t num_experts() const { return E_; }
  // Array i of expert e, or nullptr when e is not leased.
  const void* data(int64_t e, size_t i) const;

 private:
  friend bool Open(int64_t id, int32_t lease, std::shared_ptr<Lease>* out, std::string* error);
  struct End;
  std::shared_ptr<const std::vector<ArraySpec>> arrays_;
  std::vector<const char*> base_;  // [E]: each leased expert's block
  std::vector<size_t> offset_;     // [arrays]: each array's offset in a block
  int64_t E_ = 0;
  std::shared_ptr<End> end_;
};
bool Open(int64_t id, int32_t lease, std::shared_ptr<Lease>* out, std::string* error);

// Refuses new puts and leases; blocks are freed as their leases end.
void Close(int64_t id);
StoreStats Stats(int64_t id);
// Every open store's: mapped (E x ExpertBytes: what their experts would take
// held), resident and streamed bytes held (StoreStats).
struct Totals {
  int64_t mapped = 0, resident = 0, streamed = 0, stores = 0;
};
Totals AllStores();
// The expert's bytes (the sum of its arrays, each 64-byte aligned in its block).
int64_t ExpertBytes(int64_t id);

// What reads a store's missing experts and leases a call's (set by the
// Python module: jax_nbx/expert_store.py's fetch): the lease, or 0 with
// `*error` (`*exhausted`: the account refused).
using FetchFn = std::function<int32_t(const int32_t* ids, int64_t n, std::string* error,
                                      bool* exhausted)>;
void SetFetch(int64_t id, std::shared_ptr<FetchFn> fetch);

// The lease of the experts `n` ids route to, opened for a handler's run:
// TryAcquire, else the store's FetchFn (which reads what is missing).  false
// and `*error` (`*exhausted`: the account refused) when it cannot be had.
bool LeaseCall(int64_t id, const int32_t* ids, int64_t n, bool skip_outside,
               std::shared_ptr<Lease>* out, std::string* error, bool* exhausted);

}  // namespace nbx::store
