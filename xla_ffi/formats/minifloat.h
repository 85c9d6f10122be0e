// The element encodings the microscaling and FP8 formats share, as their
// specifications define each value exactly: E2M1 (FP4), E4M3 (FP8, the "fn"
// variant: no infinities, one NaN per sign) and E8M0 (a power-of-two scale).
// OCP Microscaling Formats (MX) v1.0, sections 5.3 (element types) and 5.4
// (E8M0); ml_dtypes' float4_e2m1fn, float8_e4m3fn and float8_e8m0fnu hold the
// same values (tests/library/test_format_producers.py checks every code).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace nbx::formats {

// The E2M1 values of codes 0..15 (sign bit 3, exponent bits 2-1 with bias 1,
// mantissa bit 0): OCP MX v1.0 section 5.3.3; transformers' FP4_VALUES.
inline constexpr float kE2M1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// 2^(s - 127) for an E8M0 byte s, exactly (s = 0 is the subnormal 2^-127);
// 255 is NaN.
inline float E8M0Value(uint8_t s) {
  if (s == 255) return std::numeric_limits<float>::quiet_NaN();
  const uint32_t bits = s == 0 ? 0x00400000u : static_cast<uint32_t>(s) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The E4M3 ("fn") value of a byte: sign bit 7, exponent bits 6-3 (bias 7),
// mantissa bits 2-0; exponent 0 is subnormal (m * 2^-9), S.1111.111 is NaN and
// there is no infinity, so the largest magnitude is 448.
inline float E4M3Value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return std::numeric_limits<float>::quiet_NaN();
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                           : std::ldexp(static_cast<float>(8 + m), e - 10);
  return b & 0x80 ? -mag : mag;
}

}  // namespace nbx::formats
