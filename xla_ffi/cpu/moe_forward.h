// The CPU forward handler of fused_moe (target abi::kTargetForward).
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

XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedMoeForwardCpu);

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
  LoraAttrs lora;  // abi.h "LoRA adapters": any rank > 0 runs FusedMoeLoraForward
  // abi.h "prepacked weights": the last two weight buffers are GEMM1's and
  // GEMM2's packed words (cpu/prepacked.h), read instead of packing
  bool prepacked;
};

// The forward on x [T, H], topk_weights/topk_ids [T, k] and the weight
// buffers weights[0, size - trailing) (abi.h's groups); the last `trailing`
// inputs are ignored (the tests' output twins, xla_ffi/testing/).
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
        ::nbx::WeightViewAttrs{views, intermediate, fused_gate_up, has_bias, tensor_scales}, \
        bf16_dot, int8_dot,                                                            \
        ::nbx::LoraAttrs{lora_ranks, {lora_scale_gate, lora_scale_up, lora_scale_down}},    \
        prepacked                                                                      \
  }
