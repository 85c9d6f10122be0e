// The CPU forward's moves of whole rows (moe_forward.cc): x gathered into
// packed float32 m-panels, and GEMM2's down bias weighted like the rows.
#pragma once

#include <cstdint>

#include "dtypes.h"

namespace nbx {

// x's rows row_token[r] into one packed m-panel dst [H][mr] (float32);
// padding rows (token -1) zero.
template <typename XT>
void GatherPanel(const XT* x, int64_t H, const int32_t* row_token, int mr, float* dst) {
  for (int r = 0; r < mr; ++r) {
    if (row_token[r] < 0) {
      for (int64_t h = 0; h < H; ++h) dst[h * mr + r] = 0.0f;
    } else {
      const XT* src = x + static_cast<int64_t>(row_token[r]) * H;
      for (int64_t h = 0; h < H; ++h) dst[h * mr + r] = ToFloat(src[h]);
    }
  }
}

// GEMM2's down bias, weighted like the rows: O[m, n0+c] += w[m] * bd[n0+c]
// for rows [m0, m1) (padding rows have weight 0), c < cols.
inline void AddDownBias(const float* bd, const float* row_weight, int64_t m0, int64_t m1,
                        int64_t n0, int cols, float* O, int64_t H) {
  for (int64_t m = m0; m < m1; ++m) {
    const float w = row_weight[m];
    float* o = O + m * H + n0;
    for (int c = 0; c < cols; ++c) o[c] += w * bd[n0 + c];
  }
}

}  // namespace nbx
