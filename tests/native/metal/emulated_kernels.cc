// The Metal kernels compiled as C++ through the MSL emulation (see
// emulated_kernels.h).  Every header comes first: msl_emulation.h's macros
// (`device`, `thread`, ...) are for the .metal sources below only.
#include "native/metal/emulated_kernels.h"

#include <atomic>
#include <cmath>
#include <cstddef>
#include <functional>
#include <map>
#include <type_traits>
#include <utility>

#include "abi.h"
#include "metal/kernels/params.h"
#include "native/metal/sim_device.h"
// -- after this line: the emulation and the kernels, nothing else --
#include "native/metal/msl_emulation.h"

#if defined(__clang__)
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wunknown-attributes"
#elif defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wattributes"
#endif
#define NBX_MSL_EMULATION 1

// The library in the order CMake embeds it for Apple (prelude.metal says which).
namespace nbx::metal::kernels {
using namespace nbx::metal::msl;
using namespace nbx::metal::params;
#include "metal/kernels/prelude.metal"
#include "metal/kernels/weights.metal"
#include "metal/kernels/moe_gemm.metal"
#include "metal/kernels/moe_gemv.metal"
#include "metal/kernels/moe_lora.metal"
#include "metal/kernels/moe_order.metal"
#include "metal/kernels/moe_combine.metal"
}  // namespace nbx::metal::kernels

namespace nbx::metal::kernels_drop_barrier {
using namespace nbx::metal::msl;
using namespace nbx::metal::params;
#define NBX_TEST_DROP_BARRIER 1
#include "metal/kernels/prelude.metal"
#include "metal/kernels/weights.metal"
#include "metal/kernels/moe_gemm.metal"
#undef NBX_TEST_DROP_BARRIER
}  // namespace nbx::metal::kernels_drop_barrier

// the MSL spellings end with the kernels
#undef kernel
#undef device
#undef constant
#undef thread
#undef threadgroup

#if defined(__clang__)
#pragma clang diagnostic pop
#elif defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

namespace nbx::metal {
namespace {

// What one emulated thread hands its kernel: the resolved arguments, the
// threadgroup memory and the thread-position built-ins.
struct Ctx {
  const std::vector<void*>* args;
  float* tg;
  msl::uint3 tgpig;
  uint32_t tiitg, sgitg, tiisg;
};

// Every kernel's parameters are: buffer arguments, one threadgroup pointer,
// then tgpig, tiitg, sgitg, tiisg (the subset msl_emulation.h documents).
constexpr size_t kTrailing = 5;

template <typename T, size_t I, size_t N>
T Pick(const Ctx& c) {
  if constexpr (I + 1 == N) return c.tiisg;
  else if constexpr (I + 2 == N) return c.sgitg;
  else if constexpr (I + 3 == N) return c.tiitg;
  else if constexpr (I + 4 == N) return c.tgpig;
  else if constexpr (I + 5 == N) return reinterpret_cast<T>(c.tg);
  else if constexpr (std::is_pointer_v<T>) return static_cast<T>((*c.args)[I]);
  else return *static_cast<std::remove_reference_t<T>*>((*c.args)[I]);  // a parameter block
}

template <typename... A, size_t... I>
void CallWith(void (*f)(A...), const Ctx& c, std::index_sequence<I...>) {
  f(Pick<A, I, sizeof...(A)>(c)...);
}

// A parameter's kind: 0 for a buffer (a pointer), else its block's size.
template <typename T>
size_t BlockBytes() {
  if constexpr (std::is_pointer_v<T>) return 0;
  else return sizeof(std::remove_cv_t<std::remove_reference_t<T>>);
}

struct Entry {
  std::vector<size_t> params;  // per buffer argument: 0 (buffer) or a block's bytes
  std::function<void(const Ctx&)> call;
};

template <typename... A>
Entry Make(void (*f)(A...)) {
  static_assert(sizeof...(A) >= kTrailing, "a kernel ends in a threadgroup pointer and 4 built-ins");
  Entry e;
  size_t i = 0;
  ((i++ < sizeof...(A) - kTrailing ? e.params.push_back(BlockBytes<A>()) : void()), ...);
  e.call = [f](const Ctx& c) { CallWith(f, c, std::index_sequence_for<A...>{}); };
  return e;
}

const std::map<std::string, Entry>& Library() {
  static const std::map<std::string, Entry> lib = [] {
    namespace k = kernels;
    std::map<std::string, Entry> m;
#define NBX_ADD_VARIANT(v)                                  \
  m["nbx_moe_gemm_" #v] = Make(&k::nbx_moe_gemm_##v); \
  m["nbx_moe_gemv_" #v] = Make(&k::nbx_moe_gemv_##v);
    NBX_ADD_VARIANT(f32) NBX_ADD_VARIANT(f16) NBX_ADD_VARIANT(bf16)
    NBX_ADD_VARIANT(int8_f32) NBX_ADD_VARIANT(int8_bf16) NBX_ADD_VARIANT(int4_f32)
    NBX_ADD_VARIANT(int4_bf16) NBX_ADD_VARIANT(fp8_f32) NBX_ADD_VARIANT(fp8_bf16)
    NBX_ADD_VARIANT(mxfp4) NBX_ADD_VARIANT(mxfp8) NBX_ADD_VARIANT(nvfp4)
#undef NBX_ADD_VARIANT
    m["nbx_lora_xa"] = Make(&k::nbx_lora_xa);
    m["nbx_lora_add"] = Make(&k::nbx_lora_add);
    m["nbx_lora_glu"] = Make(&k::nbx_lora_glu);
    m["nbx_count_experts"] = Make(&k::nbx_count_experts);
    m["nbx_expert_offsets"] = Make(&k::nbx_expert_offsets);
    m["nbx_scatter_slots"] = Make(&k::nbx_scatter_slots);
    m["nbx_prepare_rows"] = Make(&k::nbx_prepare_rows);
    m["nbx_moe_combine"] = Make(&k::nbx_moe_combine);
    m["nbx_moe_gemm_f32__drop_barrier"] = Make(&kernels_drop_barrier::nbx_moe_gemm_f32);
    return m;
  }();
  return lib;
}

}  // namespace

float EmulatedErf(float x) { return kernels::nbx_erf(x); }

float EmulatedMinifloat(char kind, uint32_t code) {
  switch (kind) {
    case 'f': return kernels::nbx_e2m1(code);  // E2M1 (FP4)
    case '8': return kernels::nbx_e4m3(code);
    case 's': return kernels::nbx_e8m0(code);
    default: return std::nanf("");
  }
}

namespace {
template <typename D>
struct ReaderTag {
  using type = D;
};

// f(ReaderTag<D>{}) for the reader of (format, type): weights.metal's kernel
// variants; false for a pair that has none (e.g. float16 scales).
template <typename F>
bool WithReader(abi::WeightFormat format, WeightType t, F&& f) {
  using namespace kernels;
  using msl::bfloat;
  using msl::half;
  switch (format) {
    case abi::WeightFormat::kDense:
      if (t == WeightType::kF16) f(ReaderTag<nbx_dense<half>>{});
      else if (t == WeightType::kBF16) f(ReaderTag<nbx_dense<bfloat>>{});
      else f(ReaderTag<nbx_dense<float>>{});
      return true;
    case abi::WeightFormat::kInt8:
      if (t == WeightType::kF16) return false;
      if (t == WeightType::kBF16) f(ReaderTag<nbx_int8<bfloat>>{});
      else f(ReaderTag<nbx_int8<float>>{});
      return true;
    case abi::WeightFormat::kInt4:
      if (t == WeightType::kF16) return false;
      if (t == WeightType::kBF16) f(ReaderTag<nbx_int4<bfloat>>{});
      else f(ReaderTag<nbx_int4<float>>{});
      return true;
    case abi::WeightFormat::kFp8:
      if (t == WeightType::kF16) return false;
      if (t == WeightType::kBF16) f(ReaderTag<nbx_fp8<bfloat>>{});
      else f(ReaderTag<nbx_fp8<float>>{});
      return true;
    case abi::WeightFormat::kMxfp4: f(ReaderTag<nbx_mxfp4>{}); return true;
    case abi::WeightFormat::kMxfp8: f(ReaderTag<nbx_mxfp8>{}); return true;
    case abi::WeightFormat::kNvfp4: f(ReaderTag<nbx_nvfp4>{}); return true;
  }
  return false;
}
}  // namespace

bool EmulatedWeights(WeightKind w, const std::vector<HostPart>& parts, uint32_t K, uint32_t N,
                     uint32_t group, float* out, std::string* error) {
  // the parts in the table as one expert (e = 1 of E = 2) of the down projection: the
  // readers' table indexing is part of what is checked; other entries resolve nowhere
  constexpr uint32_t kE = 2, kProj = 2, kExpert = 1;
  std::vector<uint64_t> table(abi::kNumParts * abi::kNumProjections * kE, 0);
  for (size_t i = 0; i < parts.size() && i < static_cast<size_t>(abi::kNumParts); ++i)
    table[abi::GroupIndex(static_cast<int32_t>(i), kProj) * kE + kExpert] =
        static_cast<uint64_t>(reinterpret_cast<uintptr_t>(parts[i].data));
  params::GemmParams p{};
  p.K = K;
  p.N = N;
  p.E = kE;
  p.group = group;
  std::atomic<bool> failed{false};
  msl::tls.failed = &failed;
  msl::tls.resolve = [&parts](uint64_t a, int64_t bytes) -> void* {
    for (const HostPart& h : parts) {  // a read must lie inside one part
      const uint64_t lo = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(h.data));
      if (a >= lo && a + static_cast<uint64_t>(bytes) <= lo + static_cast<uint64_t>(h.bytes))
        return reinterpret_cast<void*>(static_cast<uintptr_t>(a));
    }
    return nullptr;
  };
  const bool known = WithReader(w.format, w.type, [&](auto tag) {
    using D = typename decltype(tag)::type;
    const D r = D::load(table.data(), kProj, static_cast<int>(kExpert), p);
    if (failed) return;  // the reader's extent of a part is not the part: nothing read
    for (uint32_t k = 0; k < K; ++k)
      for (uint32_t n = 0; n < N; ++n) out[static_cast<size_t>(k) * N + n] = r.at(k, n);
  });
  msl::tls = msl::ThreadContext{};
  if (!known) *error = "weights.metal has no reader for this format and type";
  else if (failed) *error = "a reader's extent of a part is not inside that part";
  return known && !failed;
}

std::vector<std::string> EmulatedKernelNames() {
  std::vector<std::string> names;
  for (const auto& [name, e] : Library()) names.push_back(name);
  return names;
}

bool CheckEmulated(const Dispatch& d, std::string* error) {
  auto it = Library().find(d.kernel);
  if (it == Library().end()) {
    *error = "the Metal library has no kernel '" + d.kernel + "'";
    return false;
  }
  const std::vector<size_t>& params = it->second.params;
  if (d.args.size() != params.size()) {
    *error = d.kernel + " takes " + std::to_string(params.size()) + " buffer arguments; got " +
             std::to_string(d.args.size());
    return false;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const Arg& a = d.args[i];
    if (params[i] == 0 && (!a.bytes.empty() || !a.buffer || a.offset < 0 ||
                           a.offset > a.buffer.length)) {
      *error = d.kernel + " argument " + std::to_string(i) + " must be a live buffer and an offset in it";
      return false;
    }
    if (params[i] != 0 && a.bytes.size() != params[i]) {
      *error = d.kernel + " argument " + std::to_string(i) + " is a parameter block of " +
               std::to_string(params[i]) + " bytes; got " + std::to_string(a.bytes.size());
      return false;
    }
  }
  if (d.threads == 0 || d.threads % 32 != 0 || d.threads > 1024 || d.threadgroup_bytes < 0 ||
      d.threadgroup_bytes > 32768) {
    *error = d.kernel + ": threads per threadgroup must be a multiple of 32 up to 1024 and "
             "threadgroup memory at most 32 KiB";
    return false;
  }
  return true;
}

bool RunEmulated(SimDevice& sim, const Dispatch& d, std::string* error) {
  if (!CheckEmulated(d, error)) return false;
  if (d.grid[0] == 0 || d.grid[1] == 0 || d.grid[2] == 0) return true;  // nothing to run
  const Entry& entry = Library().at(d.kernel);
  std::vector<void*> args(d.args.size());
  for (size_t i = 0; i < d.args.size(); ++i) {
    const Arg& a = d.args[i];
    if (!a.bytes.empty()) {
      args[i] = const_cast<unsigned char*>(a.bytes.data());  // a copy, as setBytes makes
      continue;
    }
    args[i] = sim.Resolve(a.buffer.gpu + static_cast<uint64_t>(a.offset),
                          std::max<int64_t>(a.buffer.length - a.offset, 1));
    if (args[i] == nullptr) {
      *error = d.kernel + " argument " + std::to_string(i) + ": a buffer that is not live or not resident";
      return false;
    }
  }
  auto resolve = [&sim](uint64_t a, int64_t bytes) -> void* { return sim.Resolve(a, bytes); };
  const msl::uint3 grid{d.grid[0], d.grid[1], d.grid[2]};
  const int64_t tg_floats = (d.threadgroup_bytes + 3) / 4;
  const bool ok = msl::Launch(grid, static_cast<int>(d.threads), tg_floats, resolve,
                              [&](msl::uint3 tgpig, uint32_t tiitg, uint32_t sgitg, uint32_t tiisg,
                                  float* tg) { entry.call(Ctx{&args, tg, tgpig, tiitg, sgitg, tiisg}); });
  if (!ok) *error = d.kernel + " read through an address no resident buffer or pin covers";
  return ok;
}

}  // namespace nbx::metal
