// The kernel testers' quantized operands (kernel_test_support.h's
// DenseWeights for quantized formats): one QuantFormat per case of every
// quantized format of the registry, and QuantWeights, a random K x N matrix in
// that format whose expected values come from the registry's scalar reference
// (formats/<name>.h).  Test-only (NBX_TESTING).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "formats/registry.h"
#include "native/kernel_test_support.h"

namespace nbx {
namespace kernel_testing {

// A quantized format case of the testers: the format, its group (0: none)
// and, for float scales, whether they are bfloat16.
struct QuantFormat {
  std::string Name() const {
    std::string n = abi::kWeightFormatNames[static_cast<int>(code)];
    if (group) n += Fmt("/g%d", group);
    if (FloatScales()) n += bf16_scales ? "/bf16-scales" : "/f32-scales";
    return n;
  }
  const formats::FormatSpec& Spec() const { return formats::SpecOf(code); }
  bool FloatScales() const { return Spec().parts[1].dtypes & formats::kF32; }
  // int8: sums of q, each column's times its scale once (FormatSpec::column_scaled)
  bool ColumnScaled() const { return Spec().column_scaled; }
  abi::WeightFormat code;
  int group;
  bool bf16_scales = false;
};

std::vector<QuantFormat> QuantFormats() {
  using abi::WeightFormat;
  std::vector<QuantFormat> v;
  for (bool b : {false, true}) {
    v.push_back({WeightFormat::kInt8, 0, b});
    for (int group : {32, 64, 128}) v.push_back({WeightFormat::kInt4, group, b});
    v.push_back({WeightFormat::kFp8, b ? 128 : 32, b});  // (two cases: the ASan tier runs these)
  }
  v.push_back({WeightFormat::kMxfp4, 32});
  v.push_back({WeightFormat::kMxfp8, 32});
  v.push_back({WeightFormat::kNvfp4, 16});
  return v;
}

// K of a quantized case: grouped formats a multiple of the group, and for
// formats with partial groups (FormatSpec::partial_groups) a partial last
// group too (even: packable), and an odd K where a byte holds one value.
std::vector<int64_t> QuantKs(const QuantFormat& f) {
  if (!f.group) return std::vector<int64_t>(std::begin(kKs), std::end(kKs));
  std::vector<int64_t> v = {0, f.group, 2 * f.group, 256};
  if (f.Spec().partial_groups) {
    v.push_back(f.group + 6);
    if (f.Spec().values_per_byte == 1) v.push_back(2 * f.group + 7);
  }
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

// A quantized K x N matrix (QuantMatrix) of which columns [n0, n0+ncols) and
// rows [k0, k1) are the case's: the scales (and mins) of other columns, and
// groups without such a row, are NaN (float NaN, E8M0 255, E4M3 0x7F).
// Parts as the format's spec lays them out: q any bytes (E4M3 codes but NaN
// unless nan_codes;
// int8 any), float scales in [-1, 1] / 127 (int8) or / 15, int4's mins in
// [-1, 1], E8M0 scales 2^-8 .. 2^2, E4M3 scales 2^-3 .. 2^3.
class QuantWeights {
 public:
  // nan_codes: E4M3 q may hold the NaN codes too (qpack, whose check takes NaN for NaN)
  QuantWeights(const QuantFormat& f, int64_t K, int64_t N, int64_t n0, int ncols, Rng& rng,
               int64_t k0 = 0, int64_t k1 = -1, bool nan_codes = false)
      : f_(f), K_(K), N_(N), n0_(n0), ncols_(ncols) {
    if (k1 < 0) k1 = K;
    const formats::FormatSpec& spec = f.Spec();
    const bool e4m3_q = f.code == abi::WeightFormat::kFp8 || f.code == abi::WeightFormat::kMxfp8;
    for (int part = 0; part < spec.num_parts; ++part) {
      const formats::PartSpec& ps = spec.parts[part];
      const int64_t rows = formats::PartRowCount(spec, part, K, f.group);
      const int64_t n = (rows < 0 ? 1 : rows) * N;
      const formats::DTypeBit t = part == 0 ? static_cast<formats::DTypeBit>(ps.dtypes)
                                  : ps.dtypes & formats::kF32 ? (f.bf16_scales ? formats::kBF16 : formats::kF32)
                                                             : formats::kU8;
      dtype_[part] = t;
      bytes_[part].assign(static_cast<size_t>(n * (t == formats::kF32 ? 4 : t == formats::kBF16 ? 2 : 1)), 0);
      if (part == 0) {
        for (uint8_t& b : bytes_[0]) {
          b = static_cast<uint8_t>(rng.Int(0, 255));
          if (e4m3_q && !nan_codes && (b & 0x7F) == 0x7F) b ^= 1;  // no NaN weights
        }
        continue;
      }
      const int64_t groups = rows < 0 ? 1 : rows;
      for (int64_t g = 0; g < groups; ++g) {
        const bool live = rows < 0 || (g * f.group < k1 && (g + 1) * f.group > k0);
        for (int64_t c = 0; c < N; ++c) {
          const bool ours = live && c >= n0 && c < n0 + ncols;
          const int64_t i = g * N + c;
          if (t == formats::kU8) {  // E8M0 (mxfp*) or E4M3 (nvfp4) scale bytes
            const bool e8m0 = f.code != abi::WeightFormat::kNvfp4;
            bytes_[part][i] = static_cast<uint8_t>(ours ? (e8m0 ? rng.Int(119, 129) : rng.Int(0x20, 0x57))
                                                        : (e8m0 ? 255 : 0x7F));
            continue;
          }
          const float v = !ours ? kNaN
                          : part == 2 ? rng.Uniform()
                                      : rng.Uniform() / (f.ColumnScaled() ? 127.0f : 15.0f);
          if (t == formats::kBF16) {
            const uint16_t h = FromFloat<bf16>(v).bits;
            memcpy(&bytes_[part][i * 2], &h, 2);
          } else {
            memcpy(&bytes_[part][i * 4], &v, 4);
          }
        }
      }
    }
  }
  QuantMatrix Matrix() const {
    return QuantMatrix{Part(0), Part(1), Part(2), N_, f_.group ? f_.group : K_, f_.code,
                       dtype_[1] == formats::kBF16};
  }
  // What qpack must produce for rows [k0, k0+kc): the registry's scalar
  // reference (formats/<name>.h), but int8's q unscaled (its scale is the
  // packed kernels' epilogue); and each value's magnitude for the tolerance.
  RefMatrix Packed(int64_t k0, int64_t kc) const {
    RefMatrix m(kc, ncols_);
    formats::PartsView view{};
    for (int p = 0; p < abi::kNumParts; ++p) view.part[p] = Part(p), view.dtype[p] = dtype_[p];
    view.N = N_;
    view.group = f_.group;
    const formats::ReferenceFn ref = formats::FindFormat(static_cast<int32_t>(f_.code))->reference;
    for (int64_t i = 0; i < kc; ++i)
      for (int c = 0; c < ncols_; ++c) {
        const int64_t k = k0 + i, n = n0_ + c;
        const double v = f_.ColumnScaled() ? formats::PartValue(view, 0, k * N_ + n) : ref(view, k, n);
        double mag = std::fabs(v);
        if (f_.code == abi::WeightFormat::kInt4) {  // q * scale + min: |q * scale| + |min|
          const int64_t g = (k / f_.group) * N_ + n;
          const uint8_t byte = static_cast<const uint8_t*>(Part(0))[(k / 2) * N_ + n];
          mag = std::fabs(((k & 1) ? byte >> 4 : byte & 15) * double(formats::PartValue(view, 1, g))) +
                std::fabs(double(formats::PartValue(view, 2, g)));
        }
        m.Set(i, c, v, mag);
      }
    return m;
  }
  // The weights the kernels multiply by (int8: q * scale).
  RefMatrix Ref() const {
    RefMatrix m = Packed(0, K_);
    if (HasScales()) {
      std::vector<float> s(ncols_);
      for (int c = 0; c < ncols_; ++c) s[c] = Scale(c);
      m.ScaleColumns(s);
    }
    return m;
  }
  // As DenseWeights::Panel, by the table's qpack.
  void Panel(const KernelTable& t, int64_t c0, int nc, int width, float* dst, int64_t rs) const {
    const QuantMatrix m = Matrix();
    t.qpack(&m, 0, static_cast<int>(K_), n0_ + c0, nc, width, dst, rs, K_ * rs);
  }
  bool HasScales() const { return f_.ColumnScaled(); }
  float Scale(int64_t c) const {
    formats::PartsView view{};
    view.part[1] = Part(1), view.dtype[1] = dtype_[1];
    return formats::PartValue(view, 1, n0_ + c);
  }

 private:
  const void* Part(int p) const { return bytes_[p].empty() ? nullptr : bytes_[p].data(); }
  QuantFormat f_;
  int64_t K_, N_, n0_;
  int ncols_;
  std::vector<uint8_t> bytes_[abi::kNumParts];
  formats::DTypeBit dtype_[abi::kNumParts] = {};
};

}  // namespace kernel_testing
}  // namespace nbx
