// The first part of the Metal kernels' library after params.h (CMake embeds
// params.h, prelude.metal, weights.metal, moe_gemm.metal, moe_gemv.metal,
// moe_lora.metal, moe_order.metal, moe_combine.metal, in that order, as the one source
// newLibraryWithSource compiles; tests/native/metal/emulated_kernels.cc includes them in
// the same order).
// Apple's compiler gets Metal's own headers and the two spellings the MSL
// emulation (tests/native/metal/msl_emulation.h) defines for C++; both get the helpers.
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

// erf(x) for float32 (Metal Shading Language has none), odd in x.  |x| < 0.5:
// its Maclaurin series to x^11 (truncation < 2e-8).  Else erf = 1 - erfc with
// erfc(|x|) = t exp(-x^2 + P(t)), t = 1 / (1 + |x| / 2), P a degree-9
// polynomial (the Chebyshev fit of Press et al., Numerical Recipes §6.2,
// erfcc; |relative error of erfc| < 1.2e-7).  The absolute error, measured
// through the emulation: tests/metal/test_metal_kernels.py.
inline float nbx_erf(float x) {
  const float z = fabs(x);
  if (z < 0.5f) {
    const float x2 = x * x;
    return 1.1283791670955126f * x *  // 2 / sqrt(pi)
           (1.0f + x2 * (-1.0f / 3.0f + x2 * (1.0f / 10.0f + x2 * (-1.0f / 42.0f +
           x2 * (1.0f / 216.0f + x2 * (-1.0f / 1320.0f))))));
  }
  const float t = 1.0f / (1.0f + 0.5f * z);
  const float p = -1.26551223f + t * (1.00002368f + t * (0.37409196f + t * (0.09678418f +
                  t * (-0.18628806f + t * (0.27886807f + t * (-1.13520398f + t * (1.48851587f +
                  t * (-0.82215223f + t * 0.17087277f))))))));
  const float r = 1.0f - t * exp(-z * z + p);
  return x < 0.0f ? -r : r;
}

// glu(g, u), the gated unit (abi.h Activation; its constants are abi.h's,
// checked by tests/library/test_contract.py):
//   0 SwiGLU  1 GeGLU (tanh)  2 clamped SwiGLU (gpt-oss)  3 GeGLU (erf)
inline float nbx_glu(float g, float u, constant GemmParams& p) {
  if (p.act == 1) {
    const float c = 0.7978845608028654f;  // sqrt(2/pi), abi.h's kGeluC
    return 0.5f * g * (1.0f + tanh(c * (g + 0.044715f * g * g * g))) * u;
  }
  if (p.act == 3) return 0.5f * g * (1.0f + nbx_erf(g * 0.7071067811865476f)) * u;  // abi.h's kInvSqrt2
  if (p.act == 2) {
    const float gc = min(g, p.limit), uc = clamp(u, -p.limit, p.limit);
    return gc / (1.0f + exp(-p.alpha * gc)) * (uc + 1.0f);
  }
  return g / (1.0f + exp(-g)) * u;
}
