// CPU handler: the fused MoE forward with LoRA adapters, on experts of every format.
//
// Per slot s = (t, j) routed to expert e, weight w_s (row_band.h's LoRA terms):
//   g | u = x_t [G_e | U_e] + biases + s_g (x_t A_g) B_g | s_u (x_t A_u) B_u
//   a = glu(g, u),  y_t += w_s (a D_e + bd + s_d (a A_d) B_d)
// through the backward's row band (row_band.h), for each band of tokens:
//
//   plan     the band's slots ordered by expert (stable in (t, j)), no padding
//   GEMMs    LR = s x A (gate, up), GU = X [G_e | U_e] + LR B    (per row chunk;
//            x's rows packed in place, row_band.h)
//   rows     a = glu(g, u) into DA; LR's down range = s a A_d
//   GEMMs    O = a D_e + LR B_d + bd, times the row's weight
//   combine  y_t = sum over j in order of O[row(t, j)]
//
// The rows' values are the backward's recomputation (the same GEMMs and
// glu), so a training step sees one function.  Each sum over K is one
// kk-ordered chain from 0 whatever the band (the adapter's terms continue
// it, the bias is added after); an expert with few rows in a band streams
// its weights in place (row_gemm.h StreamTile), with the same bits; the
// combine runs in j order: banded and unbanded results are identical bit
// for bit.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "account.h"
#include "common/handler_common.h"
#include "cpu/kernels/kernel_table.h"
#include "cpu/moe_forward.h"
#include "cpu/row_band.h"
#include "cpu/row_gemm.h"
#include "common/weights.h"
#include "dtypes.h"
#include "common/parallel.h"

namespace ffi = xla::ffi;

namespace nbx {
namespace {

template <typename W>
void RunLoraBand(const RowProblem& p, const KernelTable& kt, ffi::ThreadPool& pool, int workers,
                 int64_t t0, int64_t t1, const RowBand& b) {
  const int64_t H = p.H, I = p.I, tc = kt.nc;
  const LoraProj& Ld = p.lora->p[2];
  Stages stages("lora forward band");
  const std::pair<int64_t, int64_t> planned = PlanGather(p, pool, workers, t0, t1, b);
  const int64_t rows = planned.first, chunks = planned.second;
  stages.Mark("gather");
  GateUp<W>(p, kt, pool, workers, chunks, b);
  stages.Mark("gemm_gu");
  ParallelFor(pool, workers, (rows + 15) / 16, [&](int64_t it, int) {
    for (int64_t r = it * 16; r < std::min(rows, it * 16 + 16); ++r) {
      const float* gu = b.GU + r * 2 * I;
      float* a = b.DA + r * I;
      float unused_dg, unused_du;
      for (int64_t i = 0; i < I; ++i) GluGrad(p.glu, gu[i], gu[I + i], &a[i], &unused_dg, &unused_du);
    }
  });
  if (Ld.r > 0)
    ToRank(kt, pool, workers, b, chunks, MatA{b.DA, I, 1}, I, Ld, b.LR,
           [&](int64_t e) { return MatB<float>{Ld.A + e * I * Ld.r, Ld.r, 1}; });
  stages.Mark("rows");
  // O = a D_e + LR_d B_d + bd, weighted: items (chunk, tile of H).
  ForChunkTiles(kt, pool, workers, b, chunks, H, tc,
                [&](int64_t e, int64_t m0, int64_t m1, int64_t n0, int nc, const TileScratch& s) {
    GemmTile<W>(kt, MatA{b.DA, I, 1}, MatB<W>{static_cast<const W*>(p.down[e]), p.sk[2], p.sn[2]},
                MatC{b.O, H}, m0, m1, n0, nc, I, false, s);
    if (Ld.r > 0)
      GemmTile<float>(kt, MatA{b.LR + Ld.col, b.R, 1}, MatB<float>{Ld.B + e * Ld.r * H, H, 1},
                      MatC{b.O, H}, m0, m1, n0, nc, Ld.r, true, s);
    if (const float* bd = p.bias[2]) AddRowBias(bd + e * H + n0, b.O, H, m0, m1, n0, nc);
    for (int64_t r = m0; r < m1; ++r) {
      const float w = p.topk_w[b.plan.row_slot[r]];
      float* o = b.O + r * H + n0;
      for (int c = 0; c < nc; ++c) o[c] *= w;
    }
  });
  stages.Mark("gemm_down");
  CombineSlotRows(pool, workers, t0, t1, p.k, b.plan.slot_row, b.O, H, p.x_type, p.y);
  stages.Mark("combine");
}

}  // namespace

ffi::Error FusedMoeLoraForward(ffi::ThreadPool pool, ffi::AnyBuffer x,
                               ffi::Buffer<ffi::F32> topk_w, ffi::Buffer<ffi::S32> topk_ids,
                               ffi::RemainingArgs weights, size_t trailing,
                               ffi::Result<ffi::AnyBuffer> y, const ForwardAttrs& a) {
  int64_t T, H, k;
  if (ffi::Error e = CheckForwardCall(x, topk_w, topk_ids, y, a.activation, a.act_alpha,
                                      a.act_limit, &T, &H, &k);
      e.failure())
    return e;
  if (a.bf16_dot)
    return ffi::Error::InvalidArgument(
        "LoRA adapters in the CPU handler run in float32 arithmetic, not precision='bfloat16'");
  if (a.int8_dot)
    return ffi::Error::InvalidArgument(
        "LoRA adapters in the CPU handler run in float32 arithmetic, not precision='int8'");
  ExpertWeights w;
  Lora lora;
  size_t nlora = 0;
  if (ffi::Error e = DecodeWeightsAndLora(weights, trailing, a.num_experts, H, a.format, a.stacked,
                                          a.group_size, a.views, a.lora, &w, &lora, &nlora);
      e.failure())
    return e;
  const int32_t* ids = topk_ids.typed_data();
  if (ffi::Error e = CheckIds(ids, T, k, w.E, a.skip_outside); e.failure()) return e;
  if (ffi::Error e = CheckSlots(T, k, w.E, 1); e.failure()) return e;
  if (T == 0 || H == 0) return ffi::Error::Success();
  if (w.I == 0 || k == 0) {
    std::memset(y->untyped_data(), 0, y->size_bytes());
    return ffi::Error::Success();
  }
  RowProblem p{T, H, w.I, w.E, k, x.untyped_data(), x.element_type(), topk_w.typed_data(), ids,
               w.gate(), w.up(), w.down(), w.sk, w.sn, w.bias,
               Glu{static_cast<int>(a.activation), a.act_alpha, a.act_limit}, &lora};
  p.y = y->untyped_data();
  const int64_t band = (a.band_tokens <= 0) ? T : std::min(a.band_tokens, T);
  const int workers = static_cast<int>(std::clamp<int64_t>(a.max_workers, 1, MaxWorkers(pool)));
  const KernelTable& kt = *ActiveKernels();
  Workspace ws;
  RowBand b;
  if (ffi::Error e = AllocateRowBand(band, k, w.E, H, w.I, lora.R, false, workers, kt, "workspace",
                                     &ws, &b);
      e.failure())
    return e;
  ForWeightType(w.dtype, [&](auto tag) {
    for (int64_t t0 = 0; t0 < T; t0 += band)
      RunLoraBand<typename decltype(tag)::type>(p, kt, pool, workers, t0, std::min(T, t0 + band),
                                                b);
  });
  return ffi::Error::Success();
}

size_t LoraForwardWorkspaceBytes(int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I,
                                 int64_t R, int workers) {
  RowBand unused;
  return CarveRowBand(nullptr, tokens * k, E, H, I, R, false, workers, *ActiveKernels(), &unused);
}

}  // namespace nbx
