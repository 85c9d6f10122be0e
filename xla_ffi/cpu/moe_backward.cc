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
//   gather   x and dy rows -> Xg, dY  [S][H] float32
//   GEMMs    GU = Xg [G_e | U_e],  DA = dY D_e^T                 (per row chunk)
//   rows     a, dw, dg|du (into GU), a (into DA), dY *= w       (per row)
//   GEMMs    dG_e += Xg^T dg, dU_e += Xg^T du, dD_e += A^T dY    (per expert)
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
#include "cpu/handler_common.h"
#include "cpu/kernel_table.h"
#include "cpu/slots.h"
#include "cpu/weights.h"
#include "dtypes.h"
#include "parallel.h"

namespace ffi = xla::ffi;

namespace nbx {
namespace {

constexpr int64_t kChunkRows = 128;  // C rows per work item

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

// A[m, k] = p[m*sm + k*sk] (float32 workspace).
struct MatA {
  const float* p;
  int64_t sm, sk;
};
// B[k, n] = p[k*sk + n*sn] (weights in their dtype, or float32 workspace).
template <typename W>
struct MatB {
  const W* p;
  int64_t sk, sn;
};
// C[m, n] = p[m*ld + n*sn] (float32; sn != 1: a weight gradient in a
// transposed or interleaved view, written through a tile buffer).
struct MatC {
  float* p;
  int64_t ld;
  int64_t sn = 1;
};

// Rows [m, m+rows) of A, columns [k0, k0+kc), as one m-panel [kc][mr].
void PackA(MatA a, int64_t m, int rows, int64_t k0, int kc, int mr, float* dst) {
  if (a.sk == 1) {
    for (int r = 0; r < rows; ++r) {
      const float* src = a.p + (m + r) * a.sm + k0;
      for (int i = 0; i < kc; ++i) dst[i * mr + r] = src[i];
    }
  } else {
    for (int i = 0; i < kc; ++i) {
      const float* src = a.p + m * a.sm + (k0 + i) * a.sk;
      for (int r = 0; r < rows; ++r) dst[i * mr + r] = src[r * a.sm];
    }
  }
  for (int r = rows; r < mr; ++r)
    for (int i = 0; i < kc; ++i) dst[i * mr + r] = 0.0f;
}

// One worker's scratch for GemmTile: a packed K-block of B, a packed m-panel
// of A, the micro-tile of C being continued, the epilogue's unit weights.
struct TileScratch {
  float* packed_b;
  float* packed_a;
  float* tile;
  float* ctile;  // the micro-tile's results when C has column stride sn != 1
  float* ones;
  int64_t kc;  // K-block rows the scratch holds (the bits do not depend on it)
};

// GemmTile's scratch floats for K-blocks of at most kc rows and tiles of at
// most nc columns (CarveBand sizes them to the problem).
int64_t TileScratchFloats(int64_t kc, int64_t nc, int mr, int vl) {
  return kc * nc + kc * mr + 2 * mr * 2 * vl + mr;
}
TileScratch CarveTileScratch(float* base, int64_t kc, int64_t nc, int mr, int vl) {
  TileScratch s{base, base + kc * nc, nullptr, nullptr, nullptr, kc};
  s.tile = s.packed_a + kc * mr;
  s.ctile = s.tile + mr * 2 * vl;
  s.ones = s.ctile + mr * 2 * vl;
  return s;
}

// C[m0:m1, n0:n0+nc] = (accumulate ? C : 0) + A[m0:m1, 0:K] B[0:K, n0:n0+nc],
// each element one kk-ordered chain of multiply-adds (the micro-kernel's).
template <typename W>
void GemmTile(const KernelTable& kt, MatA a, MatB<W> b, MatC c, int64_t m0, int64_t m1,
              int64_t n0, int nc, int64_t K, bool accumulate, const TileScratch& s) {
  const int mr = kt.mr, vl = kt.vl, w = 2 * vl;
  for (int r = 0; r < mr; ++r) s.ones[r] = 1.0f;
  std::fill(s.tile, s.tile + mr * w, 0.0f);
  if (K == 0) {
    if (!accumulate)
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t n = n0; n < n0 + nc; ++n) c.p[m * c.ld + n * c.sn] = 0.0f;
    return;
  }
  const int nsub = (nc + w - 1) / w;
  const int64_t panels = (m1 - m0 + mr - 1) / mr;
  RunKBlocks(
      K, s.kc,
      [&](Prefetcher& pf, int64_t k0, int64_t kc) {
        StartViewPrefetch(pf, b.p, static_cast<const W*>(nullptr), b.sk, b.sn, k0, kc, n0, nc);
      },
      [&](int64_t k0, int kc) {
        const W* m[1] = {b.p};
        PackView<1>(kt, m, b.sk, b.sn, k0, kc, n0, nc, s.packed_b);
      },
      [&](int64_t k0, int kc, Prefetcher& pf) {
        const int64_t per_call = pf.PerCall(nsub * panels);
        const bool load = accumulate || k0 > 0;
        for (int64_t m = m0; m < m1; m += mr) {
          const int rows = static_cast<int>(std::min<int64_t>(mr, m1 - m));
          PackA(a, m, rows, k0, kc, mr, s.packed_a);
          for (int q = 0; q < nsub; ++q) {
            const int cols = std::min(w, nc - q * w);
            float* cp = c.p + m * c.ld + (n0 + q * w) * c.sn;
            if (c.sn == 1) {
              if (load)
                for (int r = 0; r < rows; ++r)
                  std::memcpy(s.tile + r * w, cp + r * c.ld, sizeof(float) * cols);
              kt.gemm2(s.packed_a, s.packed_b + q * kc * w, kc, s.ones, rows, cols, cp, c.ld,
                       s.tile, load ? kLoadPartial : 0, /*scale=*/nullptr);
            } else {  // through ctile: gathered from C, computed, scattered back
              if (load)
                for (int r = 0; r < rows; ++r)
                  for (int j = 0; j < cols; ++j) s.tile[r * w + j] = cp[r * c.ld + j * c.sn];
              kt.gemm2(s.packed_a, s.packed_b + q * kc * w, kc, s.ones, rows, cols, s.ctile, w,
                       s.tile, load ? kLoadPartial : 0, /*scale=*/nullptr);
              for (int r = 0; r < rows; ++r)
                for (int j = 0; j < cols; ++j) cp[r * c.ld + j * c.sn] = s.ctile[r * w + j];
            }
            pf.Step(per_call);
          }
        }
      });
}

// a = glu(g, u) and its partial derivatives, float32 (the forward's
// formulas, abi.h Activation).  A clamp passes the gradient inside its range
// (bounds included) and none outside, as torch.clamp's does.
inline void GluGrad(const Glu& p, float g, float u, float* a, float* da_dg, float* da_du) {
  switch (p.act) {
    case static_cast<int>(abi::Activation::kGeGLU): {
      constexpr float c = static_cast<float>(abi::kGeluC), b = static_cast<float>(abi::kGeluB);
      const float th = tanhf(c * (g + b * g * g * g));
      const float f = 0.5f * g * (1.0f + th);
      const float df = 0.5f * (1.0f + th) + 0.5f * g * (1.0f - th * th) * c * (1.0f + 3.0f * b * g * g);
      *a = f * u, *da_dg = df * u, *da_du = f;
      return;
    }
    case static_cast<int>(abi::Activation::kGeGLUErf): {
      constexpr float r = static_cast<float>(abi::kInvSqrt2);
      constexpr float inv_sqrt_2pi = 0.3989422804014327f;
      const float cdf = 0.5f * (1.0f + erff(g * r));
      const float f = g * cdf, df = cdf + g * inv_sqrt_2pi * expf(-0.5f * g * g);
      *a = f * u, *da_dg = df * u, *da_du = f;
      return;
    }
    case static_cast<int>(abi::Activation::kClampedSwiGLU): {
      const bool g_in = g <= p.limit, u_in = u >= -p.limit && u <= p.limit;
      const float gc = g_in ? g : p.limit, uc = u_in ? u : (u > 0.0f ? p.limit : -p.limit);
      const float s = 1.0f / (1.0f + expf(-p.alpha * gc));
      const float f = gc * s, df = s * (1.0f + p.alpha * gc * (1.0f - s));
      *a = f * (uc + 1.0f);
      *da_dg = g_in ? df * (uc + 1.0f) : 0.0f;
      *da_du = u_in ? f : 0.0f;
      return;
    }
    default: {
      const float s = 1.0f / (1.0f + expf(-g));
      const float f = g * s, df = s * (1.0f + g * (1.0f - s));
      *a = f * u, *da_dg = df * u, *da_du = f;
    }
  }
}

struct Band {
  SlotPlan plan;         // rows ordered by expert (slots.h, unpadded); slot_row for the combine
  Chunks chunks;         // [C] row chunks: at most kChunkRows rows of one expert
  float* Xg;             // [S][H] gathered x
  float* dY;             // [S][H] gathered dy; then w * dy; then dX rows
  float* GU;             // [S][2I] g | u; then dg | du
  float* DA;             // [S][I] dy D^T; then a
  float* scratch;        // [workers][stride]
  int64_t stride, kc, nc;  // per-worker scratch floats; its blocking maxima
  int mr, vl;
  TileScratch Scratch(int worker) const {
    return CarveTileScratch(scratch + worker * stride, kc, nc, mr, vl);
  }
};

size_t CarveBand(void* base, int64_t S, int64_t E, int64_t H, int64_t I, int workers,
                 const KernelTable& kt, Band* b) {
  const int64_t C = MaxChunks(S, E, kChunkRows);
  // Scratch sized to the problem (the same for every band): N of every
  // product is H or I; K-blocks of at most max(H, I) rows (the weight
  // gradients' K, an expert's rows, runs in blocks of that size too).
  b->kc = std::min<int64_t>(kt.kc, std::max(H, I));
  b->nc = (std::min<int64_t>(kt.nc, std::max(H, I)) + 2 * kt.vl - 1) / (2 * kt.vl) * (2 * kt.vl);
  b->mr = kt.mr;
  b->vl = kt.vl;
  b->stride = TileScratchFloats(b->kc, b->nc, kt.mr, kt.vl);
  Carver cv(base);
  b->plan.row_slot = cv.Take<int32_t>(S);
  b->plan.slot_row = cv.Take<int32_t>(S);
  b->plan.expert_off = cv.Take<int64_t>(E + 1);
  b->plan.real_end = cv.Take<int64_t>(E);
  b->plan.seen = cv.Take<int64_t>(E);
  b->chunks.expert = cv.Take<int32_t>(C);
  b->chunks.begin = cv.Take<int64_t>(C);
  b->chunks.end = cv.Take<int64_t>(C);
  b->Xg = cv.Take<float>(S, H);
  b->dY = cv.Take<float>(S, H);
  b->GU = cv.Take<float>(S, 2 * I);
  b->DA = cv.Take<float>(S, I);
  b->scratch = cv.Take<float>(workers, b->stride);
  return cv.used();
}

size_t BandBytes(int64_t S, int64_t E, int64_t H, int64_t I, int workers,
                 const KernelTable& kt) {
  Band unused;
  return CarveBand(nullptr, S, E, H, I, workers, kt, &unused);
}

struct Problem {
  int64_t T, H, I, E, k;
  const void* dy;
  const void* x;
  ffi::DataType x_type;
  const float* topk_w;
  const int32_t* topk_ids;
  const void* const* gate;  // E addresses per projection, read in place
  const void* const* up;
  const void* const* down;
  const int64_t* sk;  // [3] the views' strides (weights.h ExpertWeights)
  const int64_t* sn;
  const float* const* bias;  // [3] float32 gate, up [E, I], down [E, H] biases, or null
  void* dx;
  float* dw;
  float* const* dgate;  // E float32 gradients in the weights' views (stacked slices or
  float* const* dup;    // per-expert outputs; gate and up one buffer when fused)
  float* const* ddown;
  float* const* dbias;  // [3] their gradients, or null
  Glu glu;
  uint8_t* written;  // [E]: the expert's gradients hold a partial sum (else unwritten)
};

template <typename T>
void GatherRow(const void* src, int64_t token, int64_t H, float* dst) {
  const T* s = static_cast<const T*>(src) + token * H;
  for (int64_t h = 0; h < H; ++h) dst[h] = ToFloat(s[h]);
}

void GatherRowAny(ffi::DataType t, const void* src, int64_t token, int64_t H, float* dst) {
  switch (t) {
    case ffi::DataType::F32: GatherRow<float>(src, token, H, dst); break;
    case ffi::DataType::BF16: GatherRow<bf16>(src, token, H, dst); break;
    default: GatherRow<f16>(src, token, H, dst); break;
  }
}

template <typename W>
void RunBand(const Problem& p, const KernelTable& kt, ffi::ThreadPool& pool, int workers,
             int64_t t0, int64_t t1, const Band& b) {
  const int64_t H = p.H, I = p.I, E = p.E, k = p.k;
  const int64_t s0 = t0 * k, S = (t1 - t0) * k;
  const int64_t tc = kt.nc;
  Stages stages("backward band");

  // Plan: the band's slots ordered by expert, stable in (t, j), unpadded.
  const int64_t R = OrderSlots(p.topk_ids, s0, s0 + S, E, 1, ExpertWindow{}, b.plan);
  for (int64_t i = 0; i < S; ++i)
    if (b.plan.slot_row[i] < 0) p.dw[s0 + i] = 0.0f;  // expert held elsewhere: no gradient here
  const int64_t chunks = CutChunks(b.plan.expert_off, b.plan.real_end, E, kChunkRows, b.chunks);
  stages.Mark("plan");

  // Gather x and dy rows.
  ParallelFor(pool, workers, (R + 15) / 16, [&](int64_t it, int) {
    for (int64_t r = it * 16; r < std::min(R, it * 16 + 16); ++r) {
      const int64_t t = b.plan.row_slot[r] / k;
      GatherRowAny(p.x_type, p.x, t, H, b.Xg + r * H);
      GatherRowAny(p.x_type, p.dy, t, H, b.dY + r * H);
    }
  });
  stages.Mark("gather");

  // The recomputed forward GU = Xg [G_e | U_e]: items (chunk, matrix, tile of I).
  const int64_t tilesI = (I + tc - 1) / tc;
  const int64_t tilesH = (H + tc - 1) / tc;
  ParallelFor(pool, workers, chunks * 2 * tilesI, [&](int64_t it, int worker) {
    const int64_t c = it / (2 * tilesI), which = (it / tilesI) % 2;
    const int64_t n0 = (it % tilesI) * tc;
    const int64_t e = b.chunks.expert[c];
    const W* wt = static_cast<const W*>(which == 0 ? p.gate[e] : p.up[e]);
    const int nc = static_cast<int>(std::min(tc, I - n0));
    const float* bias = p.bias[which];
    if (bias)  // the sums start from the bias
      for (int64_t r = b.chunks.begin[c]; r < b.chunks.end[c]; ++r)
        std::memcpy(b.GU + r * 2 * I + which * I + n0, bias + e * I + n0, sizeof(float) * nc);
    GemmTile<W>(kt, MatA{b.Xg, H, 1}, MatB<W>{wt, p.sk[0], p.sn[0]}, MatC{b.GU + which * I, 2 * I},
                b.chunks.begin[c], b.chunks.end[c], n0, nc, H, bias != nullptr, b.Scratch(worker));
  });
  stages.Mark("recompute_gu");

  // DA = dY D_e^T (B[h, i] = D_e[i, h]): items (chunk, tile of I).
  ParallelFor(pool, workers, chunks * tilesI, [&](int64_t it, int worker) {
    const int64_t c = it / tilesI, n0 = (it % tilesI) * tc;
    const int64_t e = b.chunks.expert[c];
    GemmTile<W>(kt, MatA{b.dY, H, 1}, MatB<W>{static_cast<const W*>(p.down[e]), p.sn[2], p.sk[2]},
                MatC{b.DA, I}, b.chunks.begin[c], b.chunks.end[c], n0,
                static_cast<int>(std::min(tc, I - n0)), H, false,
                b.Scratch(worker));
  });
  stages.Mark("gemm_da");

  // Per row: a = act(g) u; dw = da_raw . a; dg, du; A; dY *= w.
  const Glu glu = p.glu;
  ParallelFor(pool, workers, (R + 15) / 16, [&](int64_t it, int) {
    for (int64_t r = it * 16; r < std::min(R, it * 16 + 16); ++r) {
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
    }
  });
  stages.Mark("rows");

  // Weight gradients, per expert with rows in the band: items (expert,
  // matrix, chunk of C rows, tile of C columns).  dG, dU: C [H, I], K = the
  // expert's rows; dD: C [I, H].
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (b.plan.expert_off[e + 1] > b.plan.expert_off[e]) active.push_back(e);
  const int64_t mcH = (H + kChunkRows - 1) / kChunkRows, mcI = (I + kChunkRows - 1) / kChunkRows;
  const int64_t per_gu = mcH * tilesI, per_d = mcI * tilesH;
  const int64_t per_expert = 2 * per_gu + per_d;
  ParallelFor(pool, workers, static_cast<int64_t>(active.size()) * per_expert,
              [&](int64_t it, int worker) {
    const int64_t e = active[it / per_expert];
    int64_t j = it % per_expert;
    const int64_t r0 = b.plan.expert_off[e], rows = b.plan.expert_off[e + 1] - r0;
    const bool acc = p.written[e] != 0;  // an earlier band's rows: continue their sums
    const TileScratch scratch = b.Scratch(worker);
    if (j < 2 * per_gu) {
      const int64_t which = j / per_gu;
      j %= per_gu;
      const int64_t m0 = (j / tilesI) * kChunkRows, n0 = (j % tilesI) * tc;
      float* out = which == 0 ? p.dgate[e] : p.dup[e];
      GemmTile<float>(kt, MatA{b.Xg + r0 * H, 1, H},
                      MatB<float>{b.GU + r0 * 2 * I + which * I, 2 * I, 1},
                      MatC{out, p.sk[0], p.sn[0]}, m0,
                      std::min(H, m0 + kChunkRows), n0,
                      static_cast<int>(std::min(tc, I - n0)), rows, acc, scratch);
    } else {
      j -= 2 * per_gu;
      const int64_t m0 = (j / tilesH) * kChunkRows, n0 = (j % tilesH) * tc;
      GemmTile<float>(kt, MatA{b.DA + r0 * I, 1, I}, MatB<float>{b.dY + r0 * H, H, 1},
                      MatC{p.ddown[e], p.sk[2], p.sn[2]}, m0, std::min(I, m0 + kChunkRows), n0,
                      static_cast<int>(std::min(tc, H - n0)), rows, acc, scratch);
    }
  });
  if (p.dbias[0]) {  // bias gradients: column sums of dg, du, w*dy over the expert's rows
    ParallelFor(pool, workers, static_cast<int64_t>(active.size()), [&](int64_t it, int) {
      const int64_t e = active[it];
      const int64_t r0 = b.plan.expert_off[e], r1 = b.plan.expert_off[e + 1];
      const bool acc = p.written[e] != 0;
      float* dg = p.dbias[0] + e * I;
      float* du = p.dbias[1] + e * I;
      float* dd = p.dbias[2] + e * H;
      if (!acc) {
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

  // dX rows = dg G_e^T + du U_e^T (into dY, free now): items (chunk, tile of H).
  ParallelFor(pool, workers, chunks * tilesH, [&](int64_t it, int worker) {
    const int64_t c = it / tilesH, n0 = (it % tilesH) * tc;
    const int nc = static_cast<int>(std::min(tc, H - n0));
    const int64_t e = b.chunks.expert[c];
    const TileScratch scratch = b.Scratch(worker);
    GemmTile<W>(kt, MatA{b.GU, 2 * I, 1},
                MatB<W>{static_cast<const W*>(p.gate[e]), p.sn[0], p.sk[0]}, MatC{b.dY, H},
                b.chunks.begin[c], b.chunks.end[c], n0, nc, I, false, scratch);
    GemmTile<W>(kt, MatA{b.GU + I, 2 * I, 1},
                MatB<W>{static_cast<const W*>(p.up[e]), p.sn[1], p.sk[1]},
                MatC{b.dY, H}, b.chunks.begin[c], b.chunks.end[c], n0, nc, I, true, scratch);
  });
  stages.Mark("gemm_dx");

  // dx[t] = sum over j in order of dX[row(t, j)] (zero when every slot was skipped).
  CombineSlotRows(pool, workers, t0, t1, k, b.plan.slot_row, b.dY, H, p.x_type, p.dx);
  stages.Mark("combine");
}

// Inputs: dy, x [T, H]; topk_weights, topk_ids [T, k]; then the weights: 3
// stacked buffers (gate, up [E, H, I], down [E, I, H]) or 3E per-expert ones.
// Results: dx [T, H] (x's dtype), dw [T, k] float32, then the weight
// gradients in float32, laid out as the weights (3 stacked or 3E buffers).
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
  if (weights.size() < trailing)
    return ffi::Error::InvalidArgument("fewer inputs than the aliased outputs");

  // Weights and their gradient buffers: E addresses per projection.
  ExpertWeights w;
  if (ffi::Error e = DecodeWeights(weights, 0, weights.size() - trailing, a.num_experts, H,
                                   abi::WeightFormat::kDense, a.stacked, 0, a.views, &w);
      e.failure())
    return e;
  GradientTable gt;
  if (ffi::Error e = DecodeGradients(grads, 0, w, a.stacked, &gt); e.failure()) return e;
  for (const auto& [ptr, bytes] : gt.buffers) AdviseHugePages(ptr, bytes);
  const int64_t E = w.E, I = w.I;

  const int32_t* ids = topk_ids.typed_data();
  if (ffi::Error e = CheckIds(ids, T, k, E, a.skip_outside); e.failure()) return e;
  if (ffi::Error e = CheckSlots(T, k, E, 1); e.failure()) return e;
  // Gradients of experts that receive no rows are zero: written at the end
  // (the others are written by their first band's GEMMs, never zeroed first).
  std::vector<uint8_t> written(E, 0);
  auto zero_unwritten = [&]() {  // each expert's whole arrays (every view inside them)
    for (int grp = 0; grp < w.groups(); ++grp)
      for (int64_t e = 0; e < E; ++e)
        if (!written[e])
          std::fill(gt.group_base[grp * E + e], gt.group_base[grp * E + e] + w.group_elems[grp],
                    0.0f);
    for (int j = 0; j < 3; ++j)
      if (gt.bias[j])
        for (int64_t e = 0; e < E; ++e) {
          const int64_t n = j < 2 ? I : H;
          if (!written[e]) std::fill(gt.bias[j] + e * n, gt.bias[j] + (e + 1) * n, 0.0f);
        }
  };
  if (T == 0 || H == 0 || I == 0 || k == 0) {
    std::memset(dx->untyped_data(), 0, dx->size_bytes());
    std::memset(dw->untyped_data(), 0, dw->size_bytes());
    zero_unwritten();
    return ffi::Error::Success();
  }

  Problem p{T, H, I, E, k, dy.untyped_data(), x.untyped_data(), x.element_type(),
            topk_w.typed_data(), ids, w.gate(), w.up(), w.down(), w.sk, w.sn, w.bias,
            dx->untyped_data(), dw->typed_data(), gt.table.data(), gt.table.data() + E,
            gt.table.data() + 2 * E, gt.bias,
            Glu{static_cast<int>(a.activation), a.act_alpha, a.act_limit}, written.data()};
  const int64_t band = (a.band_tokens <= 0) ? T : std::min(a.band_tokens, T);
  const int workers = static_cast<int>(std::clamp<int64_t>(a.max_workers, 1, MaxWorkers(pool)));
  const KernelTable& kt = *ActiveKernels();
  Workspace ws;
  if (ffi::Error e = AllocateWorkspace(BandBytes(band * k, E, H, I, workers, kt),
                                       BandBytes(0, E, H, I, workers, kt), band, H, "backward",
                                       &ws);
      e.failure())
    return e;
  Band b;
  CarveBand(ws.data(), band * k, E, H, I, workers, kt, &b);
  ForFloatType(w.dtype, [&](auto tag) {
    for (int64_t t0 = 0; t0 < T; t0 += band)
      RunBand<typename decltype(tag)::type>(p, kt, pool, workers, t0, std::min(T, t0 + band), b);
  });
  zero_unwritten();
  return ffi::Error::Success();
}

size_t BackwardWorkspaceBytes(int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I,
                              int workers) {
  return BandBytes(tokens * k, E, H, I, workers, *ActiveKernels());
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeBackwardCpu, FusedMoeBackwardImpl, NBX_BACKWARD_BINDING);

}  // namespace nbx
