// Quantized micro-kernels (QuantMatrix experts of every quantized format):
// streaming kernels that dequantize in registers and the dequantizing packer.
// Part of kernels.h; included only by kernels_<isa>.cc (see kernels_base.h).
//
// The streamed and the packed paths of one ISA do the same arithmetic, so
// banded and unbanded results stay identical: int8 accumulates a * q in kk
// order (q exact in float32) and multiplies each column's sum by its scale
// once (the streaming kernels at the end, the packed ones in the epilogue);
// every other format dequantizes each weight with one expression -- int4
// q * scale + min (one FMA where the ISA has one; vector lanes and scalar tail
// alike), fp8 E4M3(q) * scale (one rounding), mxfp4 / mxfp8 / nvfp4 one exact
// product of two exactly decoded values (kernels_qdecode.h) -- then
// accumulates a * w in kk order as the dense kernels do.
#pragma once

#include "cpu/kernels/kernels_base.h"
#include "cpu/kernels/kernels_qdecode.h"

namespace nbx {
namespace {

// Streaming accumulation over quantized weights: R rows (compile time),
// columns [n0, n0+ncols) of m; acc[r*ncols + c] = sum_kk a[kk*as + r] * w[kk, c]
// in kk order, w dequantized once per element for all rows.  Software
// prefetch (PrefetchRunL2) `ahead` rows (int4: byte rows) ahead.

// Two rows of W into R rows of accumulators (row r at acc + r * ncols): row
// kk's FMA, then row kk+1's, per element -- the kk order every path keeps.
// W: a vector of columns, or a float (one column: the scalar tails).
template <int R, class W>
NBX_AI void AddTwoRows(float* acc, int ncols, const float (&a0)[R], const float (&a1)[R], W w0,
                       W w1) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    W v;
    memcpy(&v, acc + r * ncols, sizeof v);
    v = MulAdd(a0[r], w0, v);
    v = MulAdd(a1[r], w1, v);
    memcpy(acc + r * ncols, &v, sizeof v);
  }
}

// acc[r * ncols] += a0[r] * w0 for r < R: a lone last row (K odd).
template <int R, class W>
NBX_AI void AddOneRow(float* acc, int ncols, const float (&a0)[R], W w0) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    W v;
    memcpy(&v, acc + r * ncols, sizeof v);
    v = MulAdd(a0[r], w0, v);
    memcpy(acc + r * ncols, &v, sizeof v);
  }
}

template <int VL, int R, int kQ, bool kB>
void AccumulateRowsQ(const float* a, int64_t as, const QuantMatrix& m, int64_t n0, int64_t K,
                     int ncols, float* acc) {
  using V = typename VecT<VL>::type;
  const int64_t N = m.N;
  const int nv = ncols / VL * VL;
  for (int i = 0; i < R * ncols; ++i) acc[i] = 0.0f;
  // the item's scales (and mins) in float32, converted once (int4: per group)
  float sc[kMaxStreamCols], zc[kMaxStreamCols];
  const int64_t ahead = StreamAheadRows(ncols);  // a byte per weight, or per two rows' weights
  if constexpr (kQ == kQInt8) {
    const int8_t* q = static_cast<const int8_t*>(m.q) + n0;
    ScalesToFloat<VL, kQ, kB>(m.scale, n0, ncols, sc);
    // two rows of W per pass over the accumulators (the same per-element
    // chain: row kk's FMA, then row kk+1's); a lone last row when K is odd
    for (int64_t kk = 0; kk < K; kk += 2) {
      const bool two = kk + 1 < K;
      const int8_t* qr0 = q + kk * N;
      const int8_t* qr1 = two ? qr0 + N : qr0;
      if (kk + ahead + 1 < K) {
        PrefetchRunL2(qr0 + ahead * N, ncols);
        PrefetchRunL2(qr1 + ahead * N, ncols);
      }
      float a0[R], a1[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) a0[r] = a[kk * as + r], a1[r] = two ? a[(kk + 1) * as + r] : 0.0f;
      if (two) {
        for (int c = 0; c < nv; c += VL) {
          const V w0 = Int8ToFloat<VL>(qr0 + c);
          const V w1 = Int8ToFloat<VL>(qr1 + c);
          AddTwoRows<R>(acc + c, ncols, a0, a1, w0, w1);
        }
        for (int c = nv; c < ncols; ++c) {
          const float w0 = static_cast<float>(qr0[c]);
          const float w1 = static_cast<float>(qr1[c]);
          AddTwoRows<R>(acc + c, ncols, a0, a1, w0, w1);
        }
      } else {
        for (int c = 0; c < nv; c += VL) AddOneRow<R>(acc + c, ncols, a0, Int8ToFloat<VL>(qr0 + c));
        for (int c = nv; c < ncols; ++c) AddOneRow<R>(acc + c, ncols, a0, static_cast<float>(qr0[c]));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < ncols; ++c) acc[r * ncols + c] *= sc[c];
  } else if constexpr (!kNibbles(kQ)) {
    // fp8, mxfp8: a byte per weight.  Groups are even (32, 64, 128), so a
    // pair of rows never straddles two groups; K may be any size (partial
    // groups: FormatSpec::partial_groups), so a lone last row when K is odd
    const uint8_t* q = static_cast<const uint8_t*>(m.q) + n0;
    for (int64_t kk = 0; kk < K; kk += 2) {
      const bool two = kk + 1 < K;
      const uint8_t* qr0 = q + kk * N;
      const uint8_t* qr1 = qr0 + N;
      if (kk + ahead + 1 < K) {
        PrefetchRunL2(qr0 + ahead * N, ncols);
        PrefetchRunL2(qr1 + ahead * N, ncols);
      }
      if (kk % m.group == 0) ScalesToFloat<VL, kQ, kB>(m.scale, (kk / m.group) * N + n0, ncols, sc);
      float a0[R], a1[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) a0[r] = a[kk * as + r], a1[r] = two ? a[(kk + 1) * as + r] : 0.0f;
      if (two) {
        for (int c = 0; c < nv; c += VL) {
          const V s = Load<VL>(sc + c);
          const V w0 = ByteValues<VL>(qr0 + c) * s;
          const V w1 = ByteValues<VL>(qr1 + c) * s;
          AddTwoRows<R>(acc + c, ncols, a0, a1, w0, w1);
        }
        for (int c = nv; c < ncols; ++c) {
          const float w0 = ByteValue(qr0[c]) * sc[c];
          const float w1 = ByteValue(qr1[c]) * sc[c];
          AddTwoRows<R>(acc + c, ncols, a0, a1, w0, w1);
        }
      } else {
        for (int c = 0; c < nv; c += VL)
          AddOneRow<R>(acc + c, ncols, a0, ByteValues<VL>(qr0 + c) * Load<VL>(sc + c));
        for (int c = nv; c < ncols; ++c) AddOneRow<R>(acc + c, ncols, a0, ByteValue(qr0[c]) * sc[c]);
      }
    }
  } else {  // 4-bit codes; K and groups even: rows come in pairs (one byte, one group)
    const uint8_t* q = static_cast<const uint8_t*>(m.q) + n0;
    for (int64_t kk = 0; kk < K; kk += 2) {
      const uint8_t* qr = q + (kk / 2) * N;
      if (kk / 2 + ahead < K / 2) PrefetchRunL2(qr + ahead * N, ncols);
      if (kk % m.group == 0) {
        ScalesToFloat<VL, kQ, kB>(m.scale, (kk / m.group) * N + n0, ncols, sc);
        if constexpr (kMins(kQ)) ScalesToFloat<VL, kQ, kB>(m.zero, (kk / m.group) * N + n0, ncols, zc);
      }
      float a0[R], a1[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) a0[r] = a[kk * as + r], a1[r] = a[(kk + 1) * as + r];
      for (int c = 0; c < nv; c += VL) {
        V lo, hi, w0, w1;
        NibblesToFloat<VL, kQ>(qr + c, lo, hi);
        const V s = Load<VL>(sc + c);
        if constexpr (kMins(kQ)) {
          const V z = Load<VL>(zc + c);
          w0 = lo * s + z;
          w1 = hi * s + z;
        } else {
          w0 = lo * s;
          w1 = hi * s;
        }
        AddTwoRows<R>(acc + c, ncols, a0, a1, w0, w1);
      }
      for (int c = nv; c < ncols; ++c) {
        float w0, w1;
        if constexpr (kMins(kQ)) {
          w0 = NibbleValue<kQ>(qr[c] & 15) * sc[c] + zc[c];
          w1 = NibbleValue<kQ>(qr[c] >> 4) * sc[c] + zc[c];
        } else {
          w0 = NibbleValue<kQ>(qr[c] & 15) * sc[c];
          w1 = NibbleValue<kQ>(qr[c] >> 4) * sc[c];
        }
        AddTwoRows<R>(acc + c, ncols, a0, a1, w0, w1);
      }
    }
  }
}

template <int VL, int R>
void AccumulateRowsQFormat(const float* a, int64_t as, const QuantMatrix& m, int64_t n0,
                           int64_t K, int ncols, float* acc) {
  WithQKind(m, "the streaming quantized kernels", [&](auto q, auto b) {
    AccumulateRowsQ<VL, R, decltype(q)::value, decltype(b)::value>(a, as, m, n0, K, ncols, acc);
  });
  // the tensor scale, once per column's sum (the packed kernels' epilogue alike)
  if (m.tensor_scale != 1.0f)
    for (int i = 0; i < R * ncols; ++i) acc[i] *= m.tensor_scale;
}

template <int VL>
void AccumulateRowsQuant(const float* a, int64_t as, int rows, const QuantMatrix& m,
                         int64_t n0, int64_t K, int ncols, float* acc) {
  WithRows(rows, [&](auto r) {
    AccumulateRowsQFormat<VL, decltype(r)::value>(a, as, m, n0, K, ncols, acc);
  });
}

// qstream1 / qstream2 (and kernels_qdot.h's qdot1 / qdot2) over an
// accumulation of rows into acc (AccumulateRowsQuant, QDotRowsAny): the
// sums, then the gated unit or the row weights.
using RowsAccumulation = void (*)(const float* a, int64_t as, int rows, const QuantMatrix& m,
                                  int64_t n0, int64_t K, int ncols, float* acc);

template <RowsAccumulation Acc>
void Gemm1StreamQ(const float* a, int64_t as, int rows, const QuantMatrix* wg, const QuantMatrix* wu,
                  int64_t n0, int64_t K, int ncols, const Glu& act, float* acc, float* out, int64_t rs,
                  int64_t cs) {
  Acc(a, as, rows, *wg, n0, K, ncols, acc);
  float* accu = acc + rows * ncols;
  Acc(a, as, rows, *wu, n0, K, ncols, accu);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < ncols; ++c)
      out[r * rs + c * cs] = GluOf(act, acc[r * ncols + c], accu[r * ncols + c]);
}

template <RowsAccumulation Acc>
void Gemm2StreamQ(const float* a, int64_t as, int rows, const QuantMatrix* wd, int64_t n0, int64_t K,
                  int ncols, const float* w, float* acc, float* out, int64_t rs) {
  Acc(a, as, rows, *wd, n0, K, ncols, acc);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < ncols; ++c) out[r * rs + c] = w[r] * acc[r * ncols + c];
}

// Packing: dequantized rows [k0, k0+kc) of columns [n0, n0+nc) into panels of
// `width` columns (KernelTable::qpack), whole runs of VL values at a time.
template <int VL, int kQ, bool kB>
void PackQuantT(const QuantMatrix& m, int64_t k0, int kc, int64_t n0, int nc, int width,
                float* dst, int64_t rs, int64_t ps) {
  using V = typename VecT<VL>::type;
  const int64_t N = m.N;
  const int np = (nc + width - 1) / width;
  if constexpr (kQ == kQInt8) {
    for (int i = 0; i < kc; ++i) {
      const int8_t* qr = static_cast<const int8_t*>(m.q) + (k0 + i) * N + n0;
      for (int p = 0; p < np; ++p) {
        float* d = dst + p * ps + i * rs;
        for (int j = 0; j < width; j += VL) {
          const int c = p * width + j, n = nc - c;
          if (n >= VL) {
            const V w = Int8ToFloat<VL>(qr + c);
            memcpy(d + j, &w, sizeof w);
          } else {
            for (int t = 0; t < VL; ++t) d[j + t] = t < n ? static_cast<float>(qr[c + t]) : 0.0f;
          }
        }
      }
    }
  } else if constexpr (!kNibbles(kQ)) {  // fp8, mxfp8: a byte per weight
    for (int i = 0; i < kc; ++i) {
      const int64_t k = k0 + i;
      const uint8_t* qr = static_cast<const uint8_t*>(m.q) + k * N + n0;
      const int64_t g = (k / m.group) * N + n0;
      for (int p = 0; p < np; ++p) {
        float* d = dst + p * ps + i * rs;
        for (int j = 0; j < width; j += VL) {
          const int c = p * width + j, n = nc - c;
          if (n >= VL) {
            const V w = ByteValues<VL>(qr + c) * ScaleVec<VL, kQ, kB>(m.scale, g + c);
            memcpy(d + j, &w, sizeof w);
          } else {
            for (int t = 0; t < VL; ++t)
              d[j + t] = t < n ? ByteValue(qr[c + t]) * ScaleOne<kQ, kB>(m.scale, g + c + t) : 0.0f;
          }
        }
      }
    }
  } else {  // 4-bit codes
    for (int i = 0; i < kc;) {
      const int64_t k = k0 + i;
      const uint8_t* qr = static_cast<const uint8_t*>(m.q) + (k / 2) * N + n0;
      const int64_t g = (k / m.group) * N + n0;
      // both rows of the byte when they are in the block (k even), else one
      const bool pair = (k & 1) == 0 && i + 1 < kc;
      const int shift = (k & 1) * 4;
      for (int p = 0; p < np; ++p) {
        float* d0 = dst + p * ps + i * rs;
        float* d1 = d0 + rs;
        for (int j = 0; j < width; j += VL) {
          const int c = p * width + j, n = nc - c;
          if (n >= VL) {
            V lo, hi, w0, w1;
            NibblesToFloat<VL, kQ>(qr + c, lo, hi);
            const V s = ScaleVec<VL, kQ, kB>(m.scale, g + c);
            if constexpr (kMins(kQ)) {
              const V z = ScaleVec<VL, kQ, kB>(m.zero, g + c);
              w0 = lo * s + z;
              w1 = hi * s + z;
            } else {
              w0 = lo * s;
              w1 = hi * s;
            }
            if (pair) {
              memcpy(d0 + j, &w0, sizeof w0);
              memcpy(d1 + j, &w1, sizeof w1);
            } else {
              memcpy(d0 + j, shift ? &w1 : &w0, sizeof w0);
            }
          } else {
            for (int t = 0; t < VL; ++t) {
              float w0 = 0.0f, w1 = 0.0f;
              if (t < n) {
                const float s = ScaleOne<kQ, kB>(m.scale, g + c + t);
                if constexpr (kMins(kQ)) {
                  const float z = ScaleOne<kQ, kB>(m.zero, g + c + t);
                  w0 = NibbleValue<kQ>(qr[c + t] & 15) * s + z;
                  w1 = NibbleValue<kQ>(qr[c + t] >> 4) * s + z;
                } else {
                  w0 = NibbleValue<kQ>(qr[c + t] & 15) * s;
                  w1 = NibbleValue<kQ>(qr[c + t] >> 4) * s;
                }
              }
              if (pair) {
                d0[j + t] = w0;
                d1[j + t] = w1;
              } else {
                d0[j + t] = shift ? w1 : w0;
              }
            }
          }
        }
      }
      i += pair ? 2 : 1;
    }
  }
}

template <int VL>
void PackQuant(const QuantMatrix* m, int64_t k0, int kc, int64_t n0, int nc, int width,
               float* dst, int64_t rs, int64_t ps) {
  WithQKind(*m, "the quantized packer", [&](auto q, auto b) {
    PackQuantT<VL, decltype(q)::value, decltype(b)::value>(*m, k0, kc, n0, nc, width, dst, rs, ps);
  });
}

}  // namespace
}  // namespace nbx
