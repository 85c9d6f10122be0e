// CPU handler: the fused MoE backward in one call.
//
// Forward (per slot s = (t, j) routed to expert e, weight w_s):
//   g = x_t G_e, u = x_t U_e, a = act(g) * u, y_t += w_s * a D_e
// Backward, given dy:
//   da_raw = dy_t D_e^T                       dw_s = da_raw . a
//   da = w_s da_raw; dg, du = da * the partials of glu(g, u) (GluGrad)
//   dD_e += a^T (w_s dy_t)      dG_e += x_t^T dg      dU_e += x_t^T du
//   dx_t += dg G_e^T + du U_e^T
//
// The forward saves nothing but its inputs: g and u ([T*k, 2I]) are recomputed
// here (one GEMM1 of the forward's three GEMMs' work; docs/benchmarks.md has
// the measurement behind that choice).  For each band of tokens:
//
//   plan     the band's slots ordered by expert (stable in (t, j)), no padding
//   gather   dy rows -> dY [S][H] float32 (x is read in place: row_band.h)
//   GEMMs    GU = X [G_e | U_e],  DA = dY D_e^T                  (per row chunk)
//   rows     a, dw, dg|du (into GU), a (into DA), dY *= w       (per row)
//   GEMMs    dG_e += X^T dg, dU_e += X^T du, dD_e += A^T dY      (per expert)
//   GEMMs    dX = dg G_e^T + du U_e^T  (into dY)                 (per row chunk)
//   combine  dx_t = sum over j in order of dX[row(t, j)]
//
// Every GEMM runs through one routine (GemmTile) on the shared driver
// (gemm_driver.h: prefetcher, packers, K-block loop) and the packed GEMM2
// micro-kernel of the instruction set chosen at run time (epilogue weight 1,
// exact).  The weights are decoded by the forward's decoder (weights.h), the
// slots planned by its planner (slots.h, unpadded).  The weight gradients are float32 outputs accumulated across bands
// (the micro-kernel continues each sum from the stored value): the sum over
// an expert's rows runs in global (t, j) order whatever the bands, so banded
// and unbanded results are identical bit for bit.

#include "cpu/moe_backward.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "account.h"
#include "cpu/gemm_driver.h"
#include "common/handler_common.h"
#include "cpu/kernels/kernel_table.h"
#include "cpu/row_band.h"
#include "cpu/row_gemm.h"
#include "common/slots.h"
#include "common/weights.h"
#include "dtypes.h"
#include "common/parallel.h"

namespace ffi = xla::ffi;

namespace nbx {
namespace {

// The weight gradients are large fresh outputs (3*E*H*I float32 per call,
// 1.6 GB at OLMoE's shape) that our GEMMs touch first: with 4 kB pages the
// page faults cost more than the GEMMs writing them (measured: first touch
// of 1.6 GB 1.0-1.3 s, with 2 MB pages 0.3 s).  Ask Linux for transparent
// huge pages on the whole 2 MB pages inside each buffer (THP in "madvise"
// mode; a no-op where THP is off or always on, or on other systems).  Only
// the page size changes; the memory stays XLA's.
void AdviseHugePages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

// One weight-gradient GEMM of an expert: C [M, N] (+)= A [M, K] B [K, N]
// over the expert's rows (K), cut into items of kChunkRows rows and nc columns.
struct GradGemm {
  MatA a;
  MatB<float> b;
  MatC c;
  int64_t M, N, K;
};

template <typename W>
void RunBand(const RowProblem& p, const KernelTable& kt, ffi::ThreadPool& pool, int workers,
             int64_t t0, int64_t t1, const RowBand& b) {
  const int64_t H = p.H, I = p.I, E = p.E, k = p.k, R = b.R;
  const int64_t s0 = t0 * k, S = (t1 - t0) * k;
  const int64_t tc = kt.nc;
  const Lora& lora = *p.lora;
  const LoraProj& Ld = lora.p[2];
  Stages stages("backward band");

  // Plan (the band's slots ordered by expert, stable in (t, j), unpadded)
  // and gather x and dy rows.
  const std::pair<int64_t, int64_t> planned = PlanGather(p, pool, workers, t0, t1, b);
  const int64_t rows = planned.first, chunks = planned.second;
  for (int64_t i = 0; i < S; ++i)
    if (b.plan.slot_row[i] < 0) p.dw[s0 + i] = 0.0f;  // expert held elsewhere: no gradient here
  stages.Mark("gather");

  // The recomputed forward GU = X [G_e | U_e] (+ the adapters' terms).
  GateUp<W>(p, kt, pool, workers, chunks, b);
  stages.Mark("recompute_gu");

  // DA = dY D_e^T (B[h, i] = D_e[i, h]) + s (dY B_d^T) A_d^T: items (chunk, tile of I).
  if (Ld.r > 0)
    ToRank(kt, pool, workers, b, chunks, MatA{b.dY, H, 1}, H, Ld, b.LB,
           [&](int64_t e) { return MatB<float>{Ld.B + e * Ld.r * H, 1, H}; });
  ForChunkTiles(kt, pool, workers, b, chunks, I, tc,
                [&](int64_t e, int64_t m0, int64_t m1, int64_t n0, int nc, const TileScratch& s) {
    GemmTile<W>(kt, MatA{b.dY, H, 1},
                MatB<W>{static_cast<const W*>(p.down[e]), p.sn[2], p.sk[2], true},
                MatC{b.DA, I}, m0, m1, n0, nc, H, false, s);
    if (Ld.r > 0)
      GemmTile<float>(kt, MatA{b.LB + Ld.col, R, 1}, MatB<float>{Ld.A + e * I * Ld.r, 1, Ld.r},
                      MatC{b.DA, I}, m0, m1, n0, nc, Ld.r, true, s);
  });
  stages.Mark("gemm_da");

  // Per row: a = act(g) u; dw = da_raw . a; dg, du; A; dY *= w (and LB's down range).
  const Glu glu = p.glu;
  ParallelFor(pool, workers, (rows + 15) / 16, [&](int64_t it, int) {
    for (int64_t r = it * 16; r < std::min(rows, it * 16 + 16); ++r) {
      const int64_t slot = b.plan.row_slot[r];
      const float w = p.topk_w[slot];
      float* gu = b.GU + r * 2 * I;
      float* da = b.DA + r * I;
      float dot = 0.0f;
      for (int64_t i = 0; i < I; ++i) {
        float a, da_dg, da_du;
        GluGrad(glu, gu[i], gu[I + i], &a, &da_dg, &da_du);
        const float d = da[i];
        dot += d * a;
        const float dw_a = w * d;
        gu[i] = dw_a * da_dg;      // dg
        gu[I + i] = dw_a * da_du;  // du
        da[i] = a;
      }
      float* dy = b.dY + r * H;
      if (p.bias[2]) {  // the output is a D + bd: d(weight) also gets dy . bd
        const float* bd = p.bias[2] + static_cast<int64_t>(p.topk_ids[slot]) * H;
        for (int64_t h = 0; h < H; ++h) dot += dy[h] * bd[h];
      }
      p.dw[slot] = dot;
      for (int64_t h = 0; h < H; ++h) dy[h] *= w;
      for (int64_t j = 0; j < Ld.r; ++j) b.LB[r * R + Ld.col + j] *= w;
    }
  });
  stages.Mark("rows");

  // The adapters' rank products: LR's down range s a A_d; LB's gate and up
  // ranges s dg B_g^T, s du B_u^T.
  if (Ld.r > 0)
    ToRank(kt, pool, workers, b, chunks, MatA{b.DA, I, 1}, I, Ld, b.LR,
           [&](int64_t e) { return MatB<float>{Ld.A + e * I * Ld.r, Ld.r, 1}; });
  for (int j = 0; j < 2; ++j) {
    const LoraProj& L = lora.p[j];
    if (L.r > 0)
      ToRank(kt, pool, workers, b, chunks, MatA{b.GU + j * I, 2 * I, 1}, I, L, b.LB,
             [&](int64_t e) { return MatB<float>{L.B + e * L.r * I, 1, I}; });
  }
  stages.Mark("lora_ranks");

  // Gradients, per expert with rows in the band, K = the expert's rows:
  // the experts' (when asked for) dG, dU [H, I], dD [I, H]; the adapters'
  // dA = z^T LB, dB = LR^T d(out).  Items (expert, GEMM, chunk of rows of
  // C, tile of columns of C).
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (b.plan.expert_off[e + 1] > b.plan.expert_off[e]) active.push_back(e);
  struct Item {
    int64_t e, g, m0, n0;
  };
  std::vector<GradGemm> gemms;
  std::vector<Item> items;
  for (int64_t e : active) {
    const int64_t r0 = b.plan.expert_off[e], n = b.plan.expert_off[e + 1] - r0;
    const size_t first = gemms.size();
    if (p.dgate != nullptr) {
      for (int j = 0; j < 2; ++j)
        gemms.push_back({XRows(p, b, r0, true), MatB<float>{b.GU + r0 * 2 * I + j * I, 2 * I, 1},
                         MatC{j == 0 ? p.dgate[e] : p.dup[e], p.sk[0], p.sn[0]}, H, I, n});
      gemms.push_back({MatA{b.DA + r0 * I, 1, I}, MatB<float>{b.dY + r0 * H, H, 1},
                       MatC{p.ddown[e], p.sk[2], p.sn[2]}, I, H, n});
    }
    for (int j = 0; j < 3; ++j) {
      const LoraProj& L = lora.p[j];
      if (L.r == 0) continue;
      const MatA z = j < 2 ? XRows(p, b, r0, true) : MatA{b.DA + r0 * I, 1, I};
      const MatB<float> dout = j < 2 ? MatB<float>{b.GU + r0 * 2 * I + j * I, 2 * I, 1}
                                     : MatB<float>{b.dY + r0 * H, H, 1};
      gemms.push_back({z, MatB<float>{b.LB + r0 * R + L.col, R, 1},
                       MatC{L.dA + e * L.in * L.r, L.r}, L.in, L.r, n});
      gemms.push_back({MatA{b.LR + r0 * R + L.col, 1, R}, dout,
                       MatC{L.dB + e * L.r * L.out, L.out}, L.r, L.out, n});
    }
    for (size_t g = first; g < gemms.size(); ++g)
      for (int64_t m0 = 0; m0 < gemms[g].M; m0 += kChunkRows)
        for (int64_t n0 = 0; n0 < gemms[g].N; n0 += tc)
          items.push_back({e, static_cast<int64_t>(g), m0, n0});
  }
  ParallelFor(pool, workers, static_cast<int64_t>(items.size()), [&](int64_t it, int worker) {
    const Item& item = items[it];
    const GradGemm& g = gemms[item.g];
    GemmTile<float>(kt, g.a, g.b, g.c, item.m0, std::min(g.M, item.m0 + kChunkRows), item.n0,
                    static_cast<int>(std::min(tc, g.N - item.n0)), g.K,
                    /*accumulate=*/p.written[item.e] != 0, b.Scratch(worker));
  });
  if (p.dbias != nullptr && p.dbias[0]) {  // bias gradients: column sums of dg, du, w*dy
    ParallelFor(pool, workers, static_cast<int64_t>(active.size()), [&](int64_t it, int) {
      const int64_t e = active[it];
      const int64_t r0 = b.plan.expert_off[e], r1 = b.plan.expert_off[e + 1];
      float* dg = p.dbias[0] + e * I;
      float* du = p.dbias[1] + e * I;
      float* dd = p.dbias[2] + e * H;
      if (!p.written[e]) {
        std::fill(dg, dg + I, 0.0f);
        std::fill(du, du + I, 0.0f);
        std::fill(dd, dd + H, 0.0f);
      }
      for (int64_t r = r0; r < r1; ++r) {
        const float* gu = b.GU + r * 2 * I;
        for (int64_t i = 0; i < I; ++i) dg[i] += gu[i], du[i] += gu[I + i];
        const float* dy = b.dY + r * H;
        for (int64_t h = 0; h < H; ++h) dd[h] += dy[h];
      }
    });
  }
  for (int64_t e : active) p.written[e] = 1;
  stages.Mark("gemm_dw");

  // dX rows = dg G_e^T + du U_e^T (+ LB_g A_g^T + LB_u A_u^T), into dY (free
  // now): items (chunk, tile of H).
  ForChunkTiles(kt, pool, workers, b, chunks, H, tc,
                [&](int64_t e, int64_t m0, int64_t m1, int64_t n0, int nc, const TileScratch& s) {
    GemmTile<W>(kt, MatA{b.GU, 2 * I, 1},
                MatB<W>{static_cast<const W*>(p.gate[e]), p.sn[0], p.sk[0], true}, MatC{b.dY, H},
                m0, m1, n0, nc, I, false, s);
    GemmTile<W>(kt, MatA{b.GU + I, 2 * I, 1},
                MatB<W>{static_cast<const W*>(p.up[e]), p.sn[1], p.sk[1], true}, MatC{b.dY, H},
                m0, m1, n0, nc, I, true, s);
    for (int j = 0; j < 2; ++j) {
      const LoraProj& L = lora.p[j];
      if (L.r > 0)
        GemmTile<float>(kt, MatA{b.LB + L.col, R, 1}, MatB<float>{L.A + e * H * L.r, 1, L.r},
                        MatC{b.dY, H}, m0, m1, n0, nc, L.r, true, s);
    }
  });
  stages.Mark("gemm_dx");

  // dx[t] = sum over j in order of dX[row(t, j)] (zero when every slot was skipped).
  CombineSlotRows(pool, workers, t0, t1, k, b.plan.slot_row, b.dY, H, p.x_type, p.dx);
  stages.Mark("combine");
}

// Inputs: dy, x [T, H]; topk_weights, topk_ids [T, k]; then the weights: 3
// stacked buffers (gate, up [E, H, I], down [E, I, H]) or 3E per-expert ones.
// Then the LoRA adapters (abi.h).  Results: dx [T, H] (x's dtype), dw [T, k]
// float32, then (weight_grads) the weight gradients in float32, laid out as
// the weights (3 stacked or 3E buffers) and the biases', then the adapters'.
ffi::Error FusedMoeBackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                                ffi::Buffer<ffi::F32> topk_w, ffi::Buffer<ffi::S32> topk_ids,
                                ffi::RemainingArgs weights, ffi::Result<ffi::AnyBuffer> dx,
                                ffi::Result<ffi::Buffer<ffi::F32>> dw, ffi::RemainingRets grads
                                NBX_BACKWARD_ATTR_PARAMS) {
  return FusedMoeBackward(pool, dy, x, topk_w, topk_ids, weights, 0, dx, dw, grads,
                          NBX_BACKWARD_ATTRS);
}

}  // namespace

ffi::Error FusedMoeBackward(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::F32> topk_w, ffi::Buffer<ffi::S32> topk_ids,
                            ffi::RemainingArgs weights, size_t trailing,
                            ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::Buffer<ffi::F32>> dw,
                            ffi::RemainingRets grads, const BackwardAttrs& a) {
  int64_t T, H, k;
  if (ffi::Error e = CheckRouting(x, topk_w, topk_ids, &T, &H, &k); e.failure()) return e;
  auto xd = x.dimensions();
  if (dy.element_type() != x.element_type() || dy.dimensions().size() != 2 ||
      dy.dimensions()[0] != T || dy.dimensions()[1] != H)
    return ffi::Error::InvalidArgument("dy must have x's shape " + Shape(xd) + " and dtype, got " +
                                       Shape(dy.dimensions()));
  if (dx->element_type() != x.element_type() || dx->element_count() != x.element_count() ||
      dw->element_count() != topk_w.element_count())
    return ffi::Error::InvalidArgument("dx must be like x and dw like topk_weights");
  if (ffi::Error e = CheckActivation(a.activation, a.act_alpha, a.act_limit); e.failure()) return e;
  if (ffi::Error e = CheckKernelsRead(a.format, formats::kCpuKernels, "the CPU"); e.failure()) return e;
  // Weights, adapters and their gradient buffers: E addresses per projection.
  ExpertWeights w;
  Lora lora;
  size_t nlora = 0;
  WeightViewAttrs views = a.views;  // mapped experts: their lease for this run
  if (ffi::Error e = LeaseWeights(&views, topk_ids.typed_data(),
                                  static_cast<int64_t>(topk_ids.element_count()), a.skip_outside);
      e.failure())
    return e;
  if (ffi::Error e = DecodeWeightsAndLora(weights, trailing, a.num_experts, H, a.format, a.stacked,
                                          a.group_size, views, a.lora, &w, &lora, &nlora);
      e.failure())
    return e;
  if (w.quantized() && a.weight_grads)
    return ffi::Error::InvalidArgument(
        std::string("quantized experts (") + abi::kWeightFormatNames[static_cast<int>(a.format)] +
        ") are frozen: the backward takes weight_grads=false");
  const int64_t E = w.E, I = w.I;
  GradientTable gt;  // (empty when the experts' gradients are not asked for)
  if (a.weight_grads) {
    if (ffi::Error e = DecodeGradients(grads, 0, nlora, w, a.stacked, &gt); e.failure()) return e;
    for (const auto& [ptr, bytes] : gt.buffers) AdviseHugePages(ptr, bytes);
  }
  const size_t nexpert_grads = a.weight_grads ? grads.size() - nlora : 0;
  if (ffi::Error e = DecodeLoraGrads(grads, nexpert_grads, E, &lora); e.failure()) return e;

  const int32_t* ids = topk_ids.typed_data();
  if (ffi::Error e = CheckIds(ids, T, k, E, a.skip_outside); e.failure()) return e;
  if (ffi::Error e = CheckSlots(T, k, E, 1); e.failure()) return e;
  // Gradients of experts that receive no rows are zero: written at the end
  // (the others are written by their first band's GEMMs, never zeroed first).
  std::vector<uint8_t> written(E, 0);
  auto zero_unwritten = [&]() {  // each expert's whole arrays (every view inside them)
    for (int64_t e = 0; e < E; ++e) {
      if (written[e]) continue;
      for (size_t grp = 0; grp < gt.group_base.size() / std::max<int64_t>(E, 1); ++grp)
        std::fill_n(gt.group_base[grp * E + e], w.group_elems[grp], 0.0f);
      for (int j = 0; j < 3; ++j) {
        if (gt.bias[j]) std::fill_n(gt.bias[j] + e * (j < 2 ? I : H), j < 2 ? I : H, 0.0f);
        const LoraProj& L = lora.p[j];
        if (L.r == 0) continue;
        std::fill_n(L.dA + e * L.in * L.r, L.in * L.r, 0.0f);
        std::fill_n(L.dB + e * L.r * L.out, L.r * L.out, 0.0f);
      }
    }
  };
  if (T == 0 || H == 0 || I == 0 || k == 0) {
    std::memset(dx->untyped_data(), 0, dx->size_bytes());
    std::memset(dw->untyped_data(), 0, dw->size_bytes());
    zero_unwritten();
    return ffi::Error::Success();
  }

  RowProblem p{T, H, I, E, k, x.untyped_data(), x.element_type(), topk_w.typed_data(), ids,
               w.gate(), w.up(), w.down(), w.sk, w.sn, w.bias,
               Glu{static_cast<int>(a.activation), a.act_alpha, a.act_limit}, &lora};
  p.dy = dy.untyped_data();
  p.dx = dx->untyped_data();
  p.dw = dw->typed_data();
  if (a.weight_grads) {
    p.dgate = gt.table.data();
    p.dup = gt.table.data() + E;
    p.ddown = gt.table.data() + 2 * E;
    p.dbias = gt.bias;
  }
  p.written = written.data();
  const int64_t band = (a.band_tokens <= 0) ? T : std::min(a.band_tokens, T);
  const int workers = static_cast<int>(std::clamp<int64_t>(a.max_workers, 1, MaxWorkers(pool)));
  const KernelTable& kt = *ActiveKernels();
  Workspace ws;
  RowBand b;
  if (ffi::Error e =
          AllocateRowBand(band, k, E, H, I, lora.R, workers, kt, "backward", &ws, &b);
      e.failure())
    return e;
  ForWeightType(w.dtype, [&](auto tag) {
    for (int64_t t0 = 0; t0 < T; t0 += band)
      RunBand<typename decltype(tag)::type>(p, kt, pool, workers, t0, std::min(T, t0 + band), b);
  });
  zero_unwritten();
  return ffi::Error::Success();
}

size_t BackwardWorkspaceBytes(int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I,
                              int workers, int64_t lora_rank) {
  RowBand unused;
  return CarveRowBand(nullptr, tokens * k, E, H, I, lora_rank, workers, *ActiveKernels(), &unused);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeBackwardCpu, FusedMoeBackwardImpl, NBX_BACKWARD_BINDING);

}  // namespace nbx
