// Quantized micro-kernels (int8 / int4 experts, QuantMatrix): streaming
// kernels that dequantize in registers and the dequantizing packer.  Part of
// kernels.h; included only by kernels_<isa>.cc (see kernels_base.h).
#pragma once

#include "cpu/kernels_base.h"
#include "formats/mxfp4.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace nbx {
namespace {

// ---- Quantized weights (QuantMatrix, kernel_table.h) ----------------------
// The kernels' cases, one per quantized format (formats/<name>.h).
enum QKind : int { kQInt8 = 0, kQInt4 = 1, kQMxfp4 = 2 };

// The streamed and the packed paths of one ISA do the same arithmetic, so
// banded and unbanded results stay identical: int8 accumulates a * q in kk
// order (q exact in float32) and multiplies each column's sum by its scale
// once (the streaming kernels at the end, the packed ones in the epilogue);
// int4 dequantizes each weight with one expression, q * scale + min (one FMA
// where the ISA has one; vector lanes and scalar tail alike), then
// accumulates a * w in kk order as the dense kernels do; mxfp4 as int4, its
// weight E2M1(code) * 2^(s - 127) one exact product (no min).

template <int VL> struct I32T;
template <> struct I32T<4> { typedef int32_t type __attribute__((vector_size(16))); };
template <> struct I32T<8> { typedef int32_t type __attribute__((vector_size(32))); };
template <> struct I32T<16> { typedef int32_t type __attribute__((vector_size(64))); };
typedef uint8_t U8x16 __attribute__((vector_size(16)));
typedef uint16_t U16x8 __attribute__((vector_size(16)));
typedef uint32_t U32x4 __attribute__((vector_size(16)));
typedef uint8_t U8x32 __attribute__((vector_size(32)));
typedef uint8_t U8x64 __attribute__((vector_size(64)));
typedef uint64_t U64x4 __attribute__((vector_size(32)));
typedef uint64_t U64x8 __attribute__((vector_size(64)));

// VL bytes p[0, VL) spread over 32-bit lanes: the top byte of lane j is p[j]
// (the lower bytes are unspecified: callers shift right by 24 or more).
// Shuffles, because GCC 12 widens a byte vector (__builtin_convertvector) one
// lane at a time: AVX2/AVX-512 broadcast the bytes to every 128-bit lane and
// shuffle within lanes (vpshufb); SSE2 interleaves twice (punpcklbw, punpcklwd).
template <int VL>
NBX_AI typename U32T<VL>::type TopBytes(const uint8_t* p) {
  typedef typename U32T<VL>::type U;
  if constexpr (VL == 4) {
    uint32_t x;
    memcpy(&x, p, 4);
    const U32x4 d = {x, 0, 0, 0};
    U8x16 b;
    memcpy(&b, &d, 16);
    const U8x16 s1 = __builtin_shufflevector(b, b, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    U16x8 w1;
    memcpy(&w1, &s1, 16);
    const U16x8 s2 = __builtin_shufflevector(w1, w1, 0, 0, 1, 1, 2, 2, 3, 3);
    U r;
    memcpy(&r, &s2, 16);
    return r;
  } else if constexpr (VL == 8) {
    uint64_t x;
    memcpy(&x, p, 8);
    const U64x4 l = {x, x, x, x};
    U8x32 b;
    memcpy(&b, &l, 32);
    const U8x32 s = __builtin_shufflevector(b, b, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3,
                                            20, 20, 20, 20, 21, 21, 21, 21, 22, 22, 22, 22, 23,
                                            23, 23, 23);
    U r;
    memcpy(&r, &s, 32);
    return r;
  } else {  // byte j of the copy in 128-bit lane j/4: 16 * (j/4) + j
    uint64_t x0, x1;
    memcpy(&x0, p, 8);
    memcpy(&x1, p + 8, 8);
    const U64x8 l = {x0, x1, x0, x1, x0, x1, x0, x1};
    U8x64 b;
    memcpy(&b, &l, 64);
    const U8x64 s = __builtin_shufflevector(
        b, b, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 20, 20, 20, 20, 21, 21, 21, 21, 22,
        22, 22, 22, 23, 23, 23, 23, 40, 40, 40, 40, 41, 41, 41, 41, 42, 42, 42, 42, 43, 43, 43,
        43, 60, 60, 60, 60, 61, 61, 61, 61, 62, 62, 62, 62, 63, 63, 63, 63);
    U r;
    memcpy(&r, &s, 64);
    return r;
  }
}

// VL scales (or mins) from element i: float32, or bfloat16 bits (kB).
template <int VL, bool kB>
NBX_AI typename VecT<VL>::type LoadScales(const void* p, int64_t i) {
  if constexpr (kB) {
    return LoadBf16<VL>(static_cast<const uint16_t*>(p) + i);
  } else {
    return Load<VL>(static_cast<const float*>(p) + i);
  }
}

template <bool kB>
NBX_AI float ScaleAt(const void* p, int64_t i) {
  if constexpr (kB) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
  } else {
    return static_cast<const float*>(p)[i];
  }
}

// VL bytes p[0, VL) widened to 32-bit lanes, sign-extended (int8) or
// zero-extended (packed int4).  AVX-512 and AVX2: one extending load
// (vpmovsxbd/vpmovzxbd; the zero-masked AVX-512 forms, as GCC 12 warns on the
// unmasked ones' undefined pass-through).  The generic shuffles of
// TopBytes<16> went through the stack there -- four 16-byte stores read back
// as one 64-byte load, a store-forwarding stall per step -- and made the
// AVX-512 streaming kernels slower than AVX2's.  The same integers either way,
// so results are unchanged bit for bit.
template <int VL, bool kSigned>
NBX_AI typename I32T<VL>::type WidenBytes(const uint8_t* p) {
  typedef typename I32T<VL>::type I;
  I w;
#if defined(__AVX512F__)
  if constexpr (VL == 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m512i v = kSigned ? _mm512_maskz_cvtepi8_epi32(0xFFFF, b) : _mm512_maskz_cvtepu8_epi32(0xFFFF, b);
    memcpy(&w, &v, sizeof w);
  } else
#endif
#if defined(__AVX2__)
  if constexpr (VL == 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m256i v = kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
    memcpy(&w, &v, sizeof w);
  } else
#endif
  {
    const typename U32T<VL>::type t = TopBytes<VL>(p);
    w = kSigned ? reinterpret_cast<I>(t) >> 24 : reinterpret_cast<I>(t >> 24);
  }
  return w;
}

// VL int8 values widened to float32.
template <int VL>
NBX_AI typename VecT<VL>::type Int8ToFloat(const int8_t* p) {
  return __builtin_convertvector(WidenBytes<VL, true>(reinterpret_cast<const uint8_t*>(p)),
                                 typename VecT<VL>::type);
}

// VL bytes of packed int4 (two rows): the low nibbles (even row) and the high
// nibbles (odd row) widened to float32.
template <int VL>
NBX_AI void Int4ToFloat(const uint8_t* p, typename VecT<VL>::type& lo,
                        typename VecT<VL>::type& hi) {
  const typename I32T<VL>::type w = WidenBytes<VL, false>(p);
  lo = __builtin_convertvector(w & 15, typename VecT<VL>::type);
  hi = __builtin_convertvector(w >> 4, typename VecT<VL>::type);
}

// The 4-bit codes of VL lanes (0..15) as mxfp4's E2M1 values
// (formats::kE2M1Values) by a table lookup: one variable permute of the
// 16-entry table (AVX-512 vpermps), or of the 8 magnitudes with the sign, bit
// 3, moved to the float's sign bit (AVX2 vpermps); lane by lane elsewhere.
// Building the values from their bits instead (compares, selects, a multiply)
// made mxfp4 decode 0.9-1.5x bf16's speed against int4's 2.3-3.5x
// (benchmarks/quant.py, Zen 4, 2026-12-03).  Intrinsics, not GCC's
// __builtin_shuffle, which Clang lacks.
template <int VL>
NBX_AI typename VecT<VL>::type E2M1FromCodes(typename U32T<VL>::type n) {
  typedef typename VecT<VL>::type V;
  V out;
#if defined(__AVX512F__)
  if constexpr (VL == 16) {
    const __m512 tab = _mm512_loadu_ps(formats::kE2M1Values);
    __m512i idx;
    memcpy(&idx, &n, sizeof idx);
    // (the zero-masked form: GCC 12 warns on the unmasked one's undefined pass-through)
    const __m512 r = _mm512_maskz_permutexvar_ps(0xFFFF, idx, tab);  // indices taken mod 16
    memcpy(&out, &r, sizeof out);
    return out;
  }
#endif
#if defined(__AVX2__)
  if constexpr (VL == 8) {
    const __m256 tab = _mm256_loadu_ps(formats::kE2M1Values);  // the 8 magnitudes
    __m256i idx;
    memcpy(&idx, &n, sizeof idx);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(idx, _mm256_set1_epi32(8)), 28);
    const __m256 mag = _mm256_permutevar8x32_ps(tab, idx);  // indices taken mod 8
    const __m256 r = _mm256_or_ps(mag, _mm256_castsi256_ps(sign));
    memcpy(&out, &r, sizeof out);
    return out;
  }
#endif
  for (int i = 0; i < VL; ++i) out[i] = formats::kE2M1Values[n[i] & 15u];
  return out;
}

template <int VL>
NBX_AI void Fp4ToFloat(const uint8_t* p, typename VecT<VL>::type& lo,
                       typename VecT<VL>::type& hi) {
  typedef typename U32T<VL>::type U;
  const U w = reinterpret_cast<U>(WidenBytes<VL, false>(p));
  lo = E2M1FromCodes<VL>(w & 15u);
  hi = E2M1FromCodes<VL>(w >> 4);
}

// VL E8M0 scale bytes as float32: 2^(s - 127) (bits s << 23; s = 0 the
// subnormal 2^-127, s = 255 NaN), exactly formats::E8M0Value.
template <int VL>
NBX_AI typename VecT<VL>::type E8M0ToFloat(const uint8_t* p) {
  typedef typename U32T<VL>::type U;
  const U s = reinterpret_cast<U>(WidenBytes<VL, false>(p));
  const U zero = reinterpret_cast<U>(s == 0u), nan = reinterpret_cast<U>(s == 255u);
  const U bits = ((s << 23) & ~zero & ~nan) | (0x00400000u & zero) | (0x7FC00000u & nan);
  typename VecT<VL>::type f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

// One 4-bit code's value: int4's q, mxfp4's E2M1 value.
template <int kQ>
NBX_AI float NibbleValue(unsigned code) {
  if constexpr (kQ == kQMxfp4) return formats::kE2M1Values[code];
  else return static_cast<float>(code);
}

// VL 4-bit codes' values (low nibbles, high nibbles).
template <int VL, int kQ>
NBX_AI void NibblesToFloat(const uint8_t* p, typename VecT<VL>::type& lo,
                           typename VecT<VL>::type& hi) {
  if constexpr (kQ == kQMxfp4) Fp4ToFloat<VL>(p, lo, hi);
  else Int4ToFloat<VL>(p, lo, hi);
}

// The float32 scales of columns [c0, c0+n): E8M0 bytes (mxfp4).
template <int VL>
NBX_AI void E8M0ScalesToFloat(const void* p, int64_t c0, int n, float* dst) {
  const uint8_t* s = static_cast<const uint8_t*>(p) + c0;
  const int nv = n / VL * VL;
  for (int c = 0; c < nv; c += VL) {
    const typename VecT<VL>::type v = E8M0ToFloat<VL>(s + c);
    memcpy(dst + c, &v, sizeof v);
  }
  for (int c = nv; c < n; ++c) dst[c] = formats::E8M0Value(s[c]);
}

// The float32 scales of columns [c0, c0+n).
template <int VL, bool kB>
NBX_AI void ScalesToFloat(const void* p, int64_t c0, int n, float* dst) {
  const int nv = n / VL * VL;
  for (int c = 0; c < nv; c += VL) {
    const typename VecT<VL>::type v = LoadScales<VL, kB>(p, c0 + c);
    memcpy(dst + c, &v, sizeof v);
  }
  for (int c = nv; c < n; ++c) dst[c] = ScaleAt<kB>(p, c0 + c);
}

// Streaming accumulation over quantized weights: R rows (compile time),
// columns [n0, n0+ncols) of m; acc[r*ncols + c] = sum_kk a[kk*as + r] * w[kk, c]
// in kk order, w dequantized once per element for all rows.  Software
// prefetch kPrefetchRows rows (int4: byte rows) ahead: each row's run is short
// (<= 1 kB) and the runs cross pages the hardware prefetcher stops at.
constexpr int kPrefetchRows = 8;

template <int VL, int R, int kQ, bool kB>
void AccumulateRowsQ(const float* a, int64_t as, const QuantMatrix& m, int64_t n0, int64_t K,
                     int ncols, float* acc) {
  using V = typename VecT<VL>::type;
  const int64_t N = m.N;
  const int nv = ncols / VL * VL;
  for (int i = 0; i < R * ncols; ++i) acc[i] = 0.0f;
  // the item's scales (and mins) in float32, converted once (int4: per group)
  float sc[kMaxStreamCols], zc[kMaxStreamCols];
  if constexpr (kQ == kQInt8) {
    const int8_t* q = static_cast<const int8_t*>(m.q) + n0;
    ScalesToFloat<VL, kB>(m.scale, n0, ncols, sc);
    // two rows of W per pass over the accumulators (the same per-element
    // chain: row kk's FMA, then row kk+1's); a lone last row when K is odd
    for (int64_t kk = 0; kk < K; kk += 2) {
      const bool two = kk + 1 < K;
      const int8_t* qr0 = q + kk * N;
      const int8_t* qr1 = two ? qr0 + N : qr0;
      if (kk + kPrefetchRows + 1 < K)
        for (int l = 0; l < ncols; l += 64) {
          __builtin_prefetch(qr0 + kPrefetchRows * N + l, 0, 3);
          __builtin_prefetch(qr1 + kPrefetchRows * N + l, 0, 3);
        }
      float a0[R], a1[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) a0[r] = a[kk * as + r], a1[r] = two ? a[(kk + 1) * as + r] : 0.0f;
      if (two) {
        for (int c = 0; c < nv; c += VL) {
          const V w0 = Int8ToFloat<VL>(qr0 + c);
          const V w1 = Int8ToFloat<VL>(qr1 + c);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            V v;
            memcpy(&v, acc + r * ncols + c, sizeof v);
            v += a0[r] * w0;
            v += a1[r] * w1;
            memcpy(acc + r * ncols + c, &v, sizeof v);
          }
        }
        for (int c = nv; c < ncols; ++c) {
          const float w0 = static_cast<float>(qr0[c]);
          const float w1 = static_cast<float>(qr1[c]);
          for (int r = 0; r < R; ++r) {
            acc[r * ncols + c] += a0[r] * w0;
            acc[r * ncols + c] += a1[r] * w1;
          }
        }
      } else {
        for (int c = 0; c < nv; c += VL) {
          const V w0 = Int8ToFloat<VL>(qr0 + c);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            V v;
            memcpy(&v, acc + r * ncols + c, sizeof v);
            v += a0[r] * w0;
            memcpy(acc + r * ncols + c, &v, sizeof v);
          }
        }
        for (int c = nv; c < ncols; ++c) {
          const float w0 = static_cast<float>(qr0[c]);
          for (int r = 0; r < R; ++r) acc[r * ncols + c] += a0[r] * w0;
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < ncols; ++c) acc[r * ncols + c] *= sc[c];
  } else {  // K is a multiple of the (even) group: rows come in pairs, one byte
    const uint8_t* q = static_cast<const uint8_t*>(m.q) + n0;
    for (int64_t kk = 0; kk < K; kk += 2) {
      const uint8_t* qr = q + (kk / 2) * N;
      if (kk / 2 + kPrefetchRows < K / 2)
        for (int l = 0; l < ncols; l += 64) __builtin_prefetch(qr + kPrefetchRows * N + l, 0, 3);
      if (kk % m.group == 0) {
        if constexpr (kQ == kQMxfp4) {
          E8M0ScalesToFloat<VL>(m.scale, (kk / m.group) * N + n0, ncols, sc);
        } else {
          ScalesToFloat<VL, kB>(m.scale, (kk / m.group) * N + n0, ncols, sc);
          ScalesToFloat<VL, kB>(m.zero, (kk / m.group) * N + n0, ncols, zc);
        }
      }
      float a0[R], a1[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) a0[r] = a[kk * as + r], a1[r] = a[(kk + 1) * as + r];
      for (int c = 0; c < nv; c += VL) {
        V lo, hi, w0, w1;
        NibblesToFloat<VL, kQ>(qr + c, lo, hi);
        const V s = Load<VL>(sc + c);
        if constexpr (kQ == kQMxfp4) {
          w0 = lo * s;
          w1 = hi * s;
        } else {
          const V z = Load<VL>(zc + c);
          w0 = lo * s + z;
          w1 = hi * s + z;
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          V v;
          memcpy(&v, acc + r * ncols + c, sizeof v);
          v += a0[r] * w0;
          v += a1[r] * w1;
          memcpy(acc + r * ncols + c, &v, sizeof v);
        }
      }
      for (int c = nv; c < ncols; ++c) {
        float w0, w1;
        if constexpr (kQ == kQMxfp4) {
          w0 = NibbleValue<kQ>(qr[c] & 15) * sc[c];
          w1 = NibbleValue<kQ>(qr[c] >> 4) * sc[c];
        } else {
          w0 = NibbleValue<kQ>(qr[c] & 15) * sc[c] + zc[c];
          w1 = NibbleValue<kQ>(qr[c] >> 4) * sc[c] + zc[c];
        }
        for (int r = 0; r < R; ++r) {
          acc[r * ncols + c] += a0[r] * w0;
          acc[r * ncols + c] += a1[r] * w1;
        }
      }
    }
  }
}

template <int VL, int R>
void AccumulateRowsQFormat(const float* a, int64_t as, const QuantMatrix& m, int64_t n0,
                           int64_t K, int ncols, float* acc) {
  switch (m.format) {
    case abi::WeightFormat::kInt4:
      if (m.bf16_scales) AccumulateRowsQ<VL, R, kQInt4, true>(a, as, m, n0, K, ncols, acc);
      else AccumulateRowsQ<VL, R, kQInt4, false>(a, as, m, n0, K, ncols, acc);
      return;
    case abi::WeightFormat::kInt8:
      if (m.bf16_scales) AccumulateRowsQ<VL, R, kQInt8, true>(a, as, m, n0, K, ncols, acc);
      else AccumulateRowsQ<VL, R, kQInt8, false>(a, as, m, n0, K, ncols, acc);
      return;
    case abi::WeightFormat::kMxfp4:
      AccumulateRowsQ<VL, R, kQMxfp4, false>(a, as, m, n0, K, ncols, acc);
      return;
    case abi::WeightFormat::kDense: break;
  }
  FormatHasNoKernel("the streaming quantized kernels", m.format);
}

template <int VL>
void AccumulateRowsQuant(const float* a, int64_t as, int rows, const QuantMatrix& m,
                         int64_t n0, int64_t K, int ncols, float* acc) {
  WithRows(rows, [&](auto r) {
    AccumulateRowsQFormat<VL, decltype(r)::value>(a, as, m, n0, K, ncols, acc);
  });
}

template <int VL>
void Gemm1StreamQuant(const float* a, int64_t as, int rows, const QuantMatrix* wg,
                      const QuantMatrix* wu, int64_t n0, int64_t K, int ncols, const Glu& act,
                      float* acc, float* out, int64_t rs, int64_t cs) {
  AccumulateRowsQuant<VL>(a, as, rows, *wg, n0, K, ncols, acc);
  float* accu = acc + rows * ncols;
  AccumulateRowsQuant<VL>(a, as, rows, *wu, n0, K, ncols, accu);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < ncols; ++c)
      out[r * rs + c * cs] = GluOf(act, acc[r * ncols + c], accu[r * ncols + c]);
}

template <int VL>
void Gemm2StreamQuant(const float* a, int64_t as, int rows, const QuantMatrix* wd, int64_t n0,
                      int64_t K, int ncols, const float* w, float* acc, float* out,
                      int64_t rs) {
  AccumulateRowsQuant<VL>(a, as, rows, *wd, n0, K, ncols, acc);
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
  } else {
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
            if constexpr (kQ == kQMxfp4) {
              const V s = E8M0ToFloat<VL>(static_cast<const uint8_t*>(m.scale) + g + c);
              w0 = lo * s;
              w1 = hi * s;
            } else {
              const V s = LoadScales<VL, kB>(m.scale, g + c);
              const V z = LoadScales<VL, kB>(m.zero, g + c);
              w0 = lo * s + z;
              w1 = hi * s + z;
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
                if constexpr (kQ == kQMxfp4) {
                  const float s = formats::E8M0Value(static_cast<const uint8_t*>(m.scale)[g + c + t]);
                  w0 = NibbleValue<kQ>(qr[c + t] & 15) * s;
                  w1 = NibbleValue<kQ>(qr[c + t] >> 4) * s;
                } else {
                  const float s = ScaleAt<kB>(m.scale, g + c + t), z = ScaleAt<kB>(m.zero, g + c + t);
                  w0 = NibbleValue<kQ>(qr[c + t] & 15) * s + z;
                  w1 = NibbleValue<kQ>(qr[c + t] >> 4) * s + z;
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
  switch (m->format) {
    case abi::WeightFormat::kInt4:
      if (m->bf16_scales) PackQuantT<VL, kQInt4, true>(*m, k0, kc, n0, nc, width, dst, rs, ps);
      else PackQuantT<VL, kQInt4, false>(*m, k0, kc, n0, nc, width, dst, rs, ps);
      return;
    case abi::WeightFormat::kInt8:
      if (m->bf16_scales) PackQuantT<VL, kQInt8, true>(*m, k0, kc, n0, nc, width, dst, rs, ps);
      else PackQuantT<VL, kQInt8, false>(*m, k0, kc, n0, nc, width, dst, rs, ps);
      return;
    case abi::WeightFormat::kMxfp4:
      PackQuantT<VL, kQMxfp4, false>(*m, k0, kc, n0, nc, width, dst, rs, ps);
      return;
    case abi::WeightFormat::kDense: break;
  }
  FormatHasNoKernel("the quantized packer", m->format);
}

}  // namespace
}  // namespace nbx
