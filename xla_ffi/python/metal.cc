// jax_nbx._ffi's bindings of the Metal layer (metal/): its forward's capsule
// (platform "cpu"), the active device and its pointer tables.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <string>

#include "abi.h"
#include "account.h"  // SaturatedBytes
#include "metal/moe_metal.h"
#include "metal/runtime.h"
#include "metal/tables.h"
#include "python/bindings.h"

namespace nbx::python {

void AddMetalHandlers(nb::dict& d) { d[nbx::abi::kTargetMetalForward] = Capsule(nbx::FusedMoeForwardMetal); }

void BindMetal(nb::module_& m) {
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

}  // namespace nbx::python
