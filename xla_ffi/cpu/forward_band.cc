// The CPU forward's workspace layout (forward_band.h).
#include "cpu/forward_band.h"

#include <algorithm>

#include "common/handler_common.h"

namespace nbx {
namespace cpu_forward {
namespace {

int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

}  // namespace

ScratchLayout LayOutScratch(int64_t H, int64_t I, const KernelTable& kt, bool dot) {
  const int64_t mr = kt.mr, vl = kt.vl;
  const int64_t cols1 = 2 * RoundUp(std::min<int64_t>(kt.nc, I), vl);  // gate||up
  const int64_t cols2 = RoundUp(std::min<int64_t>(kt.nc, H), 2 * vl);  // down
  const int64_t packed = std::max(PackedBlockFloats(std::min<int64_t>(kt.kc, H), cols1, kt.vl),
                                  PackedBlockFloats(std::min<int64_t>(kt.kc, I), cols2, kt.vl));
  const int64_t part =
      kt.chunk_panels * mr * std::max(H > kt.kc ? cols1 : 0, I > kt.kc ? cols2 : 0);
  const int64_t rows = std::min(kStreamRows, mr);
  const int64_t stream = rows * std::max(2 * std::min(kStreamCols, I), std::min(kStreamCols, H));
  const int64_t raw = packed + std::max(part, stream);
  // (also one m-panel's GEMM1 sums, when they are stored for the epilogue
  // within a single K-block)
  const int64_t raw_floats = std::max(rows * 2 * std::min(kStreamCols, I), mr * 2 * vl);
  // (precision="bfloat16": a chunk's packed A of one K-block, up to
  // kMaxDotAWords 4-byte words per pair and row, used only where A cannot
  // become pairs in place -- an odd K of two words per pair, RunGemm -- but
  // counted for every such call: the dot kernels, and so their words per
  // pair, are chosen when the call runs, after the plan)
  const int64_t dot_a = dot ? kt.chunk_panels * mr * kMaxDotAWords *
                                  ((std::min<int64_t>(kt.kc, std::max(H, I)) + 1) / 2)
                            : 0;
  const int64_t dot_a_offset = raw + raw_floats;
  return {packed, raw, dot_a_offset,
          RoundUp(dot_a_offset + dot_a + std::max(cols1, cols2), 1024)};
}

size_t CarveBand(void* base, int64_t S, int64_t E, int64_t H, int64_t I, int workers,
                 const KernelTable& kt, bool dot, int64_t R, Band* b) {
  const int64_t P = MaxPaddedRows(S, E, kt.mr);
  const int64_t C = MaxChunks(P, E, int64_t{kt.mr} * kt.chunk_panels);
  Carver cv(base);
  b->plan.slot_row = cv.Take<int32_t>(S);
  b->row_token = cv.Take<int32_t>(P);
  b->row_weight = cv.Take<float>(P);
  b->plan.row_slot = cv.Take<int32_t>(P);
  b->plan.expert_off = cv.Take<int64_t>(E + 1);
  b->plan.real_end = cv.Take<int64_t>(E);
  b->plan.seen = cv.Take<int64_t>(E);
  b->total = cv.Take<int64_t>(E);
  b->chunks.expert = cv.Take<int32_t>(C);
  b->chunks.begin = cv.Take<int64_t>(C);
  b->chunks.end = cv.Take<int64_t>(C);
  b->XO = cv.Take<float>(P, H);
  b->A2 = cv.Take<float>(P, I);
  b->LR = R > 0 ? cv.Take<float>(P, R) : nullptr;
  b->scratch_layout = LayOutScratch(H, I, kt, dot);
  b->scratch = cv.Take<float>(workers, b->scratch_layout.stride);
  return cv.used();
}

size_t BandBytes(int64_t S, int64_t E, int64_t H, int64_t I, int workers, const KernelTable& kt,
                 bool dot, int64_t R) {
  Band unused;
  return CarveBand(nullptr, S, E, H, I, workers, kt, dot, R, &unused);
}

}  // namespace cpu_forward
}  // namespace nbx
