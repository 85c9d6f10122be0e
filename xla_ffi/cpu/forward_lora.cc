// The CPU forward's LoRA terms (forward_lora.h).
#include "cpu/forward_lora.h"

#include <cstring>

namespace nbx {

void LoraRanks(const LoraProj& pj, int64_t R, const float* panels, int64_t K, int mr, int64_t e,
               int64_t m0, int64_t m1, float* LR) {
  if (pj.r == 0) return;
  const float* A = pj.A + e * K * pj.r;
  for (int64_t m = m0; m < m1; ++m) {
    const float* a = panels + (m / mr) * K * mr + m % mr;
    float* lr = LR + m * R + pj.col;
    std::memset(lr, 0, static_cast<size_t>(pj.r) * sizeof(float));
    for (int64_t kk = 0; kk < K; ++kk) {
      const float v = a[kk * mr];
      const float* Ak = A + kk * pj.r;
      for (int64_t j = 0; j < pj.r; ++j) lr[j] += v * Ak[j];
    }
    for (int64_t j = 0; j < pj.r; ++j) lr[j] *= pj.s;
  }
}

void AddLoraTerm(const LoraProj& pj, int64_t R, const float* LR, int64_t e, int64_t m, int rows,
                 int64_t n0, int cols, float* sums, int64_t rs, int64_t cs) {
  if (pj.r == 0) return;
  constexpr int kCols = 256;
  float t[kCols];
  const float* B = pj.B + e * pj.r * pj.out + n0;
  for (int r = 0; r < rows; ++r) {
    const float* lr = LR + (m + r) * R + pj.col;
    for (int c0 = 0; c0 < cols; c0 += kCols) {
      const int nc = cols - c0 < kCols ? cols - c0 : kCols;
      for (int c = 0; c < nc; ++c) t[c] = 0.0f;
      for (int64_t j = 0; j < pj.r; ++j) {
        const float l = lr[j];
        const float* Bj = B + j * pj.out + c0;
        for (int c = 0; c < nc; ++c) t[c] += l * Bj[c];
      }
      float* s = sums + r * rs + c0 * cs;
      for (int c = 0; c < nc; ++c)
        if (t[c] != 0.0f) s[c * cs] += t[c];
    }
  }
}

}  // namespace nbx
