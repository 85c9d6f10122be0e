// The bfloat16 dot-product kernels on VDPBF16PS (this file is compiled with
// -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mfma; isa.cc calls it only on
// a CPU with avx512_bf16).  The same blocking as the emulated table: 16
// lanes, 12 rows per m-panel (24 accumulators, two B vectors and a broadcast
// in the 32 registers), K-blocks of 256 rows (128 pairs).
#include <immintrin.h>

#include "cpu/kernels_dot.h"

namespace nbx {
namespace {

struct DotAvx512Bf16 {
  static constexpr int kVl = 16;
  typedef __m512 Acc;
  typedef __m512i B;
  static NBX_AI Acc Zero() { return _mm512_setzero_ps(); }
  static NBX_AI Acc LoadAcc(const float* p) { return _mm512_loadu_ps(p); }
  static NBX_AI void StoreAcc(float* p, const Acc& v) { _mm512_storeu_ps(p, v); }
  static NBX_AI B LoadB(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static NBX_AI Acc Dot(Acc acc, uint32_t a, const B& b) {
    const __m512i av = _mm512_set1_epi32(static_cast<int>(a));
    return _mm512_dpbf16_ps(acc, (__m512bh)av, (__m512bh)b);
  }
};

}  // namespace
}  // namespace nbx

NBX_DEFINE_DOT_KERNELS(DotKernelsAvx512Bf16, "avx512_bf16", DotAvx512Bf16, 12, 256)
