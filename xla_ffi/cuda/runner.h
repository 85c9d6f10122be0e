// Runs one call's launch program of Triton kernels compiled ahead of time
// (jax_nbx/backends/cuda/plan.py builds the program, jax_nbx/backends/cuda/compile.py the
// cubins) on XLA's stream: what every CUDA handler ends in (handlers.cc).
#pragma once

#include <cstdint>
#include <vector>

#include <cuda.h>
#include <cuda_runtime_api.h>  // cudaStream_t (XLA's stream type); no runtime calls

#include "xla/ffi/api/ffi.h"

namespace nbx::cuda {

// The program and how to run it: the attributes every CUDA handler takes
// (abi.h NBX_ATTRS_CUDA_PROGRAM; jax_nbx/backends/cuda/calls.py _program_attrs).
struct ProgramAttrs {
  xla::ffi::Span<const uint8_t> blob;     // the kernels' names and cubins
  xla::ffi::Span<const int64_t> kernels;  // the kernel table (cuda/program.h)
  xla::ffi::Span<const int64_t> program;  // the launches (cuda/program.h)
  int64_t workspace_bytes;
  int64_t err_offset, err_words;  // the expert-id check's words in the workspace
  bool w_aligned;                 // kernels compiled for 16-byte aligned expert arrays
  int64_t num_experts;            // E
  int64_t check_ids;              // abi::kIdCheck*
  bool graph;                     // launch as one CUDA graph (graphs.h)
};

// This call's buffers as the program addresses them.
struct ProgramCall {
  cudaStream_t stream;
  int32_t ordinal;
  xla::ffi::AnyBuffer x;                    // [T, H]: input abi::kInputX
  xla::ffi::AnyBuffer w;                    // topk_weights: abi::kInputW
  xla::ffi::Buffer<xla::ffi::S32> ids;      // topk_ids [T, k]: abi::kInputIds
  xla::ffi::AnyBuffer workspace;            // the workspace result (XLA's pool)
  int64_t groups;                           // G weight groups
  bool fused;                               // the groups are gate_up, down (errors' names)
  // Pointer tables [n_tables][E] of absolute addresses: the G weight groups
  // in abi.h's order, abi::GroupIndex(part, projection), or gate_up, down
  // when `fused`; the backward's then its G gradient groups.
  std::vector<int64_t> addrs;
  int64_t n_tables;
  // Each group's first buffer (the program's typed weight arguments are
  // inputs abi::kInputGroup0 + group), then the biases if any (inputs
  // abi::kInputGroup0 + G + j), then the backward's dy.
  std::vector<CUdeviceptr> extra;
  // The addresses the program's kOutput arguments index (y; or dx,
  // d(topk_weights), the bias gradients).
  std::vector<CUdeviceptr> outputs;
};

// Per call: decode and check the program and the kernel table (cuda/
// program.h) before anything is reserved, uploaded or launched; reserve the
// workspace in the account ("cuda:N", tag "workspace"); look up the weights'
// pointer tables (tables.h) and upload the backward's gradient tables into
// the workspace; load each cubin once per device (cubins.h); launch every
// kernel in order, checking each driver call (or as one graph, graphs.h);
// then the expert-id check (id_checks.h), failing the call naming the slot
// and the id when there is one.
xla::ffi::Error RunProgram(const ProgramCall& call, const ProgramAttrs& attrs);

}  // namespace nbx::cuda
