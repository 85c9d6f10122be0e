// The dense format: one part, the weights themselves (float32, bfloat16 or
// float16, one dtype for every projection), [K, N] per expert in the plain
// layout (other layouts: abi.h "weight views").
#pragma once

#include "formats/format.h"

namespace nbx::formats {

inline constexpr FormatSpec kDenseSpec = {
    abi::WeightFormat::kDense, "dense",
    "float32, bfloat16 or float16 weights",
    1,
    {{"q", kF32 | kBF16 | kF16, PartRows::kK, -1}, {}, {}},
    1,
    0, {},
    0,
};

// W[k, n].
inline float DenseReference(const PartsView& v, int64_t k, int64_t n) {
  return PartValue(v, 0, k * v.N + n);
}

}  // namespace nbx::formats
