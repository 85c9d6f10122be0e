// The CPU micro-kernels of one instruction set: kernels_<isa>.cc includes
// this file and instantiates NBX_DEFINE_KERNELS with its vector length VL,
// rows per m-panel MR and blocking parameters.  The kernels themselves are in
// kernels_base.h (common), kernels_dense.h, kernels_quant.h and kernels_qdot.h.
#pragma once

#include "cpu/kernels/kernels_base.h"
#include "cpu/kernels/kernels_dense.h"
#include "cpu/kernels/kernels_qdot.h"
#include "cpu/kernels/kernels_quant.h"

// One ISA's streaming entries over weights of type T: G1/G2 = Gemm1Stream and
// Gemm2Stream (weights by rows) or Gemm1StreamCols and Gemm2StreamCols (by columns).
#define NBX_STREAM(NAME, FN, T, G1, G2)                                                   \
  void NAME##1(const float* a, int64_t as, int rows, const void* wg, const void* wu,      \
               int64_t ld, int64_t K, int ncols, const Glu& act, float* acc, float* out,  \
               int64_t rs, int64_t cs) {                                                  \
    G1<FN>(a, as, rows, static_cast<const T*>(wg), static_cast<const T*>(wu), ld, K,      \
           ncols, act, acc, out, rs, cs);                                                 \
  }                                                                                       \
  void NAME##2(const float* a, int64_t as, int rows, const void* wd, int64_t ld,          \
               int64_t K, int ncols, const float* w, float* acc, float* out, int64_t rs) { \
    G2<FN>(a, as, rows, static_cast<const T*>(wd), ld, K, ncols, w, acc, out, rs);        \
  }

// Defines the kernel table of one instruction set: vector length VL (floats),
// rows per m-panel MR, and the blocking parameters KC (K-block rows), NC
// (tile columns) and CP (m-panels per chunk) of KernelTable.
#define NBX_DEFINE_KERNELS(FN, NAME, VL, MR, KC, NC, CP)                                  \
  namespace nbx {                                                                         \
  namespace {                                                                             \
  void G1(const float* a, const float* b, int64_t K, const Glu& act, int rows, int cols,  \
          float* out, int64_t rs, int64_t cs, float* c, int flags, const float* s) {      \
    Gemm1Packed<VL, MR>(a, b, K, act, rows, cols, out, rs, cs, c, flags, s);              \
  }                                                                                       \
  void G2(const float* a, const float* b, int64_t K, const float* w, int rows, int cols,  \
          float* out, int64_t rs, float* c, int flags, const float* s) {                  \
    Gemm2Packed<VL, MR>(a, b, K, w, rows, cols, out, rs, c, flags, s);                    \
  }                                                                                       \
  NBX_STREAM(SF, VL, float, Gemm1Stream, Gemm2Stream)                                     \
  NBX_STREAM(SB, VL, uint16_t, Gemm1Stream, Gemm2Stream)                                  \
  NBX_STREAM(CF, VL, float, Gemm1StreamCols, Gemm2StreamCols)                             \
  NBX_STREAM(CB, VL, uint16_t, Gemm1StreamCols, Gemm2StreamCols)                          \
  }                                                                                       \
  const KernelTable* FN() {                                                               \
    static const KernelTable t = {NAME,       VL,         MR,         KC, NC, CP,         \
                                  G1,         G2,         {SF1, SB1},                     \
                                  {SF2, SB2}, Gemm1StreamQ<AccumulateRowsQuant<VL>>,      \
                                  Gemm2StreamQ<AccumulateRowsQuant<VL>>,                  \
                                  PackQuant<VL>,                                          \
                                  Gemm1StreamQ<QDotRowsAny<VL>>, Gemm2StreamQ<QDotRowsAny<VL>>, \
                                  GluRows,                                                \
                                  {CF1, CB1}, {CF2, CB2},                                 \
                                  {PackColumnsT<VL, float>, PackColumnsT<VL, uint16_t>},  \
                                  {PackPairsT<VL, float>, PackPairsT<VL, uint16_t>},      \
                                  {StreamPair<VL, float>, StreamPair<VL, uint16_t>},      \
                                  &t};                                                    \
    return &t;                                                                            \
  }                                                                                       \
  }

