// The CPU targets' bindings and attributes as one struct each (abi.h
// NBX_ATTRS_CPU_FORWARD / NBX_ATTRS_CPU_BACKWARD): what every handler of those
// attribute lists shares -- the CPU forward and backward (cpu/), the Metal
// forward (metal/moe_metal.cc, the forward's inputs and attributes) and the
// tests' twins (tests/native/).
#pragma once

#include <cstdint>

#include "abi.h"
#include "common/attr_types.h"  // the enum attributes' decoding
#include "common/lora_args.h"   // LoraAttrs
#include "common/weights.h"     // WeightViewAttrs
#include "xla/ffi/api/ffi.h"

namespace nbx {

// The forward's static attributes (one FFI attribute each, same names).
struct ForwardAttrs {
  abi::Activation activation;
  float act_alpha, act_limit;  // kClampedSwiGLU's parameters (abi.h)
  int64_t band_tokens;  // tokens per band; <= 0: one band
  int64_t max_workers;  // the plan counted scratch for this many workers
  bool skip_outside;    // ids outside [0, E) are skipped (expert parallelism), not an error
  int64_t num_experts;
  abi::WeightFormat format;
  bool stacked;  // one [E, ...] buffer per group, else E per-expert buffers
  int64_t group_size;  // int4: rows of K per group
  WeightViewAttrs views;  // abi.h "weight views"
  // precision="bfloat16": x and the activations rounded to bfloat16, products
  // summed in pairs as VDPBF16PS does (kernels_dot.h); bfloat16 weights
  // stored by rows only, every expert through the packed kernels.
  bool bf16_dot;
  // precision="int8": int8 and int4 experts only, every expert streamed
  // through the int8-arithmetic kernels (abi.h "int8 arithmetic").
  bool int8_dot;
  LoraAttrs lora;  // abi.h "LoRA adapters": any rank > 0 adds the adapters (cpu/forward_lora.h)
  // abi.h "prepacked weights": the last two weight buffers are GEMM1's and
  // GEMM2's packed words (cpu/prepacked.h), read instead of packing
  bool prepacked;
};

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

}  // namespace nbx

// The binding both the product target and the tests' twin use: the inputs,
// then the weights (and the twin's output buffer) as remaining arguments.
#define NBX_FORWARD_BINDING                                         \
  ::xla::ffi::Ffi::Bind()                                           \
      .Ctx<::xla::ffi::ThreadPool>()                                \
      .Arg<::xla::ffi::AnyBuffer>()                /* x [T, H] */   \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>()  /* topk_weights */ \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()  /* topk_ids */   \
      .RemainingArgs()                             /* weights */    \
      .Ret<::xla::ffi::AnyBuffer>()                /* y [T, H] */   \
      NBX_ATTRS_CPU_FORWARD(NBX_BIND_ATTR)

// Forwards the binding's attributes as a ForwardAttrs.
// The handler's attribute parameters (abi.h's list), after its buffers.
#define NBX_FORWARD_ATTR_PARAMS NBX_ATTRS_CPU_FORWARD(NBX_ATTR_PARAM)
#define NBX_FORWARD_ATTRS                                                              \
  ::nbx::ForwardAttrs {                                                                \
    activation, act_alpha, act_limit, band_tokens, max_workers, skip_outside, num_experts, \
        format, stacked, group_size,                                                   \
        ::nbx::WeightViewAttrs{views, intermediate, fused_gate_up, has_bias, tensor_scales, \
                               expert_store},                                          \
        bf16_dot, int8_dot,                                                            \
        ::nbx::LoraAttrs{lora_ranks, {lora_scale_gate, lora_scale_up, lora_scale_down}},    \
        prepacked                                                                      \
  }

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
        ::nbx::WeightViewAttrs{views, intermediate, fused_gate_up, has_bias, tensor_scales, \
                               expert_store},                                          \
        ::nbx::LoraAttrs{lora_ranks, {lora_scale_gate, lora_scale_up, lora_scale_down}},   \
        weight_grads, format, group_size                                                 \
  }
