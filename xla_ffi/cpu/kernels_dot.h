// bfloat16 dot-product micro-kernels: the packed GEMM1 / GEMM2 of
// kernels_dense.h on operands held as bfloat16 pairs, each step adding two
// products into float32 as the x86 instruction VDPBF16PS does.  One template
// of the kernel logic, instantiated per "dot" policy by kernels_dot_<name>.cc:
//   avx512_bf16  the instruction itself (_mm512_dpbf16_ps), compiled with
//                -mavx512bf16, chosen at run time where the CPU has it;
//   emulated     a scalar emulation of the instruction's documented semantics
//                (portable: runs and is tested everywhere).
// Included ONLY by those files (kernels_base.h's rules: internal linkage, no
// inline function of the C++ library).
//
// Semantics (Intel SDM, VDPBF16PS), per float32 lane j of the accumulator:
//   acc += float(a.bf16[2j+1]) * float(b.bf16[2j+1])
//   acc += float(a.bf16[2j])   * float(b.bf16[2j])
// each a float32 fused multiply-add rounded to nearest even, the inputs'
// denormals read as zero (DAZ) and each result's flushed to zero (FTZ); MXCSR
// is neither read nor written.  So a K-sum runs over pairs of rows (2p+1,
// then 2p), and results are the same bits whichever implementation ran them,
// whatever the rows' place in their panel, and across K-blocks (partial sums
// in c, as kernels_dense.h).
//
// Layouts (uint32 words, each two bfloat16: the low half row 2p, the high
// half row 2p+1; a missing row 2p+1 of an odd K is 0), built by dot_pack.h:
//   packed A  one m-panel of MR rows: a[p*MR + r]
//   packed B  one micro-panel of 2VL columns: b[p*2VL + c]
//             GEMM1: c < VL gate columns, c >= VL the same columns of up
//             GEMM2: 2VL columns of down
#pragma once

#include "cpu/kernels_base.h"

namespace nbx {
namespace {

// One lane of the instruction, exactly as documented (the emulation).
NBX_AI float DazBf16(uint32_t bits16) {
  uint32_t u = (bits16 & 0x7f80u) == 0 ? (bits16 & 0x8000u) << 16 : bits16 << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
NBX_AI float Ftz(float v) {
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
  memcpy(&v, &u, sizeof v);
  return v;
}
NBX_AI float DotPairLane(float acc, uint32_t a, uint32_t b) {
  acc = Ftz(fmaf(DazBf16(a >> 16), DazBf16(b >> 16), acc));
  return Ftz(fmaf(DazBf16(a & 0xffffu), DazBf16(b & 0xffffu), acc));
}

// The policies: Acc (VL float32 sums), B (VL words of packed B), and
// Zero/LoadAcc/StoreAcc/LoadB/Dot on them.  The emulation's are plain arrays
// (no vector types: the same 16 lanes as the instruction on any target).
template <int VL>
struct DotEmulated {
  static constexpr int kVl = VL;
  struct Acc {
    float v[VL];
  };
  struct B {
    uint32_t v[VL];
  };
  static NBX_AI Acc Zero() { return Acc{}; }
  static NBX_AI Acc LoadAcc(const float* p) {
    Acc r;
    memcpy(r.v, p, sizeof r.v);
    return r;
  }
  static NBX_AI void StoreAcc(float* p, const Acc& a) { memcpy(p, a.v, sizeof a.v); }
  static NBX_AI B LoadB(const uint32_t* p) {
    B r;
    memcpy(r.v, p, sizeof r.v);
    return r;
  }
  static NBX_AI Acc Dot(Acc acc, uint32_t a, const B& b) {
    for (int j = 0; j < VL; ++j) acc.v[j] = DotPairLane(acc.v[j], a, b.v[j]);
    return acc;
  }
};

// lo[r] = c0 + the pair sums of a's row r with b's VL lo columns, hi[r] with
// the VL hi columns, over P pairs of rows (c0: 0, or c's stored sums).
template <class D, int MR>
NBX_AI void AccumulatePairs(const uint32_t* a, const uint32_t* b, int64_t P, const float* c,
                            typename D::Acc (&lo)[MR], typename D::Acc (&hi)[MR]) {
  constexpr int VL = D::kVl;
  if (c != nullptr) {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      lo[r] = D::LoadAcc(c + r * 2 * VL);
      hi[r] = D::LoadAcc(c + r * 2 * VL + VL);
    }
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) lo[r] = hi[r] = D::Zero();
  }
  for (int64_t p = 0; p < P; ++p) {
    const typename D::B b0 = D::LoadB(b + p * 2 * VL);
    const typename D::B b1 = D::LoadB(b + p * 2 * VL + VL);
    const uint32_t* ap = a + p * MR;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      lo[r] = D::Dot(lo[r], ap[r], b0);
      hi[r] = D::Dot(hi[r], ap[r], b1);
    }
  }
}

// The MR x 2VL sums of one m-panel over one K-block of P pairs, row r at
// + r*2VL (lo then hi: the stored partial sums' layout): stored to c when
// more K-blocks follow (flags & kStorePartial; returns false: no epilogue),
// else to s (returns true).  c also holds the earlier blocks' sums (flags &
// kLoadPartial).
template <class D, int MR>
NBX_AI bool PanelSums(const uint32_t* a, const uint32_t* b, int64_t P, float* c, int flags,
                      float* s) {
  constexpr int VL = D::kVl;
  typename D::Acc lo[MR], hi[MR];
  AccumulatePairs<D, MR>(a, b, P, (flags & kLoadPartial) ? c : nullptr, lo, hi);
  float* dst = (flags & kStorePartial) ? c : s;
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    D::StoreAcc(dst + r * 2 * VL, lo[r]);
    D::StoreAcc(dst + r * 2 * VL + VL, hi[r]);
  }
  return !(flags & kStorePartial);
}

// GEMM1 on one packed m-panel, one K-block of P pairs (flags: PartialFlags,
// as Gemm1Packed): out[r*rs + c*cs] = act(g) * u for r < rows, c < cols <= VL.
template <class D, int MR>
void Gemm1Dot(const uint32_t* a, const uint32_t* b, int64_t P, const Glu& act, int rows,
              int cols, float* out, int64_t rs, int64_t cs, float* c, int flags) {
  constexpr int VL = D::kVl;
  float s[MR * 2 * VL];
  if (!PanelSums<D, MR>(a, b, P, c, flags, s)) return;
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < cols; ++j)
      out[r * rs + j * cs] = GluOf(act, s[r * 2 * VL + j], s[r * 2 * VL + VL + j]);
}

// GEMM2 on one packed m-panel, one K-block of P pairs: out[r*rs + c] =
// w[r] * sum for r < rows, c < cols <= 2VL.
template <class D, int MR>
void Gemm2Dot(const uint32_t* a, const uint32_t* b, int64_t P, const float* w, int rows,
              int cols, float* out, int64_t rs, float* c, int flags) {
  constexpr int VL = D::kVl;
  float s[MR * 2 * VL];
  if (!PanelSums<D, MR>(a, b, P, c, flags, s)) return;
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < cols; ++j) out[r * rs + j] = w[r] * s[r * 2 * VL + j];
}

}  // namespace
}  // namespace nbx

// Defines the dot-kernel table FN() of policy D (VL lanes), MR rows per
// m-panel, KC rows (even) per K-block (several tables per file: the kernels
// are named after FN).
#define NBX_DEFINE_DOT_KERNELS(FN, NAME, D, MR, KC)                                           \
  namespace nbx {                                                                           \
  namespace {                                                                               \
  static_assert((KC) % 2 == 0, "K-blocks hold whole pairs of rows");                        \
  void FN##G1(const uint32_t* a, const uint32_t* b, int64_t P, const Glu& act, int rows,    \
              int cols, float* out, int64_t rs, int64_t cs, float* c, int flags) {          \
    Gemm1Dot<D, MR>(a, b, P, act, rows, cols, out, rs, cs, c, flags);                       \
  }                                                                                         \
  void FN##G2(const uint32_t* a, const uint32_t* b, int64_t P, const float* w, int rows,    \
              int cols, float* out, int64_t rs, float* c, int flags) {                      \
    Gemm2Dot<D, MR>(a, b, P, w, rows, cols, out, rs, c, flags);                             \
  }                                                                                         \
  }                                                                                         \
  const DotKernelTable* FN() {                                                              \
    static const DotKernelTable t = {NAME, D::kVl, MR, KC, FN##G1, FN##G2};                 \
    return &t;                                                                              \
  }                                                                                         \
  }
