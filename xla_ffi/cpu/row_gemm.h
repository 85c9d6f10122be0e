// Row-major GEMM tiles and per-row pieces of the CPU backward
// (moe_backward.cc, row_band.h): operands as
// strided views of float32 workspace or weights in their dtype, every
// element one kk-ordered chain of multiply-adds on the packed GEMM2
// micro-kernel of the instruction set chosen at run time (epilogue weight
// 1, exact), through the shared driver (gemm_driver.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "abi.h"
#include "cpu/gemm_driver.h"
#include "common/handler_common.h"
#include "cpu/kernels/kernel_table.h"
#include "common/weights.h"  // Quantized
#include "dtypes.h"
#include "xla/ffi/api/ffi.h"

namespace nbx {

// A[m, k] = p[m*sm + k*sk] (float32 workspace); or, with `rows`, read from
// a [?, ld] input in its dtype through a row map (the backward's x rows, not
// gathered into the workspace): A[m, k] = src[rows[m]*ld + k], or with
// `transposed` src[rows[k]*ld + m] (the flag, not the strides, says which:
// with ld == 1 both strides are 1).
struct MatA {
  const float* p;
  int64_t sm, sk;
  const int32_t* rows = nullptr;
  const void* src = nullptr;
  xla::ffi::DataType type = xla::ffi::DataType::F32;
  bool transposed = false;
};
// The rows of `src` [?, ld] (float32, bfloat16 or float16) named by `rows`, as A.
inline MatA RowsOf(const void* src, xla::ffi::DataType type, int64_t ld, const int32_t* rows,
                   bool transposed) {
  return transposed ? MatA{nullptr, 1, ld, rows, src, type, true}
                    : MatA{nullptr, ld, 1, rows, src, type, false};
}

template <typename T>
void PackMappedA(const MatA& a, const T* src, int64_t m, int rows, int64_t k0, int kc, int mr,
                 float* dst) {
  if (!a.transposed) {
    for (int r = 0; r < rows; ++r) {
      const T* s = src + static_cast<int64_t>(a.rows[m + r]) * a.sm + k0;
      for (int i = 0; i < kc; ++i) dst[i * mr + r] = ToFloat(s[i]);
    }
  } else {
    for (int i = 0; i < kc; ++i) {
      const T* s = src + static_cast<int64_t>(a.rows[k0 + i]) * a.sk + m;
      for (int r = 0; r < rows; ++r) dst[i * mr + r] = ToFloat(s[r]);
    }
  }
}
// B[k, n] = p[k*sk + n*sn] (weights in their dtype, or float32 workspace).
// W = Quantized: p is a QuantMatrix* of W_q [K_q, N_q] (weights.h), B = W_q,
// or B = W_q^T with `transposed` (the strides are then the swapped plain
// view's, which dense weights read; a quantized matrix is read by its packer).
template <typename W>
struct MatB {
  const W* p;
  int64_t sk, sn;
  bool transposed = false;
};
// C[m, n] = p[m*ld + n*sn] (float32; sn != 1: a weight gradient in a
// transposed or interleaved view, written through a tile buffer).
struct MatC {
  float* p;
  int64_t ld;
  int64_t sn = 1;
};

// Rows [m, m+rows) of A, columns [k0, k0+kc), as one m-panel [kc][mr].
inline void PackA(MatA a, int64_t m, int rows, int64_t k0, int kc, int mr, float* dst) {
  if (a.rows != nullptr) {
    switch (a.type) {
      case xla::ffi::DataType::F32:
        PackMappedA(a, static_cast<const float*>(a.src), m, rows, k0, kc, mr, dst);
        break;
      case xla::ffi::DataType::BF16:
        PackMappedA(a, static_cast<const bf16*>(a.src), m, rows, k0, kc, mr, dst);
        break;
      default: PackMappedA(a, static_cast<const f16*>(a.src), m, rows, k0, kc, mr, dst); break;
    }
  } else if (a.sk == 1) {
    for (int r = 0; r < rows; ++r) {
      const float* src = a.p + (m + r) * a.sm + k0;
      for (int i = 0; i < kc; ++i) dst[i * mr + r] = src[i];
    }
  } else {
    for (int i = 0; i < kc; ++i) {
      const float* src = a.p + m * a.sm + (k0 + i) * a.sk;
      for (int r = 0; r < rows; ++r) dst[i * mr + r] = src[r * a.sm];
    }
  }
  for (int r = rows; r < mr; ++r)
    for (int i = 0; i < kc; ++i) dst[i * mr + r] = 0.0f;
}

// One worker's scratch for GemmTile: a packed K-block of B, a packed m-panel
// of A, the micro-tile of C being continued, the epilogue's unit weights;
// for a streamed tile (StreamTile), A's rows [K][rows] and the streaming
// kernels' sums.
struct TileScratch {
  float* packed_b;
  float* packed_a;
  float* tile;
  float* ctile;  // the micro-tile's results when C has column stride sn != 1
  float* ones;
  float* qtmp;   // a transposed quantized B's block, dequantized before it is turned
  int64_t kc;  // K-block rows the scratch holds (the bits do not depend on it)
  int64_t nc;  // columns of a packed tile at most (GemmTile splits wider ones)
  float* stream_a = nullptr;    // [stream_k][kMaxStreamRows]
  float* stream_acc = nullptr;  // [2 * kMaxStreamRows * stream_n]
  int64_t stream_k = 0;         // the longest K a tile streams (0: none streams)
  int64_t stream_n = 0;         // the widest tile that streams
};

// GemmTile's scratch floats for K-blocks of at most kc rows and packed tiles
// of at most nc columns, streaming tiles of K <= stream_k and at most
// min(kMaxStreamCols, stream_k) columns (CarveRowBand sizes them to the
// problem: stream_k = max(H, I, R), every product's N too).
// kc rounded up to whole micro-panels of 2vl (a transposed quantized B's
// dequantized block, qtmp [nc][kcp]).
inline int64_t PaddedKc(int64_t kc, int vl) { return (kc + 2 * vl - 1) / (2 * vl) * (2 * vl); }

inline int64_t TileScratchFloats(int64_t kc, int64_t nc, int mr, int vl, int64_t stream_k) {
  return PackedBlockFloats(kc, nc, vl) + kc * mr + 2 * mr * 2 * vl + mr + nc * PaddedKc(kc, vl) +
         (stream_k + 2 * std::min<int64_t>(kMaxStreamCols, stream_k)) * kMaxStreamRows;
}
inline TileScratch CarveTileScratch(float* base, int64_t kc, int64_t nc, int mr, int vl,
                                    int64_t stream_k) {
  TileScratch s{base, base + PackedBlockFloats(kc, nc, vl), nullptr, nullptr, nullptr, nullptr, kc, nc};
  s.tile = s.packed_a + kc * mr;
  s.ctile = s.tile + mr * 2 * vl;
  s.ones = s.ctile + mr * 2 * vl;
  s.qtmp = s.ones + mr;
  s.stream_a = s.qtmp + nc * PaddedKc(kc, vl);
  s.stream_acc = s.stream_a + stream_k * kMaxStreamRows;
  s.stream_k = stream_k;
  s.stream_n = std::min<int64_t>(kMaxStreamCols, stream_k);
  return s;
}

// Whether a tile of `rows` rows may stream (StreamTile), and so be given
// kMaxStreamCols columns: whole rows of a weight, read in one sweep (a
// narrower tile of a row-major weight starts a new page on every row).
inline bool StreamsRows(const KernelTable& kt, int64_t rows) {
  return rows <= std::min(kMaxStreamRows, kt.mr);
}

// Rows [k0, k0+kc) of a quantized B's columns [n0, n0+nc) as GemmTile's
// packed panels ([panel][kc][w], PanelStride apart, zero-padded), dequantized by the
// instruction set's packer (KernelTable::qpack) and scaled: int8's column
// scales and the tensor scale multiply each weight (B = W_q^T: W_q's column
// scale is B's row scale).
inline void PackQuantB(const KernelTable& kt, const MatB<Quantized>& b, int64_t k0, int kc,
                       int64_t n0, int nc, const TileScratch& s) {
  const QuantMatrix& m = *reinterpret_cast<const QuantMatrix*>(b.p);
  const int w = 2 * kt.vl, np = (nc + w - 1) / w;
  const int64_t ps = PanelStride(kc, kt.vl);
  const bool by_column = QuantArithOf(m.format) == QuantArith::kColumnScaled;
  if (!b.transposed) {  // B = W_q: its rows
    kt.qpack(&m, k0, kc, n0, nc, w, s.packed_b, w, ps);
    if (by_column || m.tensor_scale != 1.0f)
      for (int p = 0; p < np; ++p)
        for (int j = 0; j < w && p * w + j < nc; ++j) {
          const float sc = (by_column ? ColumnScale(m, n0 + p * w + j) : 1.0f) * m.tensor_scale;
          for (int i = 0; i < kc; ++i) s.packed_b[p * ps + i * w + j] *= sc;
        }
    return;
  }
  // B = W_q^T: W_q's rows [n0, n0+nc), columns [k0, k0+kc) dequantized as
  // qtmp [nc][kcp], then turned into the panels.
  const int64_t kcp = PaddedKc(kc, kt.vl);
  kt.qpack(&m, n0, nc, k0, kc, w, s.qtmp, kcp, w);
  for (int i = 0; i < kc; ++i) {
    const float sc = (by_column ? ColumnScale(m, k0 + i) : 1.0f) * m.tensor_scale;
    for (int p = 0; p < np; ++p)
      for (int j = 0; j < w; ++j) {
        const int n = p * w + j;
        s.packed_b[p * ps + i * w + j] = n < nc ? s.qtmp[n * kcp + i] * sc : 0.0f;
      }
  }
}

// C[m0:m1, n0:n0+nc] = A[m0:m1, 0:K] B[0:K, n0:n0+nc] through the streaming
// kernels, B read in place (no packing): the decode rows of the row band.
// Only where their sums are the packed micro-kernel's bit for bit (each a
// kk-ordered chain from 0; kernel_table.h): C not continued, C's columns
// contiguous, at most kMaxStreamRows rows, K within the scratch, and B dense
// float32 or bfloat16 by rows or by columns, or quantized in a dequantizing
// format without a tensor scale (int8's column scales and a tensor scale
// multiply the sums in the streaming kernels but each weight in PackQuantB).
// Returns false, having done nothing, where it does not apply.
template <typename W>
bool StreamTile(const KernelTable& kt, const MatA& a, const MatB<W>& b, const MatC& c,
                int64_t m0, int64_t m1, int64_t n0, int nc, int64_t K, const TileScratch& s) {
  const int rows = static_cast<int>(m1 - m0);
  if (c.sn != 1 || !StreamsRows(kt, rows) || K > s.stream_k || nc > s.stream_n) return false;
  float* out = c.p + m0 * c.ld + n0;
  if constexpr (std::is_same_v<W, Quantized>) {
    const QuantMatrix& m = *reinterpret_cast<const QuantMatrix*>(b.p);
    if (b.transposed || QuantArithOf(m.format) != QuantArith::kDequantized ||
        m.tensor_scale != 1.0f)
      return false;
    PackA(a, m0, rows, 0, static_cast<int>(K), rows, s.stream_a);
    kt.qstream2(s.stream_a, rows, rows, &m, n0, K, nc, kStreamUnitWeights, s.stream_acc, out,
                c.ld);
    return true;
  } else if constexpr (std::is_same_v<W, float> || std::is_same_v<W, bf16>) {
    const int wi = std::is_same_v<W, float> ? 0 : 1;
    if (b.sn != 1 && b.sk != 1) return false;
    PackA(a, m0, rows, 0, static_cast<int>(K), rows, s.stream_a);
    if (b.sn == 1)  // by rows: row kk of the tile at b.p + kk*sk + n0
      kt.stream2[wi](s.stream_a, rows, rows, b.p + n0, b.sk, K, nc, kStreamUnitWeights,
                     s.stream_acc, out, c.ld);
    else  // by columns: column n at b.p + n*sn, its K values contiguous
      kt.stream2_cols[wi](s.stream_a, rows, rows, b.p + n0 * b.sn, b.sn, K, nc, kStreamUnitWeights,
                          s.stream_acc, out, c.ld);
    return true;
  } else {
    return false;  // float16 weights always pack (as the forward's)
  }
}

// C[m0:m1, n0:n0+nc] = (accumulate ? C : 0) + A[m0:m1, 0:K] B[0:K, n0:n0+nc],
// each element one kk-ordered chain of multiply-adds (the micro-kernel's).
// A fresh tile of few rows streams B in place (StreamTile): the same bits.
// A tile wider than the scratch's packed tiles runs as several (each
// element's chain does not depend on the columns beside it).
template <typename W>
void GemmTile(const KernelTable& kt, MatA a, MatB<W> b, MatC c, int64_t m0, int64_t m1,
              int64_t n0, int nc, int64_t K, bool accumulate, const TileScratch& s) {
  if (!accumulate && K > 0 && StreamTile(kt, a, b, c, m0, m1, n0, nc, K, s)) return;
  if (nc > s.nc) {
    for (int64_t j = 0; j < nc; j += s.nc)
      GemmTile<W>(kt, a, b, c, m0, m1, n0 + j, static_cast<int>(std::min<int64_t>(s.nc, nc - j)),
                  K, accumulate, s);
    return;
  }
  const int mr = kt.mr, vl = kt.vl, w = 2 * vl;
  for (int r = 0; r < mr; ++r) s.ones[r] = 1.0f;
  std::fill(s.tile, s.tile + mr * w, 0.0f);
  if (K == 0) {
    if (!accumulate)
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t n = n0; n < n0 + nc; ++n) c.p[m * c.ld + n * c.sn] = 0.0f;
    return;
  }
  const int nsub = (nc + w - 1) / w;
  const int64_t panels = (m1 - m0 + mr - 1) / mr;
  RunKBlocks(
      K, s.kc,
      [&](Prefetcher& pf, int64_t k0, int64_t kc) {
        if constexpr (!std::is_same_v<W, Quantized>)
          StartViewPrefetch(pf, b.p, static_cast<const W*>(nullptr), b.sk, b.sn, k0, kc, n0, nc);
      },
      [&](int64_t k0, int kc) {
        if constexpr (std::is_same_v<W, Quantized>) {
          PackQuantB(kt, b, k0, kc, n0, nc, s);
        } else {
          const W* m[1] = {b.p};
          PackView<1>(kt, m, b.sk, b.sn, k0, kc, n0, nc, s.packed_b);
        }
      },
      [&](int64_t k0, int kc, Prefetcher& pf) {
        const int64_t per_call = pf.PerCall(nsub * panels);
        const bool load = accumulate || k0 > 0;
        for (int64_t m = m0; m < m1; m += mr) {
          const int rows = static_cast<int>(std::min<int64_t>(mr, m1 - m));
          PackA(a, m, rows, k0, kc, mr, s.packed_a);
          for (int q = 0; q < nsub; ++q) {
            const int cols = std::min(w, nc - q * w);
            const float* bq = s.packed_b + q * PanelStride(kc, kt.vl);
            float* cp = c.p + m * c.ld + (n0 + q * w) * c.sn;
            if (c.sn == 1) {
              if (load)
                for (int r = 0; r < rows; ++r)
                  std::memcpy(s.tile + r * w, cp + r * c.ld, sizeof(float) * cols);
              kt.gemm2(s.packed_a, bq, kc, s.ones, rows, cols, cp, c.ld, s.tile,
                       load ? kLoadPartial : 0, /*scale=*/nullptr);
            } else {  // through ctile: gathered from C, computed, scattered back
              if (load)
                for (int r = 0; r < rows; ++r)
                  for (int j = 0; j < cols; ++j) s.tile[r * w + j] = cp[r * c.ld + j * c.sn];
              kt.gemm2(s.packed_a, bq, kc, s.ones, rows, cols, s.ctile, w, s.tile,
                       load ? kLoadPartial : 0, /*scale=*/nullptr);
              for (int r = 0; r < rows; ++r)
                for (int j = 0; j < cols; ++j) cp[r * c.ld + j * c.sn] = s.ctile[r * w + j];
            }
            pf.Step(per_call);
          }
        }
      });
}

// a = glu(g, u) and its partial derivatives, float32 (the forward's
// formulas, abi.h Activation).  A clamp passes the gradient inside its range
// (bounds included) and none outside, as torch.clamp's does.
inline void GluGrad(const Glu& p, float g, float u, float* a, float* da_dg, float* da_du) {
  switch (p.act) {
    case static_cast<int>(abi::Activation::kGeGLU): {
      constexpr float c = static_cast<float>(abi::kGeluC), b = static_cast<float>(abi::kGeluB);
      const float th = tanhf(c * (g + b * g * g * g));
      const float f = 0.5f * g * (1.0f + th);
      const float df = 0.5f * (1.0f + th) + 0.5f * g * (1.0f - th * th) * c * (1.0f + 3.0f * b * g * g);
      *a = f * u, *da_dg = df * u, *da_du = f;
      return;
    }
    case static_cast<int>(abi::Activation::kGeGLUErf): {
      constexpr float r = static_cast<float>(abi::kInvSqrt2);
      constexpr float inv_sqrt_2pi = 0.3989422804014327f;
      const float cdf = 0.5f * (1.0f + erff(g * r));
      const float f = g * cdf, df = cdf + g * inv_sqrt_2pi * expf(-0.5f * g * g);
      *a = f * u, *da_dg = df * u, *da_du = f;
      return;
    }
    case static_cast<int>(abi::Activation::kClampedSwiGLU): {
      const bool g_in = g <= p.limit, u_in = u >= -p.limit && u <= p.limit;
      const float gc = g_in ? g : p.limit, uc = u_in ? u : (u > 0.0f ? p.limit : -p.limit);
      const float s = 1.0f / (1.0f + expf(-p.alpha * gc));
      const float f = gc * s, df = s * (1.0f + p.alpha * gc * (1.0f - s));
      *a = f * (uc + 1.0f);
      *da_dg = g_in ? df * (uc + 1.0f) : 0.0f;
      *da_du = u_in ? f : 0.0f;
      return;
    }
    default: {
      const float s = 1.0f / (1.0f + expf(-g));
      const float f = g * s, df = s * (1.0f + g * (1.0f - s));
      *a = f * u, *da_dg = df * u, *da_du = f;
    }
  }
}

template <typename T>
void GatherRow(const void* src, int64_t token, int64_t H, float* dst) {
  const T* s = static_cast<const T*>(src) + token * H;
  for (int64_t h = 0; h < H; ++h) dst[h] = ToFloat(s[h]);
}

inline void GatherRowAny(xla::ffi::DataType t, const void* src, int64_t token, int64_t H, float* dst) {
  switch (t) {
    case xla::ffi::DataType::F32: GatherRow<float>(src, token, H, dst); break;
    case xla::ffi::DataType::BF16: GatherRow<bf16>(src, token, H, dst); break;
    default: GatherRow<f16>(src, token, H, dst); break;
  }
}

}  // namespace nbx
