// CPU handler of jax_nbx.prepack (abi.h kTargetPrepack, "prepacked weights"):
// every K-block of every tile of every expert's dense matrices, packed once
// by the forward's own packer (PackDenseBlock) into the layout the forward
// reads (cpu/prepacked.h), for the kernels in use now.  It allocates nothing:
// the two results are XLA's buffers.
#include "cpu/prepack.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "common/handler_common.h"
#include "cpu/kernels/kernel_table.h"
#include "cpu/moe_forward.h"  // ForwardDotKernels
#include "cpu/prepacked.h"
#include "common/weights.h"
#include "common/parallel.h"

namespace ffi = xla::ffi;

namespace nbx {
namespace {

// Packs projection group `first` (gate||up, else down) of every expert.
template <typename W, bool first>
void PackAll(ffi::ThreadPool& pool, const KernelTable& kt, const DotKernelTable* dot,
             const ExpertWeights& w, const PackedLayout& l, uint32_t* out) {
  const int proj = first ? 0 : 2;
  const int64_t sk = w.sk[proj], sn = w.sn[proj];
  const int64_t tiles = (l.N + l.nc - 1) / l.nc;
  const int64_t words = l.ExpertWords();
  ParallelFor(pool, MaxWorkers(pool), w.E * tiles, [&](int64_t it, int) {
    const int64_t e = it / tiles, n0 = (it % tiles) * l.nc;
    const int nc = static_cast<int>(std::min<int64_t>(l.nc, l.N - n0));
    const W* const mats[2] = {static_cast<const W*>((first ? w.gate() : w.down())[e]),
                              first ? static_cast<const W*>(w.up()[e]) : nullptr};
    for (int64_t k0 = 0; k0 < l.K; k0 += l.kc) {
      const int kc = static_cast<int>(std::min<int64_t>(l.kc, l.K - k0));
      float* dst = reinterpret_cast<float*>(out + e * words + l.Offset(n0, k0));
      PackDenseBlock<W, first>(kt, dot, mats, sk, sn, k0, kc, n0, nc, dst);
    }
  });
}

ffi::Error PrepackImpl(ffi::ThreadPool pool, ffi::RemainingArgs weights,
                       ffi::Result<ffi::Buffer<ffi::U32>> gate_up,
                       ffi::Result<ffi::Buffer<ffi::U32>> down NBX_PREPACK_ATTR_PARAMS) {
  if (hidden < 0) return ffi::Error::InvalidArgument("hidden must be >= 0; got " + std::to_string(hidden));
  ExpertWeights w;
  const WeightViewAttrs view_attrs{views, intermediate, fused_gate_up, has_bias, tensor_scales};
  if (ffi::Error e = DecodeWeights(weights, 0, weights.size(), num_experts, hidden, format, stacked,
                                   group_size, view_attrs, &w);
      e.failure())
    return e;
  if (w.quantized())
    return ffi::Error::InvalidArgument(
        std::string("jax_nbx.prepack takes dense experts; these are ") +
        abi::kWeightFormatNames[static_cast<int>(w.format)]);
  const KernelTable& kt = *ActiveKernels(bf16_dot);
  const DotKernelTable* dot = nullptr;
  if (bf16_dot)
    if (ffi::Error e = ForwardDotKernels(w, kt, &dot); e.failure()) return e;
  const PackedLayout l1 = PackedLayout::Of(kt, bf16_dot, true, hidden, w.I);
  const PackedLayout l2 = PackedLayout::Of(kt, bf16_dot, false, hidden, w.I);
  ffi::Result<ffi::Buffer<ffi::U32>>* outs[2] = {&gate_up, &down};
  const PackedLayout* layouts[2] = {&l1, &l2};
  for (int g = 0; g < 2; ++g) {
    const PackedLayout& l = *layouts[g];
    if (l.ExpertWords() > std::numeric_limits<uint32_t>::max())
      return ffi::Error::InvalidArgument("an expert's packed words exceed 2^32");
    const int64_t want = l.BufferWords(w.E);
    const int64_t got = static_cast<int64_t>((*outs[g])->element_count());
    if (got != want)
      return ffi::Error::InvalidArgument(
          std::string(g == 0 ? "gate_up" : "down") + " words: the result holds " +
          std::to_string(got) + ", the kernels in use (" + kt.isa + ") need " +
          std::to_string(want) + " (the instruction set changed after tracing?)");
    uint32_t* o = (*outs[g])->typed_data();
    std::memset(o, 0, static_cast<size_t>(want) * sizeof(uint32_t));  // the skews too
    l.WriteHeader(w.E, o);
  }
  uint32_t* o1 = gate_up->typed_data() + abi::kPackedHeaderWords;
  uint32_t* o2 = down->typed_data() + abi::kPackedHeaderWords;
  ForFloatType(w.dtype, [&](auto tag) {
    using W = typename decltype(tag)::type;
    PackAll<W, true>(pool, kt, dot, w, l1, o1);
    PackAll<W, false>(pool, kt, dot, w, l2, o2);
  });
  return ffi::Error::Success();
}

}  // namespace

int64_t PrepackedBufferWords(int64_t E, int64_t H, int64_t I, bool bf16_dot, bool gemm1) {
  return PackedLayout::Of(*ActiveKernels(bf16_dot), bf16_dot, gemm1, H, I).BufferWords(E);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PrepackCpu, PrepackImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>() NBX_PREPACK_BIND_ATTRS);

}  // namespace nbx
