// The CPU backward handler of fused_moe (target abi::kTargetBackward).
#pragma once
#include <cstddef>
#include <cstdint>

#include "abi.h"
#include "common/bindings.h"  // ForwardAttrs, BackwardAttrs and the bindings
#include "common/weights.h"
#include "cpu/kernels/kernel_table.h"
#include "xla/ffi/api/ffi.h"

namespace nbx {

// dx, d(topk_weights) and the experts' gradients (float32) in one call.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedMoeBackwardCpu);

// The backward on dy, x, topk_weights, topk_ids and the dense weight buffers
// weights[0, size - trailing) (3 stacked or 3E per-expert); the last
// `trailing` inputs are ignored (the tests' NaN-filled result twins).
xla::ffi::Error FusedMoeBackward(xla::ffi::ThreadPool pool, xla::ffi::AnyBuffer dy,
                                 xla::ffi::AnyBuffer x, xla::ffi::Buffer<xla::ffi::F32> topk_w,
                                 xla::ffi::Buffer<xla::ffi::S32> topk_ids,
                                 xla::ffi::RemainingArgs weights, size_t trailing,
                                 xla::ffi::Result<xla::ffi::AnyBuffer> dx,
                                 xla::ffi::Result<xla::ffi::Buffer<xla::ffi::F32>> dw,
                                 xla::ffi::RemainingRets grads, const BackwardAttrs& a);

// Bytes of workspace the CPU backward allocates for one band of `tokens`
// tokens (0 gives the part that does not shrink with the band); `lora_rank`:
// the adapters' ranks summed.
size_t BackwardWorkspaceBytes(int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I,
                              int workers, int64_t lora_rank = 0);
}  // namespace nbx
