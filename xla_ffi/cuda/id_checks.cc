// The expert-id checks, synchronous and deferred (see id_checks.h).
#include "cuda/id_checks.h"

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "abi.h"
#include "cuda/driver.h"

namespace ffi = xla::ffi;

namespace nbx::cuda {
namespace {

// Deferred expert-id checks (abi::kIdCheckDeferred): per device, a ring of
// pinned host records.  A call copies its err words and its topk_ids (both
// at most abi::kMaxDeferredErrWords) into the next record with asynchronous
// copies on its stream and records an event -- no synchronization; every
// later call on the device first reads the records whose events have
// completed, oldest first, and fails naming the earliest bad slot it finds.
// A full ring waits for its oldest record (the only wait).  The records'
// pinned bytes are counted in the device's account ("id checks").
class DeferredChecks {
 public:
  static DeferredChecks& Get() {
    static DeferredChecks c;
    return c;
  }

  // The message of the earliest completed check that found a bad slot (""
  // if none); needs the device's context current.
  std::string Poll(const Device& dev) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = rings_.find(dev.ordinal);
    if (it == rings_.end()) return "";
    return Drain(it->second, dev, /*wait_oldest=*/false);
  }

  // Enqueues this call's check: `words` err words at `err` and the n slots'
  // ids at `ids` (n = T * k <= kMaxDeferredErrWords).  Returns an error for
  // a CUDA failure, or a found bad slot of an earlier call (a full ring).
  ffi::Error Enqueue(const Device& dev, CUstream stream, CUdeviceptr err, int64_t words,
                     CUdeviceptr ids, int64_t n, int64_t k, int64_t E) {
    std::lock_guard<std::mutex> lock(mu_);
    Ring& ring = rings_[dev.ordinal];
    Driver& d = Driver::Get();
    if (ring.host == nullptr) {
      const int64_t bytes = kSlots * kRecordInts * static_cast<int64_t>(sizeof(int32_t));
      std::string why;
      void* unused = nullptr;
      if (!Account::Get().Reserve(dev, bytes, "id checks", WorkShape{}, &why, &unused))
        return ffi::Error(ffi::ErrorCode::kResourceExhausted, why);
      void* p = nullptr;
      std::vector<CUevent> events(kSlots, nullptr);
      CUresult r = d.cuMemAllocHost(&p, bytes);
      for (size_t i = 0; r == CUDA_SUCCESS && i < events.size(); ++i)
        r = d.cuEventCreate(&events[i], CU_EVENT_DISABLE_TIMING);
      if (r != CUDA_SUCCESS) {  // nothing half-built stays behind (a few events may leak)
        if (p != nullptr) d.cuMemFreeHost(p);
        Account::Get().Release(dev, bytes, "id checks", nullptr);
        return CudaError("setting up the deferred id checks", r);
      }
      ring.events = std::move(events);
      ring.meta.assign(kSlots, Meta{});
      ring.host = static_cast<int32_t*>(p);  // last: a built ring
    }
    std::string earlier;  // a bad slot of an earlier call, found waiting for room
    if (ring.meta[ring.tail].pending) earlier = Drain(ring, dev, /*wait_oldest=*/true);
    const int64_t slot = ring.tail;
    int32_t* rec = ring.host + slot * kRecordInts;
    NBX_CU("copying the expert-id check",
           d.cuMemcpyDtoHAsync(rec, err, words * sizeof(int32_t), stream));
    if (n > 0)
      NBX_CU("copying topk_ids for the expert-id check",
             d.cuMemcpyDtoHAsync(rec + abi::kMaxDeferredErrWords, ids, n * sizeof(int32_t), stream));
    NBX_CU("cuEventRecord (deferred id check)", d.cuEventRecord(ring.events[slot], stream));
    ring.meta[slot] = Meta{true, words, n, k, E, ++ring.calls};
    ring.tail = (slot + 1) % kSlots;
    // this call's own check is recorded either way; an earlier bad slot fails it now
    return earlier.empty() ? ffi::Error::Success() : ffi::Error::InvalidArgument(earlier);
  }

 private:
  static constexpr int64_t kSlots = 64;
  static constexpr int64_t kRecordInts = 2 * abi::kMaxDeferredErrWords;  // err words, then ids
  struct Meta {
    bool pending = false;
    int64_t words = 0, n = 0, k = 1, E = 0, call = 0;
  };
  struct Ring {
    int32_t* host = nullptr;
    std::vector<CUevent> events;
    std::vector<Meta> meta;
    int64_t head = 0, tail = 0, calls = 0;
  };

  // Reads the completed records from the oldest (the oldest one at any rate
  // with wait_oldest), freeing them; the first bad slot's message, or "".
  std::string Drain(Ring& ring, const Device& dev, bool wait_oldest) {
    Driver& d = Driver::Get();
    while (ring.meta[ring.head].pending) {
      const int64_t slot = ring.head;
      CUresult r = wait_oldest ? d.cuEventSynchronize(ring.events[slot])
                               : d.cuEventQuery(ring.events[slot]);
      wait_oldest = false;
      if (r == CUDA_ERROR_NOT_READY) return "";
      Meta m = ring.meta[slot];
      ring.meta[slot].pending = false;
      ring.head = (slot + 1) % kSlots;
      if (r != CUDA_SUCCESS)
        return "the deferred expert-id check of call " + std::to_string(m.call) + " on " +
               dev.Name() + " could not be read (CUresult " +
               std::to_string(static_cast<int>(r)) + ")";
      const int32_t* rec = ring.host + slot * kRecordInts;
      int32_t bad = abi::kErrNone;
      for (int64_t i = 0; i < m.words; ++i) bad = std::min(bad, rec[i]);
      if (bad != abi::kErrNone)
        return "topk_ids[" + std::to_string(bad / m.k) + ", " + std::to_string(bad % m.k) +
               "] = " +
               (bad >= 0 && bad < m.n ? std::to_string(rec[abi::kMaxDeferredErrWords + bad])
                                      : std::string("?")) +
               " is outside [0, " + std::to_string(m.E) + ") in an earlier call (call " +
               std::to_string(m.call) + " of the fused MoE on " + dev.Name() +
               "; JAX_NBX_CUDA_CHECK_IDS=deferred reports it at the next call; that slot was "
               "skipped, not read)";
    }
    return "";
  }

  std::mutex mu_;
  std::unordered_map<int32_t, Ring> rings_;
};

}  // namespace

ffi::Error CheckIdsNow(CUstream stream, CUdeviceptr err, int64_t words, CUdeviceptr ids,
                       int64_t n, int64_t k, int64_t E) {
  Driver& d = Driver::Get();
  std::vector<int32_t> vals(static_cast<size_t>(words), abi::kErrNone);
  NBX_CU("reading the expert-id check",
         d.cuMemcpyDtoHAsync(vals.data(), err, words * sizeof(int32_t), stream));
  NBX_CU("cuStreamSynchronize", d.cuStreamSynchronize(stream));
  int32_t bad = abi::kErrNone;
  for (int32_t v : vals) bad = std::min(bad, v);
  if (bad != abi::kErrNone) {
    if (bad < 0 || bad >= n)  // never from our kernels; never read out of bounds either
      return ffi::Error::Internal("the expert-id check holds slot " + std::to_string(bad) +
                                  ", outside the call's " + std::to_string(n) + " slots");
    int32_t id = 0;
    NBX_CU("reading the bad expert id",
           d.cuMemcpyDtoHAsync(&id, ids + static_cast<int64_t>(bad) * 4, 4, stream));
    NBX_CU("cuStreamSynchronize", d.cuStreamSynchronize(stream));
    return ffi::Error::InvalidArgument(
        "topk_ids[" + std::to_string(bad / k) + ", " + std::to_string(bad % k) + "] = " +
        std::to_string(id) + " is outside [0, " + std::to_string(E) + ")");
  }
  return ffi::Error::Success();
}

std::string PollDeferredIdChecks(const Device& dev) { return DeferredChecks::Get().Poll(dev); }

ffi::Error EnqueueDeferredIdCheck(const Device& dev, CUstream stream, CUdeviceptr err,
                                  int64_t words, CUdeviceptr ids, int64_t n, int64_t k,
                                  int64_t E) {
  return DeferredChecks::Get().Enqueue(dev, stream, err, words, ids, n, k, E);
}

}  // namespace nbx::cuda
