// Decoding quantized weights in registers (kernels_quant.h's helpers): bytes
// widened to 32-bit lanes, each format's element values (int8, int4, E2M1,
// E4M3) and scales (float32/bfloat16, E8M0, E4M3) as float32, vector and
// scalar alike; every decode is exact, so a weight is the same float in every
// lane, tail and kernel.  Part of kernels.h; included only by kernels_<isa>.cc.
#pragma once

#include <type_traits>

#include "cpu/kernels/kernels_base.h"
#include "formats/minifloat.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace nbx {
namespace {

// The kernels' cases, one per quantized format (formats/<name>.h).
enum QKind : int { kQInt8 = 0, kQInt4 = 1, kQMxfp4 = 2, kQFp8 = 3, kQMxfp8 = 4, kQNvfp4 = 5 };
// Values packed as two 4-bit codes per byte along K (else one byte each).
constexpr bool kNibbles(int q) { return q == kQInt4 || q == kQMxfp4 || q == kQNvfp4; }
// How a format's scales are stored.
enum class QScale { kFloat, kE8M0, kE4M3 };  // float32 or bfloat16 (bf16_scales); bytes
constexpr QScale kScaleOf(int q) {
  return q == kQMxfp4 || q == kQMxfp8 ? QScale::kE8M0 : q == kQNvfp4 ? QScale::kE4M3 : QScale::kFloat;
}
// Group minimums (int4's W = q * scale + min).
constexpr bool kMins(int q) { return q == kQInt4; }

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

// VL E4M3 ("fn") codes (bytes in 32-bit lanes) as float32, exactly
// formats::E4M3Value: a normal code's bits moved into float32's fields with
// the exponent rebiased (+120), a subnormal's mantissa m as m * 2^-9 by a
// conversion (no float32 denormal arises, so flush-to-zero modes cannot
// change it), S.1111.111 NaN, the sign bit moved last.
template <int VL>
NBX_AI typename VecT<VL>::type E4M3FromCodes(typename U32T<VL>::type w) {
  typedef typename U32T<VL>::type U;
  typedef typename I32T<VL>::type I;
  typedef typename VecT<VL>::type V;
  const U mag = w & 0x7Fu;
  const V sub = __builtin_convertvector(reinterpret_cast<I>(mag), V) * 0x1p-9f;
  U subbits;
  memcpy(&subbits, &sub, sizeof subbits);
  const U is_sub = reinterpret_cast<U>(mag < 8u), is_nan = reinterpret_cast<U>(mag == 0x7Fu);
  const U normal = (mag << 20) + (120u << 23);
  const U bits = ((((normal & ~is_sub) | (subbits & is_sub)) & ~is_nan) | (0x7FC00000u & is_nan)) |
                 ((w & 0x80u) << 24);
  typename VecT<VL>::type f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

// VL E4M3 bytes as float32 divided by 2^8 -- exactly formats::E4M3Value(b) *
// 2^-8, every result a float32 normal or zero (or NaN).  AVX-512, and AVX2
// with F16C: each byte's bits become a half's (the byte sign-extended to 16
// bits and shifted left 7 puts its sign at bit 15, exponent and mantissa at
// bits 13-7; bit 14, a copy of the sign, is cleared): that half is the value
// / 2^8, subnormals included; vcvtph2ps widens it exactly (it reads half
// subnormals whatever MXCSR's DAZ says); the NaN codes are set apart.  7
// instructions per vector against E4M3FromCodes' 14, which made fp8 decode
// slower than bf16's (benchmarks/quant.py, Zen 4, 2026-12-03).  The weight
// paths fold the 2^8 into their scales (ScaleVec/ScaleOne): (v / 2^8) *
// (s * 2^8) is v * s rounded once, as the reference's, while s * 2^8 stays
// finite (|s| < 2^120; larger scales give infinities).
template <int VL>
NBX_AI typename VecT<VL>::type E4M3Over256(const uint8_t* p) {
  typename VecT<VL>::type out;
#if defined(__AVX512F__)
  if constexpr (VL == 16) {
    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
    // (the zero-masked form: GCC 12 warns on the unmasked one's undefined pass-through)
    const __m512 f = _mm512_maskz_cvtph_ps(0xFFFF, h);
    const __m256i m7 = _mm256_set1_epi16(0x7F);
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(w, m7), m7);
    const __m512 r = _mm512_mask_mov_ps(f, nan, _mm512_set1_ps(__builtin_nanf("")));
    memcpy(&out, &r, sizeof out);
    return out;
  }
#endif
#if defined(__AVX2__) && defined(__F16C__)
  if constexpr (VL == 8) {
    const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(static_cast<short>(0xBFFF)));
    const __m256 f = _mm256_cvtph_ps(h);
    const __m128i m7 = _mm_set1_epi16(0x7F);
    const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(_mm_and_si128(w, m7), m7)));
    const __m256 r = _mm256_blendv_ps(f, _mm256_set1_ps(__builtin_nanf("")), nan);
    memcpy(&out, &r, sizeof out);
    return out;
  }
#endif
  out = E4M3FromCodes<VL>(reinterpret_cast<typename U32T<VL>::type>(WidenBytes<VL, false>(p))) * 0x1p-8f;
  return out;
}

// VL E4M3 bytes as float32, exactly formats::E4M3Value (nvfp4's scales).
template <int VL>
NBX_AI typename VecT<VL>::type E4M3ToFloat(const uint8_t* p) {
  return E4M3Over256<VL>(p) * 256.0f;
}

// One 4-bit code's value: int4's q, an E2M1 value (mxfp4, nvfp4).
template <int kQ>
NBX_AI float NibbleValue(unsigned code) {
  if constexpr (kQ == kQInt4) return static_cast<float>(code);
  else return formats::kE2M1Values[code];
}

// VL bytes of 4-bit codes' values (low nibbles: even row; high: odd row).
template <int VL, int kQ>
NBX_AI void NibblesToFloat(const uint8_t* p, typename VecT<VL>::type& lo,
                           typename VecT<VL>::type& hi) {
  if constexpr (kQ == kQInt4) Int4ToFloat<VL>(p, lo, hi);
  else Fp4ToFloat<VL>(p, lo, hi);
}

// One byte-coded weight's value (fp8, mxfp8: E4M3) over 2^8, and VL of them
// (E4M3Over256: their scales carry the 2^8).
constexpr bool kByteCodes(int q) { return q == kQFp8 || q == kQMxfp8; }
NBX_AI float ByteValue(uint8_t b) { return formats::E4M3Value(b) * 0x1p-8f; }
template <int VL>
NBX_AI typename VecT<VL>::type ByteValues(const uint8_t* p) { return E4M3Over256<VL>(p); }

// Scales (or mins) i .. i+VL of a format as float32, and scale i alone; the
// byte-coded formats' times 2^8 (ByteValue's other half).
template <int VL, int kQ, bool kB>
NBX_AI typename VecT<VL>::type ScaleVec(const void* p, int64_t i) {
  typename VecT<VL>::type v;
  if constexpr (kScaleOf(kQ) == QScale::kE8M0) v = E8M0ToFloat<VL>(static_cast<const uint8_t*>(p) + i);
  else if constexpr (kScaleOf(kQ) == QScale::kE4M3) v = E4M3ToFloat<VL>(static_cast<const uint8_t*>(p) + i);
  else v = LoadScales<VL, kB>(p, i);
  if constexpr (kByteCodes(kQ)) v *= 256.0f;
  return v;
}
template <int kQ, bool kB>
NBX_AI float ScaleOne(const void* p, int64_t i) {
  float v;
  if constexpr (kScaleOf(kQ) == QScale::kE8M0) v = formats::E8M0Value(static_cast<const uint8_t*>(p)[i]);
  else if constexpr (kScaleOf(kQ) == QScale::kE4M3) v = formats::E4M3Value(static_cast<const uint8_t*>(p)[i]);
  else v = ScaleAt<kB>(p, i);
  if constexpr (kByteCodes(kQ)) v *= 256.0f;
  return v;
}

// The float32 scales (or mins) of columns [c0, c0+n).
template <int VL, int kQ, bool kB>
NBX_AI void ScalesToFloat(const void* p, int64_t c0, int n, float* dst) {
  const int nv = n / VL * VL;
  for (int c = 0; c < nv; c += VL) {
    const typename VecT<VL>::type v = ScaleVec<VL, kQ, kB>(p, c0 + c);
    memcpy(dst + c, &v, sizeof v);
  }
  for (int c = nv; c < n; ++c) dst[c] = ScaleOne<kQ, kB>(p, c0 + c);
}

// Calls f(std::integral_constant<int, kQ>, std::bool_constant<kB>) with m's
// kernel case and scale type; a format without one aborts naming `where`.
template <class F>
NBX_AI void WithQKind(const QuantMatrix& m, const char* where, F&& f) {
  using B = std::true_type;
  using F32 = std::false_type;
  switch (m.format) {
    case abi::WeightFormat::kInt8:
      if (m.bf16_scales) f(std::integral_constant<int, kQInt8>{}, B{});
      else f(std::integral_constant<int, kQInt8>{}, F32{});
      return;
    case abi::WeightFormat::kInt4:
      if (m.bf16_scales) f(std::integral_constant<int, kQInt4>{}, B{});
      else f(std::integral_constant<int, kQInt4>{}, F32{});
      return;
    case abi::WeightFormat::kFp8:
      if (m.bf16_scales) f(std::integral_constant<int, kQFp8>{}, B{});
      else f(std::integral_constant<int, kQFp8>{}, F32{});
      return;
    case abi::WeightFormat::kMxfp4: f(std::integral_constant<int, kQMxfp4>{}, F32{}); return;
    case abi::WeightFormat::kMxfp8: f(std::integral_constant<int, kQMxfp8>{}, F32{}); return;
    case abi::WeightFormat::kNvfp4: f(std::integral_constant<int, kQNvfp4>{}, F32{}); return;
    case abi::WeightFormat::kDense: break;
  }
  FormatHasNoKernel(where, m.format);
}

}  // namespace
}  // namespace nbx
