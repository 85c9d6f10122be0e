// fp8: E4M3 ("fn") values, one byte per weight, each group of rows along K
// scaled by a float32 or bfloat16 scale per output column.  q uint8 [K, N]
// (float8_e4m3fn bits), scale [ceil(K/group), N]: W[k, n] = E4M3(q[k, n]) *
// scale[k/group, n].  The checkpoints' layouts map onto it exactly:
// DeepSeek-V3's and Qwen3's "-FP8" 128x128 blocks (`weight_scale_inv`, one
// float32 per block; transformers integrations/finegrained_fp8.py) repeat each
// block's scale over its 128 columns, and compressed-tensors' per-channel
// scales repeat over the groups of K (jax_nbx/loaders).  Partial groups: K
// need not be a multiple of the group, the last group covering K % group rows
// -- the producers size the block-scale grid by a ceiling division
// (DeepSeek-V3 inference/kernel.py weight_dequant, vLLM's block FP8,
// compressed-tensors' block strategy pads the last block).
#pragma once

#include <cstdint>

#include "formats/format.h"
#include "formats/minifloat.h"

namespace nbx::formats {

inline constexpr FormatSpec kFp8Spec = {
    abi::WeightFormat::kFp8, "fp8",
    "FP8 E4M3 codes [K, N] (one byte per weight), a float32/bfloat16 scale per group of "
    "rows of K and output column",
    2,
    {{"q", kU8, PartRows::kK, -1}, {"scale", kF32 | kBF16, PartRows::kGroups, -1}, {}},
    1,
    3, {32, 64, 128},
    1,
    /*tensor_scale=*/false,
    /*column_scaled=*/false,
    kAllKernels,
    /*partial_groups=*/true,
};

// E4M3(q) * scale, one float32 product.
inline float Fp8Reference(const PartsView& v, int64_t k, int64_t n) {
  const uint8_t q = static_cast<const uint8_t*>(v.part[0])[k * v.N + n];
  return E4M3Value(q) * PartValue(v, 1, (k / v.group) * v.N + n);
}

}  // namespace nbx::formats
