// int8: symmetric per output column.  q int8 [K, N] in [-127, 127], scale
// float32 or bfloat16 [N]: W[k, n] = q[k, n] * scale[n] (jax_nbx/formats/int8.py
// quantizes: scale = max_k |W| / 127).
#pragma once

#include "formats/format.h"

namespace nbx::formats {

inline constexpr FormatSpec kInt8Spec = {
    abi::WeightFormat::kInt8, "int8",
    "int8 q [K, N] times a float32/bfloat16 scale per output column [N]",
    2,
    {{"q", kS8, PartRows::kK, -1}, {"scale", kF32 | kBF16, PartRows::kNone, -1}, {}},
    1,
    0, {},
    1,
    /*tensor_scale=*/false,
    /*column_scaled=*/true,
};

// q[k, n] * scale[n], one float32 product.
inline float Int8Reference(const PartsView& v, int64_t k, int64_t n) {
  return PartValue(v, 0, k * v.N + n) * PartValue(v, 1, n);
}

}  // namespace nbx::formats
