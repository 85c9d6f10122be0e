// The weight-format registry: every format of abi.h's NBX_WEIGHT_FORMATS, its
// spec (formats/<name>.h) and scalar reference, by code, made from that list.
// Adding a format: its line in abi.h's list, its header (spec + reference)
// included here, then its kernels -- the spec says which backends have them
// (FormatSpec::kernels); a kernel dispatch over WeightFormat names each code,
// and the compiler (-Wswitch) finds the ones a new code misses.
#pragma once

#include <cstdint>

#include "abi.h"
#include "formats/dense.h"
#include "formats/format.h"
#include "formats/fp8.h"
#include "formats/int4.h"
#include "formats/int8.h"
#include "formats/mxfp4.h"
#include "formats/mxfp8.h"
#include "formats/nvfp4.h"

namespace nbx::formats {

using ReferenceFn = float (*)(const PartsView&, int64_t k, int64_t n);

struct FormatEntry {
  const FormatSpec* spec;
  ReferenceFn reference;
};

// In code order (checked below).
#define NBX_FORMAT_ENTRY(e, code, name, stem) {&k##stem##Spec, &stem##Reference},
inline constexpr FormatEntry kFormats[abi::kNumWeightFormats] = {NBX_WEIGHT_FORMATS(NBX_FORMAT_ENTRY)};
#undef NBX_FORMAT_ENTRY

constexpr bool CodesInOrder() {
  for (int32_t i = 0; i < abi::kNumWeightFormats; ++i)
    if (static_cast<int32_t>(kFormats[i].spec->code) != i) return false;
  return true;
}
static_assert(CodesInOrder(), "kFormats must list every format in abi.h's code order");

// Whether a spec's name is abi.h's for its code.
constexpr bool SameName(const char* a, const char* b) {
  return *a == *b && (*a == '\0' || SameName(a + 1, b + 1));
}
constexpr bool NamesMatch() {
  for (int32_t i = 0; i < abi::kNumWeightFormats; ++i)
    if (!SameName(kFormats[i].spec->name, abi::kWeightFormatNames[i])) return false;
  return true;
}
static_assert(NamesMatch(), "each format's spec must carry abi.h's name for its code");


// The entry of a code, or nullptr for a code the registry does not know
// (callers refuse it by name: "unknown weight format code N").
inline const FormatEntry* FindFormat(int32_t code) {
  return code >= 0 && code < abi::kNumWeightFormats ? &kFormats[code] : nullptr;
}
inline const FormatSpec& SpecOf(abi::WeightFormat f) { return *FindFormat(static_cast<int32_t>(f))->spec; }

// Whether `backend` (a KernelBit) has kernels for format f.
inline bool HasKernels(abi::WeightFormat f, KernelBit backend) {
  return (SpecOf(f).kernels & backend) != 0;
}

// Whether `group` is one of the format's group sizes (0 for formats without groups).
inline bool GroupSizeOk(const FormatSpec& s, int64_t group) {
  if (s.num_group_sizes == 0) return group == 0;
  for (int i = 0; i < s.num_group_sizes; ++i)
    if (s.group_sizes[i] == group) return true;
  return false;
}

// Whether a projection's K fits the format's group: a multiple of it, or any
// K for formats with partial groups (FormatSpec::partial_groups); group 0 (no
// groups) takes any K.  (Packing, K a multiple of values_per_byte, is checked
// on its own.)
inline bool GroupFitsK(const FormatSpec& s, int64_t group, int64_t K) {
  return group <= 0 || K % group == 0 || s.partial_groups;
}

// Rows of a part of one expert's [K, N] projection ([N]: -1); groups: one per
// started group, ceil(K / group) (K / group when the group divides K).
inline int64_t PartRowCount(const FormatSpec& s, int part, int64_t K, int64_t group) {
  switch (s.parts[part].rows) {
    case PartRows::kK: return K;
    case PartRows::kPackedK: return K / s.values_per_byte;
    case PartRows::kGroups: return group > 0 ? (K + group - 1) / group : 0;
    case PartRows::kNone: return -1;
  }
  return -1;
}

}  // namespace nbx::formats
