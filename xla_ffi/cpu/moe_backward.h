// The CPU backward handler of fused_moe (target abi::kTargetBackward).
#pragma once
#include <cstddef>
#include <cstdint>

#include "abi.h"
#include "attr_types.h"
#include "cpu/handler_common.h"  // the enum attributes' decoding
#include "cpu/row_band.h"        // LoraAttrs
#include "cpu/weights.h"         // WeightViewAttrs
#include "xla/ffi/api/ffi.h"

namespace nbx {

// dx, d(topk_weights) and the experts' gradients (float32) in one call.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedMoeBackwardCpu);

struct BackwardAttrs {
  abi::Activation activation;
  float act_alpha, act_limit;  // kClampedSwiGLU's parameters (abi.h)
  int64_t band_tokens;
  int64_t max_workers;
  bool skip_outside;
  int64_t num_experts;
  bool stacked;
  WeightViewAttrs views;  // abi.h "weight views" (and tensor_scales)
  LoraAttrs lora;         // abi.h "LoRA adapters"
  bool weight_grads;      // return the experts' gradients (else only dx, dw, the adapters')
  abi::WeightFormat format;  // quantized experts: weight_grads is false
  int64_t group_size;
};

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

// The binding the product target and the tests' twin share.
#define NBX_BACKWARD_BINDING                                          \
  ::xla::ffi::Ffi::Bind()                                             \
      .Ctx<::xla::ffi::ThreadPool>()                                  \
      .Arg<::xla::ffi::AnyBuffer>()               /* dy [T, H] */     \
      .Arg<::xla::ffi::AnyBuffer>()               /* x [T, H] */      \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>() /* topk_weights */  \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() /* topk_ids */      \
      .RemainingArgs()                            /* weights (3 or 3E) */ \
      .Ret<::xla::ffi::AnyBuffer>()               /* dx [T, H] */     \
      .Ret<::xla::ffi::Buffer<::xla::ffi::F32>>() /* dw [T, k] */     \
      .RemainingRets()                            /* weight gradients */ \
      NBX_ATTRS_CPU_BACKWARD(NBX_BIND_ATTR)

// The handler's attribute parameters (abi.h's list), after its buffers.
#define NBX_BACKWARD_ATTR_PARAMS NBX_ATTRS_CPU_BACKWARD(NBX_ATTR_PARAM)
#define NBX_BACKWARD_ATTRS \
  ::nbx::BackwardAttrs {                                                              \
    activation, act_alpha, act_limit, band_tokens, max_workers, skip_outside, num_experts, \
        stacked,                                                                         \
        ::nbx::WeightViewAttrs{views, intermediate, fused_gate_up, has_bias, tensor_scales}, \
        ::nbx::LoraAttrs{lora_ranks, {lora_scale_gate, lora_scale_up, lora_scale_down}},   \
        weight_grads, format, group_size                                                 \
  }
