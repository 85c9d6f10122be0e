// int4: asymmetric in groups of `group` rows along K (32, 64 or 128).  q uint8
// [K/2, N]: two 4-bit values per byte along K, the even row in the low nibble
// (packed[j, n] = q[2j, n] | q[2j+1, n] << 4); scale and zero (the group's
// minimum) float32 or bfloat16 [K/group, N], one dtype:
// W[k, n] = q[k, n] * scale[k/group, n] + zero[k/group, n].
#pragma once

#include <cmath>

#include "formats/format.h"

namespace nbx::formats {

inline constexpr FormatSpec kInt4Spec = {
    abi::WeightFormat::kInt4, "int4",
    "4-bit q packed two per byte along K (low nibble = even row), float32/bfloat16 scale and "
    "zero per group of K rows",
    3,
    {{"q", kU8, PartRows::kPackedK, -1},
     {"scale", kF32 | kBF16, PartRows::kGroups, -1},
     {"zero", kF32 | kBF16, PartRows::kGroups, 1}},
    2,
    3, {32, 64, 128},
    1,
};

// The nibble of row k, then q * scale + zero rounded once (a fused
// multiply-add, as the CPU kernels compute it).
inline float Int4Reference(const PartsView& v, int64_t k, int64_t n) {
  const uint8_t byte = static_cast<const uint8_t*>(v.part[0])[(k / 2) * v.N + n];
  const float q = static_cast<float>(k % 2 ? byte >> 4 : byte & 15);
  const int64_t g = (k / v.group) * v.N + n;
  return std::fma(q, PartValue(v, 1, g), PartValue(v, 2, g));
}

}  // namespace nbx::formats
