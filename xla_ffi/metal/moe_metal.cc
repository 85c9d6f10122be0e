// The Metal forward handler (see moe_metal.h).
#include "metal/moe_metal.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "abi.h"
#include "cpu/handler_common.h"
#include "cpu/moe_forward.h"  // NBX_FORWARD_BINDING: the same inputs and attributes
#include "cpu/slots.h"
#include "cpu/weights.h"
#include "metal/emulated_kernels.h"
#include "metal/runtime.h"
#include "metal/sim_device.h"
#include "metal/tables.h"

namespace ffi = xla::ffi;

namespace nbx {
namespace {

constexpr int64_t kTileRows = 32;  // moe_gemm.metal's NBX_BM

struct Band {
  float* x;              // [tokens][H] staged activations
  int32_t* row_slot;     // [P] slot of each padded row, -1 for padding
  int32_t* row_tok;      // [P] token of each row (band-relative), -1
  int32_t* row_self;     // [P] the row itself, -1 for padding (GEMM2 reads h by row)
  int32_t* tile_expert;  // [P / 32]
  float* row_w;          // [P] routed weight, 0 for padding
  int32_t* slot_row;     // [S] row of each slot, -1 when skipped
  int32_t* count;        // [E] slots per expert (the ordering kernels')
  int32_t* off;          // [E + 1] padded row offsets, off[E] = P
  float* h;  // [P][I]
  float* o;  // [P][H]
};

size_t CarveBand(void* base, int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I, Band* b) {
  const int64_t S = tokens * k, P = MaxPaddedRows(S, E, kTileRows);
  Carver cv(base);
  b->x = cv.Take<float>(tokens, H);
  b->row_slot = cv.Take<int32_t>(P);
  b->row_tok = cv.Take<int32_t>(P);
  b->row_self = cv.Take<int32_t>(P);
  b->tile_expert = cv.Take<int32_t>(P / kTileRows + 1);
  b->row_w = cv.Take<float>(P);
  b->slot_row = cv.Take<int32_t>(S);
  b->count = cv.Take<int32_t>(E);
  b->off = cv.Take<int32_t>(E + 1);
  b->h = cv.Take<float>(P, I);
  b->o = cv.Take<float>(P, H);
  return cv.used();
}

ffi::Error Fail(const std::string& why) { return ffi::Error::InvalidArgument(why); }

ffi::Error MetalForwardImpl(ffi::ThreadPool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> topk_w,
                            ffi::Buffer<ffi::S32> topk_ids, ffi::RemainingArgs weights,
                            ffi::Result<ffi::AnyBuffer> y, NBX_FORWARD_ATTR_PARAMS) {
  (void)max_workers;
  int64_t T, H, k;
  if (ffi::Error e = CheckRouting(x, topk_w, topk_ids, &T, &H, &k); e.failure()) return e;
  if (ffi::Error e = CheckActivation(activation); e.failure()) return e;
  if (format != abi::WeightFormat::kDense)
    return Fail("quantized experts are not supported on the Metal path yet");
  if (x.element_type() != ffi::DataType::F32 || y->element_type() != ffi::DataType::F32)
    return Fail("the Metal path takes float32 x and weights only so far");
  ExpertWeights w;
  if (ffi::Error e = DecodeWeights(weights, 0, weights.size(), num_experts, H, format, stacked,
                                   group_size, &w);
      e.failure())
    return e;
  if (w.dtype != ffi::DataType::F32)
    return Fail("the Metal path takes float32 x and weights only so far");
  const int32_t* ids = topk_ids.typed_data();
  if (ffi::Error e = CheckIds(ids, T, k, w.E, skip_outside); e.failure()) return e;
  if (ffi::Error e = CheckSlots(T, k, w.E, kTileRows); e.failure()) return e;
  if (metal::Active() == nullptr) return Fail("no Metal device is active (jax_nbx.metal)");
  if (metal::ActiveSim() == nullptr)
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "the Metal kernels are dispatched only on the simulated device so far");
  float* out = static_cast<float*>(y->untyped_data());
  if (T == 0 || H == 0) return ffi::Error::Success();
  const int64_t E = w.E, I = w.I;
  std::memset(out, 0, static_cast<size_t>(T * H) * sizeof(float));
  if (I == 0 || k == 0) return ffi::Error::Success();

  // The weights, read in place through one GPU-address table ([gate][up][down] x E).
  std::vector<metal::HostRange> ranges;
  for (int pj = 0; pj < 3; ++pj)
    for (int64_t e = 0; e < E; ++e)
      ranges.push_back({static_cast<const char*>(w.table[pj * E + e]),
                        static_cast<int64_t>(H * I * sizeof(float))});
  std::shared_ptr<metal::Table> table;
  std::string err;
  if (!metal::Tables::Get().Lookup(ranges, true, &table, &err))
    return ffi::Error(err.find("jax_nbx account") != std::string::npos
                          ? ffi::ErrorCode::kResourceExhausted : ffi::ErrorCode::kInvalidArgument,
                      err);

  const int64_t band = band_tokens <= 0 ? T : std::min(band_tokens, T);
  const float* xs = static_cast<const float*>(x.untyped_data());
  const float* wts = topk_w.typed_data();
  metal::DeviceBuffer ws;  // one band's workspace, reused for every band
  Band b;
  const size_t bytes = CarveBand(nullptr, band, k, E, H, I, &b);
  if (!metal::DeviceBuffer::Allocate(static_cast<int64_t>(bytes), "workspace",
                                     WorkShape{band, H, static_cast<int64_t>(
                                         CarveBand(nullptr, 0, k, E, H, I, &b))},
                                     &ws, &err))
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, err);
  std::vector<metal::Buffer> resident = table->pins.resources();
  resident.push_back(ws.buffer());
  const uint64_t* gpu_table = reinterpret_cast<const uint64_t*>(table->addresses.buffer().host);
  for (int64_t t0 = 0; t0 < T; t0 += band) {
    const int64_t t1 = std::min(T, t0 + band), n = t1 - t0, S = n * k;
    CarveBand(ws.buffer().host, n, k, E, H, I, &b);
    std::memcpy(b.x, xs + t0 * H, static_cast<size_t>(n * H) * sizeof(float));  // staged
    // slots ordered by expert (stable in (t, j)), each expert padded to a tile: the ordering
    // kernels (moe_order.metal); slots outside [0, E) (skip_outside) keep slot_row -1
    std::memset(b.slot_row, 0xFF, static_cast<size_t>(S) * sizeof(int32_t));
    if (!metal::LaunchOrderSlots(ids + t0 * k, S, E, kTileRows, b.count, b.off, b.row_slot,
                                 b.slot_row, &err))
      return ffi::Error::Internal(err);
    const int64_t P = b.off[E];
    for (int64_t r = 0; r < P; ++r) {
      const int32_t s = b.row_slot[r];
      b.row_tok[r] = s < 0 ? -1 : static_cast<int32_t>(s / k);
      b.row_self[r] = s < 0 ? -1 : static_cast<int32_t>(r);
      b.row_w[r] = s < 0 ? 0.0f : wts[t0 * k + s];
    }
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = b.off[e]; r < b.off[e + 1]; r += kTileRows)
        b.tile_expert[r / kTileRows] = static_cast<int32_t>(e);
    if (P == 0) continue;
    const uint32_t act = static_cast<uint32_t>(activation);
    metal::MoeGemmArgs g1{b.x, b.row_tok, b.tile_expert, gpu_table, b.row_w, b.h,
                          static_cast<uint32_t>(H), static_cast<uint32_t>(I),
                          static_cast<uint32_t>(E), 0, act, static_cast<uint32_t>(H), P};
    metal::MoeGemmArgs g2{b.h, b.row_self, b.tile_expert, gpu_table, b.row_w, b.o,
                          static_cast<uint32_t>(I), static_cast<uint32_t>(H),
                          static_cast<uint32_t>(E), 1, act, static_cast<uint32_t>(I), P};
    if (!metal::LaunchMoeGemm(g1, resident, false, &err) ||
        !metal::LaunchMoeGemm(g2, resident, false, &err))
      return ffi::Error::Internal(err);
    // the ordered combine: y[t] = sum over j in order of its slots' rows
    for (int64_t t = 0; t < n; ++t) {
      float* yt = out + (t0 + t) * H;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t r = b.slot_row[t * k + j];
        if (r < 0) continue;
        const float* src = b.o + static_cast<int64_t>(r) * H;
        for (int64_t c = 0; c < H; ++c) yt[c] += src[c];
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

size_t MetalForwardWorkspaceBytes(int64_t tokens, int64_t k, int64_t E, int64_t H, int64_t I) {
  Band unused;
  return CarveBand(nullptr, tokens, k, E, H, I, &unused);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeForwardMetal, MetalForwardImpl, NBX_FORWARD_BINDING);

}  // namespace nbx
