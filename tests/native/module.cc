// The nanobind module jax_nbx._ffi_testing: what only the tests use, built
// when CMake's NBX_TESTING is ON and never loaded by `import jax_nbx`
// (tests/support/ffi_testing.py loads it).  It links the core library
// (libnbx_core) that jax_nbx._ffi links, so the account, the active ISA and the
// Metal runtime it reaches are the product's own.  It holds:
//   handlers()           the poisoned twins (poisoned_targets.h): {target: capsule}, platform "cpu"
//   the testers          CPU micro-kernels (kernel_tests.h), slot planner (planner_tests.h),
//                        account holds (account_tests.h), CUDA program decoder (program_tests.h)
//   the Metal tests      the simulated device, the MSL emulation and its kernels, pins, buffers,
//                        tables (metal_tests.h); importing the module registers the simulated
//                        device in the product's Metal runtime under "sim" (runtime.h
//                        RegisterDevice), so that jax_nbx.metal.use("sim") can activate it.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "metal/library_source.h"
#include "metal/runtime.h"
#include "native/metal/sim_device.h"
#include "native/account_tests.h"
#include "native/kernel_tests.h"
#include "native/metal_tests.h"
#include "native/planner_tests.h"
#include "native/poisoned_targets.h"
#include "native/program_tests.h"

namespace nb = nanobind;

NB_MODULE(_ffi_testing, m) {
  m.doc() = "jax_nbx's test-only bindings (tests/native/): never loaded by the product";
  m.def("handlers", &nbx::TestingHandlers,
        "The poisoned twins' handler capsules for platform 'cpu', keyed by FFI target name.");
  m.attr("target_forward_poisoned") = nbx::kTargetForwardPoisoned;
  m.attr("target_backward_poisoned") = nbx::kTargetBackwardPoisoned;
  m.def("metal_library_source", []() { return std::string(nbx::metal::LibrarySource()); },
        "The Metal kernels' library source as the Apple device compiles it.");
  nbx::BindKernelTests(m);
  nbx::BindDotKernelTests(m);
  nbx::BindProgramTests(m);
  nbx::BindPlannerTests(m);
  nbx::BindAccountTests(m);
  nbx::BindMetalTests(m);
  nbx::metal::RegisterDevice("sim", &nbx::metal::NewSimDevice);
}
