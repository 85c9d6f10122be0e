// The Metal kernels (xla_ffi/metal/kernels/*.metal) run on the simulated
// device through the MSL emulation (msl_emulation.h): their arithmetic and
// indexing are tested on Linux; on Apple the same source is compiled by Metal.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "metal/device.h"

namespace nbx::metal {

// nbx_moe_gemm's arguments (moe_gemm.metal): P padded rows (a multiple of
// 32) ordered by expert, tiles of 32 rows.
struct MoeGemmArgs {
  const float* a;              // [*, lda] x (mode 0) or activations (mode 1)
  const int32_t* row_src;      // [P] row of a, -1 for padding
  const int32_t* tile_expert;  // [P / 32] expert of each row tile, -1: padding only
  const uint64_t* table;       // [3][E] GPU addresses (gate, up, down)
  const float* row_weight;     // [P] routed weights (mode 1)
  float* out;                  // [P, N]
  uint32_t K, N, E, mode, act, lda;
  int64_t P;
};

// One command buffer on the simulated device, `resources` resident (the
// pins of the table's weights), running nbx_moe_gemm over its grid.  False
// when the kernel read through an address no resident pin covers (the
// device's violations say which).  `drop_barrier`: the same source compiled
// without its first barrier (tests: the emulation must show the race).
bool LaunchMoeGemm(const MoeGemmArgs& g, const std::vector<Buffer>& resources, bool drop_barrier,
                   std::string* error);

// The slot ordering (moe_order.metal) on the simulated device: count per
// expert, padded offsets (off [E + 1]), then row_slot [off[E]] (-1 for
// padding) and slot_row [S] (the caller sets it to -1 first: slots whose id
// is outside [0, E) keep it).  row_slot must hold MaxPaddedRows(S, E, pad).
bool LaunchOrderSlots(const int32_t* ids, int64_t S, int64_t E, int64_t pad, int32_t* count,
                      int32_t* off, int32_t* row_slot, int32_t* slot_row, std::string* error);

}  // namespace nbx::metal
