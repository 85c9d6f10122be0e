// The CUDA tables handlers' weight buffers (see weights.h).
#include "cuda/weights.h"

#include "abi.h"

namespace ffi = xla::ffi;

namespace nbx::cuda {

std::string GroupName(int64_t p, int64_t G, bool fused) {
  if (fused) return p == 0 ? "experts.gate_up" : "experts.down";
  const int64_t proj = p % abi::kNumProjections, part = p / abi::kNumProjections;
  std::string name = std::string("experts.") + abi::kProjectionNames[proj];
  if (G > abi::kNumProjections) name += std::string(".") + abi::kPartNames[part];
  return name;
}

std::string CheckViews(ffi::Span<const int64_t> views, int64_t H, int64_t I, bool fused,
                       bool quantized, const std::vector<int64_t>& elems) {
  constexpr int F = abi::kNumViewFields, P = abi::kNumProjections;
  if (static_cast<int64_t>(views.size()) != F * P)
    return "views must hold " + std::to_string(F * P) + " values; got " +
           std::to_string(views.size());
  if (I < 1 || H < 1) return "intermediate (I) and x's H must be positive";
  const int64_t plain[F * P] = {0, I, 1, 0, I, 1, 0, H, 1};
  bool is_plain = !fused;
  for (int i = 0; i < F * P; ++i) is_plain = is_plain && views[i] == plain[i];
  if (quantized && !is_plain) return "quantized weights take the plain views only";
  if (views[1] != views[F + 1] || views[2] != views[F + 2])
    return "gate and up views must share their strides";
  if (quantized) return "";
  for (int proj = 0; proj < P; ++proj) {
    const int64_t K = proj < 2 ? H : I, N = proj < 2 ? I : H;
    const int64_t off = views[proj * F], sk = views[proj * F + 1], sn = views[proj * F + 2];
    const int64_t g = fused ? (proj == 2 ? 1 : 0) : proj;
    // int64 overflow is out of reach: each term is bounded by the buffer's elements below
    if (off < 0 || sk < 0 || sn < 0 || off >= elems[g] || (K > 1 && sk > elems[g]) ||
        (N > 1 && sn > elems[g]) || off + (K - 1) * sk + (N - 1) * sn >= elems[g])
      return std::string("the ") + abi::kProjectionNames[proj] + " view (offset " +
             std::to_string(off) + ", strides " + std::to_string(sk) + ", " + std::to_string(sn) +
             ") of a [" + std::to_string(K) + ", " + std::to_string(N) + "] matrix leaves " +
             (fused && g == 0 ? std::string("gate_up") : abi::kProjectionNames[proj]) + "'s " +
             std::to_string(elems[g]) + " elements per expert";
  }
  return "";
}

ffi::Error CollectGroups(ffi::RemainingArgs weights, int64_t E, int64_t G, bool stacked,
                         bool fused_gate_up, std::vector<int64_t>* addrs,
                         std::vector<int64_t>* elems, std::vector<CUdeviceptr>* first) {
  const int64_t per_group = stacked ? 1 : E;
  const bool quantized = G > abi::kNumProjections;
  for (int64_t p = 0; p < G; ++p) {
    size_t bytes0 = 0;
    ffi::DataType type0 = ffi::DataType::INVALID;
    for (int64_t i = 0; i < per_group; ++i) {
      auto b = weights.get<ffi::AnyBuffer>(p * per_group + i);
      if (b.has_error()) return b.error();
      const int64_t base = reinterpret_cast<int64_t>(b->untyped_data());
      if (i == 0) {
        bytes0 = b->size_bytes();
        type0 = b->element_type();
        (*first)[p] = static_cast<CUdeviceptr>(base);
      } else if (b->size_bytes() != bytes0 || b->element_type() != type0) {
        return ffi::Error::InvalidArgument("weight group " + std::to_string(p) + " expert " +
                                           std::to_string(i) +
                                           " differs from expert 0 in size or dtype");
      }
      if (stacked) {
        const int64_t stride = static_cast<int64_t>(bytes0) / E;
        for (int64_t e = 0; e < E; ++e) (*addrs)[p * E + e] = base + e * stride;
      } else {
        (*addrs)[p * E + i] = base;
      }
    }
    if (!quantized) {
      const size_t es = ffi::ByteWidth(type0);
      if (es == 0 || (type0 != ffi::DataType::F32 && type0 != ffi::DataType::BF16 &&
                      type0 != ffi::DataType::F16))
        return ffi::Error::InvalidArgument(GroupName(p, G, fused_gate_up) +
                                           " must be float32, bfloat16 or float16");
      (*elems)[p] = static_cast<int64_t>(bytes0 / es) / (stacked ? E : 1);
    }
  }
  return ffi::Error::Success();
}

ffi::Error CollectBiases(ffi::RemainingArgs weights, int64_t at, int64_t nbias, int64_t E,
                         int64_t H, int64_t I, std::vector<CUdeviceptr>* extra) {
  for (int64_t j = 0; j < nbias; ++j) {
    auto b = weights.get<ffi::AnyBuffer>(at + j);
    if (b.has_error()) return b.error();
    const int64_t n = j < 2 ? I : H;
    auto d = b->dimensions();
    if (b->element_type() != ffi::DataType::F32 || d.size() != 2 || d[0] != E || d[1] != n)
      return ffi::Error::InvalidArgument(std::string("the ") + abi::kProjectionNames[j] +
                                         " bias must be float32 [E=" + std::to_string(E) + ", " +
                                         std::to_string(n) + "]");
    extra->push_back(reinterpret_cast<CUdeviceptr>(b->untyped_data()));
  }
  return ffi::Error::Success();
}

}  // namespace nbx::cuda
