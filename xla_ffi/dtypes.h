// Scalar conversions between float32 and the 16-bit float formats.
#pragma once

#include <cstdint>
#include <cstring>

namespace nbx {

struct bf16 { uint16_t bits; };
struct f16 { uint16_t bits; };

inline float BitsToFloat(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t FloatToBits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float ToFloat(float v) { return v; }
inline float ToFloat(bf16 v) { return BitsToFloat(static_cast<uint32_t>(v.bits) << 16); }
inline float ToFloat(f16 v) {
  uint32_t h = v.bits;
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (man << 13));  // inf/nan
  if (exp == 0) {
    if (man == 0) return BitsToFloat(sign);
    // subnormal: value = man * 2^-24
    float f = static_cast<float>(man) * (1.0f / 16777216.0f);
    return sign ? -f : f;
  }
  return BitsToFloat(sign | ((exp + 112) << 23) | (man << 13));
}

template <typename T> T FromFloat(float f);
template <> inline float FromFloat<float>(float f) { return f; }
template <> inline bf16 FromFloat<bf16>(float f) {
  uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};  // quiet nan
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16{static_cast<uint16_t>(u >> 16)};
}
template <> inline f16 FromFloat<f16>(float f) {
  uint32_t u = FloatToBits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f16{static_cast<uint16_t>(sign | 0x7e00u)};  // nan
  if (a >= 0x477ff000u) return f16{static_cast<uint16_t>(sign | 0x7c00u)};  // overflow -> inf
  if (a < 0x38800000u) {  // subnormal or zero in half: round a * 2^24 to an integer
    float m = BitsToFloat(a) * 16777216.0f;
    // round half to even via the float adder
    float r = (m + 8388608.0f) - 8388608.0f;
    return f16{static_cast<uint16_t>(sign | static_cast<uint32_t>(r))};
  }
  uint32_t mant_odd = (a >> 13) & 1u;
  a += 0xfffu + mant_odd;  // round to nearest even at bit 13
  return f16{static_cast<uint16_t>(sign | ((a - 0x38000000u) >> 13))};
}

}  // namespace nbx
