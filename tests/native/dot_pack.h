// The reference packers of the bfloat16 dot-product kernels (kernels_dot.h
// layouts): uint32 words of two bfloat16, the low half row 2p and the high
// half row 2p+1 of a K-block, a missing row 2p+1 (odd K) 0.  Portable, one
// scalar loop per layout (it does not depend on the instruction).  Test code:
// the forward packs with each dot table's own pack_a / pack_b
// (kernel_table.h), which dot_kernel_tests.cc sweeps against these, word for
// word, and whose GEMMs it feeds with operands packed here.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/kernels/kernel_table.h"
#include "dtypes.h"

namespace nbx {

// Rows (even k, odd k) as one word: bfloat16 bits, low half the even row.
inline uint32_t Bf16Pair(uint16_t even, uint16_t odd) {
  return static_cast<uint32_t>(even) | (static_cast<uint32_t>(odd) << 16);
}

// Packed A: rows [k0, k0+kc) of one float32 m-panel a[k*mr + r] (the
// drivers' packed A) as pairs dst[p*mr + r], each value rounded to the
// nearest bfloat16 (even on ties; a value that is a bfloat16 -- x of dtype
// bfloat16 -- is kept exactly).  ceil(kc/2) pairs.
inline void PackPanelPairs(const float* a, int64_t k0, int kc, int mr, uint32_t* dst) {
  const int pairs = (kc + 1) / 2;
  for (int p = 0; p < pairs; ++p) {
    const float* even = a + (k0 + 2 * p) * mr;
    const bool has_odd = 2 * p + 1 < kc;
    for (int r = 0; r < mr; ++r)
      dst[p * mr + r] = Bf16Pair(FromFloat<bf16>(even[r]).bits,
                                 has_odd ? FromFloat<bf16>(even[mr + r]).bits : uint16_t{0});
  }
}

// Packed A for a table of a_words = 2 (the fma kernels): each pair as two
// float32, the odd row's bfloat16 value then the even row's (0 for a missing
// odd row), dst[(p*mr + r)*2 + {0, 1}], rounded as PackPanelPairs rounds.
inline void PackPanelSplit(const float* a, int64_t k0, int kc, int mr, uint32_t* dst) {
  const int pairs = (kc + 1) / 2;
  for (int p = 0; p < pairs; ++p) {
    const float* even = a + (k0 + 2 * p) * mr;
    const bool has_odd = 2 * p + 1 < kc;
    for (int r = 0; r < mr; ++r) {
      uint32_t* d = dst + (static_cast<int64_t>(p) * mr + r) * 2;
      d[0] = has_odd ? static_cast<uint32_t>(FromFloat<bf16>(even[mr + r]).bits) << 16 : 0u;
      d[1] = static_cast<uint32_t>(FromFloat<bf16>(even[r]).bits) << 16;
    }
  }
}

// Packed A of a dot table whose a_words is `a_words` (DotKernelTable):
// rows [k0, k0+kc) of one float32 m-panel, ceil(kc/2) * mr * a_words words.
inline void PackDotPanel(int a_words, const float* a, int64_t k0, int kc, int mr, uint32_t* dst) {
  if (a_words == 2) PackPanelSplit(a, k0, kc, mr, dst);
  else PackPanelPairs(a, k0, kc, mr, dst);
}

// Packed B: rows [k0, k0+kc) of columns [n0, n0+nc) of NS bfloat16
// row-major matrices m[s] (leading dimension ld) as micro-panels 2vl words
// wide (panel q at dst + q*PanelStride(P, vl), pair p at + p*2vl, P = ceil(kc/2)), each
// holding the next 2vl/NS columns of every matrix in turn (NS = 2: gate||up
// for GEMM1; NS = 1: down), zero past nc.
template <int NS>
void PackRowsPairs(const bf16* const* m, int64_t ld, int64_t k0, int kc, int64_t n0, int nc,
                   int vl, uint32_t* dst) {
  const int w = 2 * vl, C = w / NS, nsub = (nc + C - 1) / C, pairs = (kc + 1) / 2;
  for (int p = 0; p < pairs; ++p) {
    const bool has_odd = 2 * p + 1 < kc;
    for (int s = 0; s < NS; ++s) {
      const bf16* even = m[s] + (k0 + 2 * p) * ld + n0;
      const bf16* odd = has_odd ? even + ld : nullptr;
      for (int q = 0; q < nsub; ++q) {
        uint32_t* d = dst + q * PanelStride(pairs, vl) + p * w + s * C;
        const int n = std::min(C, nc - q * C);
        for (int j = 0; j < n; ++j)
          d[j] = Bf16Pair(even[q * C + j].bits, odd ? odd[q * C + j].bits : uint16_t{0});
        for (int j = n; j < C; ++j) d[j] = 0;
      }
    }
  }
}

}  // namespace nbx
