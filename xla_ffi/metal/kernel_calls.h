// The host side of the Metal kernels: the dispatches (dispatch.h) of each
// kernel in kernels/*.metal, with their grids, threadgroup sizes and memory,
// and parameter blocks (kernels/params.h).  Device-agnostic: the Metal
// handler and the tests build their command buffers from these, and either
// device runs them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "abi.h"
#include "metal/dispatch.h"
#include "metal/kernels/params.h"

namespace nbx::metal {

// A place in a buffer: the argument a kernel reads or writes from.
struct View {
  Buffer buffer;
  int64_t offset = 0;
};

// An element type of the weights: of dense weights, or of a quantized
// format's float scales (formats/<name>.h's compute_dtype_part).
enum class WeightType { kF32, kF16, kBF16 };

// The weights' kernel variant (kernels/weights.metal's readers): the format,
// and the type of its compute part (none for formats whose scales are bytes:
// mxfp4, mxfp8, nvfp4).  Kernel names: <base>_f32 / _f16 / _bf16 (dense),
// <base>_<format>_f32 / _bf16 (int8, int4, fp8), <base>_<format> (the others).
struct WeightKind {
  abi::WeightFormat format = abi::WeightFormat::kDense;
  WeightType type = WeightType::kF32;
};
std::string KernelName(const char* base, WeightKind w);

inline constexpr uint32_t kGemmTileRows = 32;  // moe_gemm.metal's NBX_BM (and NBX_BN)
inline constexpr int64_t kDecodeSlots = 16;    // at most this many slots: the GEMV kernels

// nbx_moe_gemm_*: row tiles [p.tile0, p.tile0 + tiles) of the padded rows.
Dispatch MoeGemm(WeightKind w, const params::GemmParams& p, uint32_t tiles, View a, View row_src,
                 View tile_expert, View table, View row_weight, View out);
// nbx_moe_gemv_*: rows [p.tile0, p.tile0 + rows).
Dispatch MoeGemv(WeightKind w, const params::GemmParams& p, uint32_t rows, View a, View row_src,
                 View row_expert, View table, View row_weight, View out);
// The LoRA kernels (moe_lora.metal) run over whole tiles of 32 rows from p.tile0: rows past
// `rows` must be marked -1 in row_src (the decode path's slots).
// nbx_lora_xa: rows [p.tile0, p.tile0 + rows) of xa's columns of one adapter.
Dispatch LoraXa(const params::LoraParams& p, uint32_t rows, View a, View row_src, View row_expert,
                View adapter_a, View xa);
// nbx_lora_add: the adapter's term onto rows [p.tile0, p.tile0 + rows) of out.
Dispatch LoraAdd(const params::LoraParams& p, uint32_t rows, View xa, View row_src, View row_expert,
                 View adapter_b, View row_weight, View out);
// nbx_lora_glu: h = glu(g | u) on rows [p.tile0, p.tile0 + rows) (p.N = I).
Dispatch LoraGlu(const params::GemmParams& p, uint32_t rows, View gu, View row_src, View h);
// The three ordering kernels (count, offsets, scatter), in order.
std::vector<Dispatch> OrderSlots(const params::OrderParams& p, View ids, View count, View off,
                                 View row_slot, View slot_row);
// nbx_prepare_rows over p.rows rows (after OrderSlots, in the same command buffer).
Dispatch PrepareRows(const params::OrderParams& p, View off, View row_slot, View wts, View row_tok,
                     View row_self, View row_w, View tile_expert);
// nbx_moe_combine over p.tokens tokens.
Dispatch Combine(const params::CombineParams& p, View o, View slot_row, View y);

// Floating-point operations of one row tile (all N columns) of a GEMM: what
// the command-buffer bound (runtime.h CommandBufferFlops) divides.
int64_t GemmTileFlops(const params::GemmParams& p);
// Row tiles per command buffer under `limit` flops (at least 1).
int64_t TilesPerCommandBuffer(const params::GemmParams& p, int64_t limit);

}  // namespace nbx::metal
