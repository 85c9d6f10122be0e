// The blocked GEMM driver the CPU handlers share (forward GEMM1 and GEMM2,
// every product of the backward): the software prefetcher, the packers that
// turn a K-block of a weight tile into the micro-kernels' micro-panels, and
// the K-block loop.  Blocking parameters (K-block rows, tile columns) belong
// to the instruction set's kernel table (kernel_table.h).
//
// A packed block holds rows [k0, k0+kc) of columns [n0, n0+nc) as
// micro-panels 2*VL floats wide: panel q at dst + q*PanelStride(kc, VL)
// (kernel_table.h: kc rows and a skew), row i at + i*2VL, zero-padded past
// nc (kernels.h's packed-B layout).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/kernels/kernel_table.h"
#include "dtypes.h"
#include "formats/registry.h"

namespace nbx {

// How a quantized format's products are formed by the kernels.
enum class QuantArith {
  kColumnScaled,  // sums of a * q; each column's sum times its scale once (int8)
  kDequantized,   // each weight dequantized before its product (int4, fp8, mxfp4, mxfp8, nvfp4)
};

// The format's arithmetic (formats/<name>.h FormatSpec::column_scaled).
inline QuantArith QuantArithOf(abi::WeightFormat f) {
  if (f == abi::WeightFormat::kDense) FormatHasNoKernel("QuantArithOf", f);
  return formats::SpecOf(f).column_scaled ? QuantArith::kColumnScaled : QuantArith::kDequantized;
}


// Software prefetch of `runs` runs of `run_bytes` contiguous bytes, `stride`
// bytes apart, in up to two matrices (each run of m0, then the same run of m1),
// issued a few cache lines at a time between micro-kernel calls: the reads
// overlap the arithmetic, and the runs, one per page, cross pages that the
// hardware prefetcher does not follow.  Into L2, not L1 (prefetcht1): a block
// (up to 256 kB) is many times L1, and pulling it into L1 evicted the packed
// panels the micro-kernels were reading.  Measured on a Zen 4 (interleaved in
// one process, T=512 prefill): 4 % (OLMoE f32) to 11 % (Qwen3 f32 and
// bfloat16 dot products) faster than prefetcht0 (docs/benchmarks.md).
class Prefetcher {
 public:
  void Start(const void* m0, const void* m1, int64_t stride, int64_t runs, int64_t run_bytes) {
    m_[0] = static_cast<const char*>(m0);
    m_[1] = static_cast<const char*>(m1);
    nm_ = m1 ? 2 : 1;
    stride_ = stride;
    lines_ = (run_bytes + 63) / 64;
    left_ = runs * nm_ * lines_;
    run_ = mat_ = line_ = 0;
  }
  // Issues the next n prefetches (counters, no division per line).
  void Step(int64_t n) {
    for (n = std::min(n, left_), left_ -= n; n > 0; --n) {
      __builtin_prefetch(m_[mat_] + run_ * stride_ + line_ * 64, 0, 2);
      if (++line_ == lines_) {
        line_ = 0;
        if (++mat_ == nm_) mat_ = 0, ++run_;
      }
    }
  }
  void Finish() { Step(left_); }
  // Prefetches per micro-kernel call so that `calls` calls issue them all.
  int64_t PerCall(int64_t calls) const { return left_ / std::max<int64_t>(calls, 1) + 1; }

 private:
  const char* m_[2] = {nullptr, nullptr};
  int nm_ = 1;
  int64_t stride_ = 0, lines_ = 1, left_ = 0, run_ = 0, mat_ = 0, line_ = 0;
};

// Prefetch of rows [k0, k0+kc) of columns [n0, n0+nc) of a and b (b may be
// null; ld columns per row).
template <typename W>
void StartPrefetch(Prefetcher& pf, const W* a, const W* b, int64_t ld, int64_t k0, int64_t kc,
                   int64_t n0, int64_t nc) {
  pf.Start(a + k0 * ld + n0, b ? b + k0 * ld + n0 : nullptr, ld * static_cast<int64_t>(sizeof(W)),
           kc, nc * static_cast<int64_t>(sizeof(W)));
}
// Quantized: the q bytes (packed formats: the byte rows holding those rows); the scales
// are small next to them and stay cached.
inline void StartPrefetch(Prefetcher& pf, const QuantMatrix* a, const QuantMatrix* b, int64_t ld,
                          int64_t k0, int64_t kc, int64_t n0, int64_t nc) {
  const int64_t d = formats::SpecOf(a->format).values_per_byte, r0 = k0 / d;
  pf.Start(static_cast<const char*>(a->q) + r0 * ld + n0,
           b ? static_cast<const char*>(b->q) + r0 * ld + n0 : nullptr, ld,
           (k0 + kc + d - 1) / d - r0, nc);
}

// dst[0, C) = float(src[0, n)), zero-padded (n <= C).
template <int C, typename W>
inline void CopyPad(const W* src, int n, float* dst) {
  if constexpr (std::is_same_v<W, float>) {
    if (n == C) {
      std::memcpy(dst, src, C * sizeof(float));
      return;
    }
  }
  for (int c = 0; c < n; ++c) dst[c] = ToFloat(src[c]);
  for (int c = n; c < C; ++c) dst[c] = 0.0f;
}

// Packs rows [k0, k0+kc) of columns [n0, n0+nc) of NS row-major matrices
// (leading dimension ld) into micro-panels 2VL wide, each panel holding the
// next 2VL/NS columns of every matrix in turn: NS = 2 packs gate||up for
// GEMM1 (VL gate then VL up columns), NS = 1 a plain B.  Each row's run is
// read in order; the caller prefetched the block.
template <int VL, int NS, typename W>
void PackRowsT(const W* const* m, int64_t ld, int64_t k0, int kc, int64_t n0, int nc,
               float* dst) {
  constexpr int C = 2 * VL / NS;
  const int nsub = (nc + C - 1) / C;
  for (int i = 0; i < kc; ++i) {
    const W* row[NS];
    for (int s = 0; s < NS; ++s) row[s] = m[s] + (k0 + i) * ld + n0;
    float* d = dst + i * 2 * VL;
    for (int q = 0; q < nsub; ++q, d += PanelStride(kc, VL)) {
      const int n = std::min(C, nc - q * C);
      for (int s = 0; s < NS; ++s) CopyPad<C>(row[s] + q * C, n, d + s * C);
    }
  }
}

template <int NS, typename W>
void PackRows(const W* const* m, int64_t ld, int64_t k0, int kc, int64_t n0, int nc, int vl,
              float* dst) {
  switch (vl) {
    case 16: PackRowsT<16, NS>(m, ld, k0, kc, n0, nc, dst); break;
    case 8: PackRowsT<8, NS>(m, ld, k0, kc, n0, nc, dst); break;
    default: PackRowsT<4, NS>(m, ld, k0, kc, n0, nc, dst); break;
  }
}

// The same block of NS matrices stored by columns (B[k, n] = m[s][n*ld + k],
// a transposed weight: nn.Linear's [out, in]): one column at a time, each a
// contiguous run of kc values.
template <int NS, typename W>
void PackColumns(const W* const* m, int64_t ld, int64_t k0, int kc, int64_t n0, int nc, int vl,
                 float* dst) {
  const int w = 2 * vl, C = w / NS, nsub = (nc + C - 1) / C;
  for (int s = 0; s < NS; ++s)
    for (int c = 0; c < nsub * C; ++c) {
      float* d = dst + (c / C) * PanelStride(kc, vl) + s * C + c % C;
      if (c >= nc) {
        for (int i = 0; i < kc; ++i) d[i * w] = 0.0f;
        continue;
      }
      const W* col = m[s] + (n0 + c) * ld + k0;
      for (int i = 0; i < kc; ++i) d[i * w] = ToFloat(col[i]);
    }
}

// The same block of NS matrices with any strides (B[k, n] = m[s][k*sk + n*sn]:
// gpt-oss's interleaved gate||up, sn = 2), element by element, row by row.
template <int NS, typename W>
void PackStrided(const W* const* m, int64_t sk, int64_t sn, int64_t k0, int kc, int64_t n0,
                 int nc, int vl, float* dst) {
  const int w = 2 * vl, C = w / NS, nsub = (nc + C - 1) / C;
  for (int i = 0; i < kc; ++i)
    for (int q = 0; q < nsub; ++q)
      for (int s = 0; s < NS; ++s) {
        const W* row = m[s] + (k0 + i) * sk + n0 * sn;
        float* d = dst + q * PanelStride(kc, vl) + i * w + s * C;
        for (int j = 0; j < C; ++j) {
          const int c = q * C + j;
          d[j] = c < nc ? ToFloat(row[c * sn]) : 0.0f;
        }
      }
}

// A K-block of NS matrices read through a view (B[k, n] = m[s][k*sk + n*sn]),
// packed by the fastest packer that fits the strides: rows; columns (the
// instruction set's pack_cols for float32 and bfloat16, turning blocks in
// registers; PackColumns for float16); an interleaved gate||up (the
// instruction set's pack_pairs); any strides.
template <int NS, typename W>
void PackView(const KernelTable& kt, const W* const* m, int64_t sk, int64_t sn, int64_t k0,
              int kc, int64_t n0, int nc, float* dst) {
  const int vl = kt.vl;
  if (sn == 1) {
    PackRows<NS>(m, sk, k0, kc, n0, nc, vl, dst);
  } else if (sk == 1) {
    if constexpr (std::is_same_v<W, float> || std::is_same_v<W, bf16>) {
      const void* mv[NS];
      for (int s = 0; s < NS; ++s) mv[s] = m[s];
      kt.pack_cols[std::is_same_v<W, float> ? 0 : 1](mv, NS, sn, k0, kc, n0, nc, dst);
    } else {
      PackColumns<NS>(m, sn, k0, kc, n0, nc, vl, dst);
    }
  } else if constexpr (NS == 2 && (std::is_same_v<W, float> || std::is_same_v<W, bf16>)) {
    if (sn == 2 && m[1] == m[0] + 1)  // an interleaved gate||up: split in registers
      kt.pack_pairs[std::is_same_v<W, float> ? 0 : 1](m[0], sk, k0, kc, n0, nc, dst);
    else
      PackStrided<NS>(m, sk, sn, k0, kc, n0, nc, vl, dst);
  } else {
    PackStrided<NS>(m, sk, sn, k0, kc, n0, nc, vl, dst);
  }
}

// Prefetch of a view's block [k0, k0+kc) x [n0, n0+nc) in a and b (b may be
// null): rows of it (sn == 1, or any sk > 1: a row's run spans nc*sn
// elements) or columns (sk == 1).
template <typename W>
void StartViewPrefetch(Prefetcher& pf, const W* a, const W* b, int64_t sk, int64_t sn, int64_t k0,
                       int64_t kc, int64_t n0, int64_t nc) {
  constexpr int64_t es = static_cast<int64_t>(sizeof(W));
  if (sn == 1) {
    StartPrefetch(pf, a, b, sk, k0, kc, n0, nc);
  } else if (sk == 1) {
    pf.Start(a + n0 * sn + k0, b ? b + n0 * sn + k0 : nullptr, sn * es, nc, kc * es);
  } else {
    pf.Start(a + k0 * sk + n0 * sn, b ? b + k0 * sk + n0 * sn : nullptr, sk * es, kc,
             ((nc - 1) * sn + 1) * es);
  }
}

// The micro-kernels' PartialFlags of block [k0, k0+kc) of K: continue the
// stored sums unless it is the first block, store them unless it is the last.
inline int BlockFlags(int64_t k0, int64_t kc, int64_t K) {
  return (k0 > 0 ? kLoadPartial : 0) | (k0 + kc < K ? kStorePartial : 0);
}

// Column-scaled formats (int8): column n's scale, and the scales applied to
// GEMM1's stored sums (rows of `width` gate then up values, laid out like the
// scales) -- what the packed epilogue applies (sum * scale) -- before the
// biased gated unit reads them; the streaming kernels' sums carry the same
// product, so both paths give the same bits.
inline float ColumnScale(const QuantMatrix& m, int64_t n) {
  return m.bf16_scales ? ToFloat(static_cast<const bf16*>(m.scale)[n])
                       : static_cast<const float*>(m.scale)[n];
}

inline void ScaleStoredSums(float* sums, const float* scale, int rows, int width) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < width; ++j) sums[r * width + j] *= scale[j];
}

// The K-block loop of one tile: block [k0, k0+kc) is packed once its
// prefetch, started during the previous block's arithmetic (the first
// block's at once), has been issued; then the next block's prefetch starts,
// and compute(k0, kc, pf) runs the micro-kernels, stepping pf between calls.
//   start(pf, k0, kc)   starts the prefetch of a block
//   pack(k0, kc)        packs it
template <typename Start, typename Pack, typename Compute>
void RunKBlocks(int64_t K, int64_t kblock, Start&& start, Pack&& pack, Compute&& compute) {
  Prefetcher pf;
  start(pf, int64_t{0}, std::min(kblock, K));
  for (int64_t k0 = 0; k0 < K; k0 += kblock) {
    const int kc = static_cast<int>(std::min(kblock, K - k0));
    pf.Finish();
    pack(k0, kc);
    if (k0 + kc < K) start(pf, k0 + kc, std::min(kblock, K - k0 - kc));
    compute(k0, kc, pf);
  }
}

}  // namespace nbx
