// The row-major band of the CPU backward (moe_backward.cc): a band's slots
// ordered by expert (unpadded), their rows gathered as float32 [S][H], every
// product a GemmTile (row_gemm.h) per chunk of rows: the plan and gather, and
// the recomputed g | u with the adapters' terms.
//
// LoRA (abi.h "LoRA adapters"): per adapted projection p, with input z
// (x for gate and up, a = glu(g, u) for down) and rank r_p,
//   out_p = z W_p + s_p (z A_p) B_p       A_p [E, in, r_p], B_p [E, r_p, out]
// The band holds LR [S][R] = s_p z A_p (R = the ranks' sum, one column
// range per projection) and LB [S][R] = s_p d(out_p) B_p^T
// (the down range weighted like the rows); the adapters' gradients are then
//   dA_p = z^T LB_p,   dB_p = LR_p^T d(out_p),   dz += LB_p A_p^T
// summed over an expert's rows in global (t, j) order whatever the bands.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "account.h"
#include "common/handler_common.h"
#include "cpu/kernels/kernel_table.h"
#include "cpu/row_gemm.h"
#include "common/slots.h"
#include "common/weights.h"
#include "common/lora_args.h"
#include "common/parallel.h"
#include "xla/ffi/api/ffi.h"

namespace nbx {

inline constexpr int64_t kChunkRows = 128;  // rows per work item

struct RowBand {
  SlotPlan plan;    // rows ordered by expert (slots.h, unpadded); slot_row for the combine
  Chunks chunks;    // [C] row chunks: at most kChunkRows rows of one expert
  int32_t* row_token;  // [S] each row's token: x is read in place through it (RowsOf)
  float* dY;        // [S][H] gathered dy; then w * dy; then dX rows
  float* GU;        // [S][2I] g | u; then dg | du
  float* DA;        // [S][I] dy D^T; then a
  float* LR;        // [S][R] the adapters' s z A
  float* LB;        // [S][R] the adapters' s d(out) B^T
  float* scratch;   // [workers][stride]
  int64_t R;
  int64_t stride, kc, nc;  // per-worker scratch floats; its blocking maxima
  int64_t stream_k;        // the longest K a tile streams
  int mr, vl;
  TileScratch Scratch(int worker) const {
    return CarveTileScratch(scratch + worker * stride, kc, nc, mr, vl, stream_k);
  }
};

// Lays a band of S slots out from `base` (nullptr: measures only); returns
// its bytes.  Per slot, float32: H + 3I + 2R (x is never copied: the GEMMs
// pack its rows in place).
size_t CarveRowBand(void* base, int64_t S, int64_t E, int64_t H, int64_t I, int64_t R,
                    int workers, const KernelTable& kt, RowBand* b);
// Allocates a band of `tokens` tokens (k slots each) in the account
// (account.h; `tag` names it in a refusal) and carves it.
xla::ffi::Error AllocateRowBand(int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I,
                                int64_t R, int workers, const KernelTable& kt,
                                const char* tag, Workspace* ws, RowBand* b);

// What the backward's row band reads: the problem and its results.
struct RowProblem {
  int64_t T, H, I, E, k;
  const void* x;
  xla::ffi::DataType x_type;
  const float* topk_w;
  const int32_t* topk_ids;
  const void* const* gate;  // E addresses per projection, read in place
  const void* const* up;
  const void* const* down;
  const int64_t* sk;  // [3] the views' strides (weights.h ExpertWeights)
  const int64_t* sn;
  const float* const* bias;  // [3] float32 gate, up [E, I], down [E, H] biases, or null
  Glu glu;
  const Lora* lora;
  const void* dy = nullptr;
  void* dx = nullptr;
  float* dw = nullptr;
  float* const* dgate = nullptr;  // E float32 gradients in the weights' views, or null:
  float* const* dup = nullptr;    // the experts' gradients are not asked for
  float* const* ddown = nullptr;
  float* const* dbias = nullptr;  // [3] their gradients, or null
  uint8_t* written = nullptr;     // [E]: the expert's gradients hold a partial sum
};

// c[r*ld + n0 + j] += bias[j] for the rows [m0, m1) and j < nc.
inline void AddRowBias(const float* bias, float* c, int64_t ld, int64_t m0, int64_t m1,
                       int64_t n0, int nc) {
  for (int64_t r = m0; r < m1; ++r)
    for (int j = 0; j < nc; ++j) c[r * ld + n0 + j] += bias[j];
}

// The columns of item n0 of a chunk of `rows` rows, in items of tc (a
// divisor of kMaxStreamCols) columns: tc, or for a chunk whose tiles stream,
// kMaxStreamCols from every such multiple and none from the items between.
inline int64_t ItemColumns(const KernelTable& kt, int64_t rows, int64_t n0, int64_t tc,
                           int64_t N) {
  return StreamsRows(kt, rows) ? StreamItemColumns(n0, N) : std::min(tc, N - n0);
}

// fn(e, m0, m1, n0, nc, scratch) for every chunk of rows and tile of tc of
// N columns (ItemColumns: wider for chunks that stream).
template <typename F>
void ForChunkTiles(const KernelTable& kt, xla::ffi::ThreadPool& pool, int workers,
                   const RowBand& b, int64_t chunks, int64_t N, int64_t tc, F&& fn) {
  const int64_t tiles = (N + tc - 1) / tc;
  ParallelFor(pool, workers, chunks * tiles, [&](int64_t it, int worker) {
    const int64_t c = it / tiles, n0 = (it % tiles) * tc;
    const int64_t m0 = b.chunks.begin[c], m1 = b.chunks.end[c];
    const int64_t nc = ItemColumns(kt, m1 - m0, n0, tc, N);
    if (nc > 0)
      fn(static_cast<int64_t>(b.chunks.expert[c]), m0, m1, n0, static_cast<int>(nc),
         b.Scratch(worker));
  });
}

// dst[:, L.col : L.col + r] = L.s * (src B_e) for each row's expert e, where
// B_e = b_of(e) is [K, r]: the adapters' rank-r products (into LR or LB).
template <typename BOf>
void ToRank(const KernelTable& kt, xla::ffi::ThreadPool& pool, int workers, const RowBand& b,
            int64_t chunks, MatA src, int64_t K, const LoraProj& L, float* dst, BOf&& b_of) {
  ForChunkTiles(kt, pool, workers, b, chunks, L.r, kt.nc,
                [&](int64_t e, int64_t m0, int64_t m1, int64_t n0, int nc, const TileScratch& s) {
    GemmTile<float>(kt, src, b_of(e), MatC{dst + L.col, b.R}, m0, m1, n0, nc, K, false, s);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t n = n0; n < n0 + nc; ++n) dst[m * b.R + L.col + n] *= L.s;
  });
}

// x's rows of the band's rows [r0, ...) as A (`transposed`: A[h, row]).
inline MatA XRows(const RowProblem& p, const RowBand& b, int64_t r0, bool transposed) {
  return RowsOf(p.x, p.x_type, p.H, b.row_token + r0, transposed);
}

// Plans the band's slots [t0 k, t1 k) by expert (stable in (t, j),
// unpadded), maps rows to tokens and gathers dy rows; returns (rows, chunks).
inline std::pair<int64_t, int64_t> PlanGather(const RowProblem& p, xla::ffi::ThreadPool& pool,
                                              int workers, int64_t t0, int64_t t1, const RowBand& b) {
  const int64_t s0 = t0 * p.k, S = (t1 - t0) * p.k;
  const int64_t rows = OrderSlots(p.topk_ids, s0, s0 + S, p.E, 1, ExpertWindow{}, b.plan);
  const int64_t chunks = CutChunks(b.plan.expert_off, b.plan.real_end, p.E, kChunkRows, b.chunks);
  ParallelFor(pool, workers, (rows + 15) / 16, [&](int64_t it, int) {
    for (int64_t r = it * 16; r < std::min(rows, it * 16 + 16); ++r) {
      const int64_t t = b.plan.row_slot[r] / p.k;
      b.row_token[r] = static_cast<int32_t>(t);
      if (p.dy) GatherRowAny(p.x_type, p.dy, t, p.H, b.dY + r * p.H);
    }
  });
  return {rows, chunks};
}

// GU = X [G_e | U_e] + s (X A) B for the adapted ones (LR's gate and up
// columns first), + biases: items (chunk, matrix, tile of I).  Each sum is
// one kk-ordered chain from 0, the adapter's rank terms continuing it, the
// bias added last: a chunk of few rows streams its weights (GemmTile) with
// the bits of a packed one, so bands change no bit.
template <typename W>
void GateUp(const RowProblem& p, const KernelTable& kt, xla::ffi::ThreadPool& pool, int workers,
            int64_t chunks, const RowBand& b) {
  const int64_t H = p.H, I = p.I, tc = kt.nc;
  for (int j = 0; j < 2; ++j) {
    const LoraProj& L = p.lora->p[j];
    if (L.r > 0)
      ToRank(kt, pool, workers, b, chunks, XRows(p, b, 0, false), H, L, b.LR,
             [&](int64_t e) { return MatB<float>{L.A + e * H * L.r, L.r, 1}; });
  }
  const int64_t tilesI = (I + tc - 1) / tc;
  ParallelFor(pool, workers, chunks * 2 * tilesI, [&](int64_t it, int worker) {
    const int64_t c = it / (2 * tilesI), which = (it / tilesI) % 2;
    const int64_t n0 = (it % tilesI) * tc;
    const int64_t e = b.chunks.expert[c], m0 = b.chunks.begin[c], m1 = b.chunks.end[c];
    const W* wt = static_cast<const W*>(which == 0 ? p.gate[e] : p.up[e]);
    const int nc = static_cast<int>(ItemColumns(kt, m1 - m0, n0, tc, I));
    if (nc == 0) return;
    const TileScratch s = b.Scratch(worker);
    const MatC gu{b.GU + which * I, 2 * I};
    GemmTile<W>(kt, XRows(p, b, 0, false), MatB<W>{wt, p.sk[0], p.sn[0]}, gu, m0, m1, n0, nc, H,
                false, s);
    const LoraProj& L = p.lora->p[which];
    if (L.r > 0)
      GemmTile<float>(kt, MatA{b.LR + L.col, b.R, 1}, MatB<float>{L.B + e * L.r * I, I, 1}, gu,
                      m0, m1, n0, nc, L.r, true, s);
    if (const float* bias = p.bias[which])
      AddRowBias(bias + e * I + n0, gu.p, 2 * I, m0, m1, n0, nc);
  });
}

}  // namespace nbx
