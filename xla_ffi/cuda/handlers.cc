// The three CUDA handlers of fused_moe and their FFI bindings: the dense
// forward (stacked gate, up, down), the tables forward (lists and/or
// quantized weight groups, fused gate_up, biases) and the backward (dense
// groups [+ biases] + dy -> dx, d(topk_weights), weight and bias gradients).
// Each checks and collects its buffers, then runs the call's program
// (runner.h) with the attributes every CUDA handler takes.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <cuda.h>
#include <cuda_runtime_api.h>  // cudaStream_t (XLA's stream type); no runtime calls

#include "abi.h"
#include "common/attr_types.h"
#include "formats/registry.h"
#include "common/lora_args.h"
#include "common/weights.h"  // CheckKernelsRead
#include "cuda/moe_cuda.h"
#include "cuda/runner.h"
#include "cuda/weights.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace nbx {
namespace cuda {
namespace {

// Stacked plain [E, ...] arrays: expert e of a projection at base + e * (bytes / E).
ffi::Error FusedMoeCudaImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                            ffi::AnyBuffer w, ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer gate,
                            ffi::AnyBuffer up, ffi::AnyBuffer down, ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::AnyBuffer> ws_buf
                                NBX_ATTRS_CUDA_PROGRAM(NBX_ATTR_PARAM)) {
  const int64_t E = num_experts;
  constexpr int P = abi::kNumProjections;
  const ffi::AnyBuffer* proj[P] = {&gate, &up, &down};
  std::vector<int64_t> addrs(P * E);
  std::vector<CUdeviceptr> first(P);
  for (int p = 0; p < P; ++p) {
    const int64_t stride = static_cast<int64_t>(proj[p]->size_bytes()) / (E > 0 ? E : 1);
    const int64_t base = reinterpret_cast<int64_t>(proj[p]->untyped_data());
    first[p] = static_cast<CUdeviceptr>(base);
    for (int64_t e = 0; e < E; ++e) addrs[p * E + e] = base + e * stride;
  }
  const ProgramAttrs attrs{blob, kernels, program, workspace_bytes, err_offset, err_words,
                           w_aligned, num_experts, check_ids, graph};
  return RunProgram(ProgramCall{stream, ordinal, x, w, ids, *ws_buf, P, /*fused=*/false,
                                std::move(addrs), P, std::move(first),
                                {reinterpret_cast<CUdeviceptr>(y->untyped_data())}},
                    attrs);
}

// Weights as `groups` groups (gate, up, down; for quantized experts then
// their scales, then (int4) their mins; gate_up, down when `fused_gate_up`),
// each one stacked [E, ...] buffer (`stacked`) or E per-expert buffers, read
// in place through the table and abi.h's views (the kernels add the offsets
// and read the strides: the table holds each expert's whole array), then with
// `has_bias` the three float32 biases [E, I], [E, I], [E, H], then the LoRA
// adapters that `lora_ranks` names (abi.h "LoRA adapters": float32 stacked
// A_p, B_p; the program reads them as inputs after the biases).
ffi::Error FusedMoeCudaTablesImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                                  ffi::AnyBuffer w, ffi::Buffer<ffi::S32> ids,
                                  ffi::RemainingArgs weights, ffi::Result<ffi::AnyBuffer> y,
                                  ffi::Result<ffi::AnyBuffer> ws_buf
                                      NBX_ATTRS_CUDA_FORWARD_TABLES(NBX_ATTR_PARAM)) {
  const int64_t E = num_experts, G = groups;
  const int64_t per_group = stacked ? 1 : E;
  const int64_t nbias = has_bias ? abi::kNumBiases : 0;
  size_t nlora = 0;
  if (ffi::Error e = LoraBufferCount(lora_ranks, &nlora); e.failure()) return e;
  const formats::FormatEntry* entry = formats::FindFormat(static_cast<int32_t>(format));
  if (entry == nullptr)
    return ffi::Error::InvalidArgument("unknown weight format code " +
                                       std::to_string(static_cast<int32_t>(format)));
  if (ffi::Error e = CheckKernelsRead(format, formats::kCudaKernels, "the CUDA"); e.failure()) return e;
  const bool quantized = format != abi::WeightFormat::kDense;
  const bool groups_ok =
      fused_gate_up ? G == 2 : G == entry->spec->num_parts * int64_t{abi::kNumProjections};
  const int64_t nbufs = G * per_group + nbias + static_cast<int64_t>(nlora);
  if (E < 1 || !groups_ok || static_cast<int64_t>(weights.size()) != nbufs)
    return ffi::Error::InvalidArgument(
        "expected " + std::to_string(nbufs) + " weight buffers (" + std::to_string(G) +
        " groups of " + std::to_string(per_group) + (nbias ? ", then 3 biases" : "") +
        (nlora ? ", then " + std::to_string(nlora) + " adapter buffers" : std::string()) +
        (fused_gate_up ? "; 2 groups when fused" : "") +
        "; " + entry->spec->name + " weights have " + std::to_string(entry->spec->num_parts) +
        " parts per projection); got " + std::to_string(weights.size()));
  if (quantized && (fused_gate_up || has_bias))
    return ffi::Error::InvalidArgument(
        "quantized weights take the plain layout only (no fused gate_up, no biases)");
  const int64_t H = x.dimensions().size() == 2 ? x.dimensions()[1] : -1;
  const int64_t I = intermediate;
  std::vector<int64_t> addrs(G * E);
  std::vector<int64_t> elems(G, 0);  // elements of one expert's array per group (dense)
  std::vector<CUdeviceptr> first(G);
  if (ffi::Error e = CollectGroups(weights, E, G, stacked, fused_gate_up, &addrs, &elems, &first);
      e.failure())
    return e;
  if (std::string why = CheckViews(views, H, I, fused_gate_up, quantized, elems); !why.empty())
    return ffi::Error::InvalidArgument(why);
  std::vector<CUdeviceptr> extra = first;  // the groups' first buffers, then the biases
  if (ffi::Error e = CollectBiases(weights, G * per_group, nbias, E, H, I, &extra); e.failure())
    return e;
  Lora lora;  // the adapters' device addresses, checked by name, after the biases
  const float scales[3] = {lora_scale_gate, lora_scale_up, lora_scale_down};
  if (ffi::Error e = DecodeLora(weights, G * per_group + nbias, E, H, I, lora_ranks, scales, &lora);
      e.failure())
    return e;
  for (const LoraProj& L : lora.p) {
    if (L.r == 0) continue;
    extra.push_back(reinterpret_cast<CUdeviceptr>(L.A));
    extra.push_back(reinterpret_cast<CUdeviceptr>(L.B));
  }
  const ProgramAttrs attrs{blob, kernels, program, workspace_bytes, err_offset, err_words,
                           w_aligned, num_experts, check_ids, graph};
  return RunProgram(ProgramCall{stream, ordinal, x, w, ids, *ws_buf, G, fused_gate_up,
                                std::move(addrs), G, std::move(extra),
                                {reinterpret_cast<CUdeviceptr>(y->untyped_data())}},
                    attrs);
}

// The CUDA backward (abi.h "CUDA backward"; jax_nbx/backends/cuda/plan.py
// build_backward): dense experts as the tables handler takes them (`groups`
// groups of one stacked or E per-expert buffers, read through abi.h's views;
// with `has_bias` the three float32 biases), then dy [T, H] in x's dtype.
// Results: dx, d(topk_weights) float32 [T, k], then the weight gradients
// (float32, the weights' shapes and grouping), then with `has_bias` the
// bias gradients, then the workspace.  The gradients' addresses are pointer
// tables groups..2*groups-1, after the weights' (the kernels write each
// expert's gradient through them, stacked or per-expert alike).
ffi::Error FusedMoeBackwardCudaImpl(
    cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
    ffi::Buffer<ffi::S32> ids, ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> dx,
    ffi::Result<ffi::Buffer<ffi::F32>> dw, ffi::RemainingRets rets
        NBX_ATTRS_CUDA_BACKWARD(NBX_ATTR_PARAM)) {
  const int64_t E = num_experts, G = groups;
  if (format != abi::WeightFormat::kDense)
    return ffi::Error::InvalidArgument("the CUDA backward takes dense experts (format code " +
                                       std::to_string(static_cast<int32_t>(format)) + ")");
  const int64_t per_group = stacked ? 1 : E;
  const int64_t nbias = has_bias ? abi::kNumBiases : 0;
  const bool groups_ok = fused_gate_up ? G == 2 : G == abi::kNumProjections;
  if (E < 1 || !groups_ok || static_cast<int64_t>(args.size()) != G * per_group + nbias + 1)
    return ffi::Error::InvalidArgument(
        "expected " + std::to_string(G * per_group + nbias + 1) + " buffers after topk_ids (" +
        std::to_string(G) + " dense weight groups of " + std::to_string(per_group) +
        (nbias ? ", 3 biases" : "") + ", then dy); got " + std::to_string(args.size()));
  const int64_t n_grads = G * per_group;
  if (static_cast<int64_t>(rets.size()) != n_grads + nbias + 1)
    return ffi::Error::InvalidArgument(
        "expected " + std::to_string(n_grads + nbias + 1) + " results after dx, dw (" +
        std::to_string(n_grads + nbias) + " gradients, then the workspace); got " +
        std::to_string(rets.size()));
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x must be [T, H]");
  const int64_t T = xd[0], H = xd[1], I = intermediate;
  std::vector<int64_t> addrs(2 * G * E);
  std::vector<int64_t> elems(G, 0);
  std::vector<CUdeviceptr> first(G);
  if (ffi::Error e = CollectGroups(args, E, G, stacked, fused_gate_up, &addrs, &elems, &first);
      e.failure())
    return e;
  if (std::string why = CheckViews(views, H, I, fused_gate_up, false, elems); !why.empty())
    return ffi::Error::InvalidArgument(why);
  std::vector<CUdeviceptr> extra = first;  // the groups' first buffers, the biases, then dy
  if (ffi::Error e = CollectBiases(args, n_grads, nbias, E, H, I, &extra); e.failure()) return e;
  auto dy = args.get<ffi::AnyBuffer>(n_grads + nbias);
  if (dy.has_error()) return dy.error();
  auto dyd = dy->dimensions();
  if (dy->element_type() != x.element_type() || dyd.size() != 2 || dyd[0] != T || dyd[1] != H)
    return ffi::Error::InvalidArgument("dy must have x's dtype and shape [T, H]");
  auto dxd = dx->dimensions();
  auto dwd = dw->dimensions();
  auto idd = ids.dimensions();
  auto wd = w.dimensions();  // the kernels read topk_weights and topk_ids at every slot
  if (w.element_type() != ffi::DataType::F32 || wd.size() != 2 || idd.size() != 2 ||
      wd[0] != idd[0] || wd[1] != idd[1] || idd[0] != T)
    return ffi::Error::InvalidArgument(
        "topk_weights must be float32 with topk_ids' shape [T, k], T = x's rows");
  if (dx->element_type() != x.element_type() || dxd.size() != 2 || dxd[0] != T || dxd[1] != H ||
      dwd.size() != 2 || idd.size() != 2 || dwd[0] != idd[0] || dwd[1] != idd[1])
    return ffi::Error::InvalidArgument(
        "dx must have x's dtype and shape, d(topk_weights) topk_ids' shape");
  for (int64_t p = 0; p < G; ++p) {
    for (int64_t i = 0; i < per_group; ++i) {
      auto g = rets.get<ffi::AnyBuffer>(p * per_group + i);
      if (g.has_error()) return g.error();
      // float32, or (grad_f32 false: the program's bwd_dw stores the weights'
      // 16-bit dtype) the weight's own dtype
      auto wt = args.get<ffi::AnyBuffer>(p * per_group);
      if (wt.has_error()) return wt.error();
      const ffi::DataType want = grad_f32 ? ffi::DataType::F32 : wt->element_type();
      if ((*g)->element_type() != want ||
          static_cast<int64_t>((*g)->element_count()) != (stacked ? E : 1) * elems[p])
        return ffi::Error::InvalidArgument(
            "the gradient of " + GroupName(p, G, fused_gate_up) + " must be " +
            (grad_f32 ? "float32" : "in the weight's dtype") + " with the weight's shape");
      const int64_t base = reinterpret_cast<int64_t>((*g)->untyped_data());
      for (int64_t e = stacked ? 0 : i; e < (stacked ? E : i + 1); ++e)
        addrs[(G + p) * E + e] =
            base + (stacked ? e * elems[p] * static_cast<int64_t>(ffi::ByteWidth(want)) : 0);
    }
  }
  static_assert(abi::kOutputDx == 0 && abi::kOutputDTopkWeights == 1 && abi::kOutputDBias0 == 2,
                "outputs[] is built in abi.h's output order");
  std::vector<CUdeviceptr> outputs = {reinterpret_cast<CUdeviceptr>(dx->untyped_data()),
                                      reinterpret_cast<CUdeviceptr>(dw->untyped_data())};
  for (int64_t j = 0; j < nbias; ++j) {
    auto g = rets.get<ffi::AnyBuffer>(n_grads + j);
    if (g.has_error()) return g.error();
    const int64_t n = j < 2 ? I : H;
    auto d = (*g)->dimensions();
    if ((*g)->element_type() != ffi::DataType::F32 || d.size() != 2 || d[0] != E || d[1] != n)
      return ffi::Error::InvalidArgument(std::string("the gradient of the ") +
                                         abi::kProjectionNames[j] + " bias must be float32 [E, " +
                                         std::to_string(n) + "]");
    outputs.push_back(reinterpret_cast<CUdeviceptr>((*g)->untyped_data()));
  }
  auto ws = rets.get<ffi::AnyBuffer>(n_grads + nbias);
  if (ws.has_error()) return ws.error();
  extra.push_back(reinterpret_cast<CUdeviceptr>(dy->untyped_data()));
  const ProgramAttrs attrs{blob, kernels, program, workspace_bytes, err_offset, err_words,
                           w_aligned, num_experts, check_ids, graph};
  return RunProgram(ProgramCall{stream, ordinal, x, w, ids, **ws, G, fused_gate_up,
                                std::move(addrs), 2 * G, std::move(extra), std::move(outputs)},
                    attrs);
}

}  // namespace
}  // namespace cuda

// What every CUDA handler takes besides its weights: the stream, the
// device, x, topk_weights, topk_ids.
#define NBX_PROGRAM_BIND                                    \
  ffi::Ffi::Bind()                                          \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()             \
      .Ctx<ffi::DeviceOrdinal>()                            \
      .Arg<ffi::AnyBuffer>()        /* x [T, H] */          \
      .Arg<ffi::AnyBuffer>()        /* topk_weights [T, k] */ \
      .Arg<ffi::Buffer<ffi::S32>>() /* topk_ids [T, k] */

// The attributes: abi.h's lists (NBX_ATTRS_CUDA_*), bound by name.
#define NBX_PROGRAM_RETS                                                   \
  .Ret<ffi::AnyBuffer>()                   /* y [T, H] */                  \
      .Ret<ffi::AnyBuffer>()               /* workspace (u8, discarded) */

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeForwardCuda, cuda::FusedMoeCudaImpl,
                              NBX_PROGRAM_BIND
                                  .Arg<ffi::AnyBuffer>()         // gate [E, H, I]
                                  .Arg<ffi::AnyBuffer>()         // up [E, H, I]
                                  .Arg<ffi::AnyBuffer>()         // down [E, I, H]
                                  NBX_PROGRAM_RETS
                                  NBX_ATTRS_CUDA_PROGRAM(NBX_BIND_ATTR));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeForwardCudaTables, cuda::FusedMoeCudaTablesImpl,
                              NBX_PROGRAM_BIND
                                  .RemainingArgs()               // weight groups
                                  NBX_PROGRAM_RETS
                                  NBX_ATTRS_CUDA_FORWARD_TABLES(NBX_BIND_ATTR));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedMoeBackwardCuda, cuda::FusedMoeBackwardCudaImpl,
                              NBX_PROGRAM_BIND
                                  .RemainingArgs()               // weight groups, biases, dy
                                  .Ret<ffi::AnyBuffer>()         // dx [T, H]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // d(topk_weights) [T, k]
                                  .RemainingRets()               // weight, bias gradients; workspace
                                  NBX_ATTRS_CUDA_BACKWARD(NBX_BIND_ATTR));

}  // namespace nbx
