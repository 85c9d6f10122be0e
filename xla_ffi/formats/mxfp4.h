// mxfp4 (OCP Microscaling Formats v1.0, MXFP4): E2M1 values in blocks of 32
// along K, each block scaled by one E8M0 power of two.  q uint8 [K/2, N]: two
// 4-bit codes per byte along K, the even row in the low nibble (packed[j, n] =
// code[2j, n] | code[2j+1, n] << 4), as gpt-oss's checkpoints
// (transformers integrations/mxfp4.py, _convert_moe_packed_tensors) and MLX's
// mx.quantize(mode="mxfp4") store them (there along the rows of an [N, K]
// matrix; the loaders transpose).  scale uint8 [ceil(K/32), N], E8M0 bits
// (bias 127; 255 is NaN): W[k, n] = E2M1(code[k, n]) * 2^(scale[k/32, n] - 127).
// Partial blocks: K (even) need not be a multiple of 32, the last block
// covering K % 32 rows, as the MX reference emulation (microsoft/microxcaling,
// zero-padded blocks) and OpenAI's triton_kernels downcast_to_mxfp_torch
// (what transformers' gpt-oss integration quantizes with: ceil(K/32) scales)
// make them; MLX's mx.quantize refuses such K, producing whole blocks only.
#pragma once

#include <cstdint>

#include "formats/format.h"
#include "formats/minifloat.h"

namespace nbx::formats {

inline constexpr FormatSpec kMxfp4Spec = {
    abi::WeightFormat::kMxfp4, "mxfp4",
    "OCP MXFP4: E2M1 codes packed two per byte along K (low nibble = even row), one E8M0 "
    "scale byte per 32 rows of K",
    2,
    {{"q", kU8, PartRows::kPackedK, -1}, {"scale", kU8, PartRows::kGroups, -1}, {}},
    2,
    1, {32},
    -1,
    /*tensor_scale=*/false,
    /*column_scaled=*/false,
    kAllKernels,
    /*partial_groups=*/true,
};

// The code's value times the block's scale: one exact product (a power of two
// times a value of at most three significant bits).
inline float Mxfp4Reference(const PartsView& v, int64_t k, int64_t n) {
  const uint8_t byte = static_cast<const uint8_t*>(v.part[0])[(k / 2) * v.N + n];
  const uint8_t s = static_cast<const uint8_t*>(v.part[1])[(k / v.group) * v.N + n];
  return kE2M1Values[k % 2 ? byte >> 4 : byte & 15] * E8M0Value(s);
}

}  // namespace nbx::formats
