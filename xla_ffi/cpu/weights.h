// The one decoder of expert weights for the CPU handlers (forward and
// backward): every format of abi.h (dense float32/bfloat16/float16, int8,
// int4), stacked [E, ...] buffers or E per-expert buffers, all read in place
// through a table of addresses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "abi.h"
#include "cpu/kernel_table.h"
#include "dtypes.h"
#include "xla/ffi/api/ffi.h"

namespace nbx {

struct ExpertWeights {
  int64_t E = 0, H = 0, I = 0;
  abi::WeightFormat format = abi::WeightFormat::kDense;
  // Dense: the weights' dtype.  Quantized: U8 (the tables hold QuantMatrix*).
  xla::ffi::DataType dtype = xla::ffi::DataType::INVALID;
  // [projection][E]: the address of each expert's matrix (gate and up
  // [H, I], down [I, H], row-major), or of its QuantMatrix record.
  std::vector<const void*> table;
  std::vector<QuantMatrix> quant;  // [projection][E], quantized formats only

  const void* const* gate() const { return table.data(); }
  const void* const* up() const { return table.data() + E; }
  const void* const* down() const { return table.data() + 2 * E; }
  bool quantized() const { return format != abi::WeightFormat::kDense; }
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

// Decodes the weight buffers args[first, first + count): the groups of
// `format` in abi.h's order (group = part * 3 + projection), each one stacked
// [E, ...] buffer (`stacked`) or E per-expert buffers.  H is x's hidden size;
// I is read from gate's shape.  Every shape and dtype is checked before an
// address is taken; errors name the projection, part and expert.
xla::ffi::Error DecodeWeights(xla::ffi::RemainingArgs args, size_t first, size_t count,
                              int64_t E, int64_t H, abi::WeightFormat format, bool stacked,
                              int64_t group_size, ExpertWeights* out);

// The float32 gradient results of dense weights, laid out as the weights
// (3 stacked or 3E per-expert buffers from rets[first]): [projection][E]
// addresses, and each buffer (address, bytes).  Checks each is float32 with
// its weight's shape.
xla::ffi::Error DecodeGradients(xla::ffi::RemainingRets rets, size_t first,
                                const ExpertWeights& w, bool stacked, std::vector<float*>* table,
                                std::vector<std::pair<void*, size_t>>* buffers);

}  // namespace nbx
