// CPU handler: the fused MoE forward in one call.
//
//   for each band of tokens [t0, t1):
//     plan    count the band's T*k slots per expert; order them by expert,
//             each expert's group padded to whole m-panels of MR rows
//     gather  x rows -> packed A panels (float32, [H][MR] per panel)
//     GEMM1   act(A @ gate[e]) * (A @ up[e]) -> packed panels of the
//             activations ([I][MR]), the activation fused in the epilogue
//     GEMM2   weight * (act @ down[e]) -> O rows (O reuses the A memory)
//     combine y[t] = O[slot(t,0)] + O[slot(t,1)] + ...   (fixed order)
//
// The arithmetic is in the micro-kernels of the instruction set chosen at run
// time (kernel_table.h, kernels.h).  Experts with few rows in the band
// (decode) skip packing: their weights (float32, bfloat16, int8 or int4) are
// streamed once, in place.  Every
// output element is the same kk-ordered sum whatever the kernel, band, tile
// or thread, so banded and unbanded results are identical bit for bit.  The
// workspace of a band is one block counted in the account (account.h);
// Python plans the bands so that each fits before the call runs.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "account.h"
#include "cpu/handler_common.h"
#include "cpu/kernel_table.h"
#include "cpu/moe_forward.h"
#include "dtypes.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace nbx {
namespace {

constexpr int64_t kPanelsPerChunk = 16;  // m-panels per work item
constexpr int64_t kTileCols = 256;       // output columns per work item
// Experts with at most this many rows (and at most MR: one m-panel) stream.
constexpr int64_t kStreamRows = kMaxStreamRows;
constexpr int64_t kStreamCols = kMaxStreamCols;  // columns per streamed work item
static_assert(kStreamCols % kTileCols == 0, "a streamed item covers whole tiles");

// Weight rows per K-block: a packed block (kKBlock rows of a tile, 256 kB
// in float32) and the partial sums of the chunk's rows stay in L2, one
// micro-panel of B (kKBlock x 2VL floats) in L1.  128 rather than 64: half
// the partial-sum round trips; OLMoE T=512 f32 ran 6-8% faster (interleaved
// runs in one process, 2-core Zen 3 with 512 kB L2 per core).
constexpr int64_t kKBlock = 128;

// Per-worker scratch: one packed K-block of a weight tile (gate||up: 2 *
// kTileCols columns), then the partial sums of one chunk over the tile's
// columns (kPanelsPerChunk panels x MR rows x 2 * kTileCols), which also hold
// the streaming accumulators.
int64_t ScratchFloats(int mr) {
  return kKBlock * 2 * kTileCols +
         std::max(kPanelsPerChunk * mr * 2 * kTileCols, 2 * kStreamRows * kStreamCols);
}


// Padded rows: each non-empty expert's group rounds up to whole m-panels.
int64_t MaxPaddedRows(int64_t S, int64_t E, int mr) {
  return S + std::min(S, E) * (mr - 1);
}
int64_t MaxChunks(int64_t P, int64_t E, int mr) {
  return std::min(P / mr, E) + P / (mr * kPanelsPerChunk) + 1;
}

struct Band {
  int32_t* inv;          // [(t-t0)*k + j] -> padded row
  int32_t* row_token;    // [P] token of each padded row, -1 for padding
  float* row_weight;     // [P] routed weight of each padded row, 0 for padding
  int64_t* expert_off;   // [E+1] padded row range of each expert
  int64_t* cursor;       // [E+1] placement; then the end of each expert's real rows
  int64_t* total;        // [E+1] expert-major groups: slots per expert in the call
  int64_t* seen;         // [E+1] expert-major groups: slots of each expert scanned
  int32_t* chunk_expert; // [C]
  int64_t* chunk_begin;  // [C] padded rows, multiples of MR
  int64_t* chunk_end;    // [C] end of the expert's real rows within the chunk
  float* XO;             // [P/MR][H][MR] packed x; later O [P][H]
  float* A2;             // [P/MR][I][MR] packed activations
  float* scratch;        // [workers][ScratchFloats] packed K-block, partial sums
};

// Lays a band's arrays out from `base`; returns the bytes they take.  With
// base == nullptr it only measures: the one layout both sizes the
// allocation (and the Python plan) and carves it.
size_t CarveBand(void* base, int64_t S, int64_t E, int64_t H, int64_t I, int workers,
                 const KernelTable& kt, Band* b) {
  const int64_t P = MaxPaddedRows(S, E, kt.mr);
  const int64_t C = MaxChunks(P, E, kt.mr);
  Carver cv(base);
  b->inv = cv.Take<int32_t>(S);
  b->row_token = cv.Take<int32_t>(P);
  b->row_weight = cv.Take<float>(P);
  b->expert_off = cv.Take<int64_t>(E + 1);
  b->cursor = cv.Take<int64_t>(E + 1);
  b->total = cv.Take<int64_t>(E + 1);
  b->seen = cv.Take<int64_t>(E + 1);
  b->chunk_expert = cv.Take<int32_t>(C);
  b->chunk_begin = cv.Take<int64_t>(C);
  b->chunk_end = cv.Take<int64_t>(C);
  b->XO = cv.Take<float>(P * H);
  b->A2 = cv.Take<float>(P * I);
  b->scratch = cv.Take<float>(static_cast<int64_t>(workers) * ScratchFloats(kt.mr));
  return cv.used();
}

size_t BandBytes(int64_t S, int64_t E, int64_t H, int64_t I, int workers,
                 const KernelTable& kt) {
  Band unused;
  return CarveBand(nullptr, S, E, H, I, workers, kt, &unused);
}

struct Problem {
  int64_t T, H, I, E, k;
  const void* x;
  ffi::DataType x_type;
  const float* topk_w;
  const int32_t* topk_ids;
  // Each expert's matrix, read in place: E addresses per projection (a
  // stacked array's slices, the buffers of per-expert lists, or QuantMatrix
  // records for quantized experts).
  const void* const* gate;
  const void* const* up;
  const void* const* down;
  ffi::DataType w_type;  // U8: quantized (QuantMatrix tables)
  void* y;
  int64_t activation;
  bool skip_outside;  // ids outside [0, E) are skipped (expert parallelism), not an error
};


// dst[0, VL) = float(src[0, n)), zero-padded (n <= VL).
template <int VL, typename W>
inline void CopyPadVec(const W* src, int n, float* dst) {
  if (n == VL) {
    if constexpr (std::is_same_v<W, float>) {
      std::memcpy(dst, src, VL * sizeof(float));
    } else {
      for (int c = 0; c < VL; ++c) dst[c] = ToFloat(src[c]);
    }
    return;
  }
  for (int c = 0; c < n; ++c) dst[c] = ToFloat(src[c]);
  for (int c = n; c < VL; ++c) dst[c] = 0.0f;
}

// RunRows' weight type for quantized experts: tables hold QuantMatrix*
// (kernel_table.h); the ISA kernels read them (qstream1/2, qpack).
struct Quantized {};

template <typename W>
struct WeightSource {
  using Src = const W*;
  static constexpr bool kQuant = false;
  static Src At(const void* const* table, int64_t e) { return static_cast<const W*>(table[e]); }
};
template <>
struct WeightSource<Quantized> {
  using Src = const QuantMatrix*;
  static constexpr bool kQuant = true;
  static Src At(const void* const* table, int64_t e) {
    return static_cast<const QuantMatrix*>(table[e]);
  }
};

// Packs rows [k0, k0+kc) of columns [n0, n0+nc) of gate and up (leading
// dimension ld) into micro-panels of VL columns: panel q at dst + q*kc*2VL,
// row i holds VL gate then VL up values, zero-padded.  Each row's run is read
// in order; the caller prefetched the block (Prefetcher), so the short runs
// (one per page) do not stall on a miss each.
template <int VL, typename Src>
void PackGateUpBlockT(Src g, Src u, int64_t ld, int64_t k0, int kc, int64_t n0,
                      int nc, float* dst) {
  const int nsub = (nc + VL - 1) / VL;
  for (int i = 0; i < kc; ++i) {
    const Src gr = g + (k0 + i) * ld + n0;
    const Src ur = u + (k0 + i) * ld + n0;
    float* d = dst + i * 2 * VL;
    for (int q = 0; q < nsub; ++q, d += kc * 2 * VL) {
      const int n = std::min(VL, nc - q * VL);
      CopyPadVec<VL>(gr + q * VL, n, d);
      CopyPadVec<VL>(ur + q * VL, n, d + VL);
    }
  }
}

// Packs rows [k0, k0+kc) of columns [n0, n0+nc) of down into micro-panels of
// 2VL columns (same scheme).
template <int VL, typename Src>
void PackDownBlockT(Src dn, int64_t ld, int64_t k0, int kc, int64_t n0, int nc,
                    float* dst) {
  const int nsub = (nc + 2 * VL - 1) / (2 * VL);
  for (int i = 0; i < kc; ++i) {
    const Src r = dn + (k0 + i) * ld + n0;
    float* d = dst + i * 2 * VL;
    for (int q = 0; q < nsub; ++q, d += kc * 2 * VL) {
      const int n = std::min(2 * VL, nc - q * 2 * VL);
      CopyPadVec<VL>(r + q * 2 * VL, std::min(n, VL), d);
      CopyPadVec<VL>(r + q * 2 * VL + VL, std::max(n - VL, 0), d + VL);
    }
  }
}

template <typename Src>
void PackGateUpBlock(Src g, Src u, int64_t ld, int64_t k0, int kc, int64_t n0,
                     int nc, int vl, float* dst) {
  switch (vl) {
    case 16: PackGateUpBlockT<16>(g, u, ld, k0, kc, n0, nc, dst); break;
    case 8: PackGateUpBlockT<8>(g, u, ld, k0, kc, n0, nc, dst); break;
    default: PackGateUpBlockT<4>(g, u, ld, k0, kc, n0, nc, dst); break;
  }
}

template <typename Src>
void PackDownBlock(Src dn, int64_t ld, int64_t k0, int kc, int64_t n0, int nc, int vl,
                   float* dst) {
  switch (vl) {
    case 16: PackDownBlockT<16>(dn, ld, k0, kc, n0, nc, dst); break;
    case 8: PackDownBlockT<8>(dn, ld, k0, kc, n0, nc, dst); break;
    default: PackDownBlockT<4>(dn, ld, k0, kc, n0, nc, dst); break;
  }
}

// Software prefetch of the next K-block of a tile (runs of `bytes` bytes at
// up to two matrices, rows [k0, k0+kc), stride ld_bytes), issued a few cache
// lines at a time between micro-kernel calls: the reads overlap the
// arithmetic, and the runs, one per page, cross pages that the hardware
// prefetcher does not.
class Prefetcher {
 public:
  void Start(const char* m0, const char* m1, int64_t ld_bytes, int64_t k0, int64_t kc,
             int64_t bytes) {
    m_[0] = m0;
    m_[1] = m1;
    nm_ = m1 ? 2 : 1;
    ld_ = ld_bytes;
    lines_ = (bytes + 63) / 64;
    left_ = kc * nm_ * lines_;
    row_ = k0;
    mat_ = 0;
    line_ = 0;
  }
  // Issues the next n prefetches (row by row, each matrix's run in turn;
  // counters, no division per line).
  void Step(int64_t n) {
    for (n = std::min(n, left_), left_ -= n; n > 0; --n) {
      __builtin_prefetch(m_[mat_] + row_ * ld_ + line_ * 64, 0, 3);
      if (++line_ == lines_) {
        line_ = 0;
        if (++mat_ == nm_) mat_ = 0, ++row_;
      }
    }
  }
  void Finish() { Step(left_); }
  int64_t left() const { return left_; }

 private:
  const char* m_[2] = {nullptr, nullptr};
  int nm_ = 1;
  int64_t ld_ = 0, lines_ = 1, left_ = 0, row_ = 0, mat_ = 0, line_ = 0;
};

// Column n's scale of an int8 matrix.
inline float ColumnScale(const QuantMatrix& m, int64_t n) {
  return m.bf16_scales ? ToFloat(static_cast<const bf16*>(m.scale)[n])
                       : static_cast<const float*>(m.scale)[n];
}

// Starts the prefetch of rows [k0, k0+kc) of columns [n0, n0+nc) of a and b
// (b may be null; ld columns per row).
template <typename W>
void StartPrefetch(Prefetcher& pf, const W* a, const W* b, int64_t ld, int64_t k0, int64_t kc,
                   int64_t n0, int64_t nc) {
  pf.Start(reinterpret_cast<const char*>(a + n0),
           b ? reinterpret_cast<const char*>(b + n0) : nullptr, ld * sizeof(W), k0, kc,
           nc * sizeof(W));
}
// Quantized: the q bytes (int4: the byte rows holding those rows); the scales
// are small next to them and stay cached.
inline void StartPrefetch(Prefetcher& pf, const QuantMatrix* a, const QuantMatrix* b,
                          int64_t ld, int64_t k0, int64_t kc, int64_t n0, int64_t nc) {
  const int64_t d = a->int4 ? 2 : 1;
  pf.Start(static_cast<const char*>(a->q) + n0,
           b ? static_cast<const char*>(b->q) + n0 : nullptr, ld, k0 / d,
           (k0 + kc + d - 1) / d - k0 / d, nc);
}

template <typename XT>
void GatherPanel(const XT* x, int64_t H, const int32_t* row_token, int mr, float* dst) {
  for (int r = 0; r < mr; ++r) {
    if (row_token[r] < 0) {
      for (int64_t h = 0; h < H; ++h) dst[h * mr + r] = 0.0f;
    } else {
      const XT* src = x + static_cast<int64_t>(row_token[r]) * H;
      for (int64_t h = 0; h < H; ++h) dst[h * mr + r] = ToFloat(src[h]);
    }
  }
}

// The rows a band runs, ordered by expert (each expert's rows padded to whole
// m-panels, stable in (t, j)); returns the number of chunks.
int64_t Chunks(const Problem& p, int mr, const Band& b) {
  int64_t chunks = 0;
  const int64_t chunk_rows = mr * kPanelsPerChunk;
  for (int64_t e = 0; e < p.E; ++e) {
    const int64_t real_end = b.cursor[e];  // after placement: end of real rows
    for (int64_t m = b.expert_off[e]; m < real_end; m += chunk_rows) {
      b.chunk_expert[chunks] = static_cast<int32_t>(e);
      b.chunk_begin[chunks] = m;
      b.chunk_end[chunks] = std::min(m + chunk_rows, real_end);
      ++chunks;
    }
  }
  return chunks;
}

// Token band [t0, t1): its slots, and inv for the combine.
int64_t PlanTokenBand(const Problem& p, int mr, int64_t t0, int64_t t1, const Band& b) {
  const int64_t E = p.E, k = p.k;
  std::fill(b.expert_off, b.expert_off + E + 1, int64_t{0});
  auto local = [&](int64_t i) { return p.topk_ids[i] >= 0 && p.topk_ids[i] < E; };
  for (int64_t i = t0 * k; i < t1 * k; ++i)
    if (local(i)) ++b.expert_off[p.topk_ids[i] + 1];
  for (int64_t e = 0; e < E; ++e)
    b.expert_off[e + 1] = b.expert_off[e] + (b.expert_off[e + 1] + mr - 1) / mr * mr;
  const int64_t P = b.expert_off[E];
  std::fill(b.row_token, b.row_token + P, int32_t{-1});
  std::fill(b.row_weight, b.row_weight + P, 0.0f);
  std::copy(b.expert_off, b.expert_off + E + 1, b.cursor);
  for (int64_t i = t0 * k; i < t1 * k; ++i) {
    if (!local(i)) {  // only with skip_outside: the handler refused such ids otherwise
      b.inv[i - t0 * k] = -1;
      continue;
    }
    const int64_t row = b.cursor[p.topk_ids[i]]++;
    b.row_token[row] = static_cast<int32_t>(i / k);
    b.row_weight[row] = p.topk_w[i];
    b.inv[i - t0 * k] = static_cast<int32_t>(row);
  }
  return P;
}

// A position in the call's slots ordered by (expert, t, j): expert e, rank r
// among that expert's slots.
struct SlotPos {
  int64_t e, r;
};

// Expert-major group: from `from`, as many slots (in (expert, t, j) order) as
// fit in P_max padded rows; b.total holds the call's slots per expert.
// Returns where the group ends.
SlotPos NextGroup(const Problem& p, int mr, int64_t P_max, SlotPos from, const Band& b) {
  int64_t left = P_max, e = from.e, r = from.r;
  while (e < p.E && left >= mr) {
    const int64_t avail = b.total[e] - r;
    const int64_t pad = (avail + mr - 1) / mr * mr;
    if (pad <= left) {
      left -= pad;
      ++e;
      r = 0;
    } else {  // the expert continues in the next group
      r += left / mr * mr;
      break;
    }
  }
  return {e, r};
}

// The group [from, to): its slots in order, no inv (rows are accumulated).
int64_t PlanGroup(const Problem& p, int mr, SlotPos from, SlotPos to, const Band& b) {
  const int64_t E = p.E, S = p.T * p.k;
  auto lo = [&](int64_t e) { return e == from.e ? from.r : 0; };
  auto hi = [&](int64_t e) { return e < to.e ? b.total[e] : (e == to.e ? to.r : 0); };
  b.expert_off[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = (e < from.e) ? 0 : std::max<int64_t>(hi(e) - lo(e), 0);
    b.expert_off[e + 1] = b.expert_off[e] + (n + mr - 1) / mr * mr;
  }
  const int64_t P = b.expert_off[E];
  std::fill(b.row_token, b.row_token + P, int32_t{-1});
  std::fill(b.row_weight, b.row_weight + P, 0.0f);
  std::copy(b.expert_off, b.expert_off + E + 1, b.cursor);
  std::fill(b.seen, b.seen + E + 1, int64_t{0});
  for (int64_t i = 0; i < S; ++i) {
    const int64_t e = p.topk_ids[i];
    if (e < from.e || e > to.e || e >= E) continue;  // (ids outside [0, E): skipped)
    const int64_t rank = b.seen[e]++;
    if (rank < lo(e) || rank >= hi(e)) continue;
    const int64_t row = b.cursor[e]++;
    b.row_token[row] = static_cast<int32_t>(i / p.k);
    b.row_weight[row] = p.topk_w[i];
  }
  return P;
}

// Gather, GEMM1, GEMM2 of the planned rows: O [P][H] (in b.XO) holds each
// row's weighted expert output.
template <typename W>
void RunRows(const Problem& p, const KernelTable& kt, ffi::ThreadPool& pool, int workers,
             int64_t P, int64_t chunks, const Band& b, Stages& st) {
  const int64_t H = p.H, I = p.I;
  const int mr = kt.mr, vl = kt.vl;
  using WS = WeightSource<W>;
  const int act = static_cast<int>(p.activation);
  // dense: f32 and bf16 weights stream (f16 ones always pack); quantized: all
  const bool can_stream = sizeof(W) == 4 || p.w_type == ffi::DataType::BF16;
  const int w_index = sizeof(W) == 4 ? 0 : 1;
  const int64_t stream_rows = std::min<int64_t>(kStreamRows, mr);

  // Gather into packed panels.
  ParallelFor(pool, workers, P / mr, [&](int64_t panel, int) {
    float* dst = b.XO + panel * H * mr;
    const int32_t* rt = b.row_token + panel * mr;
    switch (p.x_type) {
      case ffi::DataType::F32: GatherPanel(static_cast<const float*>(p.x), H, rt, mr, dst); break;
      case ffi::DataType::BF16: GatherPanel(static_cast<const bf16*>(p.x), H, rt, mr, dst); break;
      default: GatherPanel(static_cast<const f16*>(p.x), H, rt, mr, dst); break;
    }
  });
  st.Mark("gather");

  const int64_t scratch_stride = ScratchFloats(mr);

  // GEMM1 + activation: items (chunk, tile of kTileCols columns of I).
  const int64_t tiles1 = (I + kTileCols - 1) / kTileCols;
  ParallelFor(pool, workers, chunks * tiles1, [&](int64_t it, int worker) {
    const int64_t c = it / tiles1, n0 = (it % tiles1) * kTileCols;
    const int nc = static_cast<int>(std::min(kTileCols, I - n0));
    const int64_t e = b.chunk_expert[c];
    const int64_t m0 = b.chunk_begin[c], m1 = b.chunk_end[c];
    const auto ge = WS::At(p.gate, e);
    const auto ue = WS::At(p.up, e);
    float* scratch = b.scratch + worker * scratch_stride;
    if ((WS::kQuant || can_stream) && b.cursor[e] - b.expert_off[e] <= stream_rows) {
      // Few rows: stream the weights in place, kStreamCols columns (whole
      // contiguous rows of W) per item; the other items of the span are empty.
      if (n0 % kStreamCols != 0) return;
      const int ns = static_cast<int>(std::min(kStreamCols, I - n0));
      const int64_t panel = m0 / mr;  // all rows in one panel: stream_rows <= MR
      const int rows = static_cast<int>(m1 - m0);
      float* out = b.A2 + panel * I * mr + n0 * mr;
      if constexpr (WS::kQuant)
        kt.qstream1(b.XO + panel * H * mr, mr, rows, ge, ue, n0, H, ns, act, scratch, out, 1, mr);
      else
        kt.stream1[w_index](b.XO + panel * H * mr, mr, rows, ge + n0, ue + n0, I, H, ns, act,
                            scratch, out, 1, mr);
      return;
    }
    // K-blocks: pack kKBlock rows of the tile (prefetched during the previous
    // block), then run every m-panel of the chunk through each micro-panel,
    // partial sums kept in `part` between blocks.
    float* packed = scratch;
    float* part = scratch + kKBlock * 2 * kTileCols;
    const int nsub = (nc + vl - 1) / vl;
    const int64_t panels = (m1 - m0 + mr - 1) / mr;
    // int8: the tile's column scales, per micro-panel VL gate then VL up
    float colscale[2 * kTileCols];
    const float* scale = nullptr;
    if constexpr (WS::kQuant) {
      if (!ge->int4) {
        for (int q = 0; q < nsub; ++q)
          for (int j = 0; j < vl; ++j) {
            const int64_t col = n0 + q * vl + j;
            colscale[q * 2 * vl + j] = col < n0 + nc ? ColumnScale(*ge, col) : 0.0f;
            colscale[q * 2 * vl + vl + j] = col < n0 + nc ? ColumnScale(*ue, col) : 0.0f;
          }
        scale = colscale;
      }
    }
    Prefetcher pf;  // the first block: all at once, before packing it
    StartPrefetch(pf, ge, ue, I, 0, std::min(kKBlock, H), n0, nc);
    for (int64_t k0 = 0; k0 < H; k0 += kKBlock) {
      const int kc = static_cast<int>(std::min(kKBlock, H - k0));
      pf.Finish();
      if constexpr (WS::kQuant) {  // gate then up, VL columns each per row
        kt.qpack(ge, k0, kc, n0, nc, vl, packed, 2 * vl, kc * 2 * vl);
        kt.qpack(ue, k0, kc, n0, nc, vl, packed + vl, 2 * vl, kc * 2 * vl);
      } else {
        PackGateUpBlock(ge, ue, I, k0, kc, n0, nc, vl, packed);
      }
      if (k0 + kc < H) StartPrefetch(pf, ge, ue, I, k0 + kc, std::min(kKBlock, H - k0 - kc), n0, nc);
      const int64_t per_call = pf.left() / (nsub * panels) + 1;
      const int flags = (k0 > 0 ? kLoadPartial : 0) | (k0 + kc < H ? kStorePartial : 0);
      for (int q = 0; q < nsub; ++q) {
        const int cols = std::min(vl, nc - q * vl);
        for (int64_t pi = 0; pi < panels; ++pi) {
          const int64_t m = m0 + pi * mr, panel = m / mr;
          kt.gemm1(b.XO + panel * H * mr + k0 * mr, packed + q * kc * 2 * vl, kc, act,
                   static_cast<int>(std::min<int64_t>(mr, m1 - m)), cols,
                   b.A2 + panel * I * mr + (n0 + q * vl) * mr, 1, mr,
                   part + (pi * nsub + q) * mr * 2 * vl, flags,
                   scale ? scale + q * 2 * vl : nullptr);
          pf.Step(per_call);
        }
      }
    }
  });

  st.Mark("gemm1");

  // GEMM2 + routed weight: items (chunk, tile of kTileCols columns of H).
  // Output rows go to O (same memory as the packed x, no longer needed).
  float* O = b.XO;
  const int64_t tiles2 = (H + kTileCols - 1) / kTileCols;
  ParallelFor(pool, workers, chunks * tiles2, [&](int64_t it, int worker) {
    const int64_t c = it / tiles2, n0 = (it % tiles2) * kTileCols;
    const int nc = static_cast<int>(std::min(kTileCols, H - n0));
    const int64_t e = b.chunk_expert[c];
    const int64_t m0 = b.chunk_begin[c], m1 = b.chunk_end[c];
    const auto de = WS::At(p.down, e);
    float* scratch = b.scratch + worker * scratch_stride;
    if ((WS::kQuant || can_stream) && b.cursor[e] - b.expert_off[e] <= stream_rows) {
      if (n0 % kStreamCols != 0) return;
      const int ns = static_cast<int>(std::min(kStreamCols, H - n0));
      const int64_t panel = m0 / mr;
      const int rows = static_cast<int>(m1 - m0);
      if constexpr (WS::kQuant)
        kt.qstream2(b.A2 + panel * I * mr, mr, rows, de, n0, I, ns, b.row_weight + m0, scratch,
                    O + m0 * H + n0, H);
      else
        kt.stream2[w_index](b.A2 + panel * I * mr, mr, rows, de + n0, H, I, ns,
                            b.row_weight + m0, scratch, O + m0 * H + n0, H);
      return;
    }
    float* packed = scratch;
    float* part = scratch + kKBlock * 2 * kTileCols;
    const int nsub = (nc + 2 * vl - 1) / (2 * vl);
    const int64_t panels = (m1 - m0 + mr - 1) / mr;
    float colscale[kTileCols + 32];  // int8: the tile's column scales
    const float* scale = nullptr;
    if constexpr (WS::kQuant) {
      if (!de->int4) {
        for (int j = 0; j < nsub * 2 * vl; ++j)
          colscale[j] = j < nc ? ColumnScale(*de, n0 + j) : 0.0f;
        scale = colscale;
      }
    }
    Prefetcher pf;
    StartPrefetch(pf, de, decltype(de){nullptr}, H, 0, std::min(kKBlock, I), n0, nc);
    for (int64_t k0 = 0; k0 < I; k0 += kKBlock) {
      const int kc = static_cast<int>(std::min(kKBlock, I - k0));
      pf.Finish();
      if constexpr (WS::kQuant)
        kt.qpack(de, k0, kc, n0, nc, 2 * vl, packed, 2 * vl, kc * 2 * vl);
      else
        PackDownBlock(de, H, k0, kc, n0, nc, vl, packed);
      if (k0 + kc < I)
        StartPrefetch(pf, de, decltype(de){nullptr}, H, k0 + kc, std::min(kKBlock, I - k0 - kc),
                      n0, nc);
      const int64_t per_call = pf.left() / (nsub * panels) + 1;
      const int flags = (k0 > 0 ? kLoadPartial : 0) | (k0 + kc < I ? kStorePartial : 0);
      for (int q = 0; q < nsub; ++q) {
        const int cols = std::min(2 * vl, nc - q * 2 * vl);
        for (int64_t pi = 0; pi < panels; ++pi) {
          const int64_t m = m0 + pi * mr, panel = m / mr;
          kt.gemm2(b.A2 + panel * I * mr + k0 * mr, packed + q * kc * 2 * vl, kc,
                   b.row_weight + m, static_cast<int>(std::min<int64_t>(mr, m1 - m)), cols,
                   O + m * H + n0 + q * 2 * vl, H, part + (pi * nsub + q) * mr * 2 * vl,
                   flags, scale ? scale + q * 2 * vl : nullptr);
          pf.Step(per_call);
        }
      }
    }
  });
  st.Mark("gemm2");
}

// Expert-major group (float32 y, zeroed before the first group): y[t] += O[row]
// for the group's rows in order, so that over all groups each y[t] is the sum
// of its slots' outputs in (expert, j) order whatever the grouping.  Items are
// column ranges: every item walks all rows.
void AccumulateRows(const Problem& p, ffi::ThreadPool& pool, int workers, int64_t P,
                    const Band& b) {
  const int64_t H = p.H;
  const float* O = b.XO;
  float* y = static_cast<float*>(p.y);
  constexpr int64_t kCols = 256;
  ParallelFor(pool, workers, (H + kCols - 1) / kCols, [&](int64_t it, int) {
    const int64_t h0 = it * kCols, h1 = std::min(H, h0 + kCols);
    for (int64_t r = 0; r < P; ++r) {
      const int32_t t = b.row_token[r];
      if (t < 0) continue;
      const float* o = O + r * H;
      float* yt = y + static_cast<int64_t>(t) * H;
      for (int64_t h = h0; h < h1; ++h) yt[h] += o[h];
    }
  });
}

template <typename W>
void RunTokenBand(const Problem& p, const KernelTable& kt, ffi::ThreadPool& pool,
                  int workers, int64_t t0, int64_t t1, const Band& b) {
  Stages st("forward band");
  const int64_t P = PlanTokenBand(p, kt.mr, t0, t1, b);
  const int64_t chunks = Chunks(p, kt.mr, b);
  st.Mark("plan");
  RunRows<W>(p, kt, pool, workers, P, chunks, b, st);
  // y[t] = sum over j in order of O[row(t, j)]
  CombineSlotRows(pool, workers, t0, t1, p.k, b.inv, b.XO, p.H, p.x_type, p.y);
  st.Mark("combine");
}

// Float32 x: the call runs in expert-major groups of at most P_max padded
// rows (what a band of band_tokens tokens would take), so that each expert's
// weights are packed once per call, not once per band, unless one expert
// alone has more rows than a group holds.
template <typename W>
void RunExpertGroups(const Problem& p, const KernelTable& kt, ffi::ThreadPool& pool,
                     int workers, int64_t P_max, const Band& b) {
  std::fill(b.total, b.total + p.E + 1, int64_t{0});
  for (int64_t i = 0; i < p.T * p.k; ++i)
    if (p.topk_ids[i] >= 0 && p.topk_ids[i] < p.E) ++b.total[p.topk_ids[i]];
  std::memset(p.y, 0, static_cast<size_t>(p.T * p.H) * sizeof(float));
  for (SlotPos from{0, 0}; from.e < p.E;) {
    Stages st("forward group");
    const SlotPos to = NextGroup(p, kt.mr, P_max, from, b);
    const int64_t P = PlanGroup(p, kt.mr, from, to, b);
    const int64_t chunks = Chunks(p, kt.mr, b);
    st.Mark("plan");
    RunRows<W>(p, kt, pool, workers, P, chunks, b, st);
    AccumulateRows(p, pool, workers, P, b);
    st.Mark("accumulate");
    from = to;
  }
}

// The body shared by stacked and per-expert weights: the tables hold each
// expert's address per projection; E, I and the weights' dtype were checked
// by the caller.
ffi::Error RunForward(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> topk_w,
                      ffi::Buffer<ffi::S32> topk_ids, int64_t E, int64_t I, ffi::DataType wt,
                      const void* const* gate, const void* const* up, const void* const* down,
                      ffi::Result<ffi::AnyBuffer> y, int64_t activation, int64_t band_tokens,
                      int64_t max_workers, int64_t skip_outside) {
  int64_t T, H, k;
  if (ffi::Error e = CheckRouting(x, topk_w, topk_ids, &T, &H, &k); e.failure()) return e;
  if (y->element_type() != x.element_type() || y->dimensions().size() != 2 ||
      y->dimensions()[0] != T || y->dimensions()[1] != H)
    return ffi::Error::InvalidArgument("y must have x's shape and dtype");
  if (activation != kSwiGLU && activation != kGeGLU)
    return ffi::Error::InvalidArgument("unknown activation code " + std::to_string(activation));

  const int32_t* ids = topk_ids.typed_data();
  if (ffi::Error e = CheckIds(ids, T, k, E, skip_outside != 0); e.failure()) return e;
  if (T == 0 || H == 0) return ffi::Error::Success();

  Problem p{T, H, I, E, k, x.untyped_data(), x.element_type(), topk_w.typed_data(), ids,
            gate, up, down, wt, y->untyped_data(), activation, skip_outside != 0};

  if (I == 0 || k == 0) {
    std::memset(y->untyped_data(), 0, y->size_bytes());
    return ffi::Error::Success();
  }

  const int64_t band = (band_tokens <= 0) ? T : std::min(band_tokens, T);
  // The plan counted panels for max_workers; never use more.
  const int workers = static_cast<int>(
      std::clamp<int64_t>(max_workers, 1, MaxWorkers(pool)));
  const Device cpu{"cpu", 0};
  const KernelTable& kt = *ActiveKernels();
  if (x.element_type() == ffi::DataType::F32) {
    // One workspace of a band of `band` tokens, run in expert-major groups.
    const int64_t S = band * k;
    Workspace ws;
    std::string err;
    const WorkShape shape{band, H, static_cast<int64_t>(BandBytes(0, E, H, I, workers, kt))};
    if (!Workspace::Allocate(cpu, BandBytes(S, E, H, I, workers, kt), "workspace", shape,
                             &ws, &err))
      return ffi::Error(ffi::ErrorCode::kResourceExhausted, err);
    Band b;
    CarveBand(ws.data(), S, E, H, I, workers, kt, &b);
    const int64_t P_max = MaxPaddedRows(S, E, kt.mr);
    switch (wt) {
      case ffi::DataType::F32: RunExpertGroups<float>(p, kt, pool, workers, P_max, b); break;
      case ffi::DataType::BF16: RunExpertGroups<bf16>(p, kt, pool, workers, P_max, b); break;
      case ffi::DataType::U8: RunExpertGroups<Quantized>(p, kt, pool, workers, P_max, b); break;
      default: RunExpertGroups<f16>(p, kt, pool, workers, P_max, b); break;
    }
    return ffi::Error::Success();
  }
  // bfloat16 / float16 x: token bands, each summed in j order and stored.
  for (int64_t t0 = 0; t0 < T; t0 += band) {
    const int64_t t1 = std::min(T, t0 + band);
    const int64_t S = (t1 - t0) * k;
    Workspace ws;
    std::string err;
    const WorkShape shape{t1 - t0, H,
                          static_cast<int64_t>(BandBytes(0, E, H, I, workers, kt))};
    if (!Workspace::Allocate(cpu, BandBytes(S, E, H, I, workers, kt), "workspace",
                             shape, &ws, &err))
      return ffi::Error(ffi::ErrorCode::kResourceExhausted, err);
    Band b;
    CarveBand(ws.data(), S, E, H, I, workers, kt, &b);
    switch (wt) {
      case ffi::DataType::F32: RunTokenBand<float>(p, kt, pool, workers, t0, t1, b); break;
      case ffi::DataType::BF16: RunTokenBand<bf16>(p, kt, pool, workers, t0, t1, b); break;
      case ffi::DataType::U8: RunTokenBand<Quantized>(p, kt, pool, workers, t0, t1, b); break;
      default: RunTokenBand<f16>(p, kt, pool, workers, t0, t1, b); break;
    }
  }
  return ffi::Error::Success();
}

// Stacked [E, H, I], [E, H, I], [E, I, H] arrays.
ffi::Error FusedMoeForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> topk_w,
                               ffi::Buffer<ffi::S32> topk_ids, ffi::AnyBuffer gate,
                               ffi::AnyBuffer up, ffi::AnyBuffer down,
                               ffi::Result<ffi::AnyBuffer> y, int64_t activation,
                               int64_t band_tokens, int64_t max_workers, int64_t skip_outside) {
  // Shapes: Python validated them at trace time; check again, never trust.
  auto xd = x.dimensions();
  auto gd = gate.dimensions();
  auto ud = up.dimensions();
  auto dd = down.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x must be [T, H], got " + Shape(xd));
  const int64_t H = xd[1];
  if (gd.size() != 3) return ffi::Error::InvalidArgument("gate must be [E, H, I], got " + Shape(gd));
  const int64_t E = gd[0], I = gd[2];
  if (gd[1] != H)
    return ffi::Error::InvalidArgument("gate must be [E, H, I] with H=" + std::to_string(H) + ", got " + Shape(gd));
  if (ud.size() != 3 || ud[0] != E || ud[1] != H || ud[2] != I)
    return ffi::Error::InvalidArgument("up must have gate's shape " + Shape(gd) + ", got " + Shape(ud));
  if (dd.size() != 3 || dd[0] != E || dd[1] != I || dd[2] != H)
    return ffi::Error::InvalidArgument("down must be [E, I, H] = (" + std::to_string(E) + ", " + std::to_string(I) + ", " + std::to_string(H) + "), got " + Shape(dd));
  const ffi::DataType wt = gate.element_type();
  if (!IsFloatType(wt) || up.element_type() != wt || down.element_type() != wt)
    return ffi::Error::InvalidArgument("gate, up and down must share one dtype among float32, bfloat16, float16");
  const size_t es = ffi::ByteWidth(wt);
  std::vector<const void*> tables(3 * E);
  for (int64_t e = 0; e < E; ++e) {
    tables[e] = static_cast<const char*>(gate.untyped_data()) + e * H * I * es;
    tables[E + e] = static_cast<const char*>(up.untyped_data()) + e * H * I * es;
    tables[2 * E + e] = static_cast<const char*>(down.untyped_data()) + e * I * H * es;
  }
  return RunForward(pool, x, topk_w, topk_ids, E, I, wt, tables.data(), tables.data() + E,
                    tables.data() + 2 * E, y, activation, band_tokens, max_workers, skip_outside);
}

// Per-expert buffers gate[0..E) [H, I], up[0..E) [H, I], down[0..E) [I, H],
// read in place through the table of their addresses (never stacked).
// `trailing` buffers after the 3E weights are ignored (the tests' aliased output).
ffi::Error ForwardLists(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> topk_w,
                        ffi::Buffer<ffi::S32> topk_ids, ffi::RemainingArgs weights,
                        int64_t trailing, ffi::Result<ffi::AnyBuffer> y, int64_t activation,
                        int64_t band_tokens, int64_t max_workers, int64_t skip_outside,
                        int64_t num_experts) {
  const int64_t E = num_experts;
  if (E < 1 || static_cast<int64_t>(weights.size()) != 3 * E + trailing)
    return ffi::Error::InvalidArgument("expected 3 * E = " + std::to_string(3 * E) +
                                       " expert buffers; got " + std::to_string(weights.size()));
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x must be [T, H], got " + Shape(xd));
  const int64_t H = xd[1];
  const char* names[3] = {"gate", "up", "down"};
  std::vector<const void*> tables(3 * E);
  int64_t I = -1;
  ffi::DataType wt = ffi::DataType::INVALID;
  for (int p = 0; p < 3; ++p) {
    for (int64_t e = 0; e < E; ++e) {
      auto b = weights.get<ffi::AnyBuffer>(p * E + e);
      if (b.has_error()) return b.error();
      auto d = b->dimensions();
      if (d.size() != 2)
        return ffi::Error::InvalidArgument(std::string(names[p]) + " expert " + std::to_string(e) +
                                           " must be 2-D, got " + Shape(d));
      if (I < 0) {
        I = d[1];
        wt = b->element_type();
        if (!IsFloatType(wt))
          return ffi::Error::InvalidArgument("expert weights must be float32, bfloat16 or float16");
      }
      const int64_t rows = p < 2 ? H : I, cols = p < 2 ? I : H;
      if (d[0] != rows || d[1] != cols || b->element_type() != wt)
        return ffi::Error::InvalidArgument(
            std::string(names[p]) + " expert " + std::to_string(e) + " has shape " + Shape(d) +
            "; expected (" + std::to_string(rows) + ", " + std::to_string(cols) +
            ") and gate expert 0's dtype");
      tables[p * E + e] = b->untyped_data();
    }
  }
  return RunForward(pool, x, topk_w, topk_ids, E, I, wt, tables.data(), tables.data() + E,
                    tables.data() + 2 * E, y, activation, band_tokens, max_workers, skip_outside);
}

ffi::Error FusedMoeForwardListsImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                                    ffi::Buffer<ffi::F32> topk_w, ffi::Buffer<ffi::S32> topk_ids,
                                    ffi::RemainingArgs weights, ffi::Result<ffi::AnyBuffer> y,
                                    int64_t activation, int64_t band_tokens, int64_t max_workers,
                                    int64_t skip_outside, int64_t num_experts) {
  return ForwardLists(pool, x, topk_w, topk_ids, weights, 0, y, activation, band_tokens,
                      max_workers, skip_outside, num_experts);
}

// Quantized experts (jax_nbx/quant.py formats): `groups` groups of buffers —
// q of gate, up, down; their scales; (int4) their mins — each one stacked
// [E, ...] buffer (`stacked`) or E per-expert buffers.  Every size is checked
// against the format before anything is read; the ISA's quantized kernels
// read the bytes in place (streaming) or dequantize K-blocks into the packed
// float32 stage (no dequantized copy of a whole weight).
// `trailing` buffers after the weights are ignored (the tests' aliased output).
ffi::Error ForwardQuant(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> topk_w,
                        ffi::Buffer<ffi::S32> topk_ids, ffi::RemainingArgs weights,
                        int64_t trailing, ffi::Result<ffi::AnyBuffer> y, int64_t activation,
                        int64_t band_tokens, int64_t max_workers, int64_t skip_outside,
                        int64_t num_experts, int64_t groups, int64_t stacked,
                        int64_t intermediate, int64_t int4, int64_t group_size) {
  const int64_t E = num_experts, I = intermediate, G = groups;
  const int64_t per = stacked ? 1 : E;
  if (E < 1 || G != (int4 ? 9 : 6) ||
      static_cast<int64_t>(weights.size()) != G * per + trailing)
    return ffi::Error::InvalidArgument("expected " + std::to_string((int4 ? 9 : 6) * per) +
                                       " quantized weight buffers; got " +
                                       std::to_string(weights.size()));
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x must be [T, H], got " + Shape(xd));
  const int64_t H = xd[1];
  if (int4 && (group_size <= 0 || group_size % 2 || H % group_size || I % group_size))
    return ffi::Error::InvalidArgument("int4 group size " + std::to_string(group_size) +
                                       " must be even and divide H=" + std::to_string(H) + " and I=" +
                                       std::to_string(I));
  const char* names[3] = {"gate", "up", "down"};
  const char* parts[3] = {"q", "scale", "min"};
  std::vector<QuantMatrix> qe(3 * E);
  for (int64_t g = 0; g < G; ++g) {
    const int proj = static_cast<int>(g % 3), part = static_cast<int>(g / 3);
    const int64_t K = proj < 2 ? H : I, N = proj < 2 ? I : H;
    // bytes of one expert's array of this part
    const int64_t want_elems = part == 0 ? (int4 ? K / 2 : K) * N : (int4 ? K / group_size : 1) * N;
    for (int64_t i = 0; i < per; ++i) {
      auto b = weights.get<ffi::AnyBuffer>(g * per + i);
      if (b.has_error()) return b.error();
      const ffi::DataType t = b->element_type();
      const bool type_ok = part == 0 ? t == (int4 ? ffi::DataType::U8 : ffi::DataType::S8)
                                     : (t == ffi::DataType::F32 || t == ffi::DataType::BF16);
      const int64_t elems = static_cast<int64_t>(b->element_count()) / (stacked ? E : 1);
      if (!type_ok || elems != want_elems || (stacked && b->element_count() % E))
        return ffi::Error::InvalidArgument(
            std::string(names[proj]) + " " + parts[part] + (stacked ? "" : " expert " + std::to_string(i)) +
            " has " + std::to_string(b->element_count()) + " elements of the wrong type or count; expected " +
            std::to_string(want_elems) + (stacked ? " per expert" : ""));
      const size_t es = ffi::ByteWidth(t);
      for (int64_t e = stacked ? 0 : i; e < (stacked ? E : i + 1); ++e) {
        const void* addr = static_cast<const char*>(b->untyped_data()) +
                           (stacked ? e * want_elems * static_cast<int64_t>(es) : 0);
        QuantMatrix& m = qe[proj * E + e];
        m.N = N;
        m.group = int4 ? group_size : K;
        m.int4 = int4 != 0;
        if (part == 0) m.q = addr;
        if (part == 1) {
          m.scale = addr;
          m.bf16_scales = t == ffi::DataType::BF16;
        }
        if (part == 2) m.zero = addr;
      }
    }
  }
  for (const QuantMatrix& m : qe)
    if (int4 && m.zero == nullptr) return ffi::Error::InvalidArgument("int4 experts need mins");
  std::vector<const void*> tables(3 * E);
  for (int64_t i = 0; i < 3 * E; ++i) tables[i] = &qe[i];
  return RunForward(pool, x, topk_w, topk_ids, E, I, ffi::DataType::U8, tables.data(),
                    tables.data() + E, tables.data() + 2 * E, y, activation, band_tokens,
                    max_workers, skip_outside);
}

ffi::Error FusedMoeForwardQuantImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                                    ffi::Buffer<ffi::F32> topk_w, ffi::Buffer<ffi::S32> topk_ids,
                                    ffi::RemainingArgs weights, ffi::Result<ffi::AnyBuffer> y,
                                    int64_t activation, int64_t band_tokens, int64_t max_workers,
                                    int64_t skip_outside, int64_t num_experts, int64_t groups,
                                    int64_t stacked, int64_t intermediate, int64_t int4,
                                    int64_t group_size) {
  return ForwardQuant(pool, x, topk_w, topk_ids, weights, 0, y, activation, band_tokens,
                      max_workers, skip_outside, num_experts, groups, stacked, intermediate, int4,
                      group_size);
}

// Tests: one more input after the weights, aliased to y (NaN-filled).
ffi::Error FusedMoeForwardQuantIntoImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                                        ffi::Buffer<ffi::F32> topk_w,
                                        ffi::Buffer<ffi::S32> topk_ids,
                                        ffi::RemainingArgs weights, ffi::Result<ffi::AnyBuffer> y,
                                        int64_t activation, int64_t band_tokens,
                                        int64_t max_workers, int64_t skip_outside,
                                        int64_t num_experts, int64_t groups, int64_t stacked,
                                        int64_t intermediate, int64_t int4, int64_t group_size) {
  return ForwardQuant(pool, x, topk_w, topk_ids, weights, 1, y, activation, band_tokens,
                      max_workers, skip_outside, num_experts, groups, stacked, intermediate, int4,
                      group_size);
}

// Tests: one more input after the weights, aliased to y (NaN-filled).
ffi::Error FusedMoeForwardListsIntoImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                                        ffi::Buffer<ffi::F32> topk_w,
                                        ffi::Buffer<ffi::S32> topk_ids,
                                        ffi::RemainingArgs weights, ffi::Result<ffi::AnyBuffer> y,
                                        int64_t activation, int64_t band_tokens,
                                        int64_t max_workers, int64_t skip_outside,
                                        int64_t num_experts) {
  return ForwardLists(pool, x, topk_w, topk_ids, weights, 1, y, activation, band_tokens,
                      max_workers, skip_outside, num_experts);
}

}  // namespace

size_t ForwardWorkspaceBytes(int64_t tokens, int64_t k, int64_t E, int64_t H,
                             int64_t I, int workers) {
  return BandBytes(tokens * k, E, H, I, workers, *ActiveKernels());
}

#define NBX_FORWARD_ARGS                                          \
  ffi::Ffi::Bind()                                                \
      .Ctx<ffi::ThreadPool>()                                     \
      .Arg<ffi::AnyBuffer>()        /* x [T, H] */                \
      .Arg<ffi::Buffer<ffi::F32>>() /* topk_weights [T, k] */     \
      .Arg<ffi::Buffer<ffi::S32>>() /* topk_ids [T, k] */         \
      .Arg<ffi::AnyBuffer>()        /* gate [E, H, I] */          \
      .Arg<ffi::AnyBuffer>()        /* up [E, H, I] */            \
      .Arg<ffi::AnyBuffer>()        /* down [E, I, H] */

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeForwardCpu, FusedMoeForwardImpl,
                              NBX_FORWARD_ARGS
                                  .Ret<ffi::AnyBuffer>()  // y [T, H]
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("band_tokens")
                                  .Attr<int64_t>("max_workers")
                                  .Attr<int64_t>("skip_outside"));

#define NBX_FORWARD_LISTS_BINDING                                                  \
  ffi::Ffi::Bind()                                                                 \
      .Ctx<ffi::ThreadPool>()                                                      \
      .Arg<ffi::AnyBuffer>()        /* x [T, H] */                                 \
      .Arg<ffi::Buffer<ffi::F32>>() /* topk_weights [T, k] */                      \
      .Arg<ffi::Buffer<ffi::S32>>() /* topk_ids [T, k] */                          \
      .RemainingArgs()              /* gate[E], up[E], down[E] (then y_in) */      \
      .Ret<ffi::AnyBuffer>()        /* y [T, H] */                                 \
      .Attr<int64_t>("activation")                                                 \
      .Attr<int64_t>("band_tokens")                                                \
      .Attr<int64_t>("max_workers")                                                \
      .Attr<int64_t>("skip_outside")                                               \
      .Attr<int64_t>("num_experts")

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeForwardListsCpu, FusedMoeForwardListsImpl,
                              NBX_FORWARD_LISTS_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeForwardListsIntoCpu, FusedMoeForwardListsIntoImpl,
                              NBX_FORWARD_LISTS_BINDING);
#define NBX_FORWARD_QUANT_BINDING        \
  NBX_FORWARD_LISTS_BINDING              \
      .Attr<int64_t>("groups")           \
      .Attr<int64_t>("stacked")          \
      .Attr<int64_t>("intermediate")     \
      .Attr<int64_t>("int4")             \
      .Attr<int64_t>("group_size")

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeForwardQuantCpu, FusedMoeForwardQuantImpl,
                              NBX_FORWARD_QUANT_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeForwardQuantIntoCpu, FusedMoeForwardQuantIntoImpl,
                              NBX_FORWARD_QUANT_BINDING);

// Same op with one more input aliased to y: tests pass a NaN-filled buffer
// so that a row the handler fails to write shows.
static ffi::Error FusedMoeForwardIntoImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                                   ffi::Buffer<ffi::F32> topk_w,
                                   ffi::Buffer<ffi::S32> topk_ids,
                                   ffi::AnyBuffer gate, ffi::AnyBuffer up,
                                   ffi::AnyBuffer down, ffi::AnyBuffer /*y_in*/,
                                   ffi::Result<ffi::AnyBuffer> y,
                                   int64_t activation, int64_t band_tokens,
                                   int64_t max_workers, int64_t skip_outside) {
  return FusedMoeForwardImpl(pool, x, topk_w, topk_ids, gate, up, down, y,
                             activation, band_tokens, max_workers, skip_outside);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeForwardIntoCpu, FusedMoeForwardIntoImpl,
                              NBX_FORWARD_ARGS
                                  .Arg<ffi::AnyBuffer>()  // y_in, aliased to y
                                  .Ret<ffi::AnyBuffer>()  // y [T, H]
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("band_tokens")
                                  .Attr<int64_t>("max_workers")
                                  .Attr<int64_t>("skip_outside"));

}  // namespace nbx
