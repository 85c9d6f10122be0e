// mxfp8 (OCP Microscaling Formats v1.0, MXFP8 with E4M3 elements): E4M3
// values, one byte per weight, in blocks of 32 along K, each scaled by one
// E8M0 power of two.  q uint8 [K, N] (float8_e4m3fn bits), scale uint8
// [ceil(K/32), N] (E8M0 bits): W[k, n] = E4M3(q[k, n]) * 2^(scale[k/32, n] -
// 127), as MLX's mx.quantize(mode="mxfp8") stores it along the rows of an
// [N, K] matrix (the loaders transpose).  Partial blocks as mxfp4's (the last
// block covers K % 32 rows; formats/mxfp4.h names the producers).
#pragma once

#include <cstdint>

#include "formats/format.h"
#include "formats/minifloat.h"

namespace nbx::formats {

inline constexpr FormatSpec kMxfp8Spec = {
    abi::WeightFormat::kMxfp8, "mxfp8",
    "OCP MXFP8: E4M3 codes [K, N] (one byte per weight), one E8M0 scale byte per 32 rows of K",
    2,
    {{"q", kU8, PartRows::kK, -1}, {"scale", kU8, PartRows::kGroups, -1}, {}},
    1,
    1, {32},
    -1,
    /*tensor_scale=*/false,
    /*column_scaled=*/false,
    kAllKernels,
    /*partial_groups=*/true,
};

// E4M3(q) * 2^(s - 127): exact (four significant bits times a power of two).
inline float Mxfp8Reference(const PartsView& v, int64_t k, int64_t n) {
  const uint8_t q = static_cast<const uint8_t*>(v.part[0])[k * v.N + n];
  const uint8_t s = static_cast<const uint8_t*>(v.part[1])[(k / v.group) * v.N + n];
  return E4M3Value(q) * E8M0Value(s);
}

}  // namespace nbx::formats
