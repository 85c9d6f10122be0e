// The kernels of a program's kernel table as the driver runs them: each
// cubin loaded once per device (cuModuleLoadData), its function looked up,
// cached for the process by device, content hash and name.
#pragma once

#include <cstdint>

#include <cuda.h>

#include "cuda/program.h"
#include "xla/ffi/api/ffi.h"

namespace nbx::cuda {

struct LoadedKernel {
  CUfunction fn = nullptr;
  int num_warps = 4;
  int shared = 0;
};

// The kernel of `row` (checked against `blob` by DecodeKernelTable,
// cuda/program.h) on device `ordinal`, loading its cubin on first use.
// Needs the device's context current.
xla::ffi::Error GetKernel(int ordinal, const uint8_t* blob, const KernelRow& row,
                          LoadedKernel* out);

}  // namespace nbx::cuda
