// What a weight format is, as data: its parts (the arrays a projection's
// weights are passed as), each part's element types and per-expert shape, the
// packing along K, the group rule, and a scalar reference dequantization.
// One FormatSpec per format lives in its own header (formats/<name>.h); the
// registry (formats/registry.h) lists them in code order.  Everything here is
// plain constexpr C++ (no XLA headers): the CPU decoder, the CUDA and Metal
// handlers and the exporter to Python (abi_export.cc) read the same table.
#pragma once

#include <cstdint>

#include "abi.h"

namespace nbx::formats {

// Element types a part may have, as a bit set (the exporter names them with
// numpy's names: float32, bfloat16, float16, int8, uint8).
enum DTypeBit : uint32_t {
  kF32 = 1u << 0,
  kBF16 = 1u << 1,
  kF16 = 1u << 2,
  kS8 = 1u << 3,
  kU8 = 1u << 4,
};
inline constexpr int kNumDTypeBits = 5;
inline constexpr const char* kDTypeBitNames[kNumDTypeBits] = {"float32", "bfloat16", "float16",
                                                              "int8", "uint8"};

// A part's leading axis against the projection's K (its input axis): one
// expert's part is [rows, N] ([N] for kNone), N the output axis.
enum class PartRows : int32_t {
  kK = 0,       // K rows (values unpacked)
  kPackedK = 1,  // K / values_per_byte rows (packed values)
  kGroups = 2,   // ceil(K / group) rows (one per group along K; FormatSpec::partial_groups)
  kNone = 3,     // no K axis: [N] (one per output column)
};
inline constexpr int32_t kNumPartRows = 4;
inline constexpr const char* kPartRowsNames[kNumPartRows] = {"K", "packed_K", "groups", "none"};

// The backends with kernels of their own (the "kernels" of a FormatSpec), as
// a bit set (the exporter names them: "cpu", "metal", "cuda").
enum KernelBit : uint32_t {
  kCpuKernels = 1u << 0,
  kMetalKernels = 1u << 1,
  kCudaKernels = 1u << 2,
};
inline constexpr int kNumKernelBits = 3;
inline constexpr const char* kKernelBitNames[kNumKernelBits] = {"cpu", "metal", "cuda"};
inline constexpr uint32_t kAllKernels = kCpuKernels | kMetalKernels | kCudaKernels;

struct PartSpec {
  const char* name;   // abi::kPartNames[i] for part i
  uint32_t dtypes;    // DTypeBit set
  PartRows rows;
  int32_t same_dtype_as;  // -1, or the part whose dtype this one must share
};

inline constexpr int kMaxGroupSizes = 4;

struct FormatSpec {
  abi::WeightFormat code;
  const char* name;     // abi.h's name for the code
  const char* summary;  // one line for errors and docs
  int32_t num_parts;    // parts 0..num_parts-1 of abi::kPartNames
  PartSpec parts[abi::kNumParts];
  int32_t values_per_byte;  // of part 0 along K (1: unpacked; 2: two 4-bit values per byte)
  // Group sizes along K the format takes (the `group_size` attribute);
  // num_group_sizes == 0: no groups (group_size is 0, a scale per column).
  int32_t num_group_sizes;
  int32_t group_sizes[kMaxGroupSizes];
  // The part whose dtype is the weights' compute type: the dense weights'
  // own, or the scales' for quantized formats (part index); -1: float32
  // (formats whose scales are not a float type, e.g. mxfp4's E8M0 bytes).
  int32_t compute_dtype_part;
  // Whether a matrix may carry a float32 tensor scale (one per expert and
  // projection, the handlers' "tensor_scales" buffers): its every weight is
  // the reference's value times it.  The kernels multiply each column's sum
  // by it once, as int8's column scales (nvfp4's second-level scale).
  bool tensor_scale = false;
  // The format's arithmetic: true, the sums of a * q, each column's sum times
  // its scale once (int8); false, each weight dequantized before its product.
  // Every kernel of every backend does the format's arithmetic.
  bool column_scaled = false;
  // The backends whose kernels read the format (KernelBit set); a handler
  // refuses the others by name, and so does Python before tracing
  // (jax_nbx.formats.Format.kernels).
  uint32_t kernels = kAllKernels;
  // Whether K need not be a multiple of the group: the last group then covers
  // the remaining K % group rows (its scale is of those rows alone), and the
  // per-group parts have ceil(K / group) rows -- as the format's producers
  // make block-scaled checkpoints of a dimension the block does not divide.
  // false: K must be a multiple of the group (the handlers and Python refuse
  // any other K, naming the format).
  bool partial_groups = false;
};

// One expert's parts as the scalar reference reads them: each part's base
// address and its element type (one DTypeBit), N (columns) and the group.
struct PartsView {
  const void* part[abi::kNumParts];
  DTypeBit dtype[abi::kNumParts];
  int64_t N;
  int64_t group;
};

// Element i of a part as float32 (float types widened exactly; integers as
// their value).
float PartValue(const PartsView& v, int part, int64_t i);

}  // namespace nbx::formats
