// The one decoder of expert weights for the CPU handlers (forward and
// backward): every format of abi.h (dense float32/bfloat16/float16, int8,
// int4), stacked [E, ...] buffers or E per-expert buffers, all read in place
// through a table of addresses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "abi.h"
#include "common/expert_store.h"
#include "common/lora_args.h"
#include "common/quant_matrix.h"
#include "dtypes.h"
#include "xla/ffi/api/ffi.h"

namespace nbx {

// The FFI attributes of abi.h's "weight views", as bound.
struct WeightViewAttrs {
  xla::ffi::Span<const int64_t> views;  // per projection: offset, stride_k, stride_n
  int64_t intermediate;                 // I
  bool fused_gate_up;                   // groups gate_up, down
  bool has_bias;                        // three float32 bias buffers follow the weights
  // (not a view) three float32 [E] tensor-scale buffers follow (the biases),
  // one per projection: formats whose spec takes them (FormatSpec::tensor_scale)
  bool tensor_scales = false;
  // (not a view) nonzero: the weights are the experts of this store
  // (common/expert_store.h): no weight buffers before the biases and tensor
  // scales; `lease` (LeaseWeights) holds the call's experts
  int64_t expert_store = 0;
  std::shared_ptr<store::Lease> lease = nullptr;
};

struct ExpertWeights {
  int64_t E = 0, H = 0, I = 0;
  // Per projection (gate, up, down): element (k, n) of expert e's logical
  // matrix (gate, up [H, I], down [I, H]) is table[proj*E + e][k*sk + n*sn]
  // (the views' offsets `off` are folded into the table).  Gate and up share
  // their strides.
  int64_t off[3] = {0, 0, 0}, sk[3] = {0, 0, 0}, sn[3] = {0, 0, 0};
  bool fused = false;          // gate and up are one buffer group
  int64_t group_elems[3] = {0, 0, 0};  // elements of one expert's array per buffer group
  // float32 biases [E, I], [E, I], [E, H], or all null.
  const float* bias[3] = {nullptr, nullptr, nullptr};
  abi::WeightFormat format = abi::WeightFormat::kDense;
  // Dense: the weights' dtype.  Quantized: U8 (the tables hold QuantMatrix*).
  xla::ffi::DataType dtype = xla::ffi::DataType::INVALID;
  // [projection][E]: the address of each expert's matrix (gate and up
  // [H, I], down [I, H], row-major), or of its QuantMatrix record.
  std::vector<const void*> table;
  std::vector<QuantMatrix> quant;  // [projection][E], quantized formats only
  bool tensor_scales = false;      // some QuantMatrix::tensor_scale may differ from 1
  // an expert store's lease (WeightViewAttrs::expert_store): the table's
  // addresses are its blocks, pinned while this lives
  std::shared_ptr<store::Lease> lease = nullptr;

  const void* const* gate() const { return table.data(); }
  const void* const* up() const { return table.data() + E; }
  const void* const* down() const { return table.data() + 2 * E; }
  bool quantized() const { return format != abi::WeightFormat::kDense; }
  int groups() const { return fused ? 2 : 3; }  // dense weight buffer groups
  int GroupOf(int proj) const { return fused ? (proj == 2 ? 1 : 0) : proj; }
};

// The element type of quantized experts' tables (QuantMatrix*; the ISA's
// quantized kernels read them), for code templated on the weights' type.
struct Quantized {};

// A type as a value: f(TypeTag<W>{}) lets a generic lambda name W.
template <typename W>
struct TypeTag {
  using type = W;
};

// f(TypeTag<W>{}) for dense weights of dtype t: float, bf16, or f16.
template <typename F>
void ForFloatType(xla::ffi::DataType t, F&& f) {
  switch (t) {
    case xla::ffi::DataType::F32: f(TypeTag<float>{}); break;
    case xla::ffi::DataType::BF16: f(TypeTag<bf16>{}); break;
    default: f(TypeTag<f16>{}); break;
  }
}

// f(TypeTag<W>{}) for ExpertWeights::dtype: a dense type, or Quantized (U8).
template <typename F>
void ForWeightType(xla::ffi::DataType t, F&& f) {
  if (t == xla::ffi::DataType::U8)
    f(TypeTag<Quantized>{});
  else
    ForFloatType(t, f);
}

// InvalidArgument naming the format unless `backend`'s kernels read it
// (formats/<name>.h FormatSpec::kernels: a KernelBit; `who` names the backend
// in the message); a code the registry does not know passes (DecodeWeights
// names it).
xla::ffi::Error CheckKernelsRead(abi::WeightFormat format, uint32_t backend, const char* who);

// Decodes the weight buffers args[first, first + count): the groups of
// `format` in abi.h's order (group = part * 3 + projection), each one stacked
// [E, ...] buffer (`stacked`) or E per-expert buffers.  H is x's hidden size;
// I is read from gate's shape.  Every shape and dtype is checked before an
// address is taken; errors name the projection, part and expert.
// Dense weights may take any views (bounds checked per buffer), quantized
// ones the plain views only; with `v.has_bias` the three buffers after the
// weights are the float32 biases; with `v.tensor_scales` the last three are
// the tensor scales, float32 [E] (QuantMatrix::tensor_scale).
xla::ffi::Error DecodeWeights(xla::ffi::RemainingArgs args, size_t first, size_t count,
                              int64_t E, int64_t H, abi::WeightFormat format, bool stacked,
                              int64_t group_size, const WeightViewAttrs& v, ExpertWeights* out);

// The float32 gradient results of dense weights, laid out as the weights
// (their groups, stacked or per-expert, from rets[first]; then the three
// bias gradients when the weights have biases; then `trailing` other results): [projection][E] addresses
// with the views' offsets folded in as in the weights' table, the bias
// gradients, and each buffer (address, bytes).  Checks each is float32 with
// its weight's shape.
struct GradientTable {
  std::vector<float*> table;       // [projection][E]
  std::vector<float*> group_base;  // [group][E]: each expert's whole array (zeroing)
  float* bias[3] = {nullptr, nullptr, nullptr};
  std::vector<std::pair<void*, size_t>> buffers;
};
xla::ffi::Error DecodeGradients(xla::ffi::RemainingRets rets, size_t first, size_t trailing,
                                const ExpertWeights& w, bool stacked, GradientTable* out);

// Mapped experts (v->expert_store): the lease of the experts the ids (n,
// int32) route to, into v->lease, for the handler's run; a refusal of the
// account is RESOURCE_EXHAUSTED.  Nothing otherwise.
xla::ffi::Error LeaseWeights(WeightViewAttrs* v, const int32_t* ids, int64_t n, bool skip_outside);

// The weights args[0, size - trailing - adapters) (DecodeWeights)
// and the adapters after them (DecodeLora); `nlora`: the adapters' buffers.
xla::ffi::Error DecodeWeightsAndLora(xla::ffi::RemainingArgs args, size_t trailing, int64_t E,
                                     int64_t H, abi::WeightFormat format, bool stacked,
                                     int64_t group_size, const WeightViewAttrs& views,
                                     const LoraAttrs& lora_attrs, ExpertWeights* w, Lora* lora,
                                     size_t* nlora);

}  // namespace nbx
