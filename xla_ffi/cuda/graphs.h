// A program's launches as one CUDA graph (JAX_NBX_CUDA_GRAPHS, the handlers'
// attribute `graph`): a chain of kernel nodes built and instantiated on the
// first call of a program shape on a device, then per call every node's
// arguments updated and the graph launched once on XLA's stream.
#pragma once

#include <vector>

#include <cuda.h>

#include "xla/ffi/api/ffi.h"

namespace nbx::cuda {

// One launch of a program as the driver takes it (cuLaunchKernel, or a
// graph's kernel node): block = 32 * the kernel's warps, y = z = 1.
struct KernelCall {
  CUfunction fn;
  unsigned grid[3];
  unsigned block;
  unsigned shared;
  void** params;
};

// Runs `calls` (in order) on `stream` as the graph of their shape, building
// it on first use.  Fails with kFailedPrecondition (saying which entry point
// is missing) when the driver has no graphs.  Needs device `ordinal`'s
// context current.
xla::ffi::Error LaunchAsGraph(int ordinal, const std::vector<KernelCall>& calls, CUstream stream);

}  // namespace nbx::cuda
