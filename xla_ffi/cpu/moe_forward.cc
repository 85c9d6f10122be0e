// CPU handler: the fused MoE forward in one call.
//
//   for each band of tokens [t0, t1) (or expert-major group, float32 x):
//     plan    order the slots by expert, each expert's group padded to whole
//             m-panels of MR rows (slots.h)
//     gather  x rows -> packed A panels (float32, [H][MR] per panel)
//     GEMM1   act(A @ gate[e]) * (A @ up[e]) -> packed panels of the
//             activations ([I][MR]), the activation fused in the epilogue
//     GEMM2   weight * (act @ down[e]) -> O rows (O reuses the A memory)
//     combine y[t] = O[slot(t,0)] + O[slot(t,1)] + ...   (fixed order)
//
// The weights are decoded once (weights.h: every format and layout, read in
// place); the GEMMs run through the shared driver (gemm_driver.h) on the
// micro-kernels of the instruction set chosen at run time (kernel_table.h).
// LoRA adapters add their terms to the sums of GEMM1 and GEMM2
// (forward_lora.h), so adapters with B = 0 change no bit of the output.
// Experts with few rows in the band (decode) skip packing: their weights
// (float32, bfloat16 or quantized) are streamed once, in place.  Every
// output element is the same kk-ordered sum whatever the kernel, band, tile
// or thread, so banded and unbanded results are identical bit for bit.  The
// workspace of a band is one block counted in the account (account.h);
// Python plans the bands so that each fits before the call runs.

#include "cpu/moe_forward.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "account.h"
#include "cpu/forward_band.h"
#include "cpu/forward_lora.h"
#include "cpu/forward_rows.h"
#include "cpu/gemm_driver.h"
#include "common/handler_common.h"
#include "cpu/kernels/kernel_table.h"
#include "cpu/prepacked.h"
#include "common/slots.h"
#include "common/weights.h"
#include "dtypes.h"
#include "common/parallel.h"

namespace ffi = xla::ffi;

namespace nbx {
namespace {

using cpu_forward::Band;
using cpu_forward::BandBytes;
using cpu_forward::CarveBand;
using cpu_forward::kStreamCols;
using cpu_forward::kStreamRows;

struct Problem {
  int64_t T, H, I, E, k;
  const void* x;
  ffi::DataType x_type;
  const float* topk_w;
  const int32_t* topk_ids;
  const ExpertWeights* w;  // every expert's matrices, read in place
  void* y;
  Glu act;
  // precision="bfloat16": the dot-product kernels (bfloat16 weights stored by
  // rows; experts of few rows stream where the table has streaming kernels:
  // the same bits), else nullptr (float32).
  const DotKernelTable* dot = nullptr;
  // precision="int8": every expert (int8 or int4) streams through qdot1/qdot2.
  bool int8 = false;
  // jax_nbx.prepack's words of GEMM1 and GEMM2 (cpu/prepacked.h), or null bases.
  PackedWords packed[2] = {};
  // LoRA adapters (forward_lora.h), or null.
  const Lora* lora = nullptr;
};

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

// Plans the rows of `window` among slots [s0, s1) (slots.h) and the per-row
// token and weight; returns (rows P, chunks).
// (A group spans the whole call: its slots get no slot_row, which holds a band's.)
std::pair<int64_t, int64_t> PlanRows(const Problem& p, const KernelTable& kt, int64_t s0,
                                     int64_t s1, const ExpertWindow& window, bool group,
                                     const Band& b) {
  SlotPlan plan = b.plan;
  if (group) plan.slot_row = nullptr;
  const int64_t P = OrderSlots(p.topk_ids, s0, s1, p.E, kt.mr, window, plan);
  for (int64_t r = 0; r < P; ++r) {
    const int32_t s = b.plan.row_slot[r];
    b.row_token[r] = s < 0 ? -1 : static_cast<int32_t>(s / p.k);
    b.row_weight[r] = s < 0 ? 0.0f : p.topk_w[s];
  }
  const int64_t chunks = CutChunks(b.plan.expert_off, b.plan.real_end, p.E,
                                   int64_t{kt.mr} * kt.chunk_panels, b.chunks);
  return {P, chunks};
}

// One GEMM of the planned rows over every chunk and tile: GEMM1 (`first`:
// A = packed x, B = gate||up, out = packed activations) or GEMM2 (A = packed
// activations, B = down, out = O rows, weighted).  Experts with few rows
// stream their weights in place; the others run the K-block driver.
template <typename W, bool first>
void RunGemm(const Problem& p, const KernelTable& kt, ffi::ThreadPool& pool, int workers,
             int64_t chunks, const Band& b) {
  using WS = WeightSource<W>;
  const int64_t H = p.H, I = p.I;
  const int64_t K = first ? H : I, N = first ? I : H;
  const int mr = kt.mr, vl = kt.vl;
  const int ns = first ? 2 : 1;                // matrices per micro-panel
  const int width = first ? vl : 2 * vl;       // columns of each per micro-panel
  float* const A = first ? b.XO : b.A2;        // packed panels [K][MR]
  float* O = b.XO;                             // GEMM2's rows (x is no longer needed)
  // dense: f32 and bf16 weights stream (f16 ones always pack); quantized: all.
  // Dense weights stream when stored in rows (stride_n 1), or (GEMM1) as an
  // interleaved gate||up: one matrix of 2I columns.  GEMM1 with biases or
  // interleaved stores its sums and applies the gated unit after (kt.glu),
  // on both paths alike, so the path taken changes no bit.
  const int proj = first ? 0 : 2;
  const int64_t sk = p.w->sk[proj], sn = p.w->sn[proj];
  const float* const bias_g = p.w->bias[0];
  const float* const bias_u = p.w->bias[1];
  const float* const bias_d = p.w->bias[2];
  bool interleaved = false;
  if constexpr (first && !WS::kQuant)
    interleaved = sn == 2 && p.w->off[1] == p.w->off[0] + 1 && p.w->fused;
  // LoRA: gate/up terms added to GEMM1's stored sums; GEMM2's sums stored,
  // the down term added, then weighted (forward_lora.h)
  const Lora* const lora = p.lora;
  const bool lora_gu = first && lora != nullptr && (lora->p[0].r > 0 || lora->p[1].r > 0);
  const bool lora_d = !first && lora != nullptr && lora->p[2].r > 0;
  const auto add_gu = [&](int64_t e, int64_t m, int rows, int64_t n, int cols, float* g, float* u,
                          int64_t gs, int64_t gcs) {
    if (!lora_gu) return;
    AddLoraTerm(lora->p[0], lora->R, b.LR, e, m, rows, n, cols, g, gs, gcs);
    AddLoraTerm(lora->p[1], lora->R, b.LR, e, m, rows, n, cols, u, gs, gcs);
  };
  // O[m + r, n + c] = w[m + r] * (sums[r * rs + c] + the down term), r < rows, c < cols
  const auto weigh_down = [&](int64_t e, int64_t m, int rows, int64_t n, int cols, float* sums,
                              int64_t rs) {
    AddLoraTerm(lora->p[2], lora->R, b.LR, e, m, rows, n, cols, sums, rs, 1);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) b.XO[(m + r) * H + n + c] = b.row_weight[m + r] * sums[r * rs + c];
  };
  const bool raw_glu = first && (bias_g != nullptr || interleaved || lora_gu);
  // stored by columns (out x in): the column-streaming kernels, column n at n*sn
  const bool by_columns = !WS::kQuant && sk == 1 && sn != 1;
  // (precision="bfloat16" streams only with dot kernels that stream: their
  // bits are the packed dot kernels'; else every expert packs)
  const bool can_stream = (p.dot == nullptr || p.dot->stream1 != nullptr) &&
                          (WS::kQuant || sizeof(W) == 4 || p.w->dtype == ffi::DataType::BF16) &&
                          (sn == 1 || interleaved || by_columns);
  // the dot kernels' operands: bfloat16 weights by rows (checked by the handler)
  const DotKernelTable* const dot = std::is_same_v<W, bf16> ? p.dot : nullptr;
  const int64_t ldw = by_columns ? sn : sk;  // the streaming kernels' ld
  const int64_t col_step = by_columns ? sn : 1;  // elements from column n to n + 1
  const float* const ones = kStreamUnitWeights;  // the sums, exact
  const int w_index = sizeof(W) == 4 ? 0 : 1;
  // the dense streaming kernels: the dot table's, by columns, or by rows
  auto* const stream1 = dot ? dot->stream1 : by_columns ? kt.stream1_cols[w_index] : kt.stream1[w_index];
  auto* const stream2 = dot ? dot->stream2 : by_columns ? kt.stream2_cols[w_index] : kt.stream2[w_index];
  const int64_t stream_rows = std::min<int64_t>(kStreamRows, mr);
  // precision="int8": every expert streams, its rows in runs of stream_rows
  const bool int8 = WS::kQuant && p.int8;
  const auto streams = [&](int64_t e) {
    return int8 || (can_stream && b.plan.real_end[e] - b.plan.expert_off[e] <= stream_rows);
  };
  auto* const qstream1 = int8 ? kt.qdot1 : kt.qstream1;
  auto* const qstream2 = int8 ? kt.qdot2 : kt.qstream2;
  // precision="bfloat16": the packing experts' m-panels of A become pairs once, in place
  // (pack_a reads each run of rows before it writes its words over them), not once per
  // tile; an odd K of two words per pair outgrows its panel and packs per tile instead
  const bool pairs_in_place = dot != nullptr && (dot->a_words == 1 || K % 2 == 0);
  if (pairs_in_place)
    ParallelFor(pool, workers, chunks, [&](int64_t c, int) {
      if (streams(b.chunks.expert[c])) return;
      for (int64_t m = b.chunks.begin[c]; m < b.chunks.end[c]; m += mr)
        dot->pack_a(A + m / mr * K * mr, 0, static_cast<int>(K),
                    reinterpret_cast<uint32_t*>(A + m / mr * K * mr));
    });
  const int64_t tiles = (N + kt.nc - 1) / kt.nc;
  ParallelFor(pool, workers, chunks * tiles, [&](int64_t it, int worker) {
    const int64_t c = it / tiles, n0 = (it % tiles) * kt.nc;
    const int nc = static_cast<int>(std::min<int64_t>(kt.nc, N - n0));
    const int64_t e = b.chunks.expert[c];
    const int64_t m0 = b.chunks.begin[c], m1 = b.chunks.end[c];
    const typename WS::Src mats[2] = {WS::At(first ? p.w->gate() : p.w->down(), e),
                                      first ? WS::At(p.w->up(), e) : nullptr};
    float* scratch = b.scratch + worker * b.scratch_layout.stride;
    // Few rows: stream the weights in place, kStreamCols columns (whole
    // contiguous rows of W) per item; the other items of the span are empty.
    // Rows [r0, r1) of one m-panel, at most stream_rows of them.
    const auto stream = [&](int64_t r0, int64_t r1, int cols) {
      const int64_t panel = r0 / mr, at = r0 - panel * mr;
      const int rows = static_cast<int>(r1 - r0);
      const float* a = A + panel * K * mr + at;
      if constexpr (first) {
        float* out = b.A2 + panel * I * mr + n0 * mr + at;
        if (!raw_glu) {
          if constexpr (WS::kQuant)
            qstream1(a, mr, rows, mats[0], mats[1], n0, K, cols, p.act, scratch, out, 1, mr);
          else
            stream1(a, mr, rows, mats[0] + n0 * col_step, mats[1] + n0 * col_step, ldw, K, cols,
                    p.act, scratch, out, 1, mr);
        } else {  // the sums (unit weights: exact) into `raw`, then bias and gated unit
          float* raw = scratch + b.scratch_layout.raw_offset;
          const float* bg = bias_g ? bias_g + e * I + n0 : nullptr;
          const float* bu = bias_u ? bias_u + e * I + n0 : nullptr;
          // gate sums at raw[r * 2cols + c * gcs], up sums `up` after them
          int64_t gcs = 1, up = cols;
          if constexpr (WS::kQuant) {
            qstream2(a, mr, rows, mats[0], n0, K, cols, ones, scratch, raw, 2 * cols);
            qstream2(a, mr, rows, mats[1], n0, K, cols, ones, scratch, raw + cols, 2 * cols);
          } else if (interleaved) {  // gate||up pairs: one run of 2*cols, its two halves in one pass
            kt.stream_pair[w_index](a, mr, rows, mats[0] + 2 * n0, mats[0] + 2 * n0 + cols, sk,
                                    K, cols, scratch, raw);
            gcs = 2, up = 1;
          } else if (!by_columns && dot == nullptr && mats[1] == mats[0] + cols) {  // concatenated
            kt.stream_pair[w_index](a, mr, rows, mats[0] + n0, mats[1] + n0, sk, K, cols,
                                    scratch, raw);
          } else {
            stream2(a, mr, rows, mats[0] + n0 * col_step, ldw, K, cols, ones, scratch, raw,
                    2 * cols);
            stream2(a, mr, rows, mats[1] + n0 * col_step, ldw, K, cols, ones, scratch,
                    raw + cols, 2 * cols);
          }
          add_gu(e, r0, rows, n0, cols, raw, raw + up, 2 * cols, gcs);
          kt.glu(raw, raw + up, 2 * cols, gcs, rows, cols, bg, bu, p.act, out, 1, mr);
        }
      } else {
        float* out = O + r0 * H + n0;
        // (LoRA: the sums into O, then the down term added and weighted in place)
        const float* wr = lora_d ? ones : b.row_weight + r0;
        if constexpr (WS::kQuant)
          qstream2(a, mr, rows, mats[0], n0, K, cols, wr, scratch, out, H);
        else
          stream2(a, mr, rows, mats[0] + n0 * col_step, ldw, K, cols, wr, scratch, out, H);
        if (lora_d) weigh_down(e, r0, rows, n0, cols, out, H);
        if (bias_d) AddDownBias(bias_d + e * H, b.row_weight, r0, r1, n0, cols, O, H);
      }
    };
    if (streams(e)) {
      const int cols = static_cast<int>(StreamItemColumns(n0, N));
      if (cols == 0) return;
      if (!int8) return stream(m0, m1, cols);  // all rows in one panel: stream_rows <= MR
      for (int64_t pm = m0; pm < m1; pm = (pm / mr + 1) * mr)  // each m-panel's rows, in runs
        for (int64_t r0 = pm, pe = std::min(m1, (pm / mr + 1) * mr); r0 < pe; r0 += stream_rows)
          stream(r0, std::min(pe, r0 + stream_rows), cols);
      return;
    }
    // K-blocks: pack a block of the tile, then run every m-panel of the chunk
    // through each micro-panel, partial sums kept in `part` between blocks.
    const int nsub = (nc + width - 1) / width;
    const int64_t panels = (m1 - m0 + mr - 1) / mr;
    float* packed = scratch;
    float* part = scratch + b.scratch_layout.part_offset;
    // column-scaled formats (int8) and tensor scales: the tile's column
    // scales, per micro-panel `width` of each matrix
    const float* scale = nullptr;
    if constexpr (WS::kQuant) {
      const bool by_column = QuantArithOf(mats[0]->format) == QuantArith::kColumnScaled;
      if (by_column || p.w->tensor_scales) {
        float* colscale = scratch + b.scratch_layout.stride - nsub * 2 * vl;
        for (int q = 0; q < nsub; ++q)
          for (int s = 0; s < ns; ++s)
            for (int j = 0; j < width; ++j) {
              const int64_t col = n0 + q * width + j;
              colscale[q * 2 * vl + s * width + j] =
                  col >= n0 + nc ? 0.0f
                                 : (by_column ? ColumnScale(*mats[s], col) : 1.0f) * mats[s]->tensor_scale;
            }
        scale = colscale;
      }
    }
    // prepacked weights: each block read where jax_nbx.prepack put it, not packed
    const PackedWords& pw = p.packed[first ? 0 : 1];
    const PackedLayout layout(kt, dot != nullptr, first, K, N);
    const auto prepacked = [&](int64_t k0) {
      return reinterpret_cast<const float*>(pw.base + e * pw.expert_words + layout.Offset(n0, k0));
    };
    const float* bsrc = packed;  // the block the micro-kernels read
    RunKBlocks(
        K, kt.kc,
        [&](Prefetcher& pf, int64_t k0, int64_t kc) {
          if constexpr (WS::kQuant)
            StartPrefetch(pf, mats[0], mats[1], N, k0, kc, n0, nc);
          else if (pw.base != nullptr)  // one contiguous run
            pf.Start(prepacked(k0), nullptr, 0, 1, layout.BlockWords(nc, kc) * 4);
          else
            StartViewPrefetch(pf, mats[0], mats[1], sk, sn, k0, kc, n0, nc);
        },
        [&](int64_t k0, int kc) {
          if constexpr (WS::kQuant) {
            for (int s = 0; s < ns; ++s)
              kt.qpack(mats[s], k0, kc, n0, nc, width, packed + s * width, 2 * vl, PanelStride(kc, vl));
          } else {
            if (pw.base != nullptr)
              bsrc = prepacked(k0);
            else
              PackDenseBlock<W, first>(kt, dot, mats, sk, sn, k0, kc, n0, nc, packed);
            if (dot != nullptr && !pairs_in_place) {  // this chunk's A panels of the block
              auto* a_pairs = reinterpret_cast<uint32_t*>(scratch + b.scratch_layout.dot_a_offset);
              const int64_t pairs = (kc + 1) / 2;
              for (int64_t pi = 0; pi < panels; ++pi)
                dot->pack_a(A + (m0 / mr + pi) * K * mr, k0, kc,
                            a_pairs + pi * pairs * mr * dot->a_words);
            }
          }
        },
        [&](int64_t k0, int kc, Prefetcher& pf) {
          const int64_t per_call = pf.PerCall(nsub * panels);
          int flags = BlockFlags(k0, kc, K);
          const bool last = k0 + kc >= K;
          if (raw_glu || lora_d) flags |= kStorePartial;  // the epilogue runs below, on the stored sums
          const int64_t pairs = (kc + 1) / 2;
          const auto* a_pairs =
              reinterpret_cast<const uint32_t*>(scratch + b.scratch_layout.dot_a_offset);
          for (int q = 0; q < nsub; ++q) {
            const int cols = std::min(width, nc - q * width);
            const float* bq = bsrc + q * PanelStride(kc, vl);
            const uint32_t* bq_pairs = reinterpret_cast<const uint32_t*>(bsrc) + q * PanelStride(pairs, vl);
            const float* sq = scale ? scale + q * 2 * vl : nullptr;
            for (int64_t pi = 0; pi < panels; ++pi) {
              const int64_t m = m0 + pi * mr, panel = m / mr;
              const int rows = static_cast<int>(std::min<int64_t>(mr, m1 - m));
              const float* a = A + panel * K * mr + k0 * mr;
              const uint32_t* ap =
                  dot == nullptr     ? nullptr
                  : pairs_in_place ? reinterpret_cast<const uint32_t*>(A + panel * K * mr) + k0 / 2 * mr * dot->a_words
                                   : a_pairs + pi * pairs * mr * dot->a_words;
              // (one K-block: a stored GEMM1 sum is read back at once, one panel's room)
              float* pp = K > kt.kc ? part + (pi * nsub + q) * mr * 2 * vl
                                    : scratch + b.scratch_layout.raw_offset;
              if constexpr (first) {
                float* out1 = b.A2 + panel * I * mr + (n0 + q * vl) * mr;
                if (dot != nullptr)
                  dot->gemm1(ap, bq_pairs, pairs, p.act, rows, cols, out1, 1, mr, pp, flags);
                else
                  kt.gemm1(a, bq, kc, p.act, rows, cols, out1, 1, mr, pp, flags, sq);
                if (raw_glu && last) {
                  const int64_t col = e * I + n0 + q * vl;
                  if (sq != nullptr) ScaleStoredSums(pp, sq, rows, 2 * vl);  // int8
                  add_gu(e, m, rows, n0 + q * vl, cols, pp, pp + vl, 2 * vl, 1);
                  kt.glu(pp, pp + vl, 2 * vl, 1, rows, cols, bias_g ? bias_g + col : nullptr,
                         bias_u ? bias_u + col : nullptr, p.act, out1, 1, mr);
                }
              }
              else if (dot != nullptr)
                dot->gemm2(ap, bq_pairs, pairs, b.row_weight + m, rows, cols,
                           O + m * H + n0 + q * 2 * vl, H, pp, flags);
              else
                kt.gemm2(a, bq, kc, b.row_weight + m, rows, cols, O + m * H + n0 + q * 2 * vl, H,
                         pp, flags, sq);
              if (lora_d && last) {
                if (sq != nullptr) ScaleStoredSums(pp, sq, rows, 2 * vl);  // int8
                weigh_down(e, m, rows, n0 + q * 2 * vl, cols, pp, 2 * vl);
              }
              pf.Step(per_call);
            }
          }
        });
    if constexpr (!first)
      if (bias_d) AddDownBias(bias_d + e * H, b.row_weight, m0, m1, n0, nc, O, H);
  });
}

// Gather, GEMM1, GEMM2 of the planned rows: O [P][H] (in b.XO) holds each
// row's weighted expert output.
template <typename W>
void RunRows(const Problem& p, const KernelTable& kt, ffi::ThreadPool& pool, int workers,
             int64_t P, int64_t chunks, const Band& b, Stages& st) {
  const int mr = kt.mr;
  ParallelFor(pool, workers, P / mr, [&](int64_t panel, int) {
    float* dst = b.XO + panel * p.H * mr;
    const int32_t* rt = b.row_token + panel * mr;
    switch (p.x_type) {
      case ffi::DataType::F32: GatherPanel(static_cast<const float*>(p.x), p.H, rt, mr, dst); break;
      case ffi::DataType::BF16: GatherPanel(static_cast<const bf16*>(p.x), p.H, rt, mr, dst); break;
      default: GatherPanel(static_cast<const f16*>(p.x), p.H, rt, mr, dst); break;
    }
  });
  st.Mark("gather");
  // LoRA: each row's rank projections, from the float32 panels (before GEMM1
  // and GEMM2 turn them into pairs)
  const auto ranks = [&](int first, int last, const float* panels, int64_t K) {
    ParallelFor(pool, workers, chunks, [&](int64_t c, int) {
      for (int j = first; j <= last; ++j)
        LoraRanks(p.lora->p[j], p.lora->R, panels, K, mr, b.chunks.expert[c], b.chunks.begin[c],
                  b.chunks.end[c], b.LR);
    });
  };
  if (p.lora != nullptr) ranks(0, 1, b.XO, p.H);
  RunGemm<W, /*first=*/true>(p, kt, pool, workers, chunks, b);
  st.Mark("gemm1");
  if (p.lora != nullptr) ranks(2, 2, b.A2, p.I);
  RunGemm<W, /*first=*/false>(p, kt, pool, workers, chunks, b);
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

// Token band [t0, t1): every slot of its tokens, summed per token in j order.
template <typename W>
void RunTokenBand(const Problem& p, const KernelTable& kt, ffi::ThreadPool& pool, int workers,
                  int64_t t0, int64_t t1, const Band& b) {
  Stages st("forward band");
  const auto [P, chunks] = PlanRows(p, kt, t0 * p.k, t1 * p.k, ExpertWindow{}, false, b);
  st.Mark("plan");
  RunRows<W>(p, kt, pool, workers, P, chunks, b, st);
  CombineSlotRows(pool, workers, t0, t1, p.k, b.plan.slot_row, b.XO, p.H, p.x_type, p.y);
  st.Mark("combine");
}

// Float32 x: the call runs in expert-major groups of at most P_max padded
// rows (what a band of band_tokens tokens would take), so that each expert's
// weights are packed once per call, not once per band, unless one expert
// alone has more rows than a group holds.
template <typename W>
void RunExpertGroups(const Problem& p, const KernelTable& kt, ffi::ThreadPool& pool, int workers,
                     int64_t P_max, const Band& b) {
  const int64_t S = p.T * p.k;
  CountSlots(p.topk_ids, 0, S, p.E, b.total);
  std::memset(p.y, 0, static_cast<size_t>(p.T * p.H) * sizeof(float));
  for (SlotPos from{0, 0}; from.e < p.E;) {
    Stages st("forward group");
    const SlotPos to = NextGroup(b.total, p.E, kt.mr, P_max, from);
    const auto [P, chunks] = PlanRows(p, kt, 0, S, ExpertWindow{from, to}, true, b);
    st.Mark("plan");
    RunRows<W>(p, kt, pool, workers, P, chunks, b, st);
    AccumulateRows(p, pool, workers, P, b);
    st.Mark("accumulate");
    from = to;
  }
}

// Allocates a band of S slots (`tokens` tokens) in the account and carves it.
ffi::Error AllocateBand(int64_t S, int64_t tokens, const Problem& p, int workers,
                        const KernelTable& kt, Workspace* ws, Band* b) {
  const bool dot = p.dot != nullptr;
  const int64_t R = p.lora != nullptr ? p.lora->R : 0;
  if (ffi::Error e = AllocateWorkspace(BandBytes(S, p.E, p.H, p.I, workers, kt, dot, R),
                                       BandBytes(0, p.E, p.H, p.I, workers, kt, dot, R), tokens,
                                       p.H, "workspace", ws);
      e.failure())
    return e;
  CarveBand(ws->data(), S, p.E, p.H, p.I, workers, kt, dot, R, b);
  return ffi::Error::Success();
}

ffi::Error FusedMoeForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                               ffi::Buffer<ffi::F32> topk_w, ffi::Buffer<ffi::S32> topk_ids,
                               ffi::RemainingArgs weights, ffi::Result<ffi::AnyBuffer> y
                               NBX_FORWARD_ATTR_PARAMS) {
  return FusedMoeForward(pool, x, topk_w, topk_ids, weights, 0, y, NBX_FORWARD_ATTRS);
}

}  // namespace

ffi::Error FusedMoeForward(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> topk_w,
                           ffi::Buffer<ffi::S32> topk_ids, ffi::RemainingArgs weights,
                           size_t trailing, ffi::Result<ffi::AnyBuffer> y, const ForwardAttrs& a) {
  const bool with_lora = !NoLora(a.lora);
  if (with_lora && a.prepacked)
    return ffi::Error::InvalidArgument("prepacked experts take no LoRA adapters");
  int64_t T, H, k;
  if (ffi::Error e = CheckForwardCall(x, topk_w, topk_ids, y, a.activation, a.act_alpha,
                                      a.act_limit, &T, &H, &k);
      e.failure())
    return e;
  if (ffi::Error e = CheckKernelsRead(a.format, formats::kCpuKernels, "the CPU"); e.failure()) return e;
  const size_t packed_bufs = a.prepacked ? 2 : 0;  // after the weights
  if (weights.size() < trailing + packed_bufs)
    return ffi::Error::InvalidArgument("fewer inputs than the prepacked words and aliased outputs");
  const size_t nw = weights.size() - trailing - packed_bufs;
  ExpertWeights w;
  Lora lora;
  size_t nlora = 0;
  WeightViewAttrs views = a.views;  // mapped experts: their lease for this run
  if (ffi::Error e = LeaseWeights(&views, topk_ids.typed_data(),
                                  static_cast<int64_t>(topk_ids.element_count()), a.skip_outside);
      e.failure())
    return e;
  if (ffi::Error e = with_lora ? DecodeWeightsAndLora(weights, trailing, a.num_experts, H, a.format,
                                                      a.stacked, a.group_size, views, a.lora,
                                                      &w, &lora, &nlora)
                               : DecodeWeights(weights, 0, nw, a.num_experts, H, a.format,
                                               a.stacked, a.group_size, views, &w);
      e.failure())
    return e;
  const int32_t* ids = topk_ids.typed_data();
  if (ffi::Error e = CheckIds(ids, T, k, w.E, a.skip_outside); e.failure()) return e;
  const KernelTable& kt = *ActiveKernels(a.bf16_dot);
  if (ffi::Error e = CheckSlots(T, k, w.E, kt.mr); e.failure()) return e;
  if (T == 0 || H == 0) return ffi::Error::Success();
  if (w.I == 0 || k == 0) {
    std::memset(y->untyped_data(), 0, y->size_bytes());
    return ffi::Error::Success();
  }
  const DotKernelTable* dot = nullptr;
  if (ffi::Error e = ForwardPrecision(a, w, kt, &dot); e.failure()) return e;
  Problem p{T, H, w.I, w.E, k, x.untyped_data(), x.element_type(), topk_w.typed_data(),
            ids, &w, y->untyped_data(),
            Glu{static_cast<int>(a.activation), a.act_alpha, a.act_limit}, dot,
            a.int8_dot};
  if (with_lora) p.lora = &lora;
  if (a.prepacked) {
    if (w.quantized())
      return ffi::Error::InvalidArgument("prepacked experts are dense; these are quantized");
    static constexpr const char* kWhat[2] = {"gate_up", "down"};
    for (int g = 0; g < 2; ++g) {
      auto buf = weights.get<ffi::AnyBuffer>(nw + g);
      if (buf.has_error()) return buf.error();
      const PackedLayout layout = PackedLayout::Of(kt, dot != nullptr, g == 0, H, w.I);
      if (ffi::Error e = CheckPacked(*buf, layout, w.E, kWhat[g], &p.packed[g]); e.failure())
        return e;
    }
  }
  const int64_t band = (a.band_tokens <= 0) ? T : std::min(a.band_tokens, T);
  // The plan counted scratch for max_workers; never use more.
  const int workers = static_cast<int>(std::clamp<int64_t>(a.max_workers, 1, MaxWorkers(pool)));
  if (x.element_type() == ffi::DataType::F32) {
    // One workspace of a band of `band` tokens, run in expert-major groups.
    Workspace ws;
    Band b;
    if (ffi::Error e = AllocateBand(band * k, band, p, workers, kt, &ws, &b); e.failure())
      return e;
    const int64_t P_max = MaxPaddedRows(band * k, p.E, kt.mr);
    ForWeightType(w.dtype, [&](auto tag) {
      RunExpertGroups<typename decltype(tag)::type>(p, kt, pool, workers, P_max, b);
    });
    return ffi::Error::Success();
  }
  // bfloat16 / float16 x: token bands, each summed in j order and stored.
  for (int64_t t0 = 0; t0 < T; t0 += band) {
    const int64_t t1 = std::min(T, t0 + band);
    Workspace ws;
    Band b;
    if (ffi::Error e = AllocateBand((t1 - t0) * k, t1 - t0, p, workers, kt, &ws, &b); e.failure())
      return e;
    ForWeightType(w.dtype, [&](auto tag) {
      RunTokenBand<typename decltype(tag)::type>(p, kt, pool, workers, t0, t1, b);
    });
  }
  return ffi::Error::Success();
}

size_t ForwardWorkspaceBytes(int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I,
                             int workers, bool bf16_dot, int64_t lora_rank) {
  return BandBytes(tokens * k, E, H, I, workers, *ActiveKernels(bf16_dot), bf16_dot, lora_rank);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeForwardCpu, FusedMoeForwardImpl, NBX_FORWARD_BINDING);

}  // namespace nbx
