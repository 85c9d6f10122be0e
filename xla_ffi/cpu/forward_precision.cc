// The arithmetic a CPU forward call asks for (precision=): what each takes,
// refused by name, and the bfloat16 dot kernels in use (moe_forward.h).
#include <string>

#include "cpu/moe_forward.h"

namespace ffi = xla::ffi;

namespace nbx {

ffi::Error ForwardDotKernels(const ExpertWeights& w, const KernelTable& kt,
                             const DotKernelTable** dot) {
  if (w.quantized() || w.dtype != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument(
        "precision='bfloat16' needs dense bfloat16 weights; these are " +
        std::string(w.quantized() ? "quantized" : "not bfloat16"));
  if (w.sn[0] != 1 || w.sn[2] != 1)
    return ffi::Error::InvalidArgument(
        "precision='bfloat16' reads weights stored by rows (layout 'in_out', gate and up "
        "not interleaved); these are stored with column stride " +
        std::to_string(w.sn[0] != 1 ? w.sn[0] : w.sn[2]));
  *dot = ActiveDotKernels(kt);
  if (*dot == nullptr || (*dot)->kc != kt.kc)
    return ffi::Error::Internal(std::string("no bfloat16 dot kernels for the ") + kt.isa +
                                " packed kernels' blocking");
  return ffi::Error::Success();
}

ffi::Error ForwardPrecision(const ForwardAttrs& a, const ExpertWeights& w, const KernelTable& kt,
                            const DotKernelTable** dot) {
  *dot = nullptr;
  if (a.int8_dot) {
    if (!NoLora(a.lora))
      return ffi::Error::InvalidArgument(
          "LoRA adapters in the CPU handler run in float32 or bfloat16 arithmetic, not "
          "precision='int8'");
    if (a.bf16_dot)
      return ffi::Error::InvalidArgument("precision is either 'int8' or 'bfloat16', not both");
    if (w.format != abi::WeightFormat::kInt8 && w.format != abi::WeightFormat::kInt4)
      return ffi::Error::InvalidArgument(
          std::string("precision='int8' takes int8 or int4 experts; these are ") +
          abi::kWeightFormatNames[static_cast<int>(w.format)]);
    for (const QuantMatrix& m : w.quant)
      if (w.format == abi::WeightFormat::kInt4 && m.group % abi::kInt8Block != 0)
        return ffi::Error::InvalidArgument(
            "precision='int8' takes int4 group sizes that are multiples of " +
            std::to_string(abi::kInt8Block) + "; got " + std::to_string(m.group));
  }
  if (a.bf16_dot) return ForwardDotKernels(w, kt, dot);
  return ffi::Error::Success();
}

}  // namespace nbx
