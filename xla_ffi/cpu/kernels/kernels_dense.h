// Dense micro-kernels (float32 math on float32/bfloat16 weights): the packed
// GEMM1/GEMM2 panels and the streaming (decode) kernels.  Part of kernels.h;
// included only by kernels_<isa>.cc (see kernels_base.h for the rules).
#pragma once

#include "cpu/kernels/kernels_base.h"

namespace nbx {
namespace {

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
      lo[r] = MulAdd(ak[r], b0, lo[r]);
      hi[r] = MulAdd(ak[r], b1, hi[r]);
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
// writes out[r*rs + c*cs] = act(g) * u for r < rows, c < cols.  With
// `scale` (int8 weights, packed unscaled): g and u are first multiplied by
// their column's scale, scale[c] (gate) and scale[VL + c] (up).
template <int VL, int MR>
NBX_AI void Gemm1Packed(const float* a, const float* b, int64_t K, const Glu& act,
                        int rows, int cols, float* out, int64_t rs, int64_t cs,
                        float* c, int flags, const float* scale) {
  typename VecT<VL>::type g[MR], u[MR];
  AccumulatePanel<VL, MR>(a, b, K, (flags & kLoadPartial) ? c : nullptr, g, u);
  if (flags & kStorePartial) {
    StorePartial<VL, MR>(g, u, c);
    return;
  }
  if (scale != nullptr) {
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < cols; ++j)
        out[r * rs + j * cs] = GluOf(act, g[r][j] * scale[j], u[r][j] * scale[VL + j]);
    return;
  }
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < cols; ++j) out[r * rs + j * cs] = GluOf(act, g[r][j], u[r][j]);
}

// GEMM2 on one packed m-panel (b: 2VL columns of down per row), one K-block
// (flags as Gemm1Packed): out[r*rs + c] = w[r] * acc for r < rows, c < cols;
// with `scale`, w[r] * (acc * scale[c]).
template <int VL, int MR>
NBX_AI void Gemm2Packed(const float* a, const float* b, int64_t K, const float* w,
                        int rows, int cols, float* out, int64_t rs, float* c, int flags,
                        const float* scale) {
  typename VecT<VL>::type lo[MR], hi[MR];
  AccumulatePanel<VL, MR>(a, b, K, (flags & kLoadPartial) ? c : nullptr, lo, hi);
  if (flags & kStorePartial) {
    StorePartial<VL, MR>(lo, hi, c);
    return;
  }
  if (scale != nullptr) {
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < cols && j < VL; ++j) out[r * rs + j] = w[r] * (lo[r][j] * scale[j]);
      for (int j = VL; j < cols; ++j) out[r * rs + j] = w[r] * (hi[r][j - VL] * scale[j]);
    }
    return;
  }
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < cols && j < VL; ++j) out[r * rs + j] = w[r] * lo[r][j];
    for (int j = VL; j < cols; ++j) out[r * rs + j] = w[r] * hi[r][j - VL];
  }
}

// Streaming (decode) over float32 weights: up to 6 rows, weights read in
// place, row by row of W (contiguous runs of ncols values; no packing),
// accumulators in `acc` (memory, L1-resident: 2 * rows * ncols floats).
// a[kk*as + r] is row r.  (bfloat16 weights: AccumulateRowsBf16 below.)
// One step: ar[c] += av * wr[c] for c < ncols.
template <int VL>
NBX_AI void AxpyRow(float av, const float* wr, int ncols, float* ar) {
  using V = typename VecT<VL>::type;
  const int nv = ncols / VL * VL;
  for (int c = 0; c < nv; c += VL) {
    V v;
    memcpy(&v, ar + c, sizeof v);
    v = MulAdd(av, Load<VL>(wr + c), v);
    memcpy(ar + c, &v, sizeof v);
  }
  for (int c = nv; c < ncols; ++c) ar[c] = MulAdd(av, wr[c], ar[c]);
}

template <int VL>
NBX_AI void AccumulateRows(const float* a, int64_t as, int rows, const float* w, int64_t ld,
                           int64_t K, int ncols, float* acc) {
  for (int i = 0; i < rows * ncols; ++i) acc[i] = 0.0f;
  const int64_t ahead = StreamAheadRows(ncols * int64_t{4});
  for (int64_t kk = 0; kk < K; ++kk) {
    if (kk + ahead < K) PrefetchRunL2(w + (kk + ahead) * ld, ncols * int64_t{4});
    for (int r = 0; r < rows; ++r) AxpyRow<VL>(a[kk * as + r], w + kk * ld, ncols, acc + r * ncols);
  }
}

// AccumulateRows over two matrices in one pass: row kk of w0 into acc0,
// then row kk of w1 into acc1, for each kk in turn (each element's chain as
// in AccumulateRows): gate and up rows read together, so a fused gate||up
// ([H, 2I]) is read as one run per row instead of two passes that each skip
// every other half-row.  (acc0, acc1: rows of `ars` floats apart.)
template <int VL>
NBX_AI void AccumulateRowsPair(const float* a, int64_t as, int rows, const float* w0,
                               const float* w1, int64_t ld, int64_t K, int ncols, float* acc0,
                               float* acc1, int64_t ars) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < ncols; ++c) acc0[r * ars + c] = acc1[r * ars + c] = 0.0f;
  const int64_t ahead = StreamAheadRows(ncols * int64_t{4});
  for (int64_t kk = 0; kk < K; ++kk)
    for (int m = 0; m < 2; ++m) {
      if (kk + ahead < K) PrefetchRunL2((m ? w1 : w0) + (kk + ahead) * ld, ncols * int64_t{4});
      for (int r = 0; r < rows; ++r)
        AxpyRow<VL>(a[kk * as + r], (m ? w1 : w0) + kk * ld, ncols, (m ? acc1 : acc0) + r * ars);
    }
}

// Streaming over bfloat16 weights, R rows (compile time), two rows of W per
// pass over the accumulators.  2VL weights are loaded as VL 32-bit lanes:
// lane i holds column 2i in its low half and 2i+1 in its high half, so
// `lane << 16` is column 2i as float32 and `lane & 0xffff0000` column 2i+1
// (two instructions per 2VL weights, no shuffles).  The accumulators of each
// 2VL-column block are kept as [even columns][odd columns] and put back in
// column order at the end.  Each element is still the chain of a * w in kk
// order, one FMA per step, as in AccumulateRows and the packed kernels.
//
// One pass: NW (1 or 2) rows of W, w[0] then w[1], each row's FMA in turn
// (MulAdd: explicit, as in every kernel).
template <int VL, int R, int NW>
NBX_AI void Bf16Pass(const float (&av)[NW][R], const uint16_t* const (&w)[NW], int ncols,
                     float* acc) {
  using V = typename VecT<VL>::type;
  using U = typename U32T<VL>::type;
  const int nb = ncols / (2 * VL) * (2 * VL);
  const U himask = U{} + 0xffff0000u;
  for (int c = 0; c < nb; c += 2 * VL) {
    V ve[NW], vo[NW];
#pragma GCC unroll 2
    for (int i = 0; i < NW; ++i) {
      U l;
      memcpy(&l, w[i] + c, sizeof l);
      const U e = l << 16, o = l & himask;
      memcpy(&ve[i], &e, sizeof e);
      memcpy(&vo[i], &o, sizeof o);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      float* ar = acc + r * ncols + c;
      V se, so;
      memcpy(&se, ar, sizeof se);
      memcpy(&so, ar + VL, sizeof so);
#pragma GCC unroll 2
      for (int i = 0; i < NW; ++i) {
        se = MulAdd(av[i][r], ve[i], se);
        so = MulAdd(av[i][r], vo[i], so);
      }
      memcpy(ar, &se, sizeof se);
      memcpy(ar + VL, &so, sizeof so);
    }
  }
  for (int c = nb; c < ncols; ++c) {
    V f = {};  // lane 0 of a vector: the same FMA as the lanes above
    V s = {};
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      s[0] = acc[r * ncols + c];
#pragma GCC unroll 2
      for (int i = 0; i < NW; ++i) {
        const uint32_t bits = static_cast<uint32_t>(w[i][c]) << 16;
        float wf;  // (no address of a vector element: Clang refuses it)
        memcpy(&wf, &bits, 4);
        f[0] = wf;
        s = MulAdd(av[i][r], f, s);
      }
      acc[r * ncols + c] = s[0];
    }
  }
}

// kDot: the bfloat16 dot-product kernels' streaming (kernels_dot.h, run under
// their policy's MXCSR DAZ|FTZ): explicit fused multiply-adds (MulAdd,
// whatever the optimisation level), a rounded to bfloat16 (RoundToBf16) and the
// chain over pairs of rows, row kk+1 before row kk (an odd K's missing last
// odd row adds 0 * 0 = +0): the packed dot kernels' bits.
template <int VL, int R, bool kDot = false>
void AccumulateRowsBf16R(const float* a, int64_t as, const uint16_t* w, int64_t ld, int64_t K,
                         int ncols, float* acc) {
  const int nb = ncols / (2 * VL) * (2 * VL);
  const auto in = [](float v) {
    if constexpr (kDot) return RoundToBf16(v);
    else return v;
  };
  for (int i = 0; i < R * ncols; ++i) acc[i] = 0.0f;
  const int64_t ahead = StreamAheadRows(ncols * int64_t{2});
  int64_t kk = 0;
  for (; kk + 1 < K; kk += 2) {
    if (kk + ahead + 1 < K) {
      PrefetchRunL2(w + (kk + ahead) * ld, ncols * int64_t{2});
      PrefetchRunL2(w + (kk + ahead + 1) * ld, ncols * int64_t{2});
    }
    const int64_t k0 = kDot ? kk + 1 : kk, k1 = kDot ? kk : kk + 1;
    float av[2][R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) av[0][r] = in(a[k0 * as + r]), av[1][r] = in(a[k1 * as + r]);
    const uint16_t* const wr[2] = {w + k0 * ld, w + k1 * ld};
    Bf16Pass<VL, R, 2>(av, wr, ncols, acc);
  }
  if (kk < K) {  // K odd: the last row alone
    if constexpr (kDot)
      for (int i = 0; i < R * ncols; ++i) acc[i] += 0.0f;
    float av[1][R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) av[0][r] = in(a[kk * as + r]);
    const uint16_t* const wr[1] = {w + kk * ld};
    Bf16Pass<VL, R, 1>(av, wr, ncols, acc);
  }
  // [even][odd] -> column order, per block
  // over-aligned explicitly: the compiler may store it with aligned vector moves, and
  // ASan's fake stack (detect_stack_use_after_return) honours only declared alignment
  alignas(64) float tmp[2 * VL];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < nb; c += 2 * VL) {
      float* ar = acc + r * ncols + c;
      for (int i = 0; i < VL; ++i) tmp[2 * i] = ar[i], tmp[2 * i + 1] = ar[VL + i];
      memcpy(ar, tmp, sizeof tmp);
    }
}

template <int VL>
NBX_AI void AccumulateRowsBf16(const float* a, int64_t as, int rows, const uint16_t* w,
                               int64_t ld, int64_t K, int ncols, float* acc) {
  WithRows(rows, [&](auto r) {
    AccumulateRowsBf16R<VL, decltype(r)::value>(a, as, w, ld, K, ncols, acc);
  });
}

// Dense streaming dispatch: float32 rows, or the bfloat16 kernel above.
template <int VL, typename W>
NBX_AI void AccumulateRowsW(const float* a, int64_t as, int rows, const W* w, int64_t ld,
                            int64_t K, int ncols, float* acc) {
  if constexpr (sizeof(W) == 2)
    AccumulateRowsBf16<VL>(a, as, rows, w, ld, K, ncols, acc);
  else
    AccumulateRows<VL>(a, as, rows, w, ld, K, ncols, acc);  // float
}

// The streaming kernels' epilogues: out[r*rs + c*cs] = act(g, u) from the
// sums g (acc) and u (accu), rows of ncols; out[r*rs + c] = w[r] * sum.
NBX_AI void StreamGluEpilogue(const float* acc, const float* accu, int rows, int ncols,
                              const Glu& act, float* out, int64_t rs, int64_t cs) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < ncols; ++c)
      out[r * rs + c * cs] = GluOf(act, acc[r * ncols + c], accu[r * ncols + c]);
}
NBX_AI void StreamWeightEpilogue(const float* acc, int rows, int ncols, const float* w, float* out,
                                 int64_t rs) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < ncols; ++c) out[r * rs + c] = w[r] * acc[r * ncols + c];
}

template <int VL, typename W>
NBX_AI void Gemm1Stream(const float* a, int64_t as, int rows, const W* wg, const W* wu,
                        int64_t ld, int64_t K, int ncols, const Glu& act, float* acc, float* out,
                        int64_t rs, int64_t cs) {
  float* accu = acc + rows * ncols;
  // (one pass where the up run follows the gate run in the row: a fused
  // [H, 2I] whose item spans all of I; separate matrices stream faster one
  // after the other, measured)
  if (sizeof(W) == 4 && wu == wg + ncols) {
    AccumulateRowsPair<VL>(a, as, rows, reinterpret_cast<const float*>(wg),
                           reinterpret_cast<const float*>(wu), ld, K, ncols, acc, accu, ncols);
  } else {
    AccumulateRowsW<VL>(a, as, rows, wg, ld, K, ncols, acc);
    AccumulateRowsW<VL>(a, as, rows, wu, ld, K, ncols, accu);
  }
  StreamGluEpilogue(acc, accu, rows, ncols, act, out, rs, cs);
}

template <int VL, typename W>
NBX_AI void Gemm2Stream(const float* a, int64_t as, int rows, const W* wd, int64_t ld,
                        int64_t K, int ncols, const float* w, float* acc, float* out,
                        int64_t rs) {
  AccumulateRowsW<VL>(a, as, rows, wd, ld, K, ncols, acc);
  StreamWeightEpilogue(acc, rows, ncols, w, out, rs);
}

// The lanes of a and b interleaved: lo = a0 b0 a1 b1 ... (first halves),
// hi the same of the second halves.  (Templates with discarded branches:
// no function on wider vectors than the instruction set has is emitted.)
template <int VL>
NBX_AI typename VecT<VL>::type InterleaveLo(typename VecT<VL>::type a, typename VecT<VL>::type b) {
  if constexpr (VL == 4)
    return __builtin_shufflevector(a, b, 0, 4, 1, 5);
  else if constexpr (VL == 8)
    return __builtin_shufflevector(a, b, 0, 8, 1, 9, 2, 10, 3, 11);
  else
    return __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
}
template <int VL>
NBX_AI typename VecT<VL>::type InterleaveHi(typename VecT<VL>::type a, typename VecT<VL>::type b) {
  if constexpr (VL == 4)
    return __builtin_shufflevector(a, b, 2, 6, 3, 7);
  else if constexpr (VL == 8)
    return __builtin_shufflevector(a, b, 4, 12, 5, 13, 6, 14, 7, 15);
  else
    return __builtin_shufflevector(a, b, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15,
                                   31);
}

// t (VL rows of VL lanes) transposed in registers: log2(VL) rounds of
// interleaving row i with row i + VL/2 (the perfect shuffle).
template <int VL>
NBX_AI void TransposeBlock(typename VecT<VL>::type (&t)[VL]) {
  typename VecT<VL>::type u[VL];
  for (int round = 1; round < VL; round *= 2) {
#pragma GCC unroll 16
    for (int i = 0; i < VL / 2; ++i) {
      u[2 * i] = InterleaveLo<VL>(t[i], t[i + VL / 2]);
      u[2 * i + 1] = InterleaveHi<VL>(t[i], t[i + VL / 2]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < VL; ++i) t[i] = u[i];
  }
}

template <int VL>
NBX_AI typename VecT<VL>::type LoadW(const float* p) { return Load<VL>(p); }
template <int VL>
NBX_AI typename VecT<VL>::type LoadW(const uint16_t* p) { return LoadBf16<VL>(p); }
NBX_AI float ScalarW(float v) { return v; }
NBX_AI float ScalarW(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// Streaming over weights stored by columns (out x in, nn.Linear's layout:
// column c of the logical matrix is the run wt[c*ld + k], k < K), R rows:
// acc[r*ncols + c] = sum_k a[k*as + r] * wt[c*ld + k], in k order, one FMA
// per step on VL columns at a time: the packed kernels' chain, so the path
// an expert takes changes no bit.  Each VL x VL block of wt is read as VL
// contiguous runs and turned in registers (TransposeBlock); the last K % VL
// steps and the last ncols % VL columns are gathered one weight at a time.
template <int VL, int R, typename W>
void AccumulateColsR(const float* a, int64_t as, const W* wt, int64_t ld, int64_t K, int ncols,
                     float* acc) {
  using V = typename VecT<VL>::type;
  for (int c0 = 0; c0 < ncols; c0 += VL) {
    const int nc = ncols - c0 < VL ? ncols - c0 : VL;
    V s[R];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) s[r] = V{};
    int64_t k0 = 0;
    if (nc == VL) {
      for (; k0 + VL <= K; k0 += VL) {
        V t[VL];
#pragma GCC unroll 16
        for (int j = 0; j < VL; ++j) t[j] = LoadW<VL>(wt + (c0 + j) * ld + k0);
        TransposeBlock<VL>(t);  // t[i]: step k0 + i of the VL columns
#pragma GCC unroll 16
        for (int i = 0; i < VL; ++i) {
          const float* ak = a + (k0 + i) * as;
#pragma GCC unroll 6
          for (int r = 0; r < R; ++r) s[r] = MulAdd(ak[r], t[i], s[r]);
        }
      }
    }
    for (; k0 < K; ++k0) {
      V t = {};
      for (int j = 0; j < nc; ++j) t[j] = ScalarW(wt[(c0 + j) * ld + k0]);
      const float* ak = a + k0 * as;
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) s[r] = MulAdd(ak[r], t, s[r]);
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < nc; ++j) acc[r * ncols + c0 + j] = s[r][j];
  }
}

template <int VL, typename W>
NBX_AI void AccumulateCols(const float* a, int64_t as, int rows, const W* wt, int64_t ld,
                           int64_t K, int ncols, float* acc) {
  WithRows(rows, [&](auto r) {
    AccumulateColsR<VL, decltype(r)::value>(a, as, wt, ld, K, ncols, acc);
  });
}

// Gemm1Stream / Gemm2Stream on weights stored by columns (ld: the stored
// row length; column c of the logical matrix starts at w + c*ld).
template <int VL, typename W>
NBX_AI void Gemm1StreamCols(const float* a, int64_t as, int rows, const W* wg, const W* wu,
                            int64_t ld, int64_t K, int ncols, const Glu& act, float* acc,
                            float* out, int64_t rs, int64_t cs) {
  AccumulateCols<VL>(a, as, rows, wg, ld, K, ncols, acc);
  float* accu = acc + rows * ncols;
  AccumulateCols<VL>(a, as, rows, wu, ld, K, ncols, accu);
  StreamGluEpilogue(acc, accu, rows, ncols, act, out, rs, cs);
}

template <int VL, typename W>
NBX_AI void Gemm2StreamCols(const float* a, int64_t as, int rows, const W* wd, int64_t ld,
                            int64_t K, int ncols, const float* w, float* acc, float* out,
                            int64_t rs) {
  AccumulateCols<VL>(a, as, rows, wd, ld, K, ncols, acc);
  StreamWeightEpilogue(acc, rows, ncols, w, out, rs);
}

// KernelTable::pack_cols: rows [k0, k0+kc) of columns [n0, n0+nc) of ns
// matrices stored by columns (column n at m[s] + n*ld) into the packed-B
// micro-panels (gemm_driver.h PackRows' layout: panel q at dst + q*PanelStride(kc, VL),
// matrix s at + s*(2VL/ns)), VL x VL blocks turned in registers, zero past nc.
template <int VL, typename W>
void PackColumnsT(const void* const* mv, int ns, int64_t ld, int64_t k0, int kc, int64_t n0,
                  int nc, float* dst) {
  using V = typename VecT<VL>::type;
  const int w = 2 * VL, C = w / ns, nsub = (nc + C - 1) / C;
  for (int s = 0; s < ns; ++s) {
    const W* m = static_cast<const W*>(mv[s]);
    for (int c0 = 0; c0 < nsub * C; c0 += VL) {  // VL columns at a time (C: VL or 2VL)
      float* d = dst + (c0 / C) * PanelStride(kc, VL) + s * C + c0 % C;
      const int ncv = nc - c0 < VL ? nc - c0 : VL;  // real columns of the block (may be <= 0)
      int i = 0;
      if (ncv == VL) {
        for (; i + VL <= kc; i += VL) {
          V t[VL];
#pragma GCC unroll 16
          for (int j = 0; j < VL; ++j) t[j] = LoadW<VL>(m + (n0 + c0 + j) * ld + k0 + i);
          TransposeBlock<VL>(t);
#pragma GCC unroll 16
          for (int r = 0; r < VL; ++r) memcpy(d + (i + r) * w, &t[r], sizeof(V));
        }
      }
      for (; i < kc; ++i)
        for (int j = 0; j < VL; ++j)
          d[i * w + j] = j < ncv ? ScalarW(m[(n0 + c0 + j) * ld + k0 + i]) : 0.0f;
    }
  }
}

// The even and the odd lanes of the 2VL values at p (an interleaved
// gate||up run: gate, up, gate, up, ...) as float32 vectors.
template <int VL>
NBX_AI void LoadPairs(const float* p, typename VecT<VL>::type* even, typename VecT<VL>::type* odd) {
  using V = typename VecT<VL>::type;
  const V a = Load<VL>(p), b = Load<VL>(p + VL);
  if constexpr (VL == 4) {
    *even = __builtin_shufflevector(a, b, 0, 2, 4, 6);
    *odd = __builtin_shufflevector(a, b, 1, 3, 5, 7);
  } else if constexpr (VL == 8) {
    *even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14);
    *odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
  } else {
    *even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    *odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  }
}
// bfloat16: 2VL values as VL 32-bit lanes, the even one in each lane's low half.
template <int VL>
NBX_AI void LoadPairs(const uint16_t* p, typename VecT<VL>::type* even,
                      typename VecT<VL>::type* odd) {
  using U = typename U32T<VL>::type;
  U l;
  memcpy(&l, p, sizeof l);
  const U e = l << 16, o = l & (U{} + 0xffff0000u);
  memcpy(even, &e, sizeof e);
  memcpy(odd, &o, sizeof o);
}

// KernelTable::pack_pairs: rows [k0, k0+kc) of columns [n0, n0+nc) of an
// interleaved gate||up (gate column n at p[k*ld + 2n], up at + 1) into
// GEMM1's packed-B micro-panels (VL gate then VL up columns per row), each
// row's run read once and split in registers, zero past nc.
template <int VL, typename W>
void PackPairsT(const void* pv, int64_t ld, int64_t k0, int kc, int64_t n0, int nc, float* dst) {
  using V = typename VecT<VL>::type;
  const W* p = static_cast<const W*>(pv);
  const int w = 2 * VL, nsub = (nc + VL - 1) / VL;
  for (int i = 0; i < kc; ++i) {
    const W* row = p + (k0 + i) * ld + 2 * n0;
    for (int q = 0; q < nsub; ++q) {
      float* d = dst + q * PanelStride(kc, VL) + i * w;
      const int ncv = nc - q * VL < VL ? nc - q * VL : VL;
      if (ncv == VL) {
        V g, u;
        LoadPairs<VL>(row + 2 * q * VL, &g, &u);
        memcpy(d, &g, sizeof g);
        memcpy(d + VL, &u, sizeof u);
      } else {
        for (int j = 0; j < VL; ++j) {
          d[j] = j < ncv ? ScalarW(row[2 * (q * VL + j)]) : 0.0f;
          d[VL + j] = j < ncv ? ScalarW(row[2 * (q * VL + j) + 1]) : 0.0f;
        }
      }
    }
  }
}

// KernelTable::stream_pair: the sums of two runs of ncols columns (w0 and
// w1, rows ld apart) read in one pass over K, into acc rows of 2*ncols
// (w0's sums, then w1's); each element's chain as in the other streaming
// kernels.  bfloat16: the one-row passes of AccumulateRowsBf16R.
template <int VL, int R>
void StreamPairBf16R(const float* a, int64_t as, const uint16_t* w0, const uint16_t* w1,
                     int64_t ld, int64_t K, int ncols, float* acc) {
  using V = typename VecT<VL>::type;
  (void)sizeof(V);
  float* acc0 = acc;  // rows of ncols each, w0's then w1's: [2][R][ncols] while summing
  float* acc1 = acc + R * ncols;
  for (int i = 0; i < 2 * R * ncols; ++i) acc[i] = 0.0f;
  for (int64_t kk = 0; kk < K; ++kk) {
    float av[1][R];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) av[0][r] = a[kk * as + r];
    const uint16_t* const r0[1] = {w0 + kk * ld};
    const uint16_t* const r1[1] = {w1 + kk * ld};
    Bf16Pass<VL, R, 1>(av, r0, ncols, acc0);
    Bf16Pass<VL, R, 1>(av, r1, ncols, acc1);
  }
}

template <int VL, typename W>
void StreamPair(const float* a, int64_t as, int rows, const void* w0, const void* w1, int64_t ld,
                int64_t K, int ncols, float* acc, float* out) {
  if constexpr (sizeof(W) == 4) {
    AccumulateRowsPair<VL>(a, as, rows, static_cast<const float*>(w0),
                           static_cast<const float*>(w1), ld, K, ncols, out, out + ncols,
                           2 * ncols);
    (void)acc;
  } else {
    WithRows(rows, [&](auto r) {
      constexpr int R = decltype(r)::value;
      StreamPairBf16R<VL, R>(a, as, static_cast<const uint16_t*>(w0),
                             static_cast<const uint16_t*>(w1), ld, K, ncols, acc);
    });
    // [even][odd] blocks -> column order (as AccumulateRowsBf16R), into out's rows
    const int nb = ncols / (2 * VL) * (2 * VL);
    for (int m = 0; m < 2; ++m)
      for (int r = 0; r < rows; ++r) {
        const float* src = acc + (m * rows + r) * ncols;
        float* dst = out + r * 2 * ncols + m * ncols;
        for (int c = 0; c < nb; c += 2 * VL)
          for (int i = 0; i < VL; ++i) dst[c + 2 * i] = src[c + i], dst[c + 2 * i + 1] = src[c + VL + i];
        for (int c = nb; c < ncols; ++c) dst[c] = src[c];
      }
  }
}

// KernelTable::glu: the gated unit on stored sums, biases added first.
inline void GluRows(const float* g, const float* u, int64_t gs, int64_t gcs, int rows, int cols,
                    const float* bg, const float* bu, const Glu& act, float* out, int64_t rs,
                    int64_t cs) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      float gv = g[r * gs + c * gcs], uv = u[r * gs + c * gcs];
      if (bg) gv += bg[c];
      if (bu) uv += bu[c];
      out[r * rs + c * cs] = GluOf(act, gv, uv);
    }
}

}  // namespace
}  // namespace nbx
