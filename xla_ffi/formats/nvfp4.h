// nvfp4 (NVIDIA's NVFP4): E2M1 values in blocks of 16 along K, each block
// scaled by one E4M3 ("fn") scale.  q uint8 [K/2, N]: two 4-bit codes per
// byte along K, the even row in the low nibble (mxfp4's order, and MLX's
// mx.quantize(mode="nvfp4")); scale uint8 [K/16, N] (float8_e4m3fn bits):
// W[k, n] = E2M1(code[k, n]) * E4M3(scale[k/16, n]), times the matrix's
// optional float32 tensor scale (FormatSpec::tensor_scale: ModelOpt's
// `weight_scale_2`, 1 / compressed-tensors' `weight_global_scale`), which the
// kernels apply to each column's sum.
#pragma once

#include <cstdint>

#include "formats/format.h"
#include "formats/minifloat.h"

namespace nbx::formats {

inline constexpr FormatSpec kNvfp4Spec = {
    abi::WeightFormat::kNvfp4, "nvfp4",
    "NVFP4: E2M1 codes packed two per byte along K (low nibble = even row), one E4M3 scale "
    "byte per 16 rows of K",
    2,
    {{"q", kU8, PartRows::kPackedK, -1}, {"scale", kU8, PartRows::kGroups, -1}, {}},
    2,
    1, {16},
    -1,
    /*tensor_scale=*/true,
};

// E2M1(code) * E4M3(s): exact (two and four significant bits; the product's
// exponent stays inside float32's normal range).
inline float Nvfp4Reference(const PartsView& v, int64_t k, int64_t n) {
  const uint8_t byte = static_cast<const uint8_t*>(v.part[0])[(k / 2) * v.N + n];
  const uint8_t s = static_cast<const uint8_t*>(v.part[1])[(k / v.group) * v.N + n];
  return kE2M1Values[k % 2 ? byte >> 4 : byte & 15] * E4M3Value(s);
}

}  // namespace nbx::formats
