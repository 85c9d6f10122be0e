// precision="int8": streaming kernels over int8 and int4 experts that
// quantize their input rows to int8 and form integer sums (abi.h "int8
// arithmetic" is the definition; tests/support/int8_ref.py its float64 twin).
// Part of kernels.h; included only by kernels_<isa>.cc.
//
// Per row and block of abi::kInt8Block values of K: amax = max |a|, d =
// amax / 127, xq = rint(a * (127 / amax)) (0 where amax is 0; a block with a
// NaN or an infinity gets d = NaN, so its row's outputs are NaN).  Per column
// n and block b, the integer sum isum = sum xq * q is exact (int4: q the code
// 0..15; int8: the signed code), and the float32 sums run in one order on
// every instruction set (fused multiply-adds, scalar or vector alike):
//   acc = fma(float(isum_b), scale[g, n] * d_b, acc)        each block, in order
//   int4, after a group's last block: acc = fma(min[g, n], u_g, acc), where
//   u_g = fma chain of d_b * float(sum_b xq) over the group's blocks
// then acc *= the tensor scale (where it is not 1).  So every instruction set
// and every row count give the same bits: the integer parts are exact and the
// float parts are written once, here.
#pragma once

#include "cpu/kernels/kernels_base.h"
#include "cpu/kernels/kernels_qdecode.h"

namespace nbx {
namespace {

constexpr int kXBlock = static_cast<int>(abi::kInt8Block);
// K values quantized at a time (whole blocks): the rows' codes live on the stack.
constexpr int kQDotChunk = 1024;
// Prefetch distance in bytes of the item's weights: a block walks its rows
// column chunk by column chunk, so its rows must be on their way a block or
// so before.  OLMoE T=1 (interleaved processes, 4 rounds, Zen 4, AVX2): int8
// 3.7-4.6 ms at 16 kB, 2.4-2.7 ms at 32 kB, 2.6-2.9 ms at 64 kB; int4 alike
// within noise; 8 kB (the float kernels' distance) had int8 at 4.1 ms.
constexpr int64_t kQDotAheadBytes = 32768;
static_assert(kQDotChunk % kXBlock == 0 && kXBlock % 4 == 0, "whole blocks of whole 4-steps");

// R rows' codes for one chunk of K: q[r][i] (zero past the chunk's values, up
// to the next multiple of 4), each block's d and sum of codes.
template <int R>
struct XCodes {
  int8_t q[R][kQDotChunk];
  float d[R][kQDotChunk / kXBlock];
  int32_t sum[R][kQDotChunk / kXBlock];
};

NBX_AI float Fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }

// Rows r < R of a[kk * as + r], kk in [k0, k0 + n), into x's codes.
template <int R>
void QuantizeChunk(const float* a, int64_t as, int64_t k0, int n, XCodes<R>& x) {
  for (int r = 0; r < R; ++r) {
    for (int b0 = 0; b0 < n; b0 += kXBlock) {
      const int len = n - b0 < kXBlock ? n - b0 : kXBlock;
      float amax = 0.0f;
      bool finite = true;
      for (int i = 0; i < len; ++i) {
        const float v = fabsf(a[(k0 + b0 + i) * as + r]);
        if (!(v <= 3.4028234663852886e38f)) finite = false;  // NaN or infinity
        else if (v > amax) amax = v;
      }
      int8_t* q = x.q[r] + b0;
      int32_t s = 0;
      if (!finite || amax == 0.0f) {
        for (int i = 0; i < len; ++i) q[i] = 0;
        x.d[r][b0 / kXBlock] = finite ? 0.0f : __builtin_nanf("");
      } else {
        const float inv = 127.0f / amax;
        for (int i = 0; i < len; ++i) {
          float v = __builtin_rintf(a[(k0 + b0 + i) * as + r] * inv);
          v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
          q[i] = static_cast<int8_t>(v);
          s += q[i];
        }
        x.d[r][b0 / kXBlock] = amax / 127.0f;
      }
      x.sum[r][b0 / kXBlock] = s;
    }
    for (int i = n; i < (n + 3) / 4 * 4; ++i) x.q[r][i] = 0;
  }
}

// The 4 codes of rows [k, k + 4) of column c as one 32-bit lane's bytes, in
// K order (rows past K: 0).  int4: two packed byte rows, low nibble first.
template <int kQ>
NBX_AI uint32_t WeightWord(const uint8_t* q, int64_t N, int64_t k, int64_t K, int64_t c) {
  if constexpr (kQ == kQInt4) {
    const uint32_t b0 = q[(k / 2) * N + c], b1 = q[(k / 2 + 1) * N + c];
    return (b0 & 15) | (b0 >> 4) << 8 | (b1 & 15) << 16 | (b1 >> 4) << 24;
  } else {
    uint32_t w = 0;
    for (int t = 0; t < 4 && k + t < K; ++t) w |= uint32_t{q[(k + t) * N + c]} << (8 * t);
    return w;
  }
}

// sum over the 4 bytes of w (int4: unsigned codes; int8: signed) times x's.
template <int kQ>
NBX_AI int32_t Dot4(uint32_t w, uint32_t x) {
  int32_t s = 0;
  for (int t = 0; t < 4; ++t) {
    const int32_t xv = static_cast<int8_t>(x >> (8 * t));
    const int32_t wv = kQ == kQInt4 ? static_cast<int32_t>((w >> (8 * t)) & 255)
                                    : static_cast<int32_t>(static_cast<int8_t>(w >> (8 * t)));
    s += xv * wv;
  }
  return s;
}

#if defined(__AVX2__)
template <int VL> struct IntVec { using T = __m256i; };
#if defined(__AVX512F__)
template <> struct IntVec<16> { using T = __m512i; };
#endif
// The vector forms, on pairs of rows (k, k + 1) of one column side by side:
//   int4: a packed byte row is such a pair (low nibble, high nibble); the
//     nibbles are split and interleaved (bytes), and vpmaddubsw forms
//     q_k x_k + q_k+1 x_k+1 per column in 16 bits (at most 2 * 15 * 127),
//     summed over 8 byte rows (16 rows of K: at most 30480) before widening.
//   int8: rows k and k + 1 widened to 16 bits and interleaved, vpmaddwd forms
//     the pair's sum in 32 bits.
// Unpacking works within 128-bit lanes: the sums come out with the columns of
// each lane in a known order, put in their natural places by AddInt4Sums and
// StoreInt8Sums (in registers).
// Overloads for the two widths: __m256i (AVX2) and __m512i (AVX-512BW).
NBX_AI __m256i LoadV(const uint8_t* p, __m256i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
NBX_AI __m256i Bytes(int v, __m256i) { return _mm256_set1_epi8(static_cast<char>(v)); }
NBX_AI __m256i Words(int v, __m256i) { return _mm256_set1_epi16(static_cast<short>(v)); }
NBX_AI __m256i Dwords(int v, __m256i) { return _mm256_set1_epi32(v); }
NBX_AI __m256i And(__m256i a, __m256i b) { return _mm256_and_si256(a, b); }
NBX_AI __m256i Shr4(__m256i a) { return _mm256_srli_epi16(a, 4); }
NBX_AI __m256i Lo8(__m256i a, __m256i b) { return _mm256_unpacklo_epi8(a, b); }
NBX_AI __m256i Hi8(__m256i a, __m256i b) { return _mm256_unpackhi_epi8(a, b); }
NBX_AI __m256i Lo16(__m256i a, __m256i b) { return _mm256_unpacklo_epi16(a, b); }
NBX_AI __m256i Hi16(__m256i a, __m256i b) { return _mm256_unpackhi_epi16(a, b); }
NBX_AI __m256i Add16(__m256i a, __m256i b) { return _mm256_add_epi16(a, b); }
NBX_AI __m256i Add32(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
NBX_AI __m256i PairsU8(__m256i w, __m256i x) { return _mm256_maddubs_epi16(w, x); }
NBX_AI __m256i Pairs16(__m256i w, __m256i x) { return _mm256_madd_epi16(w, x); }
NBX_AI __m256i Widen8(const uint8_t* p, __m256i) {  // 16 signed bytes to 16 words
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
NBX_AI __m128i Lane(__m256i v, int l) { return l ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v); }
#if defined(__AVX512F__)
NBX_AI __m512i LoadV(const uint8_t* p, __m512i) { return _mm512_loadu_si512(p); }
NBX_AI __m512i Bytes(int v, __m512i) { return _mm512_set1_epi8(static_cast<char>(v)); }
NBX_AI __m512i Words(int v, __m512i) { return _mm512_set1_epi16(static_cast<short>(v)); }
NBX_AI __m512i Dwords(int v, __m512i) { return _mm512_set1_epi32(v); }
NBX_AI __m512i And(__m512i a, __m512i b) { return _mm512_and_si512(a, b); }
NBX_AI __m512i Shr4(__m512i a) { return _mm512_maskz_srli_epi16(~0u, a, 4); }
NBX_AI __m512i Lo8(__m512i a, __m512i b) { return _mm512_unpacklo_epi8(a, b); }
NBX_AI __m512i Hi8(__m512i a, __m512i b) { return _mm512_unpackhi_epi8(a, b); }
NBX_AI __m512i Lo16(__m512i a, __m512i b) { return _mm512_unpacklo_epi16(a, b); }
NBX_AI __m512i Hi16(__m512i a, __m512i b) { return _mm512_unpackhi_epi16(a, b); }
NBX_AI __m512i Add16(__m512i a, __m512i b) { return _mm512_add_epi16(a, b); }
NBX_AI __m512i Add32(__m512i a, __m512i b) { return _mm512_add_epi32(a, b); }
NBX_AI __m512i PairsU8(__m512i w, __m512i x) { return _mm512_maddubs_epi16(w, x); }
NBX_AI __m512i Pairs16(__m512i w, __m512i x) { return _mm512_madd_epi16(w, x); }
NBX_AI __m512i Widen8(const uint8_t* p, __m512i) {  // 32 signed bytes to 32 words
  return _mm512_maskz_cvtepi8_epi16(~0u, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// dst[0, 16 * lanes) += Int4Sums' two int16 accumulators, widened: lane l
// of s0 holds columns 16l + 0..7, lane l of s1 columns 16l + 8..15.
NBX_AI void AddInt4Sums(__m256i s0, __m256i s1, int32_t* dst) {
  const __m256i w[4] = {_mm256_cvtepi16_epi32(Lane(s0, 0)), _mm256_cvtepi16_epi32(Lane(s1, 0)),
                        _mm256_cvtepi16_epi32(Lane(s0, 1)), _mm256_cvtepi16_epi32(Lane(s1, 1))};
  for (int j = 0; j < 4; ++j) {
    __m256i* p = reinterpret_cast<__m256i*>(dst + 8 * j);
    _mm256_storeu_si256(p, _mm256_add_epi32(w[j], _mm256_loadu_si256(p)));
  }
}
#if defined(__AVX512F__)
NBX_AI void AddInt4Sums(__m512i s0, __m512i s1, int32_t* dst) {  // in registers: no lane extracts
  // (zero-masked forms: GCC 12 warns on the unmasked ones' undefined operand, casts included)
  auto widen = [](__m512i v, int h) {
    return _mm512_maskz_cvtepi16_epi32(0xFFFF, h ? _mm512_maskz_extracti64x4_epi64(0xF, v, 1)
                                                 : _mm512_maskz_extracti64x4_epi64(0xF, v, 0));
  };
  const __m512i a0 = widen(s0, 0), a1 = widen(s0, 1);  // columns 0-7 | 16-23, 32-39 | 48-55
  const __m512i b0 = widen(s1, 0), b1 = widen(s1, 1);  // 8-15 | 24-31, 40-47 | 56-63
  const __m512i w[4] = {_mm512_maskz_shuffle_i64x2(0xFF, a0, b0, 0x44), _mm512_maskz_shuffle_i64x2(0xFF, a0, b0, 0xEE),
                        _mm512_maskz_shuffle_i64x2(0xFF, a1, b1, 0x44), _mm512_maskz_shuffle_i64x2(0xFF, a1, b1, 0xEE)};
  for (int j = 0; j < 4; ++j)
    _mm512_storeu_si512(dst + 16 * j, _mm512_add_epi32(w[j], _mm512_loadu_si512(dst + 16 * j)));
}
#endif

// dst[0, 8 * lanes) = Int8Sums' two int32 accumulators: lane l of s0 holds
// columns 8l + 0..3, lane l of s1 columns 8l + 4..7.
NBX_AI void StoreInt8Sums(__m256i s0, __m256i s1, int32_t* dst) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute2x128_si256(s0, s1, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8), _mm256_permute2x128_si256(s0, s1, 0x31));
}
#if defined(__AVX512F__)
NBX_AI void StoreInt8Sums(__m512i s0, __m512i s1, int32_t* dst) {  // 64-bit indices; s1's are 8-15
  const __m512i lo = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), hi = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  _mm512_storeu_si512(dst, _mm512_permutex2var_epi64(s0, lo, s1));
  _mm512_storeu_si512(dst + 16, _mm512_permutex2var_epi64(s0, hi, s1));
}
#endif

// int4, 64 (AVX-512) or 32 (AVX2) columns at c: isum (+)= the sums of the
// byte rows [p0, p0 + np) (np <= 8) for R rows.
// Each weight row read is prefetched `ahead` rows before (toward L2, spread
// among the loads; rows past `rows` are not).
template <class V, int R>
NBX_AI void Int4Sums(const uint8_t* q, int64_t N, int64_t p0, int np, const uint16_t (*xp)[kXBlock / 2],
                     int pi, int ncols, int32_t* isum, int c, int64_t ahead, int64_t rows) {
  const V m = Bytes(15, V{});
  V s[R][2];
  for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = V{};
  for (int i = 0; i < np; ++i) {
    if (p0 + i + ahead < rows) __builtin_prefetch(q + (p0 + i + ahead) * N + c, 0, 2);
    const V b = LoadV(q + (p0 + i) * N + c, V{});
    const V lo = And(b, m), hi = And(Shr4(b), m);
    const V u0 = Lo8(lo, hi), u1 = Hi8(lo, hi);  // lane l: columns 16l + 0..7, 16l + 8..15
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const V x = Words(xp[r][pi + i], V{});
      s[r][0] = Add16(s[r][0], PairsU8(u0, x));
      s[r][1] = Add16(s[r][1], PairsU8(u1, x));
    }
  }
  for (int r = 0; r < R; ++r) AddInt4Sums(s[r][0], s[r][1], isum + r * ncols + c);
}

// int8, 32 (AVX-512) or 16 (AVX2) columns at c: isum = the sums of rows
// [k, k + len) of K for R rows (a lone last row pairs with zeros).
template <class V, int R>
NBX_AI void Int8Sums(const uint8_t* q, int64_t N, int64_t k, int len, const uint32_t (*xp)[kXBlock / 2],
                     int ncols, int32_t* isum, int c, int64_t ahead, int64_t rows) {
  V s[R][2];
  for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = V{};
  for (int i = 0; i < len; i += 2) {
    if (k + i + 1 + ahead < rows) {
      __builtin_prefetch(q + (k + i + ahead) * N + c, 0, 2);
      __builtin_prefetch(q + (k + i + 1 + ahead) * N + c, 0, 2);
    }
    const V a = Widen8(q + (k + i) * N + c, V{});
    const V b = i + 1 < len ? Widen8(q + (k + i + 1) * N + c, V{}) : V{};
    const V u0 = Lo16(a, b), u1 = Hi16(a, b);  // lane l: columns 8l + 0..3, 8l + 4..7
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const V x = Dwords(static_cast<int>(xp[r][i / 2]), V{});
      s[r][0] = Add32(s[r][0], Pairs16(u0, x));
      s[r][1] = Add32(s[r][1], Pairs16(u1, x));
    }
  }
  for (int r = 0; r < R; ++r) StoreInt8Sums(s[r][0], s[r][1], isum + r * ncols + c);
}
#endif  // __AVX2__

// isum[r * ncols + c] = the integer sums of block rows [k, k + len) (len
// <= kXBlock; x's codes from xq[r] + i0) for columns [n0, n0 + ncols).
// (weight rows `ahead` rows ahead are prefetched: byte rows for int4)
template <int VL, int R, int kQ>
void BlockSums(const uint8_t* q, int64_t N, int64_t n0, int64_t k, int len, int64_t K,
               const XCodes<R>& x, int i0, int ncols, int32_t* isum, int64_t ahead) {
  const int steps = (len + 3) / 4;
  uint32_t xw[R][kXBlock / 4];
  for (int r = 0; r < R; ++r) memcpy(xw[r], x.q[r] + i0, static_cast<size_t>(steps) * 4);
  int c = 0;
  (void)ahead;  // (the portable loop below does not prefetch)
#if defined(__AVX2__)
  if constexpr (VL >= 8) {
    using V = typename IntVec<VL>::T;
    const uint8_t* qc = q + n0;
    if constexpr (kQ == kQInt4) {  // x's codes in pairs (k, k + 1), low byte first
      uint16_t xp[R][kXBlock / 2];
      for (int r = 0; r < R; ++r) memcpy(xp[r], x.q[r] + i0, kXBlock);
      constexpr int kCols = static_cast<int>(sizeof(V));  // a byte per column
      for (; c + kCols <= ncols; c += kCols) {
        for (int r = 0; r < R; ++r) memset(isum + r * ncols + c, 0, kCols * sizeof(int32_t));
        for (int h = 0; h < len / 2; h += 8)  // 8 byte rows (16 rows of K) per 16-bit run
          Int4Sums<V, R>(qc, N, k / 2 + h, len / 2 - h < 8 ? len / 2 - h : 8, xp, h, ncols, isum, c,
                         ahead, K / 2);
      }
    } else {  // x's codes in pairs as two int16 in one int32
      uint32_t xp[R][kXBlock / 2];
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < len; i += 2) {
          const int32_t x0 = x.q[r][i0 + i], x1 = i + 1 < len ? x.q[r][i0 + i + 1] : 0;
          xp[r][i / 2] = static_cast<uint16_t>(x0) | static_cast<uint32_t>(static_cast<uint16_t>(x1)) << 16;
        }
      constexpr int kCols = static_cast<int>(sizeof(V)) / 2;  // a word per column
      for (; c + kCols <= ncols; c += kCols) Int8Sums<V, R>(qc, N, k, len, xp, ncols, isum, c, ahead, K);
    }
  }
#endif
  for (; c < ncols; ++c) {
    int32_t s[R] = {};
    for (int st = 0; st < steps; ++st) {
      const uint32_t w = WeightWord<kQ>(q, N, k + 4 * st, K, n0 + c);
      for (int r = 0; r < R; ++r) s[r] += Dot4<kQ>(w, xw[r][st]);
    }
    for (int r = 0; r < R; ++r) isum[r * ncols + c] = s[r];
  }
}

// acc[r * ncols + c] = fma(float(isum), sc[c] * d_r, acc): one block's fold.
template <int VL, int R>
NBX_AI void FoldBlock(const int32_t* isum, const float* sc, const float (&d)[R], int ncols,
                      float* acc) {
  for (int r = 0; r < R; ++r) {
    float* ar = acc + r * ncols;
    const int32_t* ir = isum + r * ncols;
    int c = 0;
#if defined(__FMA__)
    using V = typename VecT<VL>::type;
    using I = typename I32T<VL>::type;
    for (; c + VL <= ncols; c += VL) {
      I iv;
      memcpy(&iv, ir + c, sizeof iv);
      const V s = Load<VL>(sc + c) * Splat<VL>(d[r]);
      const V v = FusedMulAdd<VL>(__builtin_convertvector(iv, V), s, Load<VL>(ar + c));
      memcpy(ar + c, &v, sizeof v);
    }
#endif
    for (; c < ncols; ++c) ar[c] = Fma(static_cast<float>(ir[c]), sc[c] * d[r], ar[c]);
  }
}

// acc[r * ncols + c] = sum over K of a[kk * as + r] * w[kk, n0 + c] in the
// int8 arithmetic above, for R rows and int8 or int4 weights.
template <int VL, int R, int kQ, bool kB>
void QDotRows(const float* a, int64_t as, const QuantMatrix& m, int64_t n0, int64_t K,
              int ncols, float* acc) {
  const int64_t N = m.N;
  const int64_t G = kQ == kQInt4 ? m.group : K;  // rows per scale
  const uint8_t* q = static_cast<const uint8_t*>(m.q);
  XCodes<R> x;
  float sc[kMaxStreamCols], zc[kMaxStreamCols];
  int32_t isum[R * kMaxStreamCols];
  float u[R] = {};  // int4: the group's d-weighted code sums
  for (int i = 0; i < R * ncols; ++i) acc[i] = 0.0f;
  // the same columns' byte rows about kQDotAheadBytes ahead (int4: two rows of K per byte row)
  const int64_t ahead = (kQDotAheadBytes + ncols - 1) / ncols;
  for (int64_t k0 = 0; k0 < K; k0 += kQDotChunk) {
    const int n = static_cast<int>(K - k0 < kQDotChunk ? K - k0 : kQDotChunk);
    QuantizeChunk<R>(a, as, k0, n, x);
    for (int i0 = 0; i0 < n; i0 += kXBlock) {
      const int64_t k = k0 + i0;
      const int len = n - i0 < kXBlock ? n - i0 : kXBlock;
      if (k % G == 0) {
        ScalesToFloat<VL, kQ, kB>(m.scale, (k / G) * N + n0, ncols, sc);
        if constexpr (kQ == kQInt4) ScalesToFloat<VL, kQ, kB>(m.zero, (k / G) * N + n0, ncols, zc);
      }
      BlockSums<VL, R, kQ>(q, N, n0, k, len, K, x, i0, ncols, isum, ahead);
      float d[R];
      for (int r = 0; r < R; ++r) d[r] = x.d[r][i0 / kXBlock];
      FoldBlock<VL, R>(isum, sc, d, ncols, acc);
      if constexpr (kQ == kQInt4) {
        for (int r = 0; r < R; ++r) u[r] = Fma(d[r], static_cast<float>(x.sum[r][i0 / kXBlock]), u[r]);
        if ((k + len) % G == 0) {  // the group's last block: its minimums
          for (int r = 0; r < R; ++r) {
            for (int c = 0; c < ncols; ++c) acc[r * ncols + c] = Fma(zc[c], u[r], acc[r * ncols + c]);
            u[r] = 0.0f;
          }
        }
      }
    }
  }
  if (m.tensor_scale != 1.0f)
    for (int i = 0; i < R * ncols; ++i) acc[i] *= m.tensor_scale;
}

template <int VL>
void QDotRowsAny(const float* a, int64_t as, int rows, const QuantMatrix& m, int64_t n0,
                 int64_t K, int ncols, float* acc) {
  WithRows(rows, [&](auto r) {
    constexpr int R = decltype(r)::value;
    if (m.format == abi::WeightFormat::kInt4) {
      if (m.bf16_scales) QDotRows<VL, R, kQInt4, true>(a, as, m, n0, K, ncols, acc);
      else QDotRows<VL, R, kQInt4, false>(a, as, m, n0, K, ncols, acc);
    } else if (m.format == abi::WeightFormat::kInt8) {
      if (m.bf16_scales) QDotRows<VL, R, kQInt8, true>(a, as, m, n0, K, ncols, acc);
      else QDotRows<VL, R, kQInt8, false>(a, as, m, n0, K, ncols, acc);
    } else {
      FormatHasNoKernel("the int8-arithmetic kernels", m.format);
    }
  });
}

}  // namespace
}  // namespace nbx
