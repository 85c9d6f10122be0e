// Runs Metal Shading Language kernels, unchanged, as C++ on the CPU (the
// simulated device's kernels; issue #16).  Included only by
// tests/native/metal/emulated_kernels.cc, before the .metal sources: its macros (`kernel`,
// `device`, `threadgroup`, `constant`, `thread`) must not leak elsewhere.
//
// The kernels keep to a subset of MSL that Apple's compiler and this header
// both accept (checked by tests/metal/test_metal_kernels.py's subset lint):
//   - parameters: buffers (`device`/`constant` pointers or references) with
//     [[buffer(n)]], threadgroup memory only as `threadgroup T*` parameters
//     marked NBX_THREADGROUP(n) (the .metal file defines it as
//     [[threadgroup(n)]] for Apple's compiler; here it is empty, as the
//     `threadgroup` qualifier is), then exactly these built-ins, in order:
//     `uint3 tgpig [[threadgroup_position_in_grid]]`,
//     `uint tiitg [[thread_index_in_threadgroup]]`,
//     `uint sgitg [[simdgroup_index_in_threadgroup]]`,
//     `uint tiisg [[thread_index_in_simdgroup]]`;
//   - `threadgroup_barrier(mem_flags::mem_threadgroup)`;
//   - `simdgroup_float8x8`, `simdgroup_load/store` (with an element stride),
//     `simdgroup_multiply_accumulate`, `make_filled_simdgroup_matrix`;
//   - `half` and `bfloat` (MSL 3.1) read from memory and widened with
//     `float(v)` (nothing else: no arithmetic in 16 bits);
//   - float math: exp, tanh, fabs, fma, min, max, clamp (Metal has no erf:
//     prelude.metal defines nbx_erf); `as_type<T>(v)` bit casts between
//     32-bit types; `uchar` and `int8_t` bytes read from memory;
//   - structs with address-space-qualified pointer members, a `static`
//     member function that builds one and `const` member functions
//     (weights.metal's readers);
//   - every kernel has exactly one threadgroup-memory parameter (index 0),
//     used or not, so that one launcher fits every kernel;
//   - helper functions (`inline`, templates over the weight type) with
//     address-space-qualified pointer parameters;
//   - addresses taken from a table become pointers only through
//     `nbx_device_ptr<T>(address, count)`: a cast in Metal, a checked
//     translation from the simulated GPU range here (an address outside a
//     live buffer or pin fails the launch).
// Every thread of a threadgroup is a real OS thread, all of them running at
// once, so a missing barrier shows as a wrong result; the threads start
// staggered by index and threadgroup memory starts NaN-poisoned, so a read
// before another thread's write shows reliably.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "dtypes.h"

namespace nbx::metal::msl {

using uint = uint32_t;
using ulong = uint64_t;
using uchar = uint8_t;

// as_type<T>(v): v's bits as a T of the same size.
template <typename T, typename V>
T as_type(V v) {
  static_assert(sizeof(T) == sizeof(V), "as_type between types of one size");
  T t;
  std::memcpy(&t, &v, sizeof t);
  return t;
}

// IEEE binary16 and bfloat16 as stored, widened exactly by dtypes.h's conversions.
struct half {
  uint16_t bits;
  operator float() const { return ToFloat(f16{bits}); }
};
static_assert(sizeof(half) == 2, "half is 2 bytes");
struct bfloat {
  uint16_t bits;
  operator float() const { return ToFloat(bf16{bits}); }
};
static_assert(sizeof(bfloat) == 2, "bfloat is 2 bytes");

struct uint3 {
  uint32_t x = 0, y = 0, z = 0;
};

// A reusable barrier among the threads of one threadgroup.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t gen = gen_;
    if (++waiting_ == n_) {
      waiting_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen_ != gen; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, waiting_ = 0;
  uint64_t gen_ = 0;
};

// The current thread's threadgroup (set by the launcher).
struct ThreadContext {
  Barrier* barrier = nullptr;
  // translation of simulated GPU addresses; returns nullptr when refused
  std::function<void*(uint64_t, int64_t)> resolve;
  std::atomic<bool>* failed = nullptr;
  std::vector<std::vector<unsigned char>> refused;  // what refused addresses read (zeros)
};
inline thread_local ThreadContext tls;

enum class mem_flags { mem_none, mem_threadgroup, mem_device };
inline void threadgroup_barrier(mem_flags) { tls.barrier->Wait(); }

// An 8x8 simdgroup matrix.  In Metal the 32 threads of a simdgroup hold it
// together; here each thread holds all of it and every operation computes
// the whole matrix (the same values on every thread of the simdgroup).
template <typename T>
struct simdgroup_matrix8 {
  T v[64];
};
using simdgroup_float8x8 = simdgroup_matrix8<float>;

#define make_filled_simdgroup_matrix make_filled_simdgroup_matrix_impl
template <typename T, int R, int C>
simdgroup_matrix8<T> make_filled_simdgroup_matrix_impl(T x) {
  static_assert(R == 8 && C == 8, "8x8 only");
  simdgroup_matrix8<T> m;
  for (T& e : m.v) e = x;
  return m;
}

// Row-major load/store with `stride` elements between rows.
template <typename T, typename S>
void simdgroup_load(simdgroup_matrix8<T>& m, const S* src, unsigned long stride = 8) {
  for (int r = 0; r < 8; ++r)
    for (int c = 0; c < 8; ++c) m.v[r * 8 + c] = static_cast<T>(src[r * stride + c]);
}
template <typename T, typename S>
void simdgroup_store(const simdgroup_matrix8<T>& m, S* dst, unsigned long stride = 8) {
  for (int r = 0; r < 8; ++r)
    for (int c = 0; c < 8; ++c) dst[r * stride + c] = static_cast<S>(m.v[r * 8 + c]);
}
// d = a @ b + c (float accumulation, in k order)
template <typename T>
void simdgroup_multiply_accumulate(simdgroup_matrix8<T>& d, const simdgroup_matrix8<T>& a,
                                   const simdgroup_matrix8<T>& b, const simdgroup_matrix8<T>& c) {
  simdgroup_matrix8<T> out;
  for (int r = 0; r < 8; ++r)
    for (int col = 0; col < 8; ++col) {
      float s = c.v[r * 8 + col];
      for (int k = 0; k < 8; ++k) s = std::fma(a.v[r * 8 + k], b.v[k * 8 + col], s);
      out.v[r * 8 + col] = s;
    }
  d = out;
}

// Metal's float math on float arguments (the float overloads, not C's double ones).
using std::exp;
using std::fabs;
using std::fma;
using std::max;
using std::min;
using std::tanh;
template <typename T>
T clamp(T x, T lo, T hi) {
  return std::min(std::max(x, lo), hi);
}

// An address from a table as a pointer to `count` elements (see above).
template <typename T>
T* nbx_device_ptr(uint64_t address, int64_t count) {
  void* p = tls.resolve ? tls.resolve(address, count * static_cast<int64_t>(sizeof(T))) : nullptr;
  if (p == nullptr) {
    *tls.failed = true;
    // a refused address reads zeros of the promised extent (the launch fails): never out of
    // bounds; each refusal its own block, kept until the thread's work ends
    tls.refused.emplace_back(static_cast<size_t>(count > 0 ? count : 1) * sizeof(T) + alignof(T), 0);
    void* p = tls.refused.back().data();
    size_t space = tls.refused.back().size();
    return static_cast<T*>(std::align(alignof(T), sizeof(T), p, space));
  }
  return static_cast<T*>(p);
}

// Runs `body(tgpig, tiitg, sgitg, tiisg, threadgroup memory)` for a grid of
// threadgroups of `threads` threads (a multiple of 32), each group's threads
// concurrent, with `tg_floats` floats of NaN-filled threadgroup memory.
// Returns false when a thread used a refused address.
inline bool Launch(uint3 grid, int threads, int64_t tg_floats,
                   const std::function<void*(uint64_t, int64_t)>& resolve,
                   const std::function<void(uint3, uint32_t, uint32_t, uint32_t, float*)>& body) {
  std::atomic<bool> failed{false};
  std::vector<float> tg(static_cast<size_t>(tg_floats));
  for (uint32_t z = 0; z < grid.z; ++z)
    for (uint32_t y = 0; y < grid.y; ++y)
      for (uint32_t x = 0; x < grid.x; ++x) {
        std::fill(tg.begin(), tg.end(), std::nanf(""));
        Barrier barrier(threads);
        std::vector<std::thread> pool;
        pool.reserve(static_cast<size_t>(threads));
        for (int t = 0; t < threads; ++t) {
          pool.emplace_back([&, t] {
            tls.barrier = &barrier;
            tls.resolve = resolve;
            tls.failed = &failed;
            // staggered start: a read of another thread's write without a barrier shows
            std::this_thread::sleep_for(std::chrono::microseconds(20 * t));
            body(uint3{x, y, z}, static_cast<uint32_t>(t), static_cast<uint32_t>(t / 32),
                 static_cast<uint32_t>(t % 32), tg.data());
            tls = ThreadContext{};
          });
        }
        for (std::thread& th : pool) th.join();
      }
  return !failed;
}

}  // namespace nbx::metal::msl

// ---- MSL spellings (this translation unit only) ----
#define kernel
#define device
#define constant const
#define thread
#define threadgroup
#define NBX_THREADGROUP(n)
