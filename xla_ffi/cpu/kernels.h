// The CPU micro-kernels, written once with GCC/Clang vector extensions and
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

#include "cpu/kernel_table.h"

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

template <typename W, int VL>
NBX_AI typename VecT<VL>::type LoadW(const W* p) {
  if constexpr (sizeof(W) == 2) {
    return LoadBf16<VL>(reinterpret_cast<const uint16_t*>(p));
  } else {
    return Load<VL>(reinterpret_cast<const float*>(p));
  }
}

NBX_AI float Act(int act, float g) {
  if (act == 1) {  // gelu, tanh approximation
    return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
  }
  return g / (1.0f + expf(-g));  // silu
}

// lo[r] = c0 + sum_kk a[kk*MR + r] * b[kk*2VL + (0..VL)], hi[r] the same over
// b[kk*2VL + (VL..2VL)]: the register-blocked loop both packed GEMMs share.
// c0 is 0, or with `c` the partial sums of the earlier K-blocks (row r: VL lo
// then VL hi values at c + r*2VL); continuing the chain from stored partial
// sums gives the same bits as one pass over the whole K.
template <int VL, int MR>
NBX_AI void AccumulatePanel(const float* a, const float* b, int64_t K, const float* c,
                            typename VecT<VL>::type (&lo)[MR],
                            typename VecT<VL>::type (&hi)[MR]) {
  using V = typename VecT<VL>::type;
  if (c != nullptr) {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      lo[r] = Load<VL>(c + r * 2 * VL);
      hi[r] = Load<VL>(c + r * 2 * VL + VL);
    }
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) lo[r] = hi[r] = V{};
  }
  for (int64_t kk = 0; kk < K; ++kk) {
    const V b0 = Load<VL>(b + kk * 2 * VL);
    const V b1 = Load<VL>(b + kk * 2 * VL + VL);
    const float* ak = a + kk * MR;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      lo[r] += ak[r] * b0;
      hi[r] += ak[r] * b1;
    }
  }
}

template <int VL, int MR>
NBX_AI void StorePartial(const typename VecT<VL>::type (&lo)[MR],
                         const typename VecT<VL>::type (&hi)[MR], float* c) {
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    memcpy(c + r * 2 * VL, &lo[r], sizeof lo[r]);
    memcpy(c + r * 2 * VL + VL, &hi[r], sizeof hi[r]);
  }
}

// GEMM1 on one packed m-panel (b: VL gate then VL up columns per row), one
// K-block: starts from the partial sums in c (flags & kLoadPartial) or 0;
// stores the sums back to c (flags & kStorePartial, more K-blocks follow) or
// writes out[r*rs + c*cs] = act(g) * u for r < rows, c < cols.
template <int VL, int MR>
NBX_AI void Gemm1Packed(const float* a, const float* b, int64_t K, int act,
                        int rows, int cols, float* out, int64_t rs, int64_t cs,
                        float* c, int flags) {
  typename VecT<VL>::type g[MR], u[MR];
  AccumulatePanel<VL, MR>(a, b, K, (flags & kLoadPartial) ? c : nullptr, g, u);
  if (flags & kStorePartial) {
    StorePartial<VL, MR>(g, u, c);
    return;
  }
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < cols; ++j) out[r * rs + j * cs] = Act(act, g[r][j]) * u[r][j];
}

// GEMM2 on one packed m-panel (b: 2VL columns of down per row), one K-block
// (flags as Gemm1Packed): out[r*rs + c] = w[r] * acc for r < rows, c < cols.
template <int VL, int MR>
NBX_AI void Gemm2Packed(const float* a, const float* b, int64_t K, const float* w,
                        int rows, int cols, float* out, int64_t rs, float* c, int flags) {
  typename VecT<VL>::type lo[MR], hi[MR];
  AccumulatePanel<VL, MR>(a, b, K, (flags & kLoadPartial) ? c : nullptr, lo, hi);
  if (flags & kStorePartial) {
    StorePartial<VL, MR>(lo, hi, c);
    return;
  }
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < cols && j < VL; ++j) out[r * rs + j] = w[r] * lo[r][j];
    for (int j = VL; j < cols; ++j) out[r * rs + j] = w[r] * hi[r][j - VL];
  }
}

// Streaming (decode): up to 4 rows, weights read in place, row by row of W
// (contiguous runs of ncols values; no packing), accumulators in `acc`
// (memory, L1-resident: 2 * rows * ncols floats).  a[kk*as + r] is row r.
template <int VL, typename W>
NBX_AI void AccumulateRows(const float* a, int64_t as, int rows, const W* w, int64_t ld,
                           int64_t K, int ncols, float* acc) {
  using V = typename VecT<VL>::type;
  const int nv = ncols / VL * VL;
  for (int i = 0; i < rows * ncols; ++i) acc[i] = 0.0f;
  for (int64_t kk = 0; kk < K; ++kk) {
    const W* wr = w + kk * ld;
    for (int r = 0; r < rows; ++r) {
      const float av = a[kk * as + r];
      float* ar = acc + r * ncols;
      for (int c = 0; c < nv; c += VL) {
        V v;
        memcpy(&v, ar + c, sizeof v);
        v += av * LoadW<W, VL>(wr + c);
        memcpy(ar + c, &v, sizeof v);
      }
      for (int c = nv; c < ncols; ++c) {
        float wv;
        if constexpr (sizeof(W) == 2) {
          uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(wr)[c]) << 16;
          memcpy(&wv, &bits, 4);
        } else {
          wv = reinterpret_cast<const float*>(wr)[c];
        }
        ar[c] += av * wv;
      }
    }
  }
}

template <int VL, typename W>
NBX_AI void Gemm1Stream(const float* a, int64_t as, int rows, const W* wg, const W* wu,
                        int64_t ld, int64_t K, int ncols, int act, float* acc, float* out,
                        int64_t rs, int64_t cs) {
  AccumulateRows<VL>(a, as, rows, wg, ld, K, ncols, acc);
  float* accu = acc + rows * ncols;
  AccumulateRows<VL>(a, as, rows, wu, ld, K, ncols, accu);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < ncols; ++c)
      out[r * rs + c * cs] = Act(act, acc[r * ncols + c]) * accu[r * ncols + c];
}

template <int VL, typename W>
NBX_AI void Gemm2Stream(const float* a, int64_t as, int rows, const W* wd, int64_t ld,
                        int64_t K, int ncols, const float* w, float* acc, float* out,
                        int64_t rs) {
  AccumulateRows<VL>(a, as, rows, wd, ld, K, ncols, acc);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < ncols; ++c) out[r * rs + c] = w[r] * acc[r * ncols + c];
}

}  // namespace
}  // namespace nbx

// Defines the kernel table of one instruction set: vector length VL (floats)
// and rows per m-panel MR.
#define NBX_STREAM(NAME, FN, T)                                                           \
  void NAME##1(const float* a, int64_t as, int rows, const void* wg, const void* wu,      \
               int64_t ld, int64_t K, int ncols, int act, float* acc, float* out,         \
               int64_t rs, int64_t cs) {                                                  \
    Gemm1Stream<FN>(a, as, rows, static_cast<const T*>(wg), static_cast<const T*>(wu),    \
                    ld, K, ncols, act, acc, out, rs, cs);                                 \
  }                                                                                       \
  void NAME##2(const float* a, int64_t as, int rows, const void* wd, int64_t ld,          \
               int64_t K, int ncols, const float* w, float* acc, float* out, int64_t rs) { \
    Gemm2Stream<FN>(a, as, rows, static_cast<const T*>(wd), ld, K, ncols, w, acc, out,    \
                    rs);                                                                  \
  }

#define NBX_DEFINE_KERNELS(FN, NAME, VL, MR)                                              \
  namespace nbx {                                                                         \
  namespace {                                                                             \
  void G1(const float* a, const float* b, int64_t K, int act, int rows, int cols,         \
          float* out, int64_t rs, int64_t cs, float* c, int flags) {                      \
    Gemm1Packed<VL, MR>(a, b, K, act, rows, cols, out, rs, cs, c, flags);                 \
  }                                                                                       \
  void G2(const float* a, const float* b, int64_t K, const float* w, int rows, int cols,  \
          float* out, int64_t rs, float* c, int flags) {                                  \
    Gemm2Packed<VL, MR>(a, b, K, w, rows, cols, out, rs, c, flags);                       \
  }                                                                                       \
  NBX_STREAM(SF, VL, float)                                                               \
  NBX_STREAM(SB, VL, uint16_t)                                                            \
  }                                                                                       \
  const KernelTable* FN() {                                                               \
    static const KernelTable t = {NAME, VL, MR, G1, G2, {SF1, SB1}, {SF2, SB2}};          \
    return &t;                                                                            \
  }                                                                                       \
  }
