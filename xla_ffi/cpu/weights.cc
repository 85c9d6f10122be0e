// The weight decoder of the CPU handlers (weights.h).
#include "cpu/weights.h"

#include <string>

#include "cpu/handler_common.h"

namespace ffi = xla::ffi;

namespace nbx {
namespace {

using abi::WeightFormat;

// One expert's array of a part of a projection, [K, N] as the format stores
// it: dense [K, N]; int8 q [K, N], scale [N]; int4 q [K/2, N], scale and
// zero [K/G, N].
std::vector<int64_t> PartShape(WeightFormat f, int part, int64_t K, int64_t N, int64_t group) {
  if (f == WeightFormat::kDense || part == 0)
    return {f == WeightFormat::kInt4 ? K / 2 : K, N};
  if (f == WeightFormat::kInt8) return {N};
  return {K / group, N};
}

bool PartTypeOk(WeightFormat f, int part, ffi::DataType t) {
  if (f == WeightFormat::kDense) return IsFloatType(t);
  if (part == 0) return t == (f == WeightFormat::kInt4 ? ffi::DataType::U8 : ffi::DataType::S8);
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16;
}

std::string Dims(const std::vector<int64_t>& d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + (d.size() == 1 ? ",)" : ")");
}

std::string Where(int proj, int part, WeightFormat f, bool stacked, int64_t expert) {
  std::string s = abi::kProjectionNames[proj];
  if (f != WeightFormat::kDense) s += std::string(" ") + abi::kPartNames[part];
  if (!stacked) s += " expert " + std::to_string(expert);
  return s;
}

}  // namespace

ffi::Error DecodeWeights(ffi::RemainingArgs args, size_t first, size_t count, int64_t E,
                         int64_t H, WeightFormat format, bool stacked, int64_t group_size,
                         ExpertWeights* out) {
  const int32_t fcode = static_cast<int32_t>(format);
  if (fcode < 0 || fcode >= abi::kNumWeightFormats)
    return ffi::Error::InvalidArgument("unknown weight format code " + std::to_string(fcode));
  const int parts = abi::PartsOf(format);
  const int64_t per = stacked ? 1 : E;
  const int64_t want = abi::GroupsOf(format) * per;
  if (E < 1 || static_cast<int64_t>(count) != want || first + count > args.size())
    return ffi::Error::InvalidArgument(
        "expected " + std::to_string(want) + " " + abi::kWeightFormatNames[fcode] +
        " weight buffers (" + std::to_string(abi::GroupsOf(format)) + " groups of " +
        std::to_string(per) + "); got " + std::to_string(count));
  // I from gate's first buffer: its last axis.
  auto g0 = args.get<ffi::AnyBuffer>(first);
  if (g0.has_error()) return g0.error();
  if (g0->dimensions().size() < 1)
    return ffi::Error::InvalidArgument("gate must have at least one axis");
  const int64_t I = g0->dimensions().back();
  if (format == WeightFormat::kInt4 &&
      (group_size <= 0 || group_size % 2 || H % group_size || I % group_size))
    return ffi::Error::InvalidArgument("int4 group size " + std::to_string(group_size) +
                                       " must be even and divide H=" + std::to_string(H) +
                                       " and I=" + std::to_string(I));
  out->E = E;
  out->H = H;
  out->I = I;
  out->format = format;
  out->table.assign(abi::kNumProjections * E, nullptr);
  out->quant.assign(format == WeightFormat::kDense ? 0 : abi::kNumProjections * E, QuantMatrix{});
  ffi::DataType dense_type = ffi::DataType::INVALID;
  for (int part = 0; part < parts; ++part) {
    for (int proj = 0; proj < abi::kNumProjections; ++proj) {
      const int64_t K = proj < 2 ? H : I, N = proj < 2 ? I : H;
      std::vector<int64_t> shape = PartShape(format, part, K, N, group_size);
      if (stacked) shape.insert(shape.begin(), E);
      for (int64_t i = 0; i < per; ++i) {
        auto b = args.get<ffi::AnyBuffer>(first + abi::GroupIndex(part, proj) * per + i);
        if (b.has_error()) return b.error();
        const ffi::DataType t = b->element_type();
        auto d = b->dimensions();
        const std::vector<int64_t> got(d.begin(), d.end());
        const std::string where = Where(proj, part, format, stacked, i);
        if (got != shape)
          return ffi::Error::InvalidArgument(where + " has shape " + Dims(got) + "; expected " +
                                             Dims(shape));
        if (!PartTypeOk(format, part, t) ||
            (format == WeightFormat::kDense && dense_type != ffi::DataType::INVALID &&
             t != dense_type))
          return ffi::Error::InvalidArgument(
              where + " has the wrong dtype for " + abi::kWeightFormatNames[fcode] +
              " weights (dense: float32, bfloat16 or float16, one for all; int8 q: int8; "
              "int4 q: uint8; scales and zeros: float32 or bfloat16)");
        if (format == WeightFormat::kDense) dense_type = t;
        const size_t es = ffi::ByteWidth(t);
        const int64_t elems = static_cast<int64_t>(b->element_count()) / (stacked ? E : 1);
        for (int64_t e = stacked ? 0 : i; e < (stacked ? E : i + 1); ++e) {
          const void* addr = static_cast<const char*>(b->untyped_data()) +
                             (stacked ? e * elems * static_cast<int64_t>(es) : 0);
          if (format == WeightFormat::kDense) {
            out->table[proj * E + e] = addr;
            continue;
          }
          QuantMatrix& m = out->quant[proj * E + e];
          m.N = N;
          m.group = format == WeightFormat::kInt4 ? group_size : K;
          m.int4 = format == WeightFormat::kInt4;
          if (part == 0) m.q = addr;
          if (part == 1) {
            m.scale = addr;
            m.bf16_scales = t == ffi::DataType::BF16;
          }
          if (part == 2) m.zero = addr;
        }
      }
    }
  }
  if (format == WeightFormat::kDense) {
    out->dtype = dense_type;
  } else {
    out->dtype = ffi::DataType::U8;
    for (int64_t i = 0; i < abi::kNumProjections * E; ++i) out->table[i] = &out->quant[i];
  }
  return ffi::Error::Success();
}

ffi::Error DecodeGradients(ffi::RemainingRets rets, size_t first, const ExpertWeights& w,
                           bool stacked, std::vector<float*>* table,
                           std::vector<std::pair<void*, size_t>>* buffers) {
  const int64_t E = w.E, per = stacked ? 1 : E;
  if (w.quantized())
    return ffi::Error::InvalidArgument("the CPU backward takes dense weights only");
  if (static_cast<int64_t>(rets.size()) < static_cast<int64_t>(first) + 3 * per)
    return ffi::Error::InvalidArgument("expected " + std::to_string(3 * per) +
                                       " weight-gradient results; got " +
                                       std::to_string(rets.size() - first));
  table->assign(3 * E, nullptr);
  buffers->clear();
  for (int proj = 0; proj < 3; ++proj) {
    const int64_t rows = proj < 2 ? w.H : w.I, cols = proj < 2 ? w.I : w.H;
    for (int64_t i = 0; i < per; ++i) {
      auto g = rets.get<ffi::AnyBuffer>(first + proj * per + i);
      if (g.has_error()) return g.error();
      if ((*g)->element_type() != ffi::DataType::F32 ||
          static_cast<int64_t>((*g)->element_count()) != (stacked ? E : 1) * rows * cols)
        return ffi::Error::InvalidArgument(std::string("the gradient of ") +
                                           abi::kProjectionNames[proj] +
                                           " must be float32 with the weight's shape");
      float* base = static_cast<float*>((*g)->untyped_data());
      buffers->emplace_back(base, (*g)->size_bytes());
      for (int64_t e = stacked ? 0 : i; e < (stacked ? E : i + 1); ++e)
        (*table)[proj * E + e] = base + (stacked ? e * rows * cols : 0);
    }
  }
  return ffi::Error::Success();
}

}  // namespace nbx
