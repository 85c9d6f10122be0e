// CPU handler: the fused MoE backward in one call.
//
// Forward (per slot s = (t, j) routed to expert e, weight w_s):
//   g = x_t G_e, u = x_t U_e, a = act(g) * u, y_t += w_s * a D_e
// Backward, given dy:
//   da_raw = dy_t D_e^T                       dw_s = da_raw . a
//   da = w_s da_raw, dg = da * u * act'(g), du = da * act(g)
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
// Every GEMM runs through one routine (GemmTile) built on the packed GEMM2
// micro-kernel of the instruction set chosen at run time (epilogue weight 1,
// exact).  The weight gradients are float32 outputs accumulated across bands
// (the micro-kernel continues each sum from the stored value): the sum over
// an expert's rows runs in global (t, j) order whatever the bands, so banded
// and unbanded results are identical bit for bit.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "account.h"
#include "cpu/handler_common.h"
#include "cpu/kernel_table.h"
#include "cpu/moe_backward.h"
#include "dtypes.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace nbx {
namespace {

constexpr int64_t kKBlock = 128;     // K rows per packed block of B
constexpr int64_t kTileCols = 256;   // C columns per work item (a multiple of every 2*VL)
constexpr int64_t kChunkRows = 128;  // C rows per work item

// Per-worker scratch: a packed K-block of B, a packed m-panel of A, the
// micro-tile of C being continued, the epilogue's unit weights.
int64_t ScratchFloats(int mr, int vl) {
  return kKBlock * kTileCols + kKBlock * mr + mr * 2 * vl + mr + 64;
}

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
// C[m, n] = p[m*ld + n] (float32).
struct MatC {
  float* p;
  int64_t ld;
};

// Rows [k0, k0+kc) of columns [n0, n0+nc) of B into micro-panels of 2VL
// columns: panel q at dst + q*kc*2VL, row i at + i*2VL, zero-padded.
template <typename W>
void PackB(MatB<W> b, int64_t k0, int kc, int64_t n0, int nc, int vl, float* dst) {
  const int w = 2 * vl;
  const int nsub = (nc + w - 1) / w;
  if (b.sn == 1) {  // rows of B contiguous
    for (int i = 0; i < kc; ++i) {
      const W* row = b.p + (k0 + i) * b.sk + n0;
      float* d = dst + i * w;
      for (int q = 0; q < nsub; ++q, d += kc * w) {
        const int n = std::min(w, nc - q * w);
        for (int c = 0; c < n; ++c) d[c] = ToFloat(row[q * w + c]);
        for (int c = n; c < w; ++c) d[c] = 0.0f;
      }
    }
    return;
  }
  // columns of B contiguous (a transposed weight): one column at a time
  for (int c = 0; c < nsub * w; ++c) {
    float* d = dst + (c / w) * kc * w + c % w;
    if (c >= nc) {
      for (int i = 0; i < kc; ++i) d[i * w] = 0.0f;
      continue;
    }
    const W* col = b.p + (n0 + c) * b.sn + k0 * b.sk;
    for (int i = 0; i < kc; ++i) d[i * w] = ToFloat(col[i * b.sk]);
  }
}

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

// Software prefetch of the runs of B's next K-block (rows of B, or columns of
// a transposed B: runs of contiguous bytes, a page apart, that the hardware
// prefetcher does not follow), issued a few lines between micro-kernel calls.
class RunPrefetch {
 public:
  void Start(const void* base, int64_t stride_bytes, int64_t runs, int64_t run_bytes) {
    base_ = static_cast<const char*>(base);
    stride_ = stride_bytes;
    lines_ = (run_bytes + 63) / 64;
    left_ = runs * lines_;
    run_ = line_ = 0;
  }
  void Step(int64_t n) {
    for (n = std::min(n, left_), left_ -= n; n > 0; --n) {
      __builtin_prefetch(base_ + run_ * stride_ + line_ * 64, 0, 3);
      if (++line_ == lines_) line_ = 0, ++run_;
    }
  }
  int64_t left() const { return left_; }

 private:
  const char* base_ = nullptr;
  int64_t stride_ = 0, lines_ = 1, left_ = 0, run_ = 0, line_ = 0;
};

// Prefetches B's block [k0, k0+kc) x [n0, n0+nc).
template <typename W>
void StartBlock(RunPrefetch& pf, MatB<W> b, int64_t k0, int64_t kc, int64_t n0, int64_t nc) {
  if (b.sn == 1)
    pf.Start(b.p + k0 * b.sk + n0, b.sk * sizeof(W), kc, nc * sizeof(W));
  else if (b.sk == 1)
    pf.Start(b.p + n0 * b.sn + k0, b.sn * sizeof(W), nc, kc * sizeof(W));
}

// C[m0:m1, n0:n0+nc] = (accumulate ? C : 0) + A[m0:m1, 0:K] B[0:K, n0:n0+nc],
// each element one kk-ordered chain of multiply-adds (the micro-kernel's).
template <typename W>
void GemmTile(const KernelTable& kt, MatA a, MatB<W> b, MatC c, int64_t m0, int64_t m1,
              int64_t n0, int nc, int64_t K, bool accumulate, float* scratch) {
  const int mr = kt.mr, vl = kt.vl, w = 2 * vl;
  float* packed_b = scratch;
  float* packed_a = packed_b + kKBlock * kTileCols;
  float* tile = packed_a + kKBlock * mr;
  float* ones = tile + mr * w;
  for (int r = 0; r < mr; ++r) ones[r] = 1.0f;
  std::fill(tile, tile + mr * w, 0.0f);
  if (K == 0) {
    if (!accumulate)
      for (int64_t m = m0; m < m1; ++m) std::fill(c.p + m * c.ld + n0, c.p + m * c.ld + n0 + nc, 0.0f);
    return;
  }
  const int nsub = (nc + w - 1) / w;
  const int64_t panels = (m1 - m0 + mr - 1) / mr;
  RunPrefetch pf;
  StartBlock(pf, b, 0, std::min(kKBlock, K), n0, nc);
  pf.Step(pf.left());  // the first block: all at once
  for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
    const int kc = static_cast<int>(std::min(kKBlock, K - k0));
    pf.Step(pf.left());
    PackB(b, k0, kc, n0, nc, vl, packed_b);
    if (k0 + kc < K) StartBlock(pf, b, k0 + kc, std::min(kKBlock, K - k0 - kc), n0, nc);
    const int64_t per_call = pf.left() / (nsub * panels) + 1;
    const bool load = accumulate || k0 > 0;
    for (int64_t m = m0; m < m1; m += mr) {
      const int rows = static_cast<int>(std::min<int64_t>(mr, m1 - m));
      PackA(a, m, rows, k0, kc, mr, packed_a);
      for (int q = 0; q < nsub; ++q) {
        const int cols = std::min(w, nc - q * w);
        float* cp = c.p + m * c.ld + n0 + q * w;
        if (load)
          for (int r = 0; r < rows; ++r)
            std::memcpy(tile + r * w, cp + r * c.ld, sizeof(float) * cols);
        kt.gemm2(packed_a, packed_b + q * kc * w, kc, ones, rows, cols, cp, c.ld, tile,
                 load ? kLoadPartial : 0, /*scale=*/nullptr);
        pf.Step(per_call);
      }
    }
  }
}

// act(g) and act'(g), float32 (the forward's formulas).
inline void ActGrad(int64_t act, float g, float* f, float* df) {
  if (act == kGeGLU) {
    constexpr float c = 0.7978845608028654f, b = 0.044715f;
    const float th = tanhf(c * (g + b * g * g * g));
    *f = 0.5f * g * (1.0f + th);
    *df = 0.5f * (1.0f + th) + 0.5f * g * (1.0f - th * th) * c * (1.0f + 3.0f * b * g * g);
    return;
  }
  const float s = 1.0f / (1.0f + expf(-g));
  *f = g * s;
  *df = s * (1.0f + g * (1.0f - s));
}

struct Band {
  int32_t* row_slot;     // [S] slot (t*k + j) of each row; rows ordered by expert
  int32_t* slot_row;     // [S] row of each slot of the band, -1 when skipped
  int64_t* expert_off;   // [E+1] row range of each expert
  int64_t* cursor;       // [E+1]
  int32_t* chunk_expert; // [C] row chunks: at most kChunkRows rows of one expert
  int64_t* chunk_begin;  // [C]
  int64_t* chunk_end;    // [C]
  float* Xg;             // [S][H] gathered x
  float* dY;             // [S][H] gathered dy; then w * dy; then dX rows
  float* GU;             // [S][2I] g | u; then dg | du
  float* DA;             // [S][I] dy D^T; then a
  float* scratch;        // [workers][ScratchFloats]
};

int64_t MaxChunks(int64_t S, int64_t E) { return S / kChunkRows + std::min(S, E) + 1; }

size_t CarveBand(void* base, int64_t S, int64_t E, int64_t H, int64_t I, int workers,
                 const KernelTable& kt, Band* b) {
  const int64_t C = MaxChunks(S, E);
  Carver cv(base);
  b->row_slot = cv.Take<int32_t>(S);
  b->slot_row = cv.Take<int32_t>(S);
  b->expert_off = cv.Take<int64_t>(E + 1);
  b->cursor = cv.Take<int64_t>(E + 1);
  b->chunk_expert = cv.Take<int32_t>(C);
  b->chunk_begin = cv.Take<int64_t>(C);
  b->chunk_end = cv.Take<int64_t>(C);
  b->Xg = cv.Take<float>(S * H);
  b->dY = cv.Take<float>(S * H);
  b->GU = cv.Take<float>(S * 2 * I);
  b->DA = cv.Take<float>(S * I);
  b->scratch = cv.Take<float>(static_cast<int64_t>(workers) * ScratchFloats(kt.mr, kt.vl));
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
  void* dx;
  float* dw;
  float* const* dgate;  // E float32 [H, I] gradients (stacked slices or per-expert outputs)
  float* const* dup;
  float* const* ddown;  // E float32 [I, H]
  int64_t activation;
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
  const int64_t scratch_stride = ScratchFloats(kt.mr, kt.vl);
  Stages stages("backward band");

  // Plan: the band's slots ordered by expert, stable in (t, j).
  std::fill(b.expert_off, b.expert_off + E + 1, int64_t{0});
  auto local = [&](int64_t i) { return p.topk_ids[i] >= 0 && p.topk_ids[i] < E; };
  for (int64_t i = s0; i < s0 + S; ++i)
    if (local(i)) ++b.expert_off[p.topk_ids[i] + 1];
  for (int64_t e = 0; e < E; ++e) b.expert_off[e + 1] += b.expert_off[e];
  const int64_t R = b.expert_off[E];
  std::copy(b.expert_off, b.expert_off + E + 1, b.cursor);
  for (int64_t i = s0; i < s0 + S; ++i) {
    if (!local(i)) {
      b.slot_row[i - s0] = -1;
      p.dw[i] = 0.0f;  // a skipped slot (expert held elsewhere) has no gradient here
      continue;
    }
    const int64_t row = b.cursor[p.topk_ids[i]]++;
    b.row_slot[row] = static_cast<int32_t>(i);
    b.slot_row[i - s0] = static_cast<int32_t>(row);
  }
  int64_t chunks = 0;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = b.expert_off[e]; r < b.expert_off[e + 1]; r += kChunkRows) {
      b.chunk_expert[chunks] = static_cast<int32_t>(e);
      b.chunk_begin[chunks] = r;
      b.chunk_end[chunks] = std::min(r + kChunkRows, b.expert_off[e + 1]);
      ++chunks;
    }
  }
  stages.Mark("plan");

  // Gather x and dy rows.
  ParallelFor(pool, workers, (R + 15) / 16, [&](int64_t it, int) {
    for (int64_t r = it * 16; r < std::min(R, it * 16 + 16); ++r) {
      const int64_t t = b.row_slot[r] / k;
      GatherRowAny(p.x_type, p.x, t, H, b.Xg + r * H);
      GatherRowAny(p.x_type, p.dy, t, H, b.dY + r * H);
    }
  });
  stages.Mark("gather");

  // The recomputed forward GU = Xg [G_e | U_e]: items (chunk, matrix, tile of I).
  const int64_t tilesI = (I + kTileCols - 1) / kTileCols;
  const int64_t tilesH = (H + kTileCols - 1) / kTileCols;
  ParallelFor(pool, workers, chunks * 2 * tilesI, [&](int64_t it, int worker) {
    const int64_t c = it / (2 * tilesI), which = (it / tilesI) % 2;
    const int64_t n0 = (it % tilesI) * kTileCols;
    const int64_t e = b.chunk_expert[c];
    const W* wt = static_cast<const W*>(which == 0 ? p.gate[e] : p.up[e]);
    GemmTile<W>(kt, MatA{b.Xg, H, 1}, MatB<W>{wt, I, 1}, MatC{b.GU + which * I, 2 * I},
                b.chunk_begin[c], b.chunk_end[c], n0, static_cast<int>(std::min(kTileCols, I - n0)),
                H, false, b.scratch + worker * scratch_stride);
  });
  stages.Mark("recompute_gu");

  // DA = dY D_e^T (B[h, i] = D_e[i, h]): items (chunk, tile of I).
  ParallelFor(pool, workers, chunks * tilesI, [&](int64_t it, int worker) {
    const int64_t c = it / tilesI, n0 = (it % tilesI) * kTileCols;
    const int64_t e = b.chunk_expert[c];
    GemmTile<W>(kt, MatA{b.dY, H, 1}, MatB<W>{static_cast<const W*>(p.down[e]), 1, H},
                MatC{b.DA, I}, b.chunk_begin[c], b.chunk_end[c], n0,
                static_cast<int>(std::min(kTileCols, I - n0)), H, false,
                b.scratch + worker * scratch_stride);
  });
  stages.Mark("gemm_da");

  // Per row: a = act(g) u; dw = da_raw . a; dg, du; A; dY *= w.
  const int64_t act = p.activation;
  ParallelFor(pool, workers, (R + 15) / 16, [&](int64_t it, int) {
    for (int64_t r = it * 16; r < std::min(R, it * 16 + 16); ++r) {
      const int64_t slot = b.row_slot[r];
      const float w = p.topk_w[slot];
      float* gu = b.GU + r * 2 * I;
      float* da = b.DA + r * I;
      float dot = 0.0f;
      for (int64_t i = 0; i < I; ++i) {
        float f, df;
        const float g = gu[i], u = gu[I + i];
        ActGrad(act, g, &f, &df);
        const float a = f * u;
        const float d = da[i];
        dot += d * a;
        const float dw_a = w * d;
        gu[i] = dw_a * u * df;  // dg
        gu[I + i] = dw_a * f;   // du
        da[i] = a;
      }
      p.dw[slot] = dot;
      float* dy = b.dY + r * H;
      for (int64_t h = 0; h < H; ++h) dy[h] *= w;
    }
  });
  stages.Mark("rows");

  // Weight gradients, per expert with rows in the band: items (expert,
  // matrix, chunk of C rows, tile of C columns).  dG, dU: C [H, I], K = the
  // expert's rows; dD: C [I, H].
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (b.expert_off[e + 1] > b.expert_off[e]) active.push_back(e);
  const int64_t mcH = (H + kChunkRows - 1) / kChunkRows, mcI = (I + kChunkRows - 1) / kChunkRows;
  const int64_t per_gu = mcH * tilesI, per_d = mcI * tilesH;
  const int64_t per_expert = 2 * per_gu + per_d;
  ParallelFor(pool, workers, static_cast<int64_t>(active.size()) * per_expert,
              [&](int64_t it, int worker) {
    const int64_t e = active[it / per_expert];
    int64_t j = it % per_expert;
    const int64_t r0 = b.expert_off[e], rows = b.expert_off[e + 1] - r0;
    const bool acc = p.written[e] != 0;  // an earlier band's rows: continue their sums
    float* scratch = b.scratch + worker * scratch_stride;
    if (j < 2 * per_gu) {
      const int64_t which = j / per_gu;
      j %= per_gu;
      const int64_t m0 = (j / tilesI) * kChunkRows, n0 = (j % tilesI) * kTileCols;
      float* out = which == 0 ? p.dgate[e] : p.dup[e];
      GemmTile<float>(kt, MatA{b.Xg + r0 * H, 1, H},
                      MatB<float>{b.GU + r0 * 2 * I + which * I, 2 * I, 1}, MatC{out, I}, m0,
                      std::min(H, m0 + kChunkRows), n0,
                      static_cast<int>(std::min(kTileCols, I - n0)), rows, acc, scratch);
    } else {
      j -= 2 * per_gu;
      const int64_t m0 = (j / tilesH) * kChunkRows, n0 = (j % tilesH) * kTileCols;
      GemmTile<float>(kt, MatA{b.DA + r0 * I, 1, I}, MatB<float>{b.dY + r0 * H, H, 1},
                      MatC{p.ddown[e], H}, m0, std::min(I, m0 + kChunkRows), n0,
                      static_cast<int>(std::min(kTileCols, H - n0)), rows, acc, scratch);
    }
  });
  for (int64_t e : active) p.written[e] = 1;
  stages.Mark("gemm_dw");

  // dX rows = dg G_e^T + du U_e^T (into dY, free now): items (chunk, tile of H).
  ParallelFor(pool, workers, chunks * tilesH, [&](int64_t it, int worker) {
    const int64_t c = it / tilesH, n0 = (it % tilesH) * kTileCols;
    const int nc = static_cast<int>(std::min(kTileCols, H - n0));
    const int64_t e = b.chunk_expert[c];
    float* scratch = b.scratch + worker * scratch_stride;
    GemmTile<W>(kt, MatA{b.GU, 2 * I, 1}, MatB<W>{static_cast<const W*>(p.gate[e]), 1, I},
                MatC{b.dY, H}, b.chunk_begin[c], b.chunk_end[c], n0, nc, I, false, scratch);
    GemmTile<W>(kt, MatA{b.GU + I, 2 * I, 1}, MatB<W>{static_cast<const W*>(p.up[e]), 1, I},
                MatC{b.dY, H}, b.chunk_begin[c], b.chunk_end[c], n0, nc, I, true, scratch);
  });
  stages.Mark("gemm_dx");

  // dx[t] = sum over j in order of dX[row(t, j)] (zero when every slot was skipped).
  CombineSlotRows(pool, workers, t0, t1, k, b.slot_row, b.dY, H, p.x_type, p.dx);
  stages.Mark("combine");
}

// Inputs: dy, x [T, H]; topk_weights, topk_ids [T, k]; then the weights: 3
// stacked buffers (gate, up [E, H, I], down [E, I, H]) or 3E per-expert ones.
// Results: dx [T, H] (x's dtype), dw [T, k] float32, then the weight
// gradients in float32, laid out as the weights (3 stacked or 3E buffers).
// With `aliased` (tests) one input per result follows the weights, aliased to
// it and filled with NaN, so that anything the handler leaves unwritten shows.
ffi::Error FusedMoeBackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                                ffi::Buffer<ffi::F32> topk_w, ffi::Buffer<ffi::S32> topk_ids,
                                ffi::RemainingArgs weights, ffi::Result<ffi::AnyBuffer> dx,
                                ffi::Result<ffi::Buffer<ffi::F32>> dw, ffi::RemainingRets grads,
                                int64_t activation, int64_t band_tokens, int64_t max_workers,
                                int64_t skip_outside, int64_t num_experts, int64_t stacked,
                                int64_t aliased) {
  const int64_t E = num_experts;
  const int64_t per = stacked ? 1 : E;
  // aliased (tests): the results' NaN-filled twins follow the weights
  const int64_t trailing = aliased ? 2 + 3 * per : 0;
  if (E < 1 || static_cast<int64_t>(weights.size()) != 3 * per + trailing ||
      static_cast<int64_t>(grads.size()) != 3 * per)
    return ffi::Error::InvalidArgument("expected " + std::to_string(3 * per) +
                                       " weight buffers and as many gradient results; got " +
                                       std::to_string(weights.size()) + " and " +
                                       std::to_string(grads.size()));
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
  if (activation != kSwiGLU && activation != kGeGLU)
    return ffi::Error::InvalidArgument("unknown activation code " + std::to_string(activation));

  // Weights and their gradient buffers: E addresses per projection.
  const char* names[3] = {"gate", "up", "down"};
  std::vector<const void*> tables(3 * E);
  std::vector<float*> gtables(3 * E);
  int64_t I = -1;
  ffi::DataType wt = ffi::DataType::INVALID;
  for (int pj = 0; pj < 3; ++pj) {
    for (int64_t i = 0; i < per; ++i) {
      auto b = weights.get<ffi::AnyBuffer>(pj * per + i);
      if (b.has_error()) return b.error();
      auto g = grads.get<ffi::AnyBuffer>(pj * per + i);
      if (g.has_error()) return g.error();
      auto d = b->dimensions();
      const size_t rank = stacked ? 3 : 2;
      if (d.size() != rank)
        return ffi::Error::InvalidArgument(std::string(names[pj]) + " must be " +
                                           (stacked ? "[E, ...]" : "2-D") + ", got " + Shape(d));
      if (stacked && d[0] != E)
        return ffi::Error::InvalidArgument(std::string(names[pj]) + " has " + std::to_string(d[0]) +
                                           " experts; expected " + std::to_string(E));
      if (I < 0) {
        I = d[rank - 1];
        wt = b->element_type();
        if (!IsFloatType(wt))
          return ffi::Error::InvalidArgument("expert weights must be float32, bfloat16 or float16");
      }
      const int64_t rows = pj < 2 ? H : I, cols = pj < 2 ? I : H;
      if (d[rank - 2] != rows || d[rank - 1] != cols || b->element_type() != wt)
        return ffi::Error::InvalidArgument(
            std::string(names[pj]) + (stacked ? "" : " expert " + std::to_string(i)) +
            " has shape " + Shape(d) + "; expected [" + std::to_string(rows) + ", " +
            std::to_string(cols) + "] per expert and gate's dtype");
      if ((*g)->element_type() != ffi::DataType::F32 ||
          (*g)->element_count() != b->element_count())
        return ffi::Error::InvalidArgument(std::string("the gradient of ") + names[pj] +
                                           " must be float32 with the weight's shape");
      AdviseHugePages((*g)->untyped_data(), (*g)->size_bytes());
      const size_t es = ffi::ByteWidth(wt);
      for (int64_t e = stacked ? 0 : i; e < (stacked ? E : i + 1); ++e) {
        const int64_t off = stacked ? e * rows * cols : 0;
        tables[pj * E + e] = static_cast<const char*>(b->untyped_data()) + off * es;
        gtables[pj * E + e] = static_cast<float*>((*g)->untyped_data()) + off;
      }
    }
  }

  const int32_t* ids = topk_ids.typed_data();
  if (ffi::Error e = CheckIds(ids, T, k, E, skip_outside != 0); e.failure()) return e;
  // Gradients of experts that receive no rows are zero: written at the end
  // (the others are written by their first band's GEMMs, never zeroed first).
  std::vector<uint8_t> written(E, 0);
  auto zero_unwritten = [&]() {
    for (int pj = 0; pj < 3; ++pj)
      for (int64_t e = 0; e < E; ++e)
        if (!written[e]) std::fill(gtables[pj * E + e], gtables[pj * E + e] + H * I, 0.0f);
  };
  if (T == 0 || H == 0 || I == 0 || k == 0) {
    std::memset(dx->untyped_data(), 0, dx->size_bytes());
    std::memset(dw->untyped_data(), 0, dw->size_bytes());
    zero_unwritten();
    return ffi::Error::Success();
  }

  Problem p{T, H, I, E, k, dy.untyped_data(), x.untyped_data(), x.element_type(),
            topk_w.typed_data(), ids, tables.data(), tables.data() + E, tables.data() + 2 * E,
            dx->untyped_data(), dw->typed_data(), gtables.data(), gtables.data() + E,
            gtables.data() + 2 * E, activation, written.data()};
  const int64_t band = (band_tokens <= 0) ? T : std::min(band_tokens, T);
  const int workers = static_cast<int>(std::clamp<int64_t>(max_workers, 1, MaxWorkers(pool)));
  const KernelTable& kt = *ActiveKernels();
  const Device cpu{"cpu", 0};
  Workspace ws;
  std::string err;
  const WorkShape shape{band, H, static_cast<int64_t>(BandBytes(0, E, H, I, workers, kt))};
  if (!Workspace::Allocate(cpu, BandBytes(band * k, E, H, I, workers, kt), "backward", shape,
                           &ws, &err))
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, err);
  Band b;
  CarveBand(ws.data(), band * k, E, H, I, workers, kt, &b);
  for (int64_t t0 = 0; t0 < T; t0 += band) {
    const int64_t t1 = std::min(T, t0 + band);
    switch (wt) {
      case ffi::DataType::F32: RunBand<float>(p, kt, pool, workers, t0, t1, b); break;
      case ffi::DataType::BF16: RunBand<bf16>(p, kt, pool, workers, t0, t1, b); break;
      default: RunBand<f16>(p, kt, pool, workers, t0, t1, b); break;
    }
  }
  zero_unwritten();
  return ffi::Error::Success();
}

}  // namespace

size_t BackwardWorkspaceBytes(int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I,
                              int workers) {
  return BandBytes(tokens * k, E, H, I, workers, *ActiveKernels());
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeBackwardCpu, FusedMoeBackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // dy [T, H]
                                  .Arg<ffi::AnyBuffer>()         // x [T, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // topk_weights [T, k]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // topk_ids [T, k]
                                  .RemainingArgs()               // weights (3 or 3E)
                                  .Ret<ffi::AnyBuffer>()         // dx [T, H]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dw [T, k]
                                  .RemainingRets()               // weight gradients, float32
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("band_tokens")
                                  .Attr<int64_t>("max_workers")
                                  .Attr<int64_t>("skip_outside")
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("stacked")
                                  .Attr<int64_t>("aliased"));

}  // namespace nbx
