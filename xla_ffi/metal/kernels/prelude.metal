// The first part of the Metal kernels' library after params.h (CMake embeds
// params.h, prelude.metal, moe_gemm.metal, moe_gemv.metal, moe_order.metal,
// moe_combine.metal, in that order, as the one source newLibraryWithSource
// compiles; metal/emulated_kernels.cc includes them in the same order).
// Apple's compiler gets Metal's own headers and the two spellings the MSL
// emulation (metal/msl_emulation.h) defines for C++; both get the helpers.
#ifndef NBX_MSL_EMULATION
#include <metal_stdlib>
using namespace metal;
#define NBX_THREADGROUP(n) [[threadgroup(n)]]
// A GPU address from a table as a pointer (Metal 3: gpuAddress values are
// pointers).  `count` is what the emulation checks against the live pins.
template <typename T>
inline device T* nbx_device_ptr(ulong address, long count) {
  (void)count;
  return (device T*)address;
}
#endif

// The activation of the gate (abi.h Activation; its constants are abi.h's).
inline float nbx_act(float g, uint act) {
  if (act == 1) {
    const float c = 0.7978845608028654f;  // sqrt(2/pi), abi.h's kGeluC
    return 0.5f * g * (1.0f + tanh(c * (g + 0.044715f * g * g * g)));
  }
  return g / (1.0f + exp(-g));
}
