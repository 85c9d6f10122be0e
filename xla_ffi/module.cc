// The nanobind module jax_nbx._ffi: handler capsules and the allocation view.
#include <nanobind/nanobind.h>

#include "alloc.h"
#include "cpu/moe_forward.h"

namespace nb = nanobind;

namespace {
template <typename T>
nb::capsule Capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "not an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_ffi, m) {
  m.doc() = "jax_nbx XLA FFI handlers (CPU)";
  m.def("cpu_handlers", []() {
    nb::dict d;
    d["nbx_fused_moe_fwd"] = Capsule(nbx::FusedMoeForwardCpu);
    d["nbx_fused_moe_fwd_into"] = Capsule(nbx::FusedMoeForwardIntoCpu);
    return d;
  }, "Handler capsules for platform 'cpu', keyed by FFI target name.");
  m.def("alloc_stats", []() {
    nbx::AllocStats s = nbx::GetAllocStats();
    nb::dict d;
    d["live"] = s.live;
    d["peak"] = s.peak;
    d["allocations"] = s.allocations;
    d["largest_request"] = s.largest_request;
    return d;
  }, "Counters of handler allocations: live, peak, allocations, largest_request (bytes).");
  m.def("reset_alloc_peak", &nbx::ResetAllocPeak, "Sets the peak to the live bytes.");
}
