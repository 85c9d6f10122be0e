// The CPU forward's LoRA adapters (moe_forward.cc): the adapters' terms as
// additions to the sums the base path computes, so that adapters with B = 0
// give the base's output bit for bit, in every arithmetic (float32, the
// bfloat16 dot kernels, every weight format).  Per row m routed to expert e
// (PEFT's LoRA: the base layer's output plus s (x A) B):
//   g | u = (x [G_e | U_e]) + s_g (x A_g) B_g | s_u (x A_u) B_u, then biases
//   a = glu(g, u),  O = w (a D_e + s_d (a A_d) B_d) + w bd
// The rank projections LR = s (x A) are computed once per row before the
// GEMM (LoraRanks); each tile's epilogue adds its columns' term (AddLoraTerm).
#pragma once

#include <cstdint>

#include "common/lora_args.h"

namespace nbx {

// LR[m * R + pj.col + j] = pj.s * sum_kk a(m, kk) * A_e[kk, j] for the rows m
// of [m0, m1), a(m, kk) = panels[(m / mr) * K * mr + kk * mr + m % mr] (the
// packed float32 m-panels of x or of the activations, K columns).
void LoraRanks(const LoraProj& pj, int64_t R, const float* panels, int64_t K, int mr, int64_t e,
               int64_t m0, int64_t m1, float* LR);

// sums[r * rs + c * cs] += t(m + r, n0 + c) for r < rows, c < cols, where
// t(m, n) = sum_j LR[m * R + pj.col + j] * B_e[j, n] (a sum of its own, then
// one addition; a zero term adds nothing, the sign of a zero sum kept).
void AddLoraTerm(const LoraProj& pj, int64_t R, const float* LR, int64_t e, int64_t m, int rows,
                 int64_t n0, int cols, float* sums, int64_t rs, int64_t cs);

}  // namespace nbx
