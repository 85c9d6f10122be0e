// The bfloat16 dot-product kernels on float32 fused multiply-adds, 8 lanes x
// 6 rows on 256-bit registers (the avx2 table's blocking; K-blocks of 128
// rows).  Compiled with -mavx2 -mfma; isa.cc lists it only on a CPU that
// runs the avx2 table.  Each step splits a pair of B's bfloat16 into its two
// float32 (the high half masked, the low half shifted up; A comes split by
// its packer) and adds the odd row's product, then the even row's, under
// MXCSR DAZ|FTZ (FlushDenormals): the arithmetic kernels_dot.h documents, so
// the emulation's bits.
#include <immintrin.h>

#include "cpu/kernels_dot.h"

namespace nbx {
namespace {

struct DotFmaYmm {
  static constexpr int kVl = 8;
  static constexpr int kAWords = 2;  // the odd row's float32, then the even row's (PackPanelSplit)
  static constexpr bool kStreams = true;
  typedef __m256 Acc;
  struct B {
    __m256 odd, even;
  };
  typedef FlushDenormals Mode;
  static NBX_AI Acc Zero() { return _mm256_setzero_ps(); }
  static NBX_AI Acc LoadAcc(const float* p) { return _mm256_loadu_ps(p); }
  static NBX_AI void StoreAcc(float* p, const Acc& v) { _mm256_storeu_ps(p, v); }
  static NBX_AI B LoadB(const uint32_t* p) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return B{_mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u)))),
             _mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
  }
  static NBX_AI Acc Dot(Acc acc, const uint32_t* a, const B& b) {
    float odd, even;
    memcpy(&odd, a, sizeof odd);
    memcpy(&even, a + 1, sizeof even);
    return _mm256_fmadd_ps(_mm256_set1_ps(even), b.even, _mm256_fmadd_ps(_mm256_set1_ps(odd), b.odd, acc));
  }
};

}  // namespace
}  // namespace nbx

NBX_DEFINE_DOT_KERNELS(DotKernelsFma8x6, "fma", DotFmaYmm, 6, 128)
