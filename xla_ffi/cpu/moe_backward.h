#pragma once
#include <cstddef>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace nbx {
// dx, d(topk_weights) and the experts' gradients (float32) in one call.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedMoeBackwardCpu);

// Bytes of workspace the CPU backward allocates for one band of `tokens`
// tokens (0 gives the part that does not shrink with the band).
size_t BackwardWorkspaceBytes(int64_t tokens, int64_t k, int64_t E, int64_t H,
                              int64_t I, int workers);
}  // namespace nbx
