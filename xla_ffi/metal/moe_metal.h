// The Metal forward handler of fused_moe (target abi::kTargetMetalForward,
// platform "cpu"): JAX's CPU client owns the buffers, the handler runs the
// MoE block on the active Metal device.  float32, bfloat16 or float16 x;
// experts in the plain layout, dense or quantized in any registry format
// (read in place through a table of their parts' GPU addresses, decoded in
// the kernels' weight loads: kernels/weights.metal); the slots ordered
// (kernels/moe_order.metal), the expert GEMMs (moe_gemm.metal) or decode
// GEMVs (moe_gemv.metal) and the combine (moe_combine.metal) as Metal kernels;
// LoRA adapters (abi.h "LoRA adapters") by moe_lora.metal's kernels around
// the GEMMs.
#pragma once

#include <cstddef>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace nbx {

XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedMoeForwardMetal);

// Bytes of metal:0 workspace one band of `tokens` tokens takes (0: the part
// that does not shrink with the band); the plan (Python) and the handler use
// it.  `lora_ranks`: r_gate, r_up, r_down of the adapters (0: none): they are
// staged in the workspace (float32, E (in + out) r_p each), with per padded
// row the ranks' sum (xa) and, with gate or up adapted, 2I (g | u) floats.
size_t MetalForwardWorkspaceBytes(int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I,
                                  const int64_t lora_ranks[3]);

}  // namespace nbx
