// One expert's quantized matrix as every handler decodes it (common/weights.h)
// and the kernels read it (the CPU's kernel tables, cpu/kernels/): plain C++,
// no XLA headers.
#pragma once

#include <cstdint>

#include "abi.h"

namespace nbx {

// One expert's quantized matrix [K, N] (formats/<name>.h): int8
// q[k, n] * scale[n]; int4 packed two rows per byte (low nibble = even row)
// q[k, n] * scale[k / group, n] + min[k / group, n].  Scales (and mins) f32 or
// bf16 bits.  The streamed and packed paths of one ISA do the same arithmetic
// (kernels.h, QuantArithOf): int8 sums a * q and multiplies each column's sum
// by its scale once; int4 dequantizes each weight (q * scale + min) and sums
// a * w; so they give the same bits.
struct QuantMatrix {
  const void* q;
  const void* scale;
  const void* zero;  // int4: the group minimums
  int64_t N;
  int64_t group;  // int4: rows per group (even); int8: K
  abi::WeightFormat format;  // a quantized format (never kDense)
  bool bf16_scales;
  // The matrix's tensor scale (FormatSpec::tensor_scale; 1: none): each
  // column's sum is multiplied by it once, streamed or packed alike.
  float tensor_scale = 1.0f;
};

}  // namespace nbx
