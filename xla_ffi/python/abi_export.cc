// Exports the contract of abi.h to Python as one dict (jax_nbx/contract.py reads it).
#include "python/abi_export.h"

#include <nanobind/stl/string.h>

#include "abi.h"
#include "formats/registry.h"

namespace nb = nanobind;

namespace nbx {
namespace {

template <size_t N>
nb::tuple Names(const char* const (&names)[N]) {
  nb::list l;
  for (const char* n : names) l.append(nb::str(n));
  return nb::tuple(l);
}

// The format registry (formats/registry.h), one dict per format in code
// order: name, code, summary, parts [{name, dtypes, rows, same_dtype_as}],
// values_per_byte, group_sizes, compute_dtype_part, tensor_scale,
// column_scaled, kernels (the backends whose kernels read it: "cpu", ...),
// partial_groups (whether K need not be a multiple of the group).
nb::list FormatTable() {
  nb::list out;
  for (const formats::FormatEntry& entry : formats::kFormats) {
    const formats::FormatSpec& f = *entry.spec;
    nb::dict d;
    d["name"] = f.name;
    d["code"] = static_cast<int32_t>(f.code);
    d["summary"] = f.summary;
    nb::list parts;
    for (int p = 0; p < f.num_parts; ++p) {
      const formats::PartSpec& ps = f.parts[p];
      nb::dict pd;
      pd["name"] = ps.name;
      nb::list dtypes;
      for (int b = 0; b < formats::kNumDTypeBits; ++b)
        if (ps.dtypes & (1u << b)) dtypes.append(nb::str(formats::kDTypeBitNames[b]));
      pd["dtypes"] = nb::tuple(dtypes);
      pd["rows"] = formats::kPartRowsNames[static_cast<int32_t>(ps.rows)];
      pd["same_dtype_as"] = ps.same_dtype_as;
      parts.append(pd);
    }
    d["parts"] = nb::tuple(parts);
    d["values_per_byte"] = f.values_per_byte;
    nb::list groups;
    for (int g = 0; g < f.num_group_sizes; ++g) groups.append(f.group_sizes[g]);
    d["group_sizes"] = nb::tuple(groups);
    d["compute_dtype_part"] = f.compute_dtype_part;
    d["tensor_scale"] = f.tensor_scale;
    d["column_scaled"] = f.column_scaled;
    nb::list kernels;
    for (int b = 0; b < formats::kNumKernelBits; ++b)
      if (f.kernels & (1u << b)) kernels.append(nb::str(formats::kKernelBitNames[b]));
    d["kernels"] = nb::tuple(kernels);
    d["partial_groups"] = f.partial_groups;
    out.append(d);
  }
  return out;
}

// Each target's attributes (abi.h NBX_TARGET_ATTRS): {target key: ((name, kind), ...)}.
nb::dict AttributeTable() {
  nb::dict d;
#define NBX_EXPORT_ATTR(kind, name) l.append(nb::make_tuple(#name, #kind));
#define NBX_EXPORT_TARGET(key, attrs) \
  {                                   \
    nb::list l;                       \
    attrs(NBX_EXPORT_ATTR)            \
    d[#key] = nb::tuple(l);           \
  }
  NBX_TARGET_ATTRS(NBX_EXPORT_TARGET)
#undef NBX_EXPORT_TARGET
#undef NBX_EXPORT_ATTR
  return d;
}

}  // namespace

nb::dict AbiDict() {
  using abi::ArgKind;
  nb::dict d;
  nb::dict targets;
  targets["forward"] = abi::kTargetForward;
  targets["backward"] = abi::kTargetBackward;
  targets["cuda_forward"] = abi::kTargetCudaForward;
  targets["cuda_forward_tables"] = abi::kTargetCudaForwardTables;
  targets["cuda_backward"] = abi::kTargetCudaBackward;
  targets["metal_forward"] = abi::kTargetMetalForward;
  targets["prepack"] = abi::kTargetPrepack;
  d["targets"] = targets;

  d["activations"] = Names(abi::kActivationNames);
  d["gelu_c"] = abi::kGeluC;
  d["gelu_b"] = abi::kGeluB;
  d["inv_sqrt2"] = abi::kInvSqrt2;
  d["clamped_swiglu_alpha"] = abi::kClampedSwiGLUAlpha;
  d["clamped_swiglu_limit"] = abi::kClampedSwiGLULimit;
  d["int8_block"] = abi::kInt8Block;

  d["weight_formats"] = Names(abi::kWeightFormatNames);
  d["projections"] = Names(abi::kProjectionNames);
  d["parts"] = Names(abi::kPartNames);
  d["formats"] = FormatTable();
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
  d["packed_header_words"] = abi::kPackedHeaderWords;
  d["packed_magic"] = abi::kPackedMagic;
  d["attributes"] = AttributeTable();
  return d;
}

}  // namespace nbx
