// The CPU forward's workspace: one band's (or expert-major group's) plan,
// packed panels and per-worker scratch, laid out once (CarveBand) both to
// size the allocation -- and the Python plan, through
// ForwardWorkspaceBytes -- and to carve it (moe_forward.cc).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu/kernels/kernel_table.h"
#include "common/slots.h"

namespace nbx {
namespace cpu_forward {

// Experts with at most this many rows in a band (and at most MR: one
// m-panel) stream their weights; kMaxStreamCols columns per streamed item.
constexpr int64_t kStreamRows = kMaxStreamRows;
constexpr int64_t kStreamCols = kMaxStreamCols;

// A worker's scratch, sized to the problem's H and I (never more than they
// can use, and the same for every band of a call, so the part of the
// workspace that does not shrink with the band stays fixed), in floats:
//   [0, part_offset)   one packed K-block of a weight tile (GEMM1: gate||up,
//                      GEMM2: down; the larger of the two)
//   [part_offset, ..)  the partial sums of one chunk's panels over the tile,
//                      needed only when K spans more than one K-block; the
//                      streaming accumulators use the scratch from 0
//   the last columns   a tile's int8 column scales (RunGemm)
struct ScratchLayout {
  int64_t part_offset;
  int64_t raw_offset;  // GEMM1's streamed sums before the gated unit (2 * rows * cols)
  int64_t dot_a_offset;  // precision="bfloat16", A not in place (RunGemm): a chunk's m-panels of one K-block as pairs
  int64_t stride;  // whole pages (1024 floats): workers' blocks keep one alignment
};

ScratchLayout LayOutScratch(int64_t H, int64_t I, const KernelTable& kt, bool dot);

struct Band {
  SlotPlan plan;          // slot order (slots.h); slot_row is the combine's map
  int32_t* row_token;     // [P] token of each padded row, -1 for padding
  float* row_weight;      // [P] routed weight of each padded row, 0 for padding
  int64_t* total;         // [E] expert-major groups: slots per expert in the call
  Chunks chunks;          // [C] work items
  float* XO;              // [P/MR][H][MR] packed x; later O [P][H]
  float* A2;              // [P/MR][I][MR] packed activations
  float* LR;              // [P][R] LoRA adapters: each row's rank projections (forward_lora.h)
  float* scratch;         // [workers][scratch_layout.stride]
  ScratchLayout scratch_layout;
};

// Lays a band of S slots out from `base`; returns the bytes it takes.  With
// base == nullptr it only measures: the one layout both sizes the
// allocation (and the Python plan) and carves it.  R: the LoRA adapters'
// ranks summed (0: none).
size_t CarveBand(void* base, int64_t S, int64_t E, int64_t H, int64_t I, int workers,
                 const KernelTable& kt, bool dot, int64_t R, Band* b);
size_t BandBytes(int64_t S, int64_t E, int64_t H, int64_t I, int workers, const KernelTable& kt,
                 bool dot, int64_t R);

}  // namespace cpu_forward
}  // namespace nbx
