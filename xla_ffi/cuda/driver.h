// The CUDA driver API as the handlers reach it: through dlopen("libcuda.so.1"),
// so that the extension imports on machines without a GPU driver (the
// handlers report the missing driver as an error if they are ever called
// there).  Also the text of a failed driver call (CudaError, NBX_CU) and the
// device's primary context for a scope (ScopedContext).
#pragma once

#include <string>

#include <cuda.h>

#include "xla/ffi/api/ffi.h"

namespace nbx::cuda {

// Driver entry points, by their versioned symbol names (cuda.h maps e.g.
// cuMemAlloc to cuMemAlloc_v2; driver.cc resolves the macro's expansion).
struct Driver {
  bool ok = false;
  std::string why;
#define NBX_DRIVER_FNS(X)                                                             \
  X(cuInit) X(cuGetErrorString) X(cuDeviceGet) X(cuDevicePrimaryCtxRetain)            \
  X(cuCtxPushCurrent) X(cuCtxPopCurrent) X(cuModuleLoadData) X(cuModuleGetFunction)   \
  X(cuFuncSetAttribute) X(cuLaunchKernel) X(cuMemAlloc) X(cuMemFree) X(cuMemcpyHtoD)  \
  X(cuMemcpyDtoHAsync) X(cuStreamSynchronize) X(cuMemAllocHost) X(cuEventCreate)        \
  X(cuEventRecord) X(cuEventQuery) X(cuEventSynchronize) X(cuMemcpyHtoDAsync)         \
  X(cuMemFreeHost)
// CUDA graphs (JAX_NBX_CUDA_GRAPHS): optional, so a driver without them
// still runs the plain launches; `graphs_why` says what is missing.
#define NBX_GRAPH_FNS(X)                                                              \
  X(cuGraphCreate) X(cuGraphDestroy) X(cuGraphAddKernelNode) X(cuGraphInstantiate)    \
  X(cuGraphExecKernelNodeSetParams) X(cuGraphLaunch) X(cuGraphExecDestroy)
#define NBX_DECLARE(fn) decltype(&::fn) fn = nullptr;
  NBX_DRIVER_FNS(NBX_DECLARE)
  NBX_GRAPH_FNS(NBX_DECLARE)
#undef NBX_DECLARE
  std::string graphs_why;

  // Loaded on first use, once per process.
  static Driver& Get();

 private:
  static Driver Load();
};

// `what` failed, in the driver's words and with its CUresult.
xla::ffi::Error CudaError(const char* what, CUresult r);

// Returns CudaError(what, r) from the enclosing function when `call` fails.
#define NBX_CU(what, call)                                              \
  do {                                                                  \
    CUresult _r = (call);                                               \
    if (_r != CUDA_SUCCESS) return ::nbx::cuda::CudaError(what, _r);    \
  } while (0)

// Pushes the device's primary context (the one XLA uses) for the scope.
class ScopedContext {
 public:
  xla::ffi::Error Enter(int ordinal);
  ~ScopedContext();

 private:
  bool pushed_ = false;
};

}  // namespace nbx::cuda
