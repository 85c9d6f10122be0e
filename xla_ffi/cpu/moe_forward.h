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
// inputs are ignored (the tests' output twins, tests/native/).
xla::ffi::Error FusedMoeForward(xla::ffi::ThreadPool pool, xla::ffi::AnyBuffer x,
                                xla::ffi::Buffer<xla::ffi::F32> topk_w,
                                xla::ffi::Buffer<xla::ffi::S32> topk_ids,
                                xla::ffi::RemainingArgs weights, size_t trailing,
                                xla::ffi::Result<xla::ffi::AnyBuffer> y, const ForwardAttrs& a);

// The forward with LoRA adapters, experts of every format (moe_lora.cc): the same
// inputs with the adapters after the weights (abi.h), through the row band
// (row_band.h) instead of the packed kernels; FusedMoeForward calls it when
// a rank is > 0.
xla::ffi::Error FusedMoeLoraForward(xla::ffi::ThreadPool pool, xla::ffi::AnyBuffer x,
                                    xla::ffi::Buffer<xla::ffi::F32> topk_w,
                                    xla::ffi::Buffer<xla::ffi::S32> topk_ids,
                                    xla::ffi::RemainingArgs weights, size_t trailing,
                                    xla::ffi::Result<xla::ffi::AnyBuffer> y,
                                    const ForwardAttrs& a);
// Bytes of workspace of one band of the forward with adapters of total rank R.
size_t LoraForwardWorkspaceBytes(int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I,
                                 int64_t R, int workers);
// precision="bfloat16": the dot kernels in use for the packed table kt, or
// why these experts cannot take them (dense bfloat16, stored by rows).  The
// prepack handler packs for the same kernels.
xla::ffi::Error ForwardDotKernels(const ExpertWeights& w, const KernelTable& kt,
                                  const DotKernelTable** dot);
// Bytes of workspace the CPU forward allocates for one band of `tokens`
// tokens (0 gives the part that does not shrink with the band: the
// per-expert arrays and the per-worker scratch, sized to H and I);
// `bf16_dot`: with precision="bfloat16"'s scratch.
size_t ForwardWorkspaceBytes(int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I,
                             int workers, bool bf16_dot = false);

}  // namespace nbx
