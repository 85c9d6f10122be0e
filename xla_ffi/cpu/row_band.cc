// The row band's layout (row_band.h).

#include "cpu/row_band.h"

#include <string>

#include "abi.h"

namespace ffi = xla::ffi;

namespace nbx {

size_t CarveRowBand(void* base, int64_t S, int64_t E, int64_t H, int64_t I, int64_t R,
                    int workers, const KernelTable& kt, RowBand* b) {
  const int64_t C = MaxChunks(S, E, kChunkRows);
  // Scratch sized to the problem (the same for every band): N of every
  // product is H, I or a rank; K-blocks of at most max(H, I, R) rows (the
  // weight gradients' K, an expert's rows, runs in blocks of that size too);
  // tiles of few rows stream K up to max(H, I, R) (row_gemm.h StreamTile).
  const int64_t widest = std::max({H, I, R});
  b->kc = std::min<int64_t>(kt.kc, widest);
  b->nc = (std::min<int64_t>(kt.nc, widest) + 2 * kt.vl - 1) / (2 * kt.vl) * (2 * kt.vl);
  b->mr = kt.mr;
  b->vl = kt.vl;
  b->R = R;
  b->stream_k = widest;  // every K of a weight's product (H, I or a rank)
  b->stride = TileScratchFloats(b->kc, b->nc, kt.mr, kt.vl, b->stream_k);
  Carver cv(base);
  b->plan.row_slot = cv.Take<int32_t>(S);
  b->plan.slot_row = cv.Take<int32_t>(S);
  b->plan.expert_off = cv.Take<int64_t>(E + 1);
  b->plan.real_end = cv.Take<int64_t>(E);
  b->plan.seen = cv.Take<int64_t>(E);
  b->chunks.expert = cv.Take<int32_t>(C);
  b->chunks.begin = cv.Take<int64_t>(C);
  b->chunks.end = cv.Take<int64_t>(C);
  b->row_token = cv.Take<int32_t>(S);
  b->dY = cv.Take<float>(S, H);
  b->GU = cv.Take<float>(S, 2 * I);
  b->DA = cv.Take<float>(S, I);
  b->LR = cv.Take<float>(S, R);
  b->LB = cv.Take<float>(S, R);
  b->scratch = cv.Take<float>(workers, b->stride);
  return cv.used();
}

ffi::Error AllocateRowBand(int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I, int64_t R,
                           int workers, const KernelTable& kt, const char* tag,
                           Workspace* ws, RowBand* b) {
  if (ffi::Error e = AllocateWorkspace(
          CarveRowBand(nullptr, tokens * k, E, H, I, R, workers, kt, b),
          CarveRowBand(nullptr, 0, E, H, I, R, workers, kt, b), tokens, H, tag, ws);
      e.failure())
    return e;
  CarveRowBand(ws->data(), tokens * k, E, H, I, R, workers, kt, b);
  return ffi::Error::Success();
}



}  // namespace nbx
