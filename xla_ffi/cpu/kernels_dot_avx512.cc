// The bfloat16 dot-product kernels on float32 fused multiply-adds, 16 lanes
// x 12 rows on 512-bit registers (the avx512 table's blocking; K-blocks of
// 128 rows).  Compiled with -mavx512f (and the avx512 table's other flags);
// isa.cc lists it only on a CPU that runs the avx512 table.  The same steps
// as kernels_dot_avx2.cc's, under MXCSR DAZ|FTZ: the emulation's bits.
#include <immintrin.h>

#include "cpu/kernels_dot.h"

namespace nbx {
namespace {

// w << 16 per lane (a vector-extension shift: GCC 12's _mm512_slli_epi32
// warns of its own undefined source operand once inlined)
NBX_AI __m512 LowHalves(__m512i w) {
  return reinterpret_cast<__m512>(reinterpret_cast<U32T<16>::type>(w) << 16);
}

struct DotFmaZmm {
  static constexpr int kVl = 16;
  static constexpr int kAWords = 2;  // the odd row's float32, then the even row's (PackPanelSplit)
  static constexpr bool kStreams = true;
  typedef __m512 Acc;
  struct B {
    __m512 odd, even;
  };
  typedef FlushDenormals Mode;
  static NBX_AI Acc Zero() { return _mm512_setzero_ps(); }
  static NBX_AI Acc LoadAcc(const float* p) { return _mm512_loadu_ps(p); }
  static NBX_AI void StoreAcc(float* p, const Acc& v) { _mm512_storeu_ps(p, v); }
  static NBX_AI B LoadB(const uint32_t* p) {
    const __m512i w = _mm512_loadu_si512(p);
    return B{_mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u)))),
             LowHalves(w)};
  }
  static NBX_AI Acc Dot(Acc acc, const uint32_t* a, const B& b) {
    float odd, even;
    memcpy(&odd, a, sizeof odd);
    memcpy(&even, a + 1, sizeof even);
    return _mm512_fmadd_ps(_mm512_set1_ps(even), b.even, _mm512_fmadd_ps(_mm512_set1_ps(odd), b.odd, acc));
  }
};

}  // namespace
}  // namespace nbx

NBX_DEFINE_DOT_KERNELS(DotKernelsFma16x12, "fma", DotFmaZmm, 12, 128)
