// Exports the contract of abi.h to Python as one dict (jax_nbx/_abi.py reads it).
#include "abi_export.h"

#include <nanobind/stl/string.h>

#include "abi.h"

namespace nb = nanobind;

namespace nbx {
namespace {

template <size_t N>
nb::tuple Names(const char* const (&names)[N]) {
  nb::list l;
  for (const char* n : names) l.append(nb::str(n));
  return nb::tuple(l);
}

}  // namespace

nb::dict AbiDict() {
  using abi::ArgKind;
  using abi::WeightFormat;
  nb::dict d;
  nb::dict targets;
  targets["forward"] = abi::kTargetForward;
  targets["backward"] = abi::kTargetBackward;
  targets["cuda_forward"] = abi::kTargetCudaForward;
  targets["cuda_forward_tables"] = abi::kTargetCudaForwardTables;
  targets["cuda_backward"] = abi::kTargetCudaBackward;
  targets["metal_forward"] = abi::kTargetMetalForward;
  targets["forward_poisoned"] = abi::kTargetForwardPoisoned;
  targets["backward_poisoned"] = abi::kTargetBackwardPoisoned;
  d["targets"] = targets;

  d["activations"] = Names(abi::kActivationNames);
  d["gelu_c"] = abi::kGeluC;
  d["gelu_b"] = abi::kGeluB;
  d["inv_sqrt2"] = abi::kInvSqrt2;
  d["clamped_swiglu_alpha"] = abi::kClampedSwiGLUAlpha;
  d["clamped_swiglu_limit"] = abi::kClampedSwiGLULimit;

  d["weight_formats"] = Names(abi::kWeightFormatNames);
  d["projections"] = Names(abi::kProjectionNames);
  d["parts"] = Names(abi::kPartNames);
  nb::list parts_of;
  for (int32_t f = 0; f < abi::kNumWeightFormats; ++f)
    parts_of.append(abi::PartsOf(static_cast<WeightFormat>(f)));
  d["parts_of_format"] = nb::tuple(parts_of);
  d["view_fields"] = Names(abi::kViewFieldNames);
  d["num_biases"] = abi::kNumBiases;

  nb::dict kinds;
  kinds["input"] = static_cast<int64_t>(ArgKind::kInput);
  kinds["output"] = static_cast<int64_t>(ArgKind::kOutput);
  kinds["workspace"] = static_cast<int64_t>(ArgKind::kWorkspace);
  kinds["table"] = static_cast<int64_t>(ArgKind::kTable);
  kinds["i32"] = static_cast<int64_t>(ArgKind::kI32);
  d["arg_kinds"] = kinds;
  d["launch_header"] = abi::kLaunchHeader;
  d["arg_fields"] = abi::kArgFields;
  nb::dict inputs;
  inputs["x"] = abi::kInputX;
  inputs["w"] = abi::kInputW;
  inputs["ids"] = abi::kInputIds;
  inputs["group0"] = abi::kInputGroup0;
  d["inputs"] = inputs;
  nb::dict outputs;
  outputs["dx"] = abi::kOutputDx;
  outputs["dtopk_weights"] = abi::kOutputDTopkWeights;
  outputs["dbias0"] = abi::kOutputDBias0;
  d["backward_outputs"] = outputs;
  d["kernel_fields"] = Names(abi::kKernelFieldNames);
  d["err_none"] = abi::kErrNone;
  d["id_check_modes"] = nb::make_tuple(abi::kIdCheckOff, abi::kIdCheckSync, abi::kIdCheckDeferred);
  d["max_deferred_err_words"] = abi::kMaxDeferredErrWords;
  d["workspace_align"] = abi::kWorkspaceAlign;
  d["max_slots"] = abi::kMaxSlots;
  return d;
}

}  // namespace nbx
