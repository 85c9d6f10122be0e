// The nanobind module jax_nbx._ffi: the product's bindings (handler capsules,
// the account's view, the CPU and Metal settings).  The C++ behind them is the
// core library (libnbx_core, CMakeLists.txt); the test-only bindings are the
// other module's, jax_nbx._ffi_testing (testing/module.cc, NBX_TESTING=ON).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "abi.h"
#include "abi_export.h"
#include "account.h"
#include "cpu/kernel_table.h"
#include "cpu/moe_backward.h"
#include "cpu/moe_forward.h"
#include "cpu/prepack.h"
#include "metal/moe_metal.h"
#include "metal/runtime.h"
#include "metal/tables.h"
#ifdef NBX_WITH_CUDA
#include "cuda/moe_cuda.h"
#endif

namespace nb = nanobind;

namespace {
template <typename T>
nb::capsule Capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "not an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict StatsDict(const nbx::DeviceStats& s) {
  nb::dict d;
  d["live"] = s.live;
  d["peak"] = s.peak;
  d["budget"] = s.budget;
  d["refusals"] = s.refusals;
  d["largest_request"] = s.largest_request;
  d["allocations"] = s.allocations;
  d["cached"] = s.cached;
  nb::dict tags;
  for (const auto& [tag, bytes] : s.live_by_tag) tags[tag.c_str()] = bytes;
  d["live_by_tag"] = tags;
  return d;
}
// The workspace formulas' arguments: sizes >= 0, k >= 1, workers >= 1, and
// tokens * k within the handlers' slots (abi::kMaxSlots).
void CheckFormulaArgs(int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I, int workers) {
  if (tokens < 0 || k < 1 || E < 1 || H < 0 || I < 0 || workers < 1)
    throw nb::value_error(("workspace formula arguments out of range: tokens=" +
                           std::to_string(tokens) + " k=" + std::to_string(k) + " E=" +
                           std::to_string(E) + " H=" + std::to_string(H) + " I=" +
                           std::to_string(I) + " workers=" + std::to_string(workers)).c_str());
  if (tokens > nbx::abi::kMaxSlots / k)
    throw nb::value_error(("tokens * k = " + std::to_string(tokens) + " * " + std::to_string(k) +
                           " slots exceed the handlers' limit of " +
                           std::to_string(nbx::abi::kMaxSlots)).c_str());
}
}  // namespace

NB_MODULE(_ffi, m) {
  m.doc() = "jax_nbx XLA FFI handlers (CPU) and the memory account";
  m.def("abi", &nbx::AbiDict, "The cross-language contract (xla_ffi/abi.h) as a dict.");
  m.def("cpu_handlers", []() {
    nb::dict d;
    d[nbx::abi::kTargetForward] = Capsule(nbx::FusedMoeForwardCpu);
    d[nbx::abi::kTargetBackward] = Capsule(nbx::FusedMoeBackwardCpu);
    d[nbx::abi::kTargetMetalForward] = Capsule(nbx::FusedMoeForwardMetal);
    d[nbx::abi::kTargetPrepack] = Capsule(nbx::PrepackCpu);
    return d;
  }, "Handler capsules for platform 'cpu', keyed by FFI target name.");
  m.def("set_profile", [](bool on) { nbx::ProfileStages().store(on); },
        "Prints the CPU handlers' stage timings to stderr (JAX_NBX_PROFILE).");

  m.def("forward_workspace_bytes", [](int64_t tokens, int64_t k, int64_t E, int64_t H,
                                      int64_t I, int workers, bool bf16_dot, int64_t lora_rank) {
    CheckFormulaArgs(tokens, k, E, H, I, workers);
    if (lora_rank < 0) throw nb::value_error(("lora_rank must be >= 0, got " + std::to_string(lora_rank)).c_str());
    return nbx::SaturatedBytes(
        lora_rank > 0 ? nbx::LoraForwardWorkspaceBytes(tokens, k, E, H, I, lora_rank, workers)
                      : nbx::ForwardWorkspaceBytes(tokens, k, E, H, I, workers, bf16_dot));
  }, nb::arg("tokens"), nb::arg("k"), nb::arg("E"), nb::arg("H"), nb::arg("I"),
     nb::arg("workers"), nb::arg("bf16_dot") = false, nb::arg("lora_rank") = 0,
     "Workspace bytes of one CPU forward band of `tokens` tokens (`bf16_dot`: precision='bfloat16'; "
     "`lora_rank`: LoRA adapters of these ranks summed).");
  m.def("backward_workspace_bytes", [](int64_t tokens, int64_t k, int64_t E, int64_t H,
                                       int64_t I, int workers, int64_t lora_rank) {
    CheckFormulaArgs(tokens, k, E, H, I, workers);
    if (lora_rank < 0) throw nb::value_error(("lora_rank must be >= 0, got " + std::to_string(lora_rank)).c_str());
    return nbx::SaturatedBytes(nbx::BackwardWorkspaceBytes(tokens, k, E, H, I, workers, lora_rank));
  }, nb::arg("tokens"), nb::arg("k"), nb::arg("E"), nb::arg("H"), nb::arg("I"),
     nb::arg("workers"), nb::arg("lora_rank") = 0,
     "Workspace bytes of one CPU backward band of `tokens` tokens (`lora_rank`: the adapters' "
     "ranks summed).");

  m.def("account_unlimited", []() { return nbx::Account::kUnlimited; });
  m.def("set_budget", [](const std::string& platform, int ordinal, int64_t bytes) {
    nbx::Account::Get().SetBudget({platform, ordinal}, bytes);
  }, nb::arg("platform"), nb::arg("ordinal"), nb::arg("bytes"));
  m.def("set_wait_ms", [](int64_t ms) { nbx::Account::Get().SetWaitMillis(ms); });
  m.def("stats", [](const std::string& platform, int ordinal) {
    return StatsDict(nbx::Account::Get().Stats({platform, ordinal}));
  }, nb::arg("platform"), nb::arg("ordinal"));
  m.def("all_stats", []() {
    nb::dict d;
    for (const auto& [name, s] : nbx::Account::Get().AllStats()) d[name.c_str()] = StatsDict(s);
    return d;
  });
  m.def("reset_peak", []() { nbx::Account::Get().ResetPeak(); });
  m.def("drop_cached", []() { nbx::Account::Get().DropCached(); });
  m.def("last_refusal", []() -> std::optional<nb::dict> {
    auto r = nbx::Account::Get().LastRefusal();
    if (!r) return std::nullopt;
    nb::dict d;
    d["device"] = r->device.Name();
    d["tag"] = r->tag;
    d["requested"] = r->requested;
    d["free"] = r->free;
    d["total"] = r->total;
    d["shortfall"] = r->shortfall;
    d["shape"] = r->shape.known() ? nb::object(nb::make_tuple(r->shape.rows, r->shape.cols))
                                  : nb::none();
    d["fixed_bytes"] = r->shape.fixed_bytes;
    d["message"] = r->message;
    return d;
  });
  m.def("what_would_have_fit", [](int64_t requested, int64_t free, int64_t total, int64_t rows,
                                  int64_t cols, int64_t fixed_bytes) {
    return nbx::WhatWouldHaveFit(requested, free, total, nbx::WorkShape{rows, cols, fixed_bytes});
  }, nb::arg("requested"), nb::arg("free"), nb::arg("total"), nb::arg("rows") = 0,
     nb::arg("cols") = 0, nb::arg("fixed_bytes") = 0);
  m.def("cpu_isa", []() { return std::string(nbx::ActiveKernels()->isa); },
        "The instruction set of the CPU micro-kernels in use.");
  m.def("cpu_supported_isas", []() { return std::string(nbx::SupportedIsas()); });
  m.def("cpu_default_isa", []() { return std::string(nbx::DefaultKernels()->isa); },
        "The instruction set (or per-family composition) chosen for this CPU by default.");
  m.def("cpu_isa_families", []() {
    nb::dict d;
    const nbx::KernelTable& t = *nbx::ActiveKernels();
    for (int f = 0; f < nbx::kNumFamilies; ++f)
      d[nbx::KernelFamilyName(f)] = std::string(nbx::IsaOfFamily(t, f));
    return d;
  }, "The instruction set of each kernel family in use.");
  m.def("cpu_default_families", [](const std::string& vendor, int family,
                                   const std::string& supported) {
    const char* out[nbx::kNumFamilies];
    nbx::DefaultFamilies(vendor.c_str(), family, supported.c_str(), out);
    nb::dict d;
    for (int f = 0; f < nbx::kNumFamilies; ++f) d[nbx::KernelFamilyName(f)] = std::string(out[f]);
    return d;
  }, nb::arg("vendor"), nb::arg("family"), nb::arg("supported"),
     "DefaultFamilies for a given CPU (vendor string, display family, supported list).");
  m.def("set_cpu_isa", [](const std::string& name) {
    std::string why;
    if (!nbx::SelectIsa(name.c_str(), &why))
      throw nb::value_error((std::string("cannot use instruction set '") + name + "': " + why +
                             " (this CPU supports: " + nbx::SupportedIsas() + ")").c_str());
  }, nb::arg("name"));
  m.def("cpu_prepacked_words", [](int64_t E, int64_t H, int64_t I, bool bf16_dot, bool gemm1) {
    if (E < 1 || H < 1 || I < 1)
      throw nb::value_error(("prepacked words: E, H and I must be >= 1; got E=" + std::to_string(E) +
                             " H=" + std::to_string(H) + " I=" + std::to_string(I)).c_str());
    return nbx::PrepackedBufferWords(E, H, I, bf16_dot, gemm1);
  }, "Words of jax_nbx.prepack's gate_up (gemm1) or down buffer, header included, kernels in use now.");
  m.def("cpu_dot_kernels", []() {
    return std::string(nbx::ActiveDotKernels(*nbx::ActiveKernels(true))->name);
  }, "The bfloat16 dot-product kernels precision='bfloat16' runs now: 'avx512_bf16', 'fma' or 'emulated'.");
  m.def("cpu_supported_dot_kernels", []() { return std::string(nbx::SupportedDotKernels()); },
        "The bfloat16 dot-product kernels this CPU runs, fastest first ('avx512_bf16,fma,emulated'-style).");
  m.def("set_cpu_dot_kernels", [](const std::string& name) {
    std::string why;
    if (!nbx::SelectDotKernels(name.c_str(), &why)) throw nb::value_error(why.c_str());
  }, nb::arg("name"));
  m.def("format_bytes", [](double b) { return nbx::FormatBytes(b); });

  // The CUDA handler, when this build has it (NBX_CUDA in CMakeLists.txt).
#ifdef NBX_WITH_CUDA
  m.attr("has_cuda") = true;
  m.def("cuda_handlers", []() {
    nb::dict d;
    d[nbx::abi::kTargetCudaForward] = Capsule(nbx::FusedMoeForwardCuda);
    d[nbx::abi::kTargetCudaForwardTables] = Capsule(nbx::FusedMoeForwardCudaTables);
    d[nbx::abi::kTargetCudaBackward] = Capsule(nbx::FusedMoeBackwardCuda);
    return d;
  }, "Handler capsules for platform 'CUDA', keyed by FFI target name.");
  m.def("cuda_driver_status", []() { return nbx::CudaDriverStatus(); },
        "Empty when the CUDA driver loaded, else why it did not.");
  m.def("cuda_table_stats", []() {
    int64_t entries, hits, misses, evictions, bytes;
    nbx::CudaTableStats(&entries, &hits, &misses, &evictions, &bytes);
    nb::dict d;
    d["entries"] = entries;
    d["hits"] = hits;
    d["misses"] = misses;
    d["evictions"] = evictions;
    d["bytes"] = bytes;
    return d;
  });
  m.def("cuda_table_set_capacity", [](int64_t n) { nbx::CudaTableSetCapacity(n); });
  m.def("cuda_table_clear", []() { nbx::CudaTableClear(); });
#else
  m.attr("has_cuda") = false;
#endif

  // The Metal layer (xla_ffi/metal/): the active device and its pointer tables.
  m.attr("has_metal_apple") = nbx::metal::HasAppleImplementation();
  m.def("metal_activate", [](const std::string& which) { return nbx::metal::Activate(which); },
        "Activates 'apple', 'none' or a registered device ('sim': registered by the test-only "
        "jax_nbx._ffi_testing); returns '' or why not.");
  m.def("metal_info", []() -> std::optional<nb::dict> {
    nbx::metal::Device* d = nbx::metal::Active();
    if (d == nullptr) return std::nullopt;
    const nbx::metal::DeviceInfo i = d->info();
    nb::dict out;
    out["implementation"] = std::string(d->implementation());
    out["name"] = i.name;
    out["working_set"] = i.working_set;
    out["max_buffer_length"] = i.max_buffer_length;
    out["max_wraps"] = i.max_wraps;
    out["live_wraps"] = d->live_wraps();
    out["device_count"] = nbx::metal::DeviceCount();
    return out;
  });
  m.def("metal_table_stats", []() {
    const nbx::metal::TableStats s = nbx::metal::Tables::Get().Stats();
    nb::dict d;
    d["entries"] = s.entries;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["evictions"] = s.evictions;
    d["stale"] = s.stale;
    d["bytes"] = s.bytes;
    d["wraps"] = s.wraps;
    d["capacity"] = s.capacity;
    return d;
  });
  m.def("metal_forward_workspace_bytes", [](int64_t tokens, int64_t k, int64_t E, int64_t H,
                                            int64_t I, int64_t r_gate, int64_t r_up, int64_t r_down) {
    CheckFormulaArgs(tokens, k, E, H, I, 1);
    if (r_gate < 0 || r_up < 0 || r_down < 0)
      throw nb::value_error("the LoRA ranks must be >= 0");
    const int64_t ranks[3] = {r_gate, r_up, r_down};
    return nbx::SaturatedBytes(nbx::MetalForwardWorkspaceBytes(tokens, k, E, H, I, ranks));
  }, nb::arg("tokens"), nb::arg("k"), nb::arg("E"), nb::arg("H"), nb::arg("I"), nb::arg("r_gate") = 0,
     nb::arg("r_up") = 0, nb::arg("r_down") = 0,
  "metal:0 workspace bytes of one Metal forward band of `tokens` tokens (with LoRA adapters of "
  "those ranks).");
  m.def("metal_release_pinned", []() { return nbx::metal::Tables::Get().ReleasePinned(); });
  m.def("metal_command_buffer_flops", []() { return nbx::metal::CommandBufferFlops(); });
  m.def("metal_set_command_buffer_flops", [](int64_t f) { nbx::metal::SetCommandBufferFlops(f); },
        "The bound on one Metal command buffer's GEMM flops (<= 0: the default).");
  m.def("metal_table_set_capacity", [](int64_t n) { nbx::metal::Tables::Get().SetCapacity(n); });
}
