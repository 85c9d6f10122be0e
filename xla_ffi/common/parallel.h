// ParallelFor over XLA's intra-op thread pool (never threads of our own).
//
// The calling thread works too.  Items are claimed from a shared counter, so
// a task the pool starts late (or never, while its threads are busy) costs
// nothing: the caller finishes the remaining items itself and waits only for
// items already claimed by running tasks.  Late tasks find no item left and
// return without touching the caller's function, which may be gone by then.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace nbx {

namespace detail {
struct ParallelState {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
  void* fn = nullptr;
  void (*call)(void*, int64_t, int) = nullptr;
  std::mutex mu;
  std::condition_variable cv;

  // Claims and runs items until none is left.
  void Drain(int worker) {
    for (;;) {
      int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= total) return;
      call(fn, i, worker);
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == total) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};
}  // namespace detail

// Number of workers ParallelFor may use with this pool (caller included).
inline int MaxWorkers(xla::ffi::ThreadPool& pool) {
  int64_t n = pool.num_threads();
  return static_cast<int>(std::clamp<int64_t>(n + 1, 1, 256));
}

// Calls fn(item, worker) for item in [0, n); worker is in [0, workers).
// Returns after every call has finished.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int workers, int64_t n, F&& fn) {
  if (n <= 0) return;
  workers = static_cast<int>(std::min<int64_t>(workers, n));
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  auto state = std::make_shared<detail::ParallelState>();
  state->total = n;
  state->fn = static_cast<void*>(&fn);
  state->call = [](void* f, int64_t i, int w) {
    (*static_cast<std::remove_reference_t<F>*>(f))(i, w);
  };
  for (int w = 1; w < workers; ++w) {
    pool.Schedule([state, w] { state->Drain(w); });
  }
  state->Drain(0);
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n; });
}

}  // namespace nbx
