// The nanobind module jax_nbx._ffi: the product's bindings, each part from
// its own file (bindings.h): the contract (abi_export.cc), the account
// (account.cc), the CPU handlers and instruction sets (cpu.cc), the Metal
// layer (metal.cc), the CUDA handler (cuda.cc).  The C++ behind them is the
// core library (libnbx_core, CMakeLists.txt); the test-only bindings are the
// other module's, jax_nbx._ffi_testing (tests/native/module.cc, NBX_TESTING=ON).
#include <nanobind/nanobind.h>

#include <string>

#include "abi.h"
#include "python/abi_export.h"
#include "python/bindings.h"

namespace nb = nanobind;

namespace nbx::python {

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

}  // namespace nbx::python

NB_MODULE(_ffi, m) {
  m.doc() = "jax_nbx XLA FFI handlers (CPU, Metal, CUDA) and the memory account";
  m.def("abi", &nbx::AbiDict, "The cross-language contract (xla_ffi/abi.h) as a dict.");
  nbx::python::BindAccount(m);
  nbx::python::BindExpertStore(m);
  m.def("cpu_handlers", []() {
    nb::dict d;  // platform "cpu": the CPU handlers and the Metal forward
    nbx::python::AddCpuHandlers(d);
    nbx::python::AddMetalHandlers(d);
    return d;
  }, "Handler capsules for platform 'cpu', keyed by FFI target name.");
  nbx::python::BindCpu(m);
  nbx::python::BindMetal(m);
  nbx::python::BindCuda(m);
}
