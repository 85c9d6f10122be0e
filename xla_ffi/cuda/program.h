// The decoder of the CUDA handler's launch program and kernel table.
//
// Pure C++17 (no CUDA headers), so it is compiled in every build and tested
// from Python without a GPU (tests/native/program_tests.cc binds it as
// `_ffi.decode_program`).  The encoding is abi.h's: per launch
// [kernel, gx, gy, gz, nargs] then nargs x [kind, index, offset], built by
// jax_nbx/backends/cuda/plan.py (`Program.encode`); the kernel table holds
// abi::kNumKernelFields int64 per compiled kernel (jax_nbx/backends/cuda/compile.py
// `pack`).  xla_ffi/cuda/runner.cc decodes a call's program and table
// completely before it launches anything, so a malformed program launches
// nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "abi.h"

namespace nbx {

// One argument of a launch: an input's, an output's (`index`) or the
// workspace's address plus `offset` bytes, a weight group's pointer table (`index`), or
// the int32 value `offset` (kI32).
struct ArgRef {
  abi::ArgKind kind;
  int64_t index;
  int64_t offset;
};

struct LaunchRef {
  int64_t kernel;   // row of the kernel table
  int64_t grid[3];  // gx, gy, gz (a zero means the launch is skipped)
  std::vector<ArgRef> args;
};

// Decodes `program` (`size` int64 words) into `out`.  Returns "" or what is
// wrong: a truncated header or argument list, a kernel index outside
// [0, n_kernels), a negative argument count, an unknown argument kind, an
// input index outside [0, n_inputs), a table index outside [0, n_tables), an
// output index outside [0, n_outputs) (the forward has y; the backward dx,
// d(topk_weights) and with biases their gradients: abi::kOutputDx, ...), a workspace offset
// outside [0, workspace_bytes).
inline std::string DecodeProgram(const int64_t* program, size_t size, int64_t n_kernels,
                                 int64_t n_inputs, int64_t n_tables, int64_t workspace_bytes,
                                 std::vector<LaunchRef>* out, int64_t n_outputs = 1) {
  out->clear();
  size_t pc = 0;
  for (int64_t launch = 0; pc < size; ++launch) {
    // the launch, for error messages (built only on an error)
    const auto where = [launch, start = pc] {
      return "launch " + std::to_string(launch) + " (word " + std::to_string(start) + ")";
    };
    if (size - pc < static_cast<size_t>(abi::kLaunchHeader))
      return "truncated launch program: " + where() + " has " + std::to_string(size - pc) +
             " of its " + std::to_string(abi::kLaunchHeader) + " header words";
    LaunchRef ln;
    ln.kernel = program[pc];
    ln.grid[0] = program[pc + 1];
    ln.grid[1] = program[pc + 2];
    ln.grid[2] = program[pc + 3];
    const int64_t nargs = program[pc + 4];
    pc += abi::kLaunchHeader;
    if (ln.kernel < 0 || ln.kernel >= n_kernels)
      return "malformed launch program: " + where() + " names kernel " + std::to_string(ln.kernel) +
             "; the kernel table has " + std::to_string(n_kernels);
    if (nargs < 0)
      return "malformed launch program: " + where() + " has a negative argument count (" +
             std::to_string(nargs) + ")";
    if (static_cast<uint64_t>(nargs) > (size - pc) / abi::kArgFields)
      return "truncated launch program: " + where() + " has " + std::to_string(nargs) +
             " arguments but only " + std::to_string(size - pc) + " words follow its header";
    ln.args.reserve(static_cast<size_t>(nargs));
    for (int64_t a = 0; a < nargs; ++a, pc += abi::kArgFields) {
      const int64_t kind = program[pc], index = program[pc + 1], offset = program[pc + 2];
      const auto arg = [&where, a] { return where() + " argument " + std::to_string(a); };
      if (kind < 0 || kind >= abi::kNumArgKinds)
        return "unknown argument kind " + std::to_string(kind) + " in " + arg();
      const auto k = static_cast<abi::ArgKind>(kind);
      if (k == abi::ArgKind::kInput && (index < 0 || index >= n_inputs))
        return "bad input index " + std::to_string(index) + " in " + arg() + " (the call has " +
               std::to_string(n_inputs) + " inputs)";
      if (k == abi::ArgKind::kOutput && (index < 0 || index >= n_outputs))
        return "bad output index " + std::to_string(index) + " in " + arg() + " (the call has " +
               std::to_string(n_outputs) + " outputs the program addresses)";
      if (k == abi::ArgKind::kTable && (index < 0 || index >= n_tables))
        return "bad table index " + std::to_string(index) + " in " + arg() + " (the call has " +
               std::to_string(n_tables) + " pointer tables)";
      if (k == abi::ArgKind::kWorkspace && (offset < 0 || offset >= workspace_bytes))
        return "workspace offset " + std::to_string(offset) + " in " + arg() +
               " is outside the workspace of " + std::to_string(workspace_bytes) + " bytes";
      ln.args.push_back(ArgRef{k, index, offset});
    }
    out->push_back(std::move(ln));
  }
  return "";
}

// One kernel of the table (fields in abi::kKernelFieldNames order): its name
// and cubin as [offset, offset + length) of the byte blob, launch options,
// and a content hash (the handler's module-cache key).
struct KernelRow {
  int64_t name_off, name_len, cubin_off, cubin_len, num_warps, shared, hash;
};
static_assert(sizeof(KernelRow) == abi::kNumKernelFields * sizeof(int64_t),
              "KernelRow has one member per abi::kKernelFieldNames entry");

// Decodes the kernel table (`size` int64 words, abi::kNumKernelFields per
// kernel) into `out`, checking that every name and cubin lies inside the blob
// of `blob_size` bytes.  Returns "" or what is wrong.
inline std::string DecodeKernelTable(const int64_t* table, size_t size, size_t blob_size,
                                     std::vector<KernelRow>* out) {
  out->clear();
  if (size % abi::kNumKernelFields != 0)
    return "kernel table has " + std::to_string(size) + " entries; expected a multiple of " +
           std::to_string(abi::kNumKernelFields);
  const int64_t blob = static_cast<int64_t>(blob_size);
  auto inside = [blob](int64_t off, int64_t len) {
    return off >= 0 && len >= 0 && off <= blob && len <= blob - off;
  };
  for (size_t i = 0; i < size; i += abi::kNumKernelFields) {
    const int64_t* f = table + i;
    const KernelRow r{f[0], f[1], f[2], f[3], f[4], f[5], f[6]};
    if (!inside(r.name_off, r.name_len) || !inside(r.cubin_off, r.cubin_len))
      return "kernel table points outside the cubin blob (kernel " +
             std::to_string(i / abi::kNumKernelFields) + ", blob of " + std::to_string(blob_size) +
             " bytes)";
    out->push_back(r);
  }
  return "";
}

}  // namespace nbx
