// The CUDA handlers of fused_moe as module.cc registers them (built when
// CMake finds nvcc; see CMakeLists.txt option NBX_CUDA): the handlers
// (handlers.cc), their pointer-table cache (tables.cc), the driver's status
// (driver.cc).
#pragma once
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace nbx {
XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedMoeForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedMoeForwardCudaTables);  // lists and/or quantized experts
XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedMoeBackwardCuda);       // dense experts, every layout's groups

void CudaTableStats(int64_t* entries, int64_t* hits, int64_t* misses, int64_t* evictions,
                    int64_t* bytes);
void CudaTableSetCapacity(int64_t n);
void CudaTableClear();
// Empty when the CUDA driver loaded; else why not.
std::string CudaDriverStatus();
}  // namespace nbx
