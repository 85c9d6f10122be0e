// The LoRA adapters' arguments (lora_args.h).

#include "common/lora_args.h"

#include <string>

#include "abi.h"
#include "common/handler_common.h"  // Shape

namespace ffi = xla::ffi;

namespace nbx {

ffi::Error LoraBufferCount(ffi::Span<const int64_t> ranks, size_t* count) {
  if (ranks.size() != abi::kNumProjections)
    return ffi::Error::InvalidArgument("lora_ranks must hold 3 ranks (gate, up, down), got " +
                                       std::to_string(ranks.size()));
  *count = 0;
  for (int j = 0; j < abi::kNumProjections; ++j) {
    if (ranks[j] < 0)
      return ffi::Error::InvalidArgument(std::string("the ") + abi::kProjectionNames[j] +
                                         " adapter's rank must be >= 0, got " +
                                         std::to_string(ranks[j]));
    *count += ranks[j] > 0 ? 2 : 0;
  }
  return ffi::Error::Success();
}

namespace {

std::string Dims(int64_t a, int64_t b, int64_t c) {
  return "[" + std::to_string(a) + ", " + std::to_string(b) + ", " + std::to_string(c) + "]";
}

// Checks that `buf` is float32 [E, d1, d2]; names the projection and matrix.
template <typename Buf>
ffi::Error CheckAdapter(Buf&& buf, int j, const char* which, int64_t E, int64_t d1,
                        int64_t d2) {
  auto d = buf->dimensions();
  if (buf->element_type() != ffi::DataType::F32 || d.size() != 3 || d[0] != E || d[1] != d1 ||
      d[2] != d2)
    return ffi::Error::InvalidArgument(std::string("the ") + abi::kProjectionNames[j] +
                                       " adapter's " + which + " must be float32 " +
                                       Dims(E, d1, d2) + ", got " + Shape(d));
  return ffi::Error::Success();
}

}  // namespace

ffi::Error DecodeLora(ffi::RemainingArgs args, size_t first, int64_t E, int64_t H, int64_t I,
                      ffi::Span<const int64_t> ranks, const float scales[3], Lora* out) {
  size_t count = 0;
  if (ffi::Error e = LoraBufferCount(ranks, &count); e.failure()) return e;
  *out = Lora{};
  size_t at = first;
  for (int j = 0; j < abi::kNumProjections; ++j) {
    LoraProj& L = out->p[j];
    L.in = j < 2 ? H : I;
    L.out = j < 2 ? I : H;
    if (ranks[j] == 0) continue;
    L.r = ranks[j];
    L.s = scales[j];
    L.col = out->R;
    out->R += L.r;
    auto a = args.get<ffi::AnyBuffer>(at++);
    if (a.has_error()) return a.error();
    if (ffi::Error e = CheckAdapter(a, j, "A", E, L.in, L.r); e.failure()) return e;
    auto b = args.get<ffi::AnyBuffer>(at++);
    if (b.has_error()) return b.error();
    if (ffi::Error e = CheckAdapter(b, j, "B", E, L.r, L.out); e.failure()) return e;
    L.A = static_cast<const float*>(a->untyped_data());
    L.B = static_cast<const float*>(b->untyped_data());
  }
  return ffi::Error::Success();
}

ffi::Error DecodeLoraGrads(ffi::RemainingRets rets, size_t first, int64_t E, Lora* l) {
  if (rets.size() != first + 2 * static_cast<size_t>(l->count()))
    return ffi::Error::InvalidArgument("expected " + std::to_string(2 * l->count()) +
                                       " adapter-gradient results after the experts'; got " +
                                       std::to_string(rets.size() - first));
  size_t at = first;
  for (int j = 0; j < abi::kNumProjections; ++j) {
    LoraProj& L = l->p[j];
    if (L.r == 0) continue;
    auto a = rets.get<ffi::AnyBuffer>(at++);
    if (a.has_error()) return a.error();
    if (ffi::Error e = CheckAdapter(*a, j, "A gradient", E, L.in, L.r); e.failure()) return e;
    auto b = rets.get<ffi::AnyBuffer>(at++);
    if (b.has_error()) return b.error();
    if (ffi::Error e = CheckAdapter(*b, j, "B gradient", E, L.r, L.out); e.failure()) return e;
    L.dA = static_cast<float*>((*a)->untyped_data());
    L.dB = static_cast<float*>((*b)->untyped_data());
  }
  return ffi::Error::Success();
}

}  // namespace nbx
