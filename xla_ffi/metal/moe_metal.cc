// The Metal forward handler (see moe_metal.h).
#include "metal/moe_metal.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "abi.h"
#include "common/handler_common.h"
#include "common/bindings.h"  // NBX_FORWARD_BINDING: the CPU forward's inputs and attributes
#include "common/slots.h"
#include "formats/registry.h"
#include "common/weights.h"
#include "metal/kernel_calls.h"
#include "metal/runtime.h"
#include "metal/tables.h"

namespace ffi = xla::ffi;

namespace nbx {
namespace {

constexpr int64_t kTileRows = metal::kGemmTileRows;

int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// One band's workspace in metal:0 (one shared-storage buffer): what the
// kernels read and write, and the staged inputs (XLA's CPU buffers are not
// Metal buffers: x, the ids and the routed weights are copied in, y out).
struct Band {
  float* la[3];          // the adapters' A_p [E][in][r_p] and B_p [E][r_p][out] (staged once per
  float* lb[3];          // call, carved first: the same place in every band), or nullptr
  float* x;              // [tokens][H] staged activations (float32)
  int32_t* ids;          // [S] staged expert ids
  float* wts;            // [S] staged routed weights
  int32_t* row_slot;     // [P] slot of each padded row, -1 for padding (P: MaxPaddedRows)
  int32_t* row_tok;      // [P] token of each row (band-relative), -1
  int32_t* row_self;     // [P] the row itself, -1 for padding (GEMM2 reads h by row)
  int32_t* tile_expert;  // [P / 32] expert of each row tile (GEMM) or [S rounded up to 32] of
                         // each row (GEMV; -1 past S)
  float* row_w;          // [P] routed weight, 0 for padding
  int32_t* slot_row;     // [S] row of each slot, -1 when skipped
  int32_t* count;        // [E] slots per expert (the ordering kernels')
  int32_t* off;          // [E + 1] padded row offsets; off[E]: the rows in use (<= P)
  float* h;              // [P][I]
  float* o;              // [P][H]
  float* y;              // [tokens][H] the combine's float32 result
  float* xa;             // LoRA: [P][R] s z A_p (R: the ranks' sum), or nullptr
  float* gu;             // LoRA on gate or up: [P][2I] g | u before the activation, or nullptr
};

// `ranks`: the adapters' r_gate, r_up, r_down (abi.h "LoRA adapters"; 0: none).
size_t CarveBand(void* base, int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I,
                 const int64_t ranks[3], Band* b) {
  const int64_t S = tokens * k, P = MaxPaddedRows(S, E, kTileRows);
  Carver cv(base);
  for (int j = 0; j < abi::kNumProjections; ++j) {
    const int64_t in = j < 2 ? H : I, out = j < 2 ? I : H;
    b->la[j] = ranks[j] > 0 ? cv.Take<float>(E * in, ranks[j]) : nullptr;
    b->lb[j] = ranks[j] > 0 ? cv.Take<float>(E * ranks[j], out) : nullptr;
  }
  b->x = cv.Take<float>(tokens, H);
  b->ids = cv.Take<int32_t>(S);
  b->wts = cv.Take<float>(S);
  b->row_slot = cv.Take<int32_t>(P);
  b->row_tok = cv.Take<int32_t>(P);
  b->row_self = cv.Take<int32_t>(P);
  b->tile_expert = cv.Take<int32_t>(std::max(P / kTileRows, RoundUp(S, kTileRows)));
  b->row_w = cv.Take<float>(P);
  b->slot_row = cv.Take<int32_t>(S);
  b->count = cv.Take<int32_t>(E);
  b->off = cv.Take<int32_t>(E + 1);
  b->h = cv.Take<float>(P, I);
  b->o = cv.Take<float>(P, H);
  b->y = cv.Take<float>(tokens, H);
  const int64_t R = ranks[0] + ranks[1] + ranks[2];
  b->xa = R > 0 ? cv.Take<float>(P, R) : nullptr;
  b->gu = ranks[0] + ranks[1] > 0 ? cv.Take<float>(P, 2 * I) : nullptr;
  return cv.used();
}

ffi::Error Fail(const std::string& why) { return ffi::Error::InvalidArgument(why); }

bool WeightTypeOf(ffi::DataType t, metal::WeightType* w) {
  switch (t) {
    case ffi::DataType::F32: *w = metal::WeightType::kF32; return true;
    case ffi::DataType::F16: *w = metal::WeightType::kF16; return true;
    case ffi::DataType::BF16: *w = metal::WeightType::kBF16; return true;
    default: return false;
  }
}

// The kernel variant of the decoded weights (kernels/weights.metal's
// readers): the format, and the dtype of the dense weights or of the float
// scales, which one variant reads for every projection and expert of a call.
ffi::Error KindOf(const ExpertWeights& w, metal::WeightKind* kind) {
  kind->format = w.format;
  kind->type = metal::WeightType::kF32;
  const formats::FormatSpec& spec = formats::SpecOf(w.format);
  if (!formats::HasKernels(w.format, formats::kMetalKernels))
    return Fail(std::string("the Metal kernels do not read ") + spec.name + " experts");
  if (w.format == abi::WeightFormat::kDense) {
    if (!WeightTypeOf(w.dtype, &kind->type))
      return Fail("the Metal path takes float32, bfloat16 or float16 weights");
    return ffi::Error::Success();
  }
  if (spec.compute_dtype_part < 0) return ffi::Error::Success();  // byte scales: no type
  // float32 or bfloat16 scales (and int4's zeros), one dtype for the whole call
  const bool bf16 = w.quant.front().bf16_scales;
  for (const QuantMatrix& m : w.quant)
    if (m.bf16_scales != bf16)
      return Fail(std::string("the Metal path takes one scale dtype for every projection and expert of ") +
                  spec.name + " experts; these mix float32 and bfloat16 scales");
  kind->type = bf16 ? metal::WeightType::kBF16 : metal::WeightType::kF32;
  return ffi::Error::Success();
}

// One expert's part `part` of its [K, N] projection `proj` as a host range:
// its address (the decoder's table or QuantMatrix record) and its bytes (the
// part's rows by formats/<name>.h, times N, times its element size).
metal::HostRange PartRange(const ExpertWeights& w, metal::WeightKind kind, int64_t group, int part,
                           int proj, int64_t e) {
  const formats::FormatSpec& spec = formats::SpecOf(w.format);
  const int64_t K = proj < 2 ? w.H : w.I, N = proj < 2 ? w.I : w.H;
  const int64_t rows = formats::PartRowCount(spec, part, K, group);  // -1: [N]
  const bool byte_part = (spec.parts[part].dtypes & ~uint32_t{formats::kU8 | formats::kS8}) == 0;
  const int64_t es = byte_part ? 1 : (kind.type == metal::WeightType::kF32 ? 4 : 2);
  const int64_t i = proj * w.E + e;
  const void* p = nullptr;
  if (!w.quantized()) p = w.table[i];
  else p = part == 0 ? w.quant[i].q : part == 1 ? w.quant[i].scale : w.quant[i].zero;
  return {static_cast<const char*>(p), (rows < 0 ? 1 : rows) * N * es};
}

// Commits `cb` (one command buffer) unless empty.
ffi::Error CommitOne(metal::Device* dev, const std::vector<metal::Buffer>& resident,
                     std::vector<metal::Dispatch>* cb) {
  if (cb->empty()) return ffi::Error::Success();
  std::string err;
  const bool ok = dev->Commit(resident, *cb, &err);
  cb->clear();
  return ok ? ffi::Error::Success() : ffi::Error::Internal("Metal: " + err);
}

// Waits for this thread's command buffers when it goes out of scope (declared
// after the workspace: a return on any path waits before the workspace goes
// back to the account, which may hand it to the next call at once).
struct WaitOnExit {
  metal::Device* dev;
  ~WaitOnExit() {
    std::string ignored;
    dev->Wait(&ignored);
  }
};

ffi::Error WaitAll(metal::Device* dev) {
  std::string err;
  if (!dev->Wait(&err)) return ffi::Error::Internal("Metal: " + err);
  return ffi::Error::Success();
}

// LoraParams of adapter j (abi.h "LoRA adapters") on rows [row0, row0 + ...) of the GEMMs
// (`div`: rows per tile_expert entry: 32, or 1 on the decode path).  Its input rows are x's
// (gate, up: in = H) or h's (down: in = I); its output rows g | u's (2 out) or o's (out).
metal::params::LoraParams LoraParamsOf(const Lora& lora, int j, uint32_t row0, uint32_t div) {
  const LoraProj& L = lora.p[j];
  metal::params::LoraParams p{};
  p.K = static_cast<uint32_t>(L.in);
  p.N = static_cast<uint32_t>(L.out);
  p.r = static_cast<uint32_t>(L.r);
  p.R = static_cast<uint32_t>(lora.R);
  p.col = static_cast<uint32_t>(L.col);
  p.lda = static_cast<uint32_t>(L.in);
  p.ldo = static_cast<uint32_t>(j < 2 ? 2 * L.out : L.out);
  p.off = static_cast<uint32_t>(j == 1 ? L.out : 0);  // up after the gate in g | u
  p.div = div;
  p.tile0 = row0;
  p.weighted = j == 2 ? 1u : 0u;  // down: times the routed weight, as o's rows are
  p.scale = L.s;
  return p;
}

// The gate and up adapters' terms onto g | u (GEMM1 in mode 2), then h = glu(g, u):
// rows [row0, row0 + rows).
template <typename At>
void GateUpLora(const Lora& lora, const Band& b, const At& at, uint32_t row0, uint32_t rows,
                uint32_t div, metal::params::GemmParams g1, std::vector<metal::Dispatch>* cb) {
  for (int j = 0; j < 2; ++j) {
    if (lora.p[j].r == 0) continue;
    const metal::params::LoraParams p = LoraParamsOf(lora, j, row0, div);
    cb->push_back(metal::LoraXa(p, rows, at(b.x), at(b.row_tok), at(b.tile_expert), at(b.la[j]),
                                at(b.xa)));
    cb->push_back(metal::LoraAdd(p, rows, at(b.xa), at(b.row_tok), at(b.tile_expert), at(b.lb[j]),
                                 at(b.row_w), at(b.gu)));
  }
  g1.tile0 = row0;  // nbx_lora_glu counts rows
  cb->push_back(metal::LoraGlu(g1, rows, at(b.gu), at(b.row_tok), at(b.h)));
}

// The down adapter's term, weighted, onto o (after GEMM2): rows [row0, row0 + rows).
template <typename At>
void DownLora(const Lora& lora, const Band& b, const At& at, uint32_t row0, uint32_t rows,
              uint32_t div, std::vector<metal::Dispatch>* cb) {
  if (lora.p[2].r == 0) return;
  const metal::params::LoraParams p = LoraParamsOf(lora, 2, row0, div);
  cb->push_back(metal::LoraXa(p, rows, at(b.h), at(b.row_self), at(b.tile_expert), at(b.la[2]),
                              at(b.xa)));
  cb->push_back(metal::LoraAdd(p, rows, at(b.xa), at(b.row_self), at(b.tile_expert), at(b.lb[2]),
                               at(b.row_w), at(b.o)));
}

ffi::Error MetalForwardImpl(ffi::ThreadPool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> topk_w,
                            ffi::Buffer<ffi::S32> topk_ids, ffi::RemainingArgs weights,
                            ffi::Result<ffi::AnyBuffer> y NBX_FORWARD_ATTR_PARAMS) {
  (void)max_workers;
  int64_t T, H, k;
  if (ffi::Error e = CheckRouting(x, topk_w, topk_ids, &T, &H, &k); e.failure()) return e;
  if (ffi::Error e = CheckActivation(activation, act_alpha, act_limit); e.failure()) return e;
  if (formats::FindFormat(static_cast<int32_t>(format)) == nullptr)
    return Fail("unknown weight format code " + std::to_string(static_cast<int32_t>(format)));
  if (bf16_dot) return Fail("precision='bfloat16' runs on the CPU handler only");
  if (int8_dot) return Fail("precision='int8' runs on the CPU handler only");
  if (prepacked) return Fail("prepacked experts (jax_nbx.prepack) run on the CPU handler only");
  if (tensor_scales)
    return Fail("tensor scales (nvfp4's second-level scale) run on the CPU handler only");
  if (expert_store != 0)
    return Fail("mapped experts (jax_nbx.loaders.map_moe) run on the CPU handler only");
  if (!IsFloatType(x.element_type()) || y->element_type() != x.element_type())
    return Fail("the Metal path takes x and y of one dtype: float32, bfloat16 or float16");
  ExpertWeights w;
  Lora lora;  // abi.h "LoRA adapters": the buffers after the weights
  size_t nlora = 0;
  if (ffi::Error e = DecodeWeightsAndLora(
          weights, 0, num_experts, H, format, stacked, group_size,
          WeightViewAttrs{views, intermediate, fused_gate_up, has_bias},
          LoraAttrs{lora_ranks, {lora_scale_gate, lora_scale_up, lora_scale_down}}, &w, &lora,
          &nlora);
      e.failure())
    return e;
  const int64_t ranks[3] = {lora.p[0].r, lora.p[1].r, lora.p[2].r};
  // the plain layout only (jax_nbx refuses the others by name at trace time)
  if (w.fused || w.bias[0] || w.off[1] != 0 || w.sk[0] != w.I || w.sn[0] != 1 ||
      w.sk[2] != w.H || w.sn[2] != 1)
    return Fail("the Metal path takes the plain layout only (gate, up [E, H, I], down [E, I, H], "
                "no biases)");
  metal::WeightKind wt;
  if (ffi::Error e = KindOf(w, &wt); e.failure()) return e;
  const int32_t* ids = topk_ids.typed_data();
  if (ffi::Error e = CheckIds(ids, T, k, w.E, skip_outside); e.failure()) return e;
  if (ffi::Error e = CheckSlots(T, k, w.E, kTileRows); e.failure()) return e;
  metal::Device* dev = metal::Active();
  if (dev == nullptr) return Fail("no Metal device is active (jax_nbx.metal)");
  const ffi::DataType xt = x.element_type();
  if (T == 0 || H == 0) return ffi::Error::Success();
  const int64_t E = w.E, I = w.I;
  const size_t row_bytes = static_cast<size_t>(H) * ffi::ByteWidth(xt);
  if (I == 0 || k == 0) {
    std::memset(y->untyped_data(), 0, static_cast<size_t>(T) * row_bytes);
    return ffi::Error::Success();
  }

  // The weights, read in place through one GPU-address table of their parts
  // ([part][gate, up, down][E]: abi.h's buffer groups; kernels/weights.metal).
  std::vector<metal::HostRange> ranges;
  for (int part = 0; part < formats::SpecOf(format).num_parts; ++part)
    for (int pj = 0; pj < abi::kNumProjections; ++pj)
      for (int64_t e = 0; e < E; ++e) ranges.push_back(PartRange(w, wt, group_size, part, pj, e));
  std::shared_ptr<metal::Table> table;
  std::string err;
  bool exhausted = false;
  if (!metal::Tables::Get().Lookup(ranges, true, &table, &err, &exhausted))
    return ffi::Error(exhausted ? ffi::ErrorCode::kResourceExhausted : ffi::ErrorCode::kInvalidArgument,
                      err);

  const int64_t band = band_tokens <= 0 ? T : std::min(band_tokens, T);
  metal::DeviceBuffer ws;  // one band's workspace, reused for every band
  Band b;
  const size_t bytes = CarveBand(nullptr, band, k, E, H, I, ranks, &b);
  if (!metal::DeviceBuffer::Allocate(static_cast<int64_t>(bytes), "workspace",
                                     WorkShape{band, H, static_cast<int64_t>(
                                         CarveBand(nullptr, 0, k, E, H, I, ranks, &b))},
                                     &ws, &err))
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, err);
  CarveBand(ws.buffer().host, band, k, E, H, I, ranks, &b);
  for (int j = 0; j < abi::kNumProjections; ++j) {  // the adapters, staged once (carved first)
    const LoraProj& L = lora.p[j];
    if (L.r == 0) continue;
    std::memcpy(b.la[j], L.A, static_cast<size_t>(E * L.in * L.r) * sizeof(float));
    std::memcpy(b.lb[j], L.B, static_cast<size_t>(E * L.r * L.out) * sizeof(float));
  }
  const WaitOnExit wait_on_exit{dev};
  std::vector<metal::Buffer> resident = table->pins.resources();
  resident.push_back(ws.buffer());
  resident.push_back(table->addresses.buffer());
  const metal::Buffer& wsb = ws.buffer();
  auto at = [&wsb](const void* p) {
    return metal::View{wsb, static_cast<const char*>(p) - wsb.host};
  };
  const metal::View tab{table->addresses.buffer(), 0};
  const uint32_t act = static_cast<uint32_t>(activation);
  const int64_t flops_limit = metal::CommandBufferFlops();
  const char* xs = static_cast<const char*>(x.untyped_data());
  const float* wts = topk_w.typed_data();
  char* out = static_cast<char*>(y->untyped_data());
  std::vector<metal::Dispatch> cb;
  // decode (the GEMV kernels) by the call's slots, not the band's: every band of a call runs
  // the same kernels, so banded = unbanded bit for bit
  const bool decode = T * k <= metal::kDecodeSlots;

  for (int64_t t0 = 0; t0 < T; t0 += band) {
    const int64_t t1 = std::min(T, t0 + band), n = t1 - t0, S = n * k;
    CarveBand(wsb.host, n, k, E, H, I, ranks, &b);
    LoadAsFloat(xt, xs + t0 * row_bytes, n * H, b.x);  // staged (and widened)
    std::memcpy(b.ids, ids + t0 * k, static_cast<size_t>(S) * sizeof(int32_t));
    std::memcpy(b.wts, wts + t0 * k, static_cast<size_t>(S) * sizeof(float));
    const uint32_t group = static_cast<uint32_t>(group_size);
    metal::params::GemmParams g1{static_cast<uint32_t>(H), static_cast<uint32_t>(I),
                                 static_cast<uint32_t>(E), 0, act, static_cast<uint32_t>(H), 0,
                                 act_alpha, act_limit, group};
    metal::params::GemmParams g2{static_cast<uint32_t>(I), static_cast<uint32_t>(H),
                                 static_cast<uint32_t>(E), 1, act, static_cast<uint32_t>(I), 0,
                                 act_alpha, act_limit, group};
    // with gate or up adapters GEMM1 writes g | u (mode 2); GateUpLora adds their terms, then h
    if (b.gu != nullptr) g1.mode = 2;
    const metal::View gemm1_out = at(b.gu != nullptr ? b.gu : b.h);
    if (decode) {
      // decode: the GEMV kernels on the slots as they come (row = slot), no ordering
      for (int64_t s = S; s < RoundUp(S, kTileRows); ++s)  // the LoRA kernels' whole tiles
        b.row_tok[s] = b.row_self[s] = b.tile_expert[s] = -1;
      for (int64_t s = 0; s < S; ++s) {
        const bool in = b.ids[s] >= 0 && b.ids[s] < E;  // outside: skipped (skip_outside)
        b.row_tok[s] = in ? static_cast<int32_t>(s / k) : -1;
        b.row_self[s] = in ? static_cast<int32_t>(s) : -1;
        b.tile_expert[s] = in ? b.ids[s] : -1;
        b.row_w[s] = b.wts[s];
        b.slot_row[s] = in ? static_cast<int32_t>(s) : -1;
      }
      const uint32_t rows = static_cast<uint32_t>(S);
      cb.push_back(metal::MoeGemv(wt, g1, rows, at(b.x), at(b.row_tok), at(b.tile_expert), tab,
                                  at(b.row_w), gemm1_out));
      if (b.gu != nullptr) GateUpLora(lora, b, at, 0, rows, 1, g1, &cb);
      cb.push_back(metal::MoeGemv(wt, g2, rows, at(b.h), at(b.row_self), at(b.tile_expert), tab,
                                  at(b.row_w), at(b.o)));
      DownLora(lora, b, at, 0, rows, 1, &cb);
    } else {
      // slots ordered by expert (stable in (t, j)), each expert padded to a tile: the ordering
      // kernels; slots outside [0, E) (skip_outside) keep slot_row -1.  The padded rows P =
      // off[E] are known on the GPU only: every later kernel runs over the bound on P (a
      // multiple of 32 at most MaxPaddedRows), tiles past P doing nothing, so the host never
      // waits between the ordering and the GEMMs.
      std::memset(b.slot_row, 0xFF, static_cast<size_t>(S) * sizeof(int32_t));
      const int64_t tiles = MaxPaddedRows(S, E, kTileRows) / kTileRows;
      const metal::params::OrderParams op{static_cast<uint32_t>(S), static_cast<uint32_t>(E),
                                          static_cast<uint32_t>(kTileRows), static_cast<uint32_t>(k),
                                          static_cast<uint32_t>(tiles * kTileRows)};
      cb = metal::OrderSlots(op, at(b.ids), at(b.count), at(b.off), at(b.row_slot), at(b.slot_row));
      cb.push_back(metal::PrepareRows(op, at(b.off), at(b.row_slot), at(b.wts), at(b.row_tok),
                                      at(b.row_self), at(b.row_w), at(b.tile_expert)));
      // the GEMMs in ranges of row tiles, each range's command buffer under the flops bound
      const int64_t step = std::min(metal::TilesPerCommandBuffer(g1, flops_limit),
                                    metal::TilesPerCommandBuffer(g2, flops_limit));
      for (int64_t r0 = 0; r0 < tiles; r0 += step) {
        const uint32_t cnt = static_cast<uint32_t>(std::min(step, tiles - r0));
        g1.tile0 = g2.tile0 = static_cast<uint32_t>(r0);
        const uint32_t row0 = static_cast<uint32_t>(r0 * kTileRows), nrows = cnt * kTileRows;
        cb.push_back(metal::MoeGemm(wt, g1, cnt, at(b.x), at(b.row_tok), at(b.tile_expert), tab,
                                    at(b.row_w), gemm1_out));
        if (b.gu != nullptr) GateUpLora(lora, b, at, row0, nrows, kTileRows, g1, &cb);
        cb.push_back(metal::MoeGemm(wt, g2, cnt, at(b.h), at(b.row_self), at(b.tile_expert), tab,
                                    at(b.row_w), at(b.o)));
        DownLora(lora, b, at, row0, nrows, kTileRows, &cb);
        if (r0 + step < tiles)
          if (ffi::Error e = CommitOne(dev, resident, &cb); e.failure()) return e;
      }
    }
    // the ordered combine: y[t] = sum over j in order of its slots' rows (in the last command buffer)
    const metal::params::CombineParams cp{static_cast<uint32_t>(H), static_cast<uint32_t>(k),
                                          static_cast<uint32_t>(n)};
    cb.push_back(metal::Combine(cp, at(b.o), at(b.slot_row), at(b.y)));
    if (ffi::Error e = CommitOne(dev, resident, &cb); e.failure()) return e;
    if (ffi::Error e = WaitAll(dev); e.failure()) return e;
    for (int64_t t = 0; t < n; ++t) StoreRowAs(xt, b.y + t * H, H, out, t0 + t);
  }
  return ffi::Error::Success();
}

}  // namespace

size_t MetalForwardWorkspaceBytes(int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I,
                                  const int64_t lora_ranks[3]) {
  Band unused;
  return CarveBand(nullptr, tokens, k, E, H, I, lora_ranks, &unused);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeForwardMetal, MetalForwardImpl, NBX_FORWARD_BINDING);

}  // namespace nbx
