// The Metal kernels (xla_ffi/metal/kernels/*.metal) run on the simulated
// device through the MSL emulation (msl_emulation.h): their arithmetic and
// indexing are tested on Linux; on Apple the same source is compiled by Metal
// and the same dispatches (dispatch.h) are encoded by apple_device.mm.
// Test-only, with the simulated device: built into jax_nbx._ffi_testing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "metal/dispatch.h"
#include "metal/kernel_calls.h"

namespace nbx::metal {

class SimDevice;

// Whether the emulated library has d.kernel and d's arguments fit its
// parameters (how many, which are buffers and which parameter blocks of
// which size), its threadgroup size is a positive multiple of 32 (at most
// 1024) and its grid is not empty: what Metal checks when it encodes.
bool CheckEmulated(const Dispatch& d, std::string* error);

// Runs d on the simulated device (inside one of its command buffers): every
// buffer argument is resolved through the device, which checks that it is
// live and resident; the kernel's threadgroups run one after another, the
// threads of each concurrently.  False (and why) when an argument or an
// address the kernel took from a table is not live and resident.
bool RunEmulated(SimDevice& sim, const Dispatch& d, std::string* error);

// The kernels the emulated library holds (their names), tests' variants
// included (a suffix "__drop_barrier": nbx_moe_gemm_f32 compiled without its
// first barrier, to show that the emulation catches the race).
std::vector<std::string> EmulatedKernelNames();

// prelude.metal's nbx_erf (Metal has no erf) compiled through the emulation (tests).
float EmulatedErf(float x);

// weights.metal's element decoders through the emulation (tests): kind 'f'
// nbx_e2m1, '8' nbx_e4m3, 's' nbx_e8m0 of `code`.
float EmulatedMinifloat(char kind, uint32_t code);

// One expert's [K][N] matrix as weights.metal's reader of `w` decodes it
// (tests, against formats/<name>.h's scalar reference): the parts (q, scale,
// zero as the format has them) are host arrays read in place, and every
// extent the reader asks the pins for must lie inside its part.  `out`: K*N
// floats.  False (and why) for a (format, type) with no reader or an extent
// outside its part.
struct HostPart {
  const void* data;
  int64_t bytes;
};
bool EmulatedWeights(WeightKind w, const std::vector<HostPart>& parts, uint32_t K, uint32_t N,
                     uint32_t group, float* out, std::string* error);

}  // namespace nbx::metal
