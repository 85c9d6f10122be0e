// The bfloat16 dot-product kernels on VDPBF16PS (this file is compiled with
// -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mfma; isa.cc calls it only on
// a CPU with avx512_bf16), with the packed tables' blockings: 16 lanes x 12
// rows on 512-bit registers (the avx512 table's: 24 accumulators, two B
// vectors and a broadcast in the 32 registers) and 8 lanes x 6 rows on
// 256-bit ones (the avx2 table's, chosen on double-pumped cores such as
// Zen 4); K-blocks of 128 rows.  Their streaming (decode) kernels are the fma
// ones of the same width (DotFma: the documented arithmetic on float32 FMAs
// under DAZ|FTZ): a token's bits are the same streamed or packed exactly when
// the instruction does what Intel documents, which tests/cpu/test_kernels.py's
// stream-vs-packed testers and tests/cpu/test_precision.py check where it runs.
#include <immintrin.h>

#include "cpu/kernels/kernels_dot.h"

namespace nbx {
namespace {

struct DotZmm {
  static constexpr int kVl = 16;
  static constexpr int kAWords = 1;
  typedef DotFma<16> Stream;
  typedef __m512 Acc;
  typedef __m512i B;
  typedef NoMode Mode;
  static NBX_AI Acc Zero() { return _mm512_setzero_ps(); }
  static NBX_AI Acc LoadAcc(const float* p) { return _mm512_loadu_ps(p); }
  static NBX_AI void StoreAcc(float* p, const Acc& v) { _mm512_storeu_ps(p, v); }
  static NBX_AI B LoadB(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static NBX_AI Acc Dot(Acc acc, const uint32_t* a, const B& b) {
    const __m512i av = _mm512_set1_epi32(static_cast<int>(*a));
    return _mm512_dpbf16_ps(acc, (__m512bh)av, (__m512bh)b);
  }
};

struct DotYmm {
  static constexpr int kVl = 8;
  static constexpr int kAWords = 1;
  typedef DotFma<8> Stream;
  typedef __m256 Acc;
  typedef __m256i B;
  typedef NoMode Mode;
  static NBX_AI Acc Zero() { return _mm256_setzero_ps(); }
  static NBX_AI Acc LoadAcc(const float* p) { return _mm256_loadu_ps(p); }
  static NBX_AI void StoreAcc(float* p, const Acc& v) { _mm256_storeu_ps(p, v); }
  static NBX_AI B LoadB(const uint32_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static NBX_AI Acc Dot(Acc acc, const uint32_t* a, const B& b) {
    const __m256i av = _mm256_set1_epi32(static_cast<int>(*a));
    return _mm256_dpbf16_ps(acc, (__m256bh)av, (__m256bh)b);
  }
};

}  // namespace
}  // namespace nbx

NBX_DEFINE_DOT_KERNELS(DotKernelsAvx512Bf16x16x12, "avx512_bf16", DotZmm, 12, 128)
NBX_DEFINE_DOT_KERNELS(DotKernelsAvx512Bf16x8x6, "avx512_bf16", DotYmm, 6, 128)
