// The CPU forward handler of fused_moe (target abi::kTargetForward).
#pragma once
#include <cstddef>
#include <cstdint>

#include "abi.h"
#include "common/bindings.h"  // ForwardAttrs, BackwardAttrs and the bindings
#include "common/weights.h"
#include "cpu/kernels/kernel_table.h"
#include "xla/ffi/api/ffi.h"

namespace nbx {

XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedMoeForwardCpu);

// The forward on x [T, H], topk_weights/topk_ids [T, k] and the weight
// buffers weights[0, size - trailing) (abi.h's groups); the last `trailing`
// inputs are ignored (the tests' output twins, tests/native/).  LoRA
// adapters (any rank > 0) follow the weights (abi.h) and add their terms to
// the base path's sums (forward_lora.h).
xla::ffi::Error FusedMoeForward(xla::ffi::ThreadPool pool, xla::ffi::AnyBuffer x,
                                xla::ffi::Buffer<xla::ffi::F32> topk_w,
                                xla::ffi::Buffer<xla::ffi::S32> topk_ids,
                                xla::ffi::RemainingArgs weights, size_t trailing,
                                xla::ffi::Result<xla::ffi::AnyBuffer> y, const ForwardAttrs& a);

// The call's precision= checked against the experts (forward_precision.cc):
// *dot, the bfloat16 dot kernels for precision="bfloat16", else null.
xla::ffi::Error ForwardPrecision(const ForwardAttrs& a, const ExpertWeights& w,
                                 const KernelTable& kt, const DotKernelTable** dot);
// precision="bfloat16": the dot kernels in use for the packed table kt, or
// why these experts cannot take them (dense bfloat16, stored by rows).  The
// prepack handler packs for the same kernels.
xla::ffi::Error ForwardDotKernels(const ExpertWeights& w, const KernelTable& kt,
                                  const DotKernelTable** dot);
// Bytes of workspace the CPU forward allocates for one band of `tokens`
// tokens (0 gives the part that does not shrink with the band: the
// per-expert arrays and the per-worker scratch, sized to H and I);
// `bf16_dot`: with precision="bfloat16"'s scratch; `lora_rank`: LoRA
// adapters of these ranks summed.
size_t ForwardWorkspaceBytes(int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I,
                             int workers, bool bf16_dot = false, int64_t lora_rank = 0);

}  // namespace nbx
