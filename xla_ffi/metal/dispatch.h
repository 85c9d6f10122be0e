// A compute dispatch described as data, so that one description serves both
// devices: Metal encodes it (apple_device.mm: the pipeline of `kernel`,
// setBuffer:offset:atIndex: / setBytes:length:atIndex: in argument order,
// threadgroup memory at index 0, dispatchThreadgroups), and the simulated
// device runs the same kernel's MSL source through the emulation
// (emulated_kernels.cc), resolving every buffer argument through the
// residency it checks.  Kernel names and parameter blocks: kernels/*.metal
// and kernels/params.h; the host side that fills them: kernel_calls.h.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "metal/device.h"

namespace nbx::metal {

// [[buffer(i)]] of a kernel: a buffer from `offset` on (setBuffer), or a
// parameter block copied into the command (setBytes: `bytes` not empty).
struct Arg {
  Buffer buffer;
  int64_t offset = 0;
  std::vector<unsigned char> bytes;
};

inline Arg BufferArg(const Buffer& b, int64_t offset = 0) { return Arg{b, offset, {}}; }
template <typename P>
Arg BytesArg(const P& params) {
  Arg a;
  a.bytes.resize(sizeof(P));
  std::memcpy(a.bytes.data(), &params, sizeof(P));
  return a;
}

struct Dispatch {
  std::string kernel;                  // the kernel function's name in the library
  uint32_t grid[3] = {1, 1, 1};        // threadgroups
  uint32_t threads = 128;              // threads per threadgroup (a multiple of 32)
  int64_t threadgroup_bytes = 0;       // threadgroup memory at index 0
  std::vector<Arg> args;               // in [[buffer(i)]] order
};

}  // namespace nbx::metal
