// CPU handler: the fused MoE forward in one call.
//
//   for each band of tokens [t0, t1):
//     plan    count the band's T*k slots per expert, order them by expert
//     gather  X[s] = float(x[token(s)])
//     GEMM1   A[s] = act(X[s] @ gate[e]) * (X[s] @ up[e])     (e = expert of s)
//     GEMM2   O[s] = weight(s) * (A[s] @ down[e])             (O reuses X)
//     combine y[t] = O[slot(t,0)] + O[slot(t,1)] + ...        (fixed order)
//
// Every row's arithmetic is independent of how rows are grouped into bands,
// tiles or threads, so banded and unbanded results are identical bit for bit.
// The workspace of a band is one block counted in the account (account.h);
// Python plans the bands so that each fits before the call runs.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "account.h"
#include "dtypes.h"
#include "cpu/moe_forward.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace nbx {
namespace {

constexpr int64_t kNB = 64;   // columns per tile
constexpr int kMB = 4;        // rows per micro-tile
constexpr int64_t kMC = 256;  // rows per work item

enum Activation : int64_t { kSwiGLU = 0, kGeGLU = 1 };

inline float Silu(float g) { return g / (1.0f + std::exp(-g)); }
inline float GeluTanh(float g) {
  const float c = 0.7978845608028654f;  // sqrt(2/pi)
  return 0.5f * g * (1.0f + std::tanh(c * (g + 0.044715f * g * g * g)));
}

// P[kk*kNB + nn] = float(w[kk*ld + n0 + nn]) for nn < nb, zero-padded to kNB.
template <typename W>
void PackPanel(const W* w, int64_t ld, int64_t K, int64_t n0, int64_t nb,
               float* P) {
  for (int64_t kk = 0; kk < K; ++kk) {
    const W* row = w + kk * ld + n0;
    float* p = P + kk * kNB;
    for (int64_t nn = 0; nn < nb; ++nn) p[nn] = ToFloat(row[nn]);
    for (int64_t nn = nb; nn < kNB; ++nn) p[nn] = 0.0f;
  }
}

// A K x kNB block of float32 weights: row kk at p + kk * ld.
struct Panel {
  const float* p;
  int64_t ld;
};

// Packs (converts, zero-pads) a tile into `scratch`.  Always packed, float32
// included: reading a tile in place strides by a whole weight row per kk,
// which measured ~1.5x slower here (cache-set and TLB conflicts).
template <typename W>
Panel GetPanel(const W* w, int64_t ld, int64_t K, int64_t n0, int64_t nb,
               float* scratch) {
  PackPanel(w, ld, K, n0, nb, scratch);
  return {scratch, kNB};
}

// acc[r][:] = sum_kk a[r][kk] * P[kk][:], for MB rows.  Each row's sum runs
// in kk order whatever MB is, so results do not depend on row grouping.
template <int MB>
inline void MicroTile(const float* const* a, Panel P, int64_t K,
                      float (*acc)[kNB]) {
  for (int r = 0; r < MB; ++r)
    for (int64_t nn = 0; nn < kNB; ++nn) acc[r][nn] = 0.0f;
  for (int64_t kk = 0; kk < K; ++kk) {
    const float* p = P.p + kk * P.ld;
    for (int r = 0; r < MB; ++r) {
      const float av = a[r][kk];
      for (int64_t nn = 0; nn < kNB; ++nn) acc[r][nn] += av * p[nn];
    }
  }
}

// MicroTile over `rows` (1..kMB) rows.
inline void MicroTileRows(const float* const* a, int rows, Panel P, int64_t K,
                          float (*acc)[kNB]) {
  switch (rows) {
    case 4: MicroTile<4>(a, P, K, acc); break;
    case 3: MicroTile<3>(a, P, K, acc); break;
    case 2: MicroTile<2>(a, P, K, acc); break;
    default: MicroTile<1>(a, P, K, acc); break;
  }
}

// Pointers to rows [m, m + rows) of a matrix with leading dimension ld.
inline void RowPointers(const float* base, int64_t ld, int64_t m, int rows,
                        const float* out[kMB]) {
  for (int r = 0; r < rows; ++r) out[r] = base + (m + r) * ld;
}

template <typename XT>
void GatherRows(const XT* x, int64_t H, const int32_t* slot_token, int64_t s0,
                int64_t s1, float* X) {
  for (int64_t s = s0; s < s1; ++s) {
    const XT* src = x + static_cast<int64_t>(slot_token[s]) * H;
    float* dst = X + s * H;
    for (int64_t h = 0; h < H; ++h) dst[h] = ToFloat(src[h]);
  }
}

template <typename YT>
void StoreRow(const float* src, int64_t H, YT* dst) {
  for (int64_t h = 0; h < H; ++h) dst[h] = FromFloat<YT>(src[h]);
}

inline size_t AlignUp(size_t n) { return (n + 63) / 64 * 64; }

// Carves typed arrays out of one workspace block.
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}
  template <typename T>
  T* Take(int64_t count) {
    T* p = reinterpret_cast<T*>(base_ + offset_);
    offset_ += AlignUp(sizeof(T) * static_cast<size_t>(count));
    return p;
  }
  size_t used() const { return offset_; }

 private:
  char* base_;
  size_t offset_ = 0;
};

struct Band {
  int32_t* slot_token;   // [S] token of each slot, ordered by expert
  float* slot_weight;    // [S] routed weight of each slot
  int32_t* inv;          // [(t-t0)*k + j] -> slot position
  int64_t* expert_off;   // [E+1] slot range of each expert
  int32_t* chunk_expert; // [max_chunks] expert of each row chunk
  int64_t* chunk_begin;  // [max_chunks]
  int64_t* chunk_end;    // [max_chunks]
  float* X;              // [S, H]  gathered rows, later GEMM2 output
  float* A;              // [S, I]  activations
  float* panels;         // [workers, kNB * max(2H, I)]
};

int64_t MaxChunks(int64_t S, int64_t E) { return E + (S + kMC - 1) / kMC; }

size_t BandBytes(int64_t S, int64_t E, int64_t H, int64_t I, int workers) {
  size_t b = 0;
  b += AlignUp(4 * S) * 3;
  b += AlignUp(8 * (E + 1));
  int64_t mc = MaxChunks(S, E);
  b += AlignUp(4 * mc) + 2 * AlignUp(8 * mc);
  b += AlignUp(4 * static_cast<size_t>(S) * H);
  b += AlignUp(4 * static_cast<size_t>(S) * I);
  b += AlignUp(4 * static_cast<size_t>(workers) * kNB * std::max(2 * H, I));
  return b;
}

struct Problem {
  int64_t T, H, I, E, k;
  const void* x;
  ffi::DataType x_type;
  const float* topk_w;
  const int32_t* topk_ids;
  const void* gate;
  const void* up;
  const void* down;
  ffi::DataType w_type;
  void* y;
  int64_t activation;
};

template <typename W>
void RunBand(const Problem& p, ffi::ThreadPool& pool, int workers, int64_t t0,
             int64_t t1, const Band& b) {
  const int64_t H = p.H, I = p.I, E = p.E, k = p.k;
  const int64_t S = (t1 - t0) * k;
  const W* gate = static_cast<const W*>(p.gate);
  const W* up = static_cast<const W*>(p.up);
  const W* down = static_cast<const W*>(p.down);

  // Plan: counting sort of the band's slots by expert (stable in (t, j)).
  std::fill(b.expert_off, b.expert_off + E + 1, int64_t{0});
  for (int64_t i = t0 * k; i < t1 * k; ++i) ++b.expert_off[p.topk_ids[i] + 1];
  for (int64_t e = 0; e < E; ++e) b.expert_off[e + 1] += b.expert_off[e];
  {
    // chunk_end (at least E entries, filled only below) is the cursor here.
    int64_t* cursor = b.chunk_end;
    for (int64_t e = 0; e < E; ++e) cursor[e] = b.expert_off[e];
    for (int64_t i = t0 * k; i < t1 * k; ++i) {
      int64_t e = p.topk_ids[i];
      int64_t s = cursor[e]++;
      b.slot_token[s] = static_cast<int32_t>(i / k);
      b.slot_weight[s] = p.topk_w[i];
      b.inv[i - t0 * k] = static_cast<int32_t>(s);
    }
  }
  int64_t chunks = 0;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t m = b.expert_off[e]; m < b.expert_off[e + 1]; m += kMC) {
      b.chunk_expert[chunks] = static_cast<int32_t>(e);
      b.chunk_begin[chunks] = m;
      b.chunk_end[chunks] = std::min(m + kMC, b.expert_off[e + 1]);
      ++chunks;
    }
  }

  // Gather.
  const int64_t gather_items = (S + 63) / 64;
  ParallelFor(pool, workers, gather_items, [&](int64_t it, int) {
    int64_t s0 = it * 64, s1 = std::min(S, s0 + 64);
    switch (p.x_type) {
      case ffi::DataType::F32:
        GatherRows(static_cast<const float*>(p.x), H, b.slot_token, s0, s1, b.X);
        break;
      case ffi::DataType::BF16:
        GatherRows(static_cast<const bf16*>(p.x), H, b.slot_token, s0, s1, b.X);
        break;
      default:
        GatherRows(static_cast<const f16*>(p.x), H, b.slot_token, s0, s1, b.X);
        break;
    }
  });

  const int64_t panel_stride = kNB * std::max(2 * H, I);

  // GEMM1 + activation: items are (chunk, column tile of I).
  const int64_t ntI = (I + kNB - 1) / kNB;
  ParallelFor(pool, workers, chunks * ntI, [&](int64_t it, int worker) {
    const int64_t c = it / ntI, n0 = (it % ntI) * kNB;
    const int64_t nb = std::min(kNB, I - n0);
    const int64_t e = b.chunk_expert[c];
    float* scratch = b.panels + worker * panel_stride;
    const Panel Pg = GetPanel(gate + e * H * I, I, H, n0, nb, scratch);
    const Panel Pu = GetPanel(up + e * H * I, I, H, n0, nb, scratch + H * kNB);
    alignas(64) float ag[kMB][kNB];
    alignas(64) float au[kMB][kNB];
    const float* rows[kMB];
    for (int64_t m = b.chunk_begin[c]; m < b.chunk_end[c]; m += kMB) {
      const int rmax = static_cast<int>(std::min<int64_t>(kMB, b.chunk_end[c] - m));
      RowPointers(b.X, H, m, rmax, rows);
      MicroTileRows(rows, rmax, Pg, H, ag);
      MicroTileRows(rows, rmax, Pu, H, au);
      for (int r = 0; r < rmax; ++r) {
        float* dst = b.A + (m + r) * I + n0;
        if (p.activation == kGeGLU) {
          for (int64_t nn = 0; nn < nb; ++nn) dst[nn] = GeluTanh(ag[r][nn]) * au[r][nn];
        } else {
          for (int64_t nn = 0; nn < nb; ++nn) dst[nn] = Silu(ag[r][nn]) * au[r][nn];
        }
      }
    }
  });

  // GEMM2 + routed weight: items are (chunk, column tile of H); output in X.
  const int64_t ntH = (H + kNB - 1) / kNB;
  float* O = b.X;
  ParallelFor(pool, workers, chunks * ntH, [&](int64_t it, int worker) {
    const int64_t c = it / ntH, n0 = (it % ntH) * kNB;
    const int64_t nb = std::min(kNB, H - n0);
    const int64_t e = b.chunk_expert[c];
    const Panel Pd = GetPanel(down + e * I * H, H, I, n0, nb,
                              b.panels + worker * panel_stride);
    alignas(64) float acc[kMB][kNB];
    const float* rows[kMB];
    for (int64_t m = b.chunk_begin[c]; m < b.chunk_end[c]; m += kMB) {
      const int rmax = static_cast<int>(std::min<int64_t>(kMB, b.chunk_end[c] - m));
      RowPointers(b.A, I, m, rmax, rows);
      MicroTileRows(rows, rmax, Pd, I, acc);
      for (int r = 0; r < rmax; ++r) {
        const float wgt = b.slot_weight[m + r];
        float* dst = O + (m + r) * H + n0;
        for (int64_t nn = 0; nn < nb; ++nn) dst[nn] = wgt * acc[r][nn];
      }
    }
  });

  // Combine: y[t] = sum over j in order of O[slot(t, j)].
  const int64_t Tb = t1 - t0;
  const int64_t combine_items = (Tb + 15) / 16;
  ParallelFor(pool, workers, combine_items, [&](int64_t it, int) {
    for (int64_t t = t0 + it * 16; t < std::min(t1, t0 + it * 16 + 16); ++t) {
      const int32_t* inv = b.inv + (t - t0) * k;
      float* first = O + static_cast<int64_t>(inv[0]) * H;
      for (int64_t j = 1; j < k; ++j) {
        const float* o = O + static_cast<int64_t>(inv[j]) * H;
        for (int64_t h = 0; h < H; ++h) first[h] += o[h];
      }
      switch (p.x_type) {
        case ffi::DataType::F32:
          StoreRow(first, H, static_cast<float*>(p.y) + t * H);
          break;
        case ffi::DataType::BF16:
          StoreRow(first, H, static_cast<bf16*>(p.y) + t * H);
          break;
        default:
          StoreRow(first, H, static_cast<f16*>(p.y) + t * H);
          break;
      }
    }
  });
}

bool IsFloatType(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 ||
         t == ffi::DataType::F16;
}

std::string Shape(ffi::AnyBuffer::Dimensions d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(d[i]);
  }
  if (d.size() == 1) s += ",";
  return s + ")";
}

ffi::Error FusedMoeForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                               ffi::Buffer<ffi::F32> topk_w,
                               ffi::Buffer<ffi::S32> topk_ids,
                               ffi::AnyBuffer gate, ffi::AnyBuffer up,
                               ffi::AnyBuffer down,
                               ffi::Result<ffi::AnyBuffer> y,
                               int64_t activation, int64_t band_tokens,
                               int64_t max_workers) {
  // Shapes: Python validated them at trace time; check again, never trust.
  auto xd = x.dimensions();
  auto wd = topk_w.dimensions();
  auto id = topk_ids.dimensions();
  auto gd = gate.dimensions();
  auto ud = up.dimensions();
  auto dd = down.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x must be [T, H], got " + Shape(xd));
  const int64_t T = xd[0], H = xd[1];
  if (gd.size() != 3) return ffi::Error::InvalidArgument("gate must be [E, H, I], got " + Shape(gd));
  const int64_t E = gd[0], I = gd[2];
  if (wd.size() != 2 || wd[0] != T)
    return ffi::Error::InvalidArgument("topk_weights must be [T, k] with T=" + std::to_string(T) + ", got " + Shape(wd));
  const int64_t k = wd[1];
  if (id.size() != 2 || id[0] != T || id[1] != k)
    return ffi::Error::InvalidArgument("topk_ids must have the shape of topk_weights " + Shape(wd) + ", got " + Shape(id));
  if (gd[1] != H)
    return ffi::Error::InvalidArgument("gate must be [E, H, I] with H=" + std::to_string(H) + ", got " + Shape(gd));
  if (ud.size() != 3 || ud[0] != E || ud[1] != H || ud[2] != I)
    return ffi::Error::InvalidArgument("up must have gate's shape " + Shape(gd) + ", got " + Shape(ud));
  if (dd.size() != 3 || dd[0] != E || dd[1] != I || dd[2] != H)
    return ffi::Error::InvalidArgument("down must be [E, I, H] = (" + std::to_string(E) + ", " + std::to_string(I) + ", " + std::to_string(H) + "), got " + Shape(dd));
  if (!IsFloatType(x.element_type()))
    return ffi::Error::InvalidArgument("x must be float32, bfloat16 or float16");
  if (y->element_type() != x.element_type() || y->dimensions().size() != 2 ||
      y->dimensions()[0] != T || y->dimensions()[1] != H)
    return ffi::Error::InvalidArgument("y must have x's shape and dtype");
  const ffi::DataType wt = gate.element_type();
  if (!IsFloatType(wt) || up.element_type() != wt || down.element_type() != wt)
    return ffi::Error::InvalidArgument("gate, up and down must share one dtype among float32, bfloat16, float16");
  if (activation != kSwiGLU && activation != kGeGLU)
    return ffi::Error::InvalidArgument("unknown activation code " + std::to_string(activation));

  // Expert ids are checked before anything is read through them.
  const int32_t* ids = topk_ids.typed_data();
  for (int64_t i = 0; i < T * k; ++i) {
    if (ids[i] < 0 || ids[i] >= E) {
      return ffi::Error::InvalidArgument(
          "topk_ids[" + std::to_string(i / k) + ", " + std::to_string(i % k) +
          "] = " + std::to_string(ids[i]) + " is outside [0, " +
          std::to_string(E) + ")");
    }
  }
  if (T == 0 || H == 0) return ffi::Error::Success();

  Problem p{T, H, I, E, k, x.untyped_data(), x.element_type(),
            topk_w.typed_data(), ids, gate.untyped_data(), up.untyped_data(),
            down.untyped_data(), wt, y->untyped_data(), activation};

  if (I == 0 || k == 0) {
    std::memset(y->untyped_data(), 0, y->size_bytes());
    return ffi::Error::Success();
  }

  const int64_t band = (band_tokens <= 0) ? T : std::min(band_tokens, T);
  // The plan counted panels for max_workers; never use more.
  const int workers = static_cast<int>(
      std::clamp<int64_t>(max_workers, 1, MaxWorkers(pool)));
  const Device cpu{"cpu", 0};
  for (int64_t t0 = 0; t0 < T; t0 += band) {
    const int64_t t1 = std::min(T, t0 + band);
    const int64_t S = (t1 - t0) * k;
    Workspace ws;
    std::string err;
    const WorkShape shape{t1 - t0, H,
                          static_cast<int64_t>(BandBytes(0, E, H, I, workers))};
    if (!Workspace::Allocate(cpu, BandBytes(S, E, H, I, workers), "workspace",
                             shape, &ws, &err))
      return ffi::Error(ffi::ErrorCode::kResourceExhausted, err);
    Carver cv(ws.data());
    Band b;
    b.slot_token = cv.Take<int32_t>(S);
    b.slot_weight = cv.Take<float>(S);
    b.inv = cv.Take<int32_t>(S);
    b.expert_off = cv.Take<int64_t>(E + 1);
    const int64_t mc = MaxChunks(S, E);
    b.chunk_expert = cv.Take<int32_t>(mc);
    b.chunk_begin = cv.Take<int64_t>(mc);
    b.chunk_end = cv.Take<int64_t>(mc);
    b.X = cv.Take<float>(S * H);
    b.A = cv.Take<float>(S * I);
    b.panels = cv.Take<float>(static_cast<int64_t>(workers) * kNB * std::max(2 * H, I));
    switch (wt) {
      case ffi::DataType::F32: RunBand<float>(p, pool, workers, t0, t1, b); break;
      case ffi::DataType::BF16: RunBand<bf16>(p, pool, workers, t0, t1, b); break;
      default: RunBand<f16>(p, pool, workers, t0, t1, b); break;
    }
  }
  return ffi::Error::Success();
}

}  // namespace

size_t ForwardWorkspaceBytes(int64_t tokens, int64_t k, int64_t E, int64_t H,
                             int64_t I, int workers) {
  return BandBytes(tokens * k, E, H, I, workers);
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
                                  .Attr<int64_t>("max_workers"));

// Same op with one more input aliased to y: tests pass a NaN-filled buffer
// so that a row the handler fails to write shows.
static ffi::Error FusedMoeForwardIntoImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                                   ffi::Buffer<ffi::F32> topk_w,
                                   ffi::Buffer<ffi::S32> topk_ids,
                                   ffi::AnyBuffer gate, ffi::AnyBuffer up,
                                   ffi::AnyBuffer down, ffi::AnyBuffer /*y_in*/,
                                   ffi::Result<ffi::AnyBuffer> y,
                                   int64_t activation, int64_t band_tokens,
                                   int64_t max_workers) {
  return FusedMoeForwardImpl(pool, x, topk_w, topk_ids, gate, up, down, y,
                             activation, band_tokens, max_workers);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeForwardIntoCpu, FusedMoeForwardIntoImpl,
                              NBX_FORWARD_ARGS
                                  .Arg<ffi::AnyBuffer>()  // y_in, aliased to y
                                  .Ret<ffi::AnyBuffer>()  // y [T, H]
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("band_tokens")
                                  .Attr<int64_t>("max_workers"));

}  // namespace nbx
