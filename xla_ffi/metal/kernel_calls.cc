// The dispatches of the Metal kernels (see kernel_calls.h).
#include "metal/kernel_calls.h"

#include <algorithm>
#include <string>

#include "formats/registry.h"

namespace nbx::metal {
namespace {

const char* Suffix(WeightType w) {
  switch (w) {
    case WeightType::kF16: return "_f16";
    case WeightType::kBF16: return "_bf16";
    case WeightType::kF32: break;
  }
  return "_f32";
}

Arg A(const View& v) { return BufferArg(v.buffer, v.offset); }

uint32_t CeilDiv(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

// A LoRA kernel's dispatch (moe_lora.metal): 128 threads per (`per` columns of `cols`, 32 rows).
Dispatch LoraDispatch(const char* kernel, uint32_t cols, uint32_t per, uint32_t rows) {
  Dispatch d;
  d.kernel = kernel;
  d.grid[0] = CeilDiv(cols, per);
  d.grid[1] = CeilDiv(rows, kGemmTileRows);
  d.threads = 128;
  d.threadgroup_bytes = 4;
  return d;
}

}  // namespace

std::string KernelName(const char* base, WeightKind w) {
  const formats::FormatSpec& spec = formats::SpecOf(w.format);
  std::string name(base);
  if (w.format != abi::WeightFormat::kDense) name += std::string("_") + spec.name;
  if (spec.compute_dtype_part >= 0) name += Suffix(w.type);
  return name;
}

Dispatch MoeGemm(WeightKind w, const params::GemmParams& p, uint32_t tiles, View a, View row_src,
                 View tile_expert, View table, View row_weight, View out) {
  Dispatch d;
  d.kernel = KernelName("nbx_moe_gemm", w);
  d.grid[0] = CeilDiv(p.N, kGemmTileRows);
  d.grid[1] = tiles;
  d.threads = 128;
  // As [32][8], Bs0 and Bs1 [8][32], Cs [32][32] floats (moe_gemm.metal)
  d.threadgroup_bytes = (32 * 8 + 2 * 8 * 32 + 32 * 32) * 4;
  d.args = {A(a), A(row_src), A(tile_expert), A(table), A(row_weight), A(out), BytesArg(p)};
  return d;
}

Dispatch MoeGemv(WeightKind w, const params::GemmParams& p, uint32_t rows, View a, View row_src,
                 View row_expert, View table, View row_weight, View out) {
  Dispatch d;
  d.kernel = KernelName("nbx_moe_gemv", w);
  d.grid[0] = CeilDiv(p.N, 32);
  d.grid[1] = rows;
  d.threads = 128;
  d.threadgroup_bytes = 2 * 4 * 32 * 4;  // two [4][32] float partial sums (moe_gemv.metal)
  d.args = {A(a), A(row_src), A(row_expert), A(table), A(row_weight), A(out), BytesArg(p)};
  return d;
}

Dispatch LoraXa(const params::LoraParams& p, uint32_t rows, View a, View row_src, View row_expert,
                View adapter_a, View xa) {
  Dispatch d = LoraDispatch("nbx_lora_xa", p.r, 32, rows);
  d.args = {A(a), A(row_src), A(row_expert), A(adapter_a), A(xa), BytesArg(p)};
  return d;
}

Dispatch LoraAdd(const params::LoraParams& p, uint32_t rows, View xa, View row_src, View row_expert,
                 View adapter_b, View row_weight, View out) {
  Dispatch d = LoraDispatch("nbx_lora_add", p.N, 128, rows);
  d.args = {A(xa), A(row_src), A(row_expert), A(adapter_b), A(row_weight), A(out), BytesArg(p)};
  return d;
}

Dispatch LoraGlu(const params::GemmParams& p, uint32_t rows, View gu, View row_src, View h) {
  Dispatch d = LoraDispatch("nbx_lora_glu", p.N, 128, rows);
  d.args = {A(gu), A(row_src), A(h), BytesArg(p)};
  return d;
}

std::vector<Dispatch> OrderSlots(const params::OrderParams& p, View ids, View count, View off,
                                 View row_slot, View slot_row) {
  Dispatch c;
  c.kernel = "nbx_count_experts";
  c.grid[0] = p.E;
  c.threads = 128;
  c.threadgroup_bytes = 128 * 4;
  c.args = {A(ids), A(count), BytesArg(p)};
  Dispatch o;
  o.kernel = "nbx_expert_offsets";
  o.threads = 32;
  o.threadgroup_bytes = 4;
  o.args = {A(count), A(off), BytesArg(p)};
  Dispatch s;
  s.kernel = "nbx_scatter_slots";
  s.grid[0] = p.E;
  s.threads = 128;
  s.threadgroup_bytes = 128 * 4;
  s.args = {A(ids), A(off), A(row_slot), A(slot_row), BytesArg(p)};
  return {c, o, s};
}

Dispatch PrepareRows(const params::OrderParams& p, View off, View row_slot, View wts, View row_tok,
                     View row_self, View row_w, View tile_expert) {
  Dispatch d;
  d.kernel = "nbx_prepare_rows";
  d.grid[0] = CeilDiv(p.rows, 128);
  d.threads = 128;
  d.threadgroup_bytes = 4;
  d.args = {A(off), A(row_slot), A(wts), A(row_tok), A(row_self), A(row_w), A(tile_expert), BytesArg(p)};
  return d;
}

Dispatch Combine(const params::CombineParams& p, View o, View slot_row, View y) {
  Dispatch d;
  d.kernel = "nbx_moe_combine";
  d.grid[0] = CeilDiv(p.H, 128);
  d.grid[1] = p.tokens;
  d.threads = 128;
  d.threadgroup_bytes = 4;
  d.args = {A(o), A(slot_row), A(y), BytesArg(p)};
  return d;
}

int64_t GemmTileFlops(const params::GemmParams& p) {
  const int64_t projections = p.mode == 1 ? 1 : 2;
  return 2 * int64_t{kGemmTileRows} * p.K * p.N * projections;
}

int64_t TilesPerCommandBuffer(const params::GemmParams& p, int64_t limit) {
  const int64_t per_tile = std::max<int64_t>(GemmTileFlops(p), 1);
  return std::max<int64_t>(limit / per_tile, 1);
}

}  // namespace nbx::metal
