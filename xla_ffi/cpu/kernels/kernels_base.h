// The CPU micro-kernels (common part: vector types, loads, the activation,
// the row-count dispatch), written once with GCC/Clang vector extensions and
// instantiated per instruction set by kernels_<isa>.cc, each compiled with its
// own -m flags.  Included ONLY by those files.  Everything here has internal
// linkage and uses no inline function of the C++ library, so no code compiled
// for one instruction set can be merged by the linker into another's (or into
// the portable code).  The portable instantiation (kernels_generic.cc) uses no
// x86 intrinsics: on arm64 it compiles to NEON.
//
// Layouts (float32):
//   packed A  one m-panel of MR rows: a[kk * MR + r]   (rows past the end are 0)
//   packed B  one micro-panel of 2*VL columns: b[kk * 2VL + c]
//             GEMM1: c < VL gate columns, c >= VL the same columns of up
//             GEMM2: 2VL columns of down
// Each output element is sum_kk a*b in kk order (one fused multiply-add per
// step where the instruction set has one), whatever the kernel, the row's
// place in its panel or the band: results do not depend on how rows group.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "abi.h"
#include "cpu/kernels/kernel_table.h"
#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace nbx {
namespace {

#define NBX_AI inline __attribute__((always_inline))

template <int VL> struct VecT;
template <> struct VecT<4> { typedef float type __attribute__((vector_size(16))); };
template <> struct VecT<8> { typedef float type __attribute__((vector_size(32))); };
template <> struct VecT<16> { typedef float type __attribute__((vector_size(64))); };
template <int VL> struct U16T;
template <> struct U16T<4> { typedef uint16_t type __attribute__((vector_size(8))); };
template <> struct U16T<8> { typedef uint16_t type __attribute__((vector_size(16))); };
template <> struct U16T<16> { typedef uint16_t type __attribute__((vector_size(32))); };
template <int VL> struct U32T;
template <> struct U32T<4> { typedef uint32_t type __attribute__((vector_size(16))); };
template <> struct U32T<8> { typedef uint32_t type __attribute__((vector_size(32))); };
template <> struct U32T<16> { typedef uint32_t type __attribute__((vector_size(64))); };

template <int VL>
NBX_AI typename VecT<VL>::type Load(const float* p) {
  typename VecT<VL>::type v;
  memcpy(&v, p, sizeof v);
  return v;
}

// x in every lane (one broadcast instruction where the file has AVX: a
// lane-by-lane build is compiled as one insert per lane).
template <int VL>
NBX_AI typename VecT<VL>::type Splat(float x) {
  using V = typename VecT<VL>::type;
#if defined(__AVX512F__)
  if constexpr (VL == 16) return reinterpret_cast<V>(_mm512_set1_ps(x));
#endif
#if defined(__AVX__)
  if constexpr (VL == 8) return reinterpret_cast<V>(_mm256_set1_ps(x));
#endif
  return x - V{};  // (x - +0 is x, -0 included)
}

// a*b + c as one fused multiply-add, whatever the optimisation level and
// whatever the compiler would contract: the FMA instructions where the file
// is compiled with them (x86 -mfma: the avx2 and avx512 files), else a*b + c.
// The kernels call it through MulAdd below.
template <int VL>
NBX_AI typename VecT<VL>::type FusedMulAdd(typename VecT<VL>::type a, typename VecT<VL>::type b,
                                           typename VecT<VL>::type c) {
#if defined(__FMA__)
  if constexpr (VL == 4)
    return reinterpret_cast<typename VecT<VL>::type>(_mm_fmadd_ps(a, b, c));
  else if constexpr (VL == 8)
    return reinterpret_cast<typename VecT<VL>::type>(_mm256_fmadd_ps(a, b, c));
  else
    return reinterpret_cast<typename VecT<VL>::type>(_mm512_fmadd_ps(a, b, c));
#else
  return a * b + c;
#endif
}

// Software prefetch for the streaming (decode) kernels: the `bytes` of a
// weight row's run that a kernel will read `ahead` rows from now, a line at a
// time, into L2 (prefetcht1).  Each run is short (<= 4 kB) and the runs of
// a tile narrower than its matrix cross pages the hardware prefetcher stops
// at.  Into L2, not L1: measured on a Zen 4 (OLMoE decode T=1, random experts
// per call, interleaved processes), int8 streamed in 2.25-2.4 ms with
// prefetcht1 against 4.1-4.2 ms with prefetcht0 and 4.6-4.8 ms with none;
// bf16 in 4.4-4.5 ms 4 rows ahead against 5.7-6.4 ms with none
// (docs/benchmarks.md).  Rows `ahead` are about 8 kB ahead (kStreamAheadBytes).
constexpr int64_t kStreamAheadBytes = 8192;
NBX_AI void PrefetchRunL2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(c + l, 0, 2);
}
// The rows ahead for runs of `run_bytes`: kStreamAheadBytes of them, at most
// 32 (at least 1: the division rounds up).
NBX_AI int64_t StreamAheadRows(int64_t run_bytes) {
  const int64_t rows = (kStreamAheadBytes + run_bytes - 1) / (run_bytes > 0 ? run_bytes : 1);
  return rows > 32 ? 32 : rows;
}

// c + a*b for a scalar a and a vector or scalar b: one fused multiply-add
// where the file is compiled with FMA (x86 -mfma), else a*b + c (which
// -ffp-contract=fast fuses where the ISA has it: aarch64).  Every kernel's
// accumulation step is written with it, never as `acc += a * b`: whether a
// compiler contracts that is its own choice (built by the compiler of the
// H200 machine's image, the by-columns streaming differed from the packed
// kernels by an ulp, most likely a step it left unfused), and every kernel
// must round each step alike.
template <class W>
NBX_AI W MulAdd(float a, W b, W c) {
  if constexpr (std::is_same_v<W, float>) {
#if defined(__FMA__)
    return __builtin_fmaf(a, b, c);
#else
    return a * b + c;
#endif
  } else {
    constexpr int VL = sizeof(W) / sizeof(float);
    return FusedMulAdd<VL>(Splat<VL>(a), b, c);
  }
}

// VL bfloat16 values (raw bits) widened to float32.
template <int VL>
NBX_AI typename VecT<VL>::type LoadBf16(const uint16_t* p) {
  typename U16T<VL>::type h;
  memcpy(&h, p, sizeof h);
  typename U32T<VL>::type w = __builtin_convertvector(h, typename U32T<VL>::type) << 16;
  typename VecT<VL>::type v;
  memcpy(&v, &w, sizeof v);
  return v;
}

// glu(g, u): the value GEMM1 stores for gate g and up u.
NBX_AI float GluOf(const Glu& p, float g, float u) {
  switch (p.act) {
    case static_cast<int>(abi::Activation::kGeGLU): {  // gelu, tanh approximation
      constexpr float c = static_cast<float>(abi::kGeluC), b = static_cast<float>(abi::kGeluB);
      return 0.5f * g * (1.0f + tanhf(c * (g + b * g * g * g))) * u;
    }
    case static_cast<int>(abi::Activation::kGeGLUErf):  // gelu, exact
      return 0.5f * g * (1.0f + erff(g * static_cast<float>(abi::kInvSqrt2))) * u;
    case static_cast<int>(abi::Activation::kClampedSwiGLU): {  // gpt-oss
      const float gc = fminf(g, p.limit), uc = fminf(fmaxf(u, -p.limit), p.limit);
      return gc / (1.0f + expf(-p.alpha * gc)) * (uc + 1.0f);
    }
    default:
      return g / (1.0f + expf(-g)) * u;  // silu
  }
}

// v rounded to the nearest bfloat16 (even on ties; a NaN made quiet), as
// float32: dtypes.h's FromFloat<bf16>, in the kernels' own copy.
NBX_AI float RoundToBf16(float v) {
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) u = (u | 0x00400000u) & 0xffff0000u;
  else u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  memcpy(&v, &u, sizeof v);
  return v;
}

// f(RowsC<R>{}) with R = rows as a compile-time constant, 1..kMaxStreamRows
// (the streaming kernels' row counts).
template <int N>
struct RowsC {
  static constexpr int value = N;
};
template <typename F>
NBX_AI void WithRows(int rows, const F& f) {
  static_assert(kMaxStreamRows == 6, "WithRows covers 1..6 rows");
  switch (rows) {
    case 1: f(RowsC<1>{}); break;
    case 2: f(RowsC<2>{}); break;
    case 3: f(RowsC<3>{}); break;
    case 4: f(RowsC<4>{}); break;
    case 5: f(RowsC<5>{}); break;
    default: f(RowsC<6>{}); break;
  }
}

}  // namespace
}  // namespace nbx
