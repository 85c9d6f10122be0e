#pragma once
#include <cstddef>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace nbx {
XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedMoeForwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedMoeForwardIntoCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedMoeForwardListsCpu);      // per-expert buffers
XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedMoeForwardListsIntoCpu);  // tests: aliased output
XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedMoeForwardQuantCpu);      // int8 / int4 experts
XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedMoeForwardQuantIntoCpu);  // the same, output aliased (tests)

// Bytes of workspace the CPU forward allocates for one band of `tokens`
// tokens (0 gives the part that does not shrink with the band).
size_t ForwardWorkspaceBytes(int64_t tokens, int64_t k, int64_t E, int64_t H,
                             int64_t I, int workers);
}  // namespace nbx
