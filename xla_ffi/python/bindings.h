// The product module's bindings (jax_nbx._ffi), one file per part: the
// account (account.cc), the CPU handlers and instruction sets (cpu.cc), the
// Metal layer (metal.cc), the CUDA handler (cuda.cc); module.cc puts them in
// one module.  What they share is here.
#pragma once

#include <cstdint>
#include <type_traits>

#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nbx::python {

namespace nb = nanobind;

// A handler symbol as the capsule jax.ffi.register_ffi_target takes.
template <typename T>
inline nb::capsule Capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "not an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// The workspace formulas' arguments: sizes >= 0, k >= 1, workers >= 1, and
// tokens * k within the handlers' slots (abi::kMaxSlots); a ValueError naming
// them otherwise (module.cc).
void CheckFormulaArgs(int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I, int workers);

void BindAccount(nb::module_& m);
void BindExpertStore(nb::module_& m);
void BindCpu(nb::module_& m);
void BindMetal(nb::module_& m);
// The capsules of the CPU targets, and of the Metal forward (platform "cpu"
// too: JAX's CPU client owns its buffers), added to `d` by target name.
void AddCpuHandlers(nb::dict& d);
void AddMetalHandlers(nb::dict& d);
// has_cuda, and the CUDA handler's bindings where this build has it.
void BindCuda(nb::module_& m);

}  // namespace nbx::python
