// Test-only twins of the CPU handlers: the same binding with one more input
// per result after the weights, aliased to that result.  The tests fill those
// inputs with NaN, so any element a handler leaves unwritten shows.  Every
// weight format and layout goes through them (the twins share the product's
// binding and decoder), so no test re-encodes a call by hand.
#include "native/poisoned_targets.h"

#include "abi.h"
#include "cpu/moe_backward.h"
#include "cpu/moe_forward.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace nbx {
namespace {

ffi::Error ForwardPoisoned(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> topk_w,
                           ffi::Buffer<ffi::S32> topk_ids, ffi::RemainingArgs weights,
                           ffi::Result<ffi::AnyBuffer> y NBX_FORWARD_ATTR_PARAMS) {
  return FusedMoeForward(pool, x, topk_w, topk_ids, weights, /*trailing=*/1, y,
                         NBX_FORWARD_ATTRS);
}

ffi::Error BackwardPoisoned(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::F32> topk_w, ffi::Buffer<ffi::S32> topk_ids,
                            ffi::RemainingArgs weights, ffi::Result<ffi::AnyBuffer> dx,
                            ffi::Result<ffi::Buffer<ffi::F32>> dw, ffi::RemainingRets grads
                            NBX_BACKWARD_ATTR_PARAMS) {
  // one twin per result: dx, dw, then each weight gradient
  return FusedMoeBackward(pool, dy, x, topk_w, topk_ids, weights, 2 + grads.size(), dx, dw,
                          grads, NBX_BACKWARD_ATTRS);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeForwardPoisonedCpu, ForwardPoisoned, NBX_FORWARD_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeBackwardPoisonedCpu, BackwardPoisoned,
                              NBX_BACKWARD_BINDING);

}  // namespace

nanobind::dict TestingHandlers() {
  nanobind::dict d;
  d[kTargetForwardPoisoned] = nanobind::capsule(reinterpret_cast<void*>(FusedMoeForwardPoisonedCpu));
  d[kTargetBackwardPoisoned] = nanobind::capsule(reinterpret_cast<void*>(FusedMoeBackwardPoisonedCpu));
  return d;
}

}  // namespace nbx
