// Pieces the CPU handlers (moe_forward.cc, moe_backward.cc) share: the
// typed enum attributes, workspace carving, the routing arguments' checks and
// their messages, storing float32 rows in x's dtype, stage timings.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <cstddef>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <string>

#include "abi.h"
#include "account.h"
#include "common/attr_types.h"  // the enum attributes' decoding
#include "common/slots.h"
#include "dtypes.h"
#include "common/parallel.h"
#include "xla/ffi/api/ffi.h"


namespace nbx {

// A band's workspace: `bytes` counted in cpu:0's account under `tag`, or
// RESOURCE_EXHAUSTED with the account's advice, which sees the band as
// `tokens` rows of width H of which `fixed` bytes do not shrink with it.
inline xla::ffi::Error AllocateWorkspace(size_t bytes, size_t fixed, int64_t tokens, int64_t H,
                                         const char* tag, Workspace* ws) {
  std::string err;
  if (!Workspace::Allocate(Device{"cpu", 0}, bytes, tag,
                           WorkShape{tokens, H, static_cast<int64_t>(fixed)}, ws, &err))
    return xla::ffi::Error(xla::ffi::ErrorCode::kResourceExhausted, err);
  return xla::ffi::Error::Success();
}

// An activation code inside abi.h's range, else an error naming it.
// kClampedSwiGLU's parameters: a finite alpha and a finite limit > 0.
inline xla::ffi::Error CheckActivation(abi::Activation a, float alpha, float limit) {
  const int32_t c = static_cast<int32_t>(a);
  if (c < 0 || c >= abi::kNumActivations)
    return xla::ffi::Error::InvalidArgument("unknown activation code " + std::to_string(c));
  if (a == abi::Activation::kClampedSwiGLU &&
      (!std::isfinite(alpha) || !std::isfinite(limit) || !(limit > 0.0f)))
    return xla::ffi::Error::InvalidArgument(
        "swiglu_clamped needs a finite act_alpha and a finite act_limit > 0; got act_alpha=" +
        std::to_string(alpha) + ", act_limit=" + std::to_string(limit));
  return xla::ffi::Error::Success();
}

inline size_t AlignUp(size_t n) { return (n + 63) / 64 * 64; }

// Carves typed arrays out of one workspace block.  Measuring (base nullptr)
// saturates: a layout whose size overflows measures SIZE_MAX, which no
// budget holds, instead of wrapping to a small number.
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}
  // The next array of `rows` x `cols` T (nullptr when only measuring).
  template <typename T>
  T* Take(int64_t rows, int64_t cols = 1) {
    T* p = base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + offset_);
    size_t n = 0, bytes = 0;
    if (rows < 0 || cols < 0 ||
        __builtin_mul_overflow(static_cast<size_t>(rows), static_cast<size_t>(cols), &n) ||
        __builtin_mul_overflow(n, sizeof(T), &bytes) || bytes > SIZE_MAX - 64 ||
        __builtin_add_overflow(offset_, AlignUp(bytes), &offset_))
      offset_ = SIZE_MAX;
    return p;
  }
  size_t used() const { return offset_; }

 private:
  char* base_;
  size_t offset_ = 0;
};

template <typename YT>
inline void StoreRow(const float* src, int64_t H, YT* dst) {
  for (int64_t h = 0; h < H; ++h) dst[h] = FromFloat<YT>(src[h]);
}

// Row `row` of a [*, H] array of dtype t (F32, BF16 or F16) = src.
inline void StoreRowAs(xla::ffi::DataType t, const float* src, int64_t H, void* base,
                       int64_t row) {
  switch (t) {
    case xla::ffi::DataType::F32: StoreRow(src, H, static_cast<float*>(base) + row * H); break;
    case xla::ffi::DataType::BF16: StoreRow(src, H, static_cast<bf16*>(base) + row * H); break;
    default: StoreRow(src, H, static_cast<f16*>(base) + row * H); break;
  }
}

// dst[i] = src[i] widened to float32, for n elements of dtype t (F32, BF16 or F16).
inline void LoadAsFloat(xla::ffi::DataType t, const void* src, int64_t n, float* dst) {
  switch (t) {
    case xla::ffi::DataType::F32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      break;
    case xla::ffi::DataType::BF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = ToFloat(static_cast<const bf16*>(src)[i]);
      break;
    default:
      for (int64_t i = 0; i < n; ++i) dst[i] = ToFloat(static_cast<const f16*>(src)[i]);
      break;
  }
}

// Tokens [t0, t1): out[t] = the sum over j in order of O[rows[(t-t0)*k + j]]
// ([*, H] float32 rows, summed in place into the first), stored in dtype
// `type`; a row is -1 for a skipped slot, and a token whose slots were all
// skipped gets a zero row (0 is all-zero bits in every dtype).
inline void CombineSlotRows(xla::ffi::ThreadPool& pool, int workers, int64_t t0, int64_t t1,
                            int64_t k, const int32_t* rows, float* O, int64_t H,
                            xla::ffi::DataType type, void* out) {
  const size_t row_bytes = static_cast<size_t>(H) * xla::ffi::ByteWidth(type);
  ParallelFor(pool, workers, (t1 - t0 + 15) / 16, [&](int64_t it, int) {
    for (int64_t t = t0 + it * 16; t < std::min(t1, t0 + it * 16 + 16); ++t) {
      const int32_t* r = rows + (t - t0) * k;
      float* first = nullptr;
      for (int64_t j = 0; j < k; ++j) {
        if (r[j] < 0) continue;
        float* o = O + static_cast<int64_t>(r[j]) * H;
        if (first == nullptr) {
          first = o;
          continue;
        }
        for (int64_t h = 0; h < H; ++h) first[h] += o[h];
      }
      if (first == nullptr)
        std::memset(static_cast<char*>(out) + t * row_bytes, 0, row_bytes);
      else
        StoreRowAs(type, first, H, out, t);
    }
  });
}

inline bool IsFloatType(xla::ffi::DataType t) {
  return t == xla::ffi::DataType::F32 || t == xla::ffi::DataType::BF16 ||
         t == xla::ffi::DataType::F16;
}

inline std::string Shape(xla::ffi::AnyBuffer::Dimensions d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(d[i]);
  }
  if (d.size() == 1) s += ",";
  return s + ")";
}

// x [T, H] in a float dtype, topk_weights and topk_ids [T, k]; sets T, H, k.
inline xla::ffi::Error CheckRouting(xla::ffi::AnyBuffer x,
                                    xla::ffi::Buffer<xla::ffi::F32> topk_w,
                                    xla::ffi::Buffer<xla::ffi::S32> topk_ids, int64_t* T,
                                    int64_t* H, int64_t* k) {
  using xla::ffi::Error;
  auto xd = x.dimensions();
  auto wd = topk_w.dimensions();
  auto id = topk_ids.dimensions();
  if (xd.size() != 2) return Error::InvalidArgument("x must be [T, H], got " + Shape(xd));
  *T = xd[0];
  *H = xd[1];
  if (wd.size() != 2 || wd[0] != *T)
    return Error::InvalidArgument("topk_weights must be [T, k] with T=" + std::to_string(*T) +
                                  ", got " + Shape(wd));
  *k = wd[1];
  if (id.size() != 2 || id[0] != *T || id[1] != *k)
    return Error::InvalidArgument("topk_ids must have the shape of topk_weights " + Shape(wd) +
                                  ", got " + Shape(id));
  if (!IsFloatType(x.element_type()))
    return Error::InvalidArgument("x must be float32, bfloat16 or float16");
  return Error::Success();
}

// A forward's routing (CheckRouting), its result y (x's shape and dtype)
// and its activation's parameters; sets T, H, k.
inline xla::ffi::Error CheckForwardCall(xla::ffi::AnyBuffer x,
                                        xla::ffi::Buffer<xla::ffi::F32> topk_w,
                                        xla::ffi::Buffer<xla::ffi::S32> topk_ids,
                                        xla::ffi::Result<xla::ffi::AnyBuffer>& y,
                                        abi::Activation act, float alpha, float limit, int64_t* T,
                                        int64_t* H, int64_t* k) {
  if (xla::ffi::Error e = CheckRouting(x, topk_w, topk_ids, T, H, k); e.failure()) return e;
  if (y->element_type() != x.element_type() || y->dimensions().size() != 2 ||
      y->dimensions()[0] != *T || y->dimensions()[1] != *H)
    return xla::ffi::Error::InvalidArgument("y must have x's shape and dtype");
  return CheckActivation(act, alpha, limit);
}

// Every expert id in [0, E), checked before anything is read through them
// (skipped when ids outside the range mean "held elsewhere").
inline xla::ffi::Error CheckIds(const int32_t* ids, int64_t T, int64_t k, int64_t E,
                                bool skip_outside) {
  for (int64_t i = 0; i < T * k && !skip_outside; ++i) {
    if (ids[i] < 0 || ids[i] >= E)
      return xla::ffi::Error::InvalidArgument(
          "topk_ids[" + std::to_string(i / k) + ", " + std::to_string(i % k) + "] = " +
          std::to_string(ids[i]) + " is outside [0, " + std::to_string(E) + ")");
  }
  return xla::ffi::Error::Success();
}

// The call's T * k slots, and the rows they pad to (`pad` per expert; 1: no
// padding), within the int32 indices of the handlers (abi::kMaxSlots).
inline xla::ffi::Error CheckSlots(int64_t T, int64_t k, int64_t E, int64_t pad) {
  const int64_t S = T * k;  // T and k are dimensions of topk_ids: no overflow
  if (S > abi::kMaxSlots || MaxPaddedRows(S, E, pad) > INT32_MAX)
    return xla::ffi::Error::InvalidArgument(
        "T * k = " + std::to_string(T) + " * " + std::to_string(k) + " = " + std::to_string(S) +
        " slots (padded to " + std::to_string(MaxPaddedRows(S, E, pad)) +
        " rows) exceed the handler's int32 indices (at most " + std::to_string(abi::kMaxSlots) +
        " slots); split the tokens over several calls");
  return xla::ffi::Error::Success();
}

// Whether Stages print (set from Python: jax_nbx/_env.py's JAX_NBX_PROFILE).
// Defined in handler_common.cc, in the core library: not inline, so that every
// module reads the one flag the handlers read (an inline function's static
// would be one copy per module, the modules' symbols being hidden).
std::atomic<bool>& ProfileStages();

// Stage timings (when profiling: one line per band or group on stderr): wall
// time and the process's CPU time (all threads), which a shared machine
// disturbs less.
class Stages {
 public:
  explicit Stages(const char* what) : on_(ProfileStages().load()), what_(what) {
    Mark(nullptr);
  }
  void Mark(const char* name) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    const double cpu = static_cast<double>(std::clock()) / CLOCKS_PER_SEC;
    if (name != nullptr) {
      char buf[96];
      std::snprintf(buf, sizeof buf, " %s=%.1f/%.1f", name,
                    std::chrono::duration<double, std::milli>(now - last_).count(),
                    (cpu - last_cpu_) * 1e3);
      line_ += buf;
    }
    last_ = now;
    last_cpu_ = cpu;
  }
  ~Stages() {
    if (on_) std::fprintf(stderr, "jax_nbx %s (wall/cpu ms):%s\n", what_, line_.c_str());
  }

 private:
  bool on_;
  const char* what_;
  std::string line_;
  std::chrono::steady_clock::time_point last_;
  double last_cpu_ = 0;
};

}  // namespace nbx
