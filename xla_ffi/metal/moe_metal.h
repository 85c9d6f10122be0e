// The Metal forward handler of fused_moe (target abi::kTargetMetalForward,
// platform "cpu"): JAX's CPU client owns the buffers, the handler runs the
// MoE block on the active Metal device.  So far: float32 x and dense float32
// weights, on the simulated device only (the kernels' dispatch on Apple is
// not written); the slots are ordered (kernels/moe_order.metal) and the
// expert GEMMs run (kernels/moe_gemm.metal) as Metal kernels, the combine on
// the host.
#pragma once

#include <cstddef>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace nbx {

XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedMoeForwardMetal);

// Bytes of metal:0 workspace one band of `tokens` tokens takes (0: the part
// that does not shrink with the band); the plan (Python) and the handler use it.
size_t MetalForwardWorkspaceBytes(int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I);

}  // namespace nbx
