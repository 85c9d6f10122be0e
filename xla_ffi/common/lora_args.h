// The LoRA adapters' arguments (abi.h "LoRA adapters"), as every handler
// reads them: the attributes, the count of adapter buffers, and each
// adapter's buffers checked by name (float32 [E, in, r], [E, r, out]).  The
// CPU handlers (cpu/row_band.h), the CUDA tables forward (cuda/handlers.cc)
// and the Metal forward decode them here; the pointers are the buffers'
// addresses on the handler's device.
#pragma once

#include <cstddef>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace nbx {

// The handlers' LoRA attributes (abi.h NBX_ATTRS_LORA).
struct LoraAttrs {
  xla::ffi::Span<const int64_t> ranks;  // gate, up, down; 0: no adapter
  float scale[3];
};

// Whether the attributes ask for no adapter (a malformed list asks: the
// adapters' decoder names it).
inline bool NoLora(const LoraAttrs& l) {
  return l.ranks.size() == 3 && l.ranks[0] == 0 && l.ranks[1] == 0 && l.ranks[2] == 0;
}

// One projection's adapter (float32, stacked over experts), or r == 0.
struct LoraProj {
  const float* A = nullptr;  // [E, in, r]
  const float* B = nullptr;  // [E, r, out]
  int64_t r = 0, in = 0, out = 0;
  float s = 0.0f;     // the scale (alpha / r)
  int64_t col = 0;    // its columns [col, col + r) of LR and LB
  float* dA = nullptr;  // backward: the float32 gradients, A's and B's shapes
  float* dB = nullptr;
};
struct Lora {
  LoraProj p[3];  // gate, up, down
  int64_t R = 0;  // the ranks' sum
  int count() const { return (p[0].r > 0) + (p[1].r > 0) + (p[2].r > 0); }
};

// The adapters' buffers args[first, first + 2 * count) (A then B of each
// projection with ranks[j] > 0, in gate, up, down order): float32 [E, in, r]
// and [E, r, out], checked by name.
xla::ffi::Error DecodeLora(xla::ffi::RemainingArgs args, size_t first, int64_t E, int64_t H,
                           int64_t I, xla::ffi::Span<const int64_t> ranks, const float scales[3],
                           Lora* out);
// Their gradients rets[first, first + 2 * count), the same shapes, float32.
xla::ffi::Error DecodeLoraGrads(xla::ffi::RemainingRets rets, size_t first, int64_t E, Lora* l);
// How many adapter buffers `ranks` names (2 per rank > 0); an error for a
// malformed list (3 entries, each >= 0).
xla::ffi::Error LoraBufferCount(xla::ffi::Span<const int64_t> ranks, size_t* count);

}  // namespace nbx
