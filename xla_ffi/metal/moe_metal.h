// The Metal forward handler of fused_moe (target abi::kTargetMetalForward,
// platform "cpu"): JAX's CPU client owns the buffers, the handler runs the
// MoE block on the active Metal device.  float32, bfloat16 or float16 x;
// experts in the plain layout, dense or quantized in any registry format
// (read in place through a table of their parts' GPU addresses, decoded in
// the kernels' weight loads: kernels/weights.metal); the slots ordered
// (kernels/moe_order.metal), the expert GEMMs (moe_gemm.metal) or decode
// GEMVs (moe_gemv.metal) and the combine (moe_combine.metal) as Metal kernels.
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
