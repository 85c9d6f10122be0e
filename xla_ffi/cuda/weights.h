// The expert weights of the CUDA tables handlers (forward and backward) as
// the program addresses them: each expert's address per weight group (the
// pointer tables' contents), each group's first buffer, the biases, and
// abi.h's "weight views" checked against the buffers -- no CUDA calls.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <cuda.h>

#include "xla/ffi/api/ffi.h"

namespace nbx::cuda {

// A weight group's name in errors: experts.gate (dense), experts.gate.q /
// .scale / .zero (quantized), experts.gate_up / experts.down (fused).
std::string GroupName(int64_t p, int64_t G, bool fused);

// Checks abi.h's "weight views" against the weight buffers of the tables
// handler (H from x, I = `intermediate`): the views' length, gate and up
// sharing strides, quantized groups with the plain views only, every view
// inside each expert's array (`elems[g]` elements of its group g; the same
// bounds as the CPU decoder's, common/weights.cc).  Returns "" or what is wrong.
std::string CheckViews(xla::ffi::Span<const int64_t> views, int64_t H, int64_t I, bool fused,
                       bool quantized, const std::vector<int64_t>& elems);

// The weights' G groups of the tables handlers (`weights` from its start:
// G groups of 1 stacked or E per-expert buffers): each expert's address per
// group (addrs [G][E]), the elements of one expert's array per group (dense
// groups; 0 for quantized ones), each group's first buffer.
xla::ffi::Error CollectGroups(xla::ffi::RemainingArgs weights, int64_t E, int64_t G, bool stacked,
                              bool fused_gate_up, std::vector<int64_t>* addrs,
                              std::vector<int64_t>* elems, std::vector<CUdeviceptr>* first);

// The biases after the weight groups (`nbias` float32 buffers from index
// `at` of `weights`: [E, I], [E, I], [E, H]), appended to `extra`.
xla::ffi::Error CollectBiases(xla::ffi::RemainingArgs weights, int64_t at, int64_t nbias,
                              int64_t E, int64_t H, int64_t I, std::vector<CUdeviceptr>* extra);

}  // namespace nbx::cuda
