// jax_nbx._ffi's bindings of the CUDA handler (cuda/), where this build has
// it (NBX_WITH_CUDA: CMake found nvcc); else only has_cuda = False.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

#include "abi.h"
#include "python/bindings.h"
#ifdef NBX_WITH_CUDA
#include "cuda/moe_cuda.h"
#endif

namespace nbx::python {

void BindCuda(nb::module_& m) {
#ifdef NBX_WITH_CUDA
  // The CUDA handler, when this build has it (NBX_CUDA in CMakeLists.txt).
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
}

}  // namespace nbx::python
