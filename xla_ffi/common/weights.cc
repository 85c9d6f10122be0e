// The weight decoder of the CPU handlers (weights.h).
#include "common/weights.h"

#include <string>

#include "common/handler_common.h"
#include "formats/registry.h"

namespace ffi = xla::ffi;

namespace nbx {
namespace {

using abi::WeightFormat;

// One expert's array of a part of a projection [K, N], by the format's spec
// (formats/registry.h): [rows, N], or [N] for a part without a K axis.
std::vector<int64_t> PartShape(const formats::FormatSpec& f, int part, int64_t K, int64_t N,
                               int64_t group) {
  const int64_t rows = formats::PartRowCount(f, part, K, group);
  if (rows < 0) return {N};
  return {rows, N};
}

// The DTypeBit of an element type (0: none of them).
uint32_t DTypeBitOf(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return formats::kF32;
    case ffi::DataType::BF16: return formats::kBF16;
    case ffi::DataType::F16: return formats::kF16;
    case ffi::DataType::S8: return formats::kS8;
    case ffi::DataType::U8: return formats::kU8;
    default: return 0;
  }
}

// "float32 or bfloat16" from a DTypeBit set.
std::string DTypeNames(uint32_t bits) {
  std::string s;
  for (int i = 0; i < formats::kNumDTypeBits; ++i) {
    if (!(bits & (1u << i))) continue;
    if (!s.empty()) s += " or ";
    s += formats::kDTypeBitNames[i];
  }
  return s;
}

std::string Dims(const std::vector<int64_t>& d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + (d.size() == 1 ? ",)" : ")");
}

// One weight array as the decoder reads it: a buffer's, or a leased block's.
struct ArrayRef {
  ffi::DataType type;
  std::vector<int64_t> dims;
  const void* data;  // nullptr: an expert the lease does not hold (never read)
  int64_t elems;
};

// The arrays of a store's lease, group-major then expert (E per group,
// `groups` groups); `out` keeps the lease.
ffi::Error LeasedArrays(const std::shared_ptr<store::Lease>& lease, int64_t E, int64_t groups,
                        ExpertWeights* out, std::vector<ArrayRef>* refs) {
  if (!lease) return ffi::Error::InvalidArgument("mapped experts without their lease (LeaseWeights)");
  if (lease->num_experts() != E ||
      static_cast<int64_t>(lease->arrays().size()) != groups)
    return ffi::Error::InvalidArgument(
        "the expert store holds " + std::to_string(lease->num_experts()) + " experts of " +
        std::to_string(lease->arrays().size()) + " arrays; the call says E=" + std::to_string(E) +
        " and " + std::to_string(groups) + " groups");
  refs->reserve(static_cast<size_t>(groups * E));
  for (int64_t g = 0; g < groups; ++g) {
    const store::ArraySpec& a = lease->arrays()[g];
    int64_t n = 1;
    for (int64_t d : a.dims) n *= d;
    for (int64_t e = 0; e < E; ++e)
      refs->push_back(ArrayRef{a.type, a.dims, lease->data(e, static_cast<size_t>(g)), n});
  }
  out->lease = lease;
  return ffi::Error::Success();
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
                         const WeightViewAttrs& v, ExpertWeights* out) {
  const int32_t fcode = static_cast<int32_t>(format);
  const formats::FormatEntry* entry = formats::FindFormat(fcode);
  if (entry == nullptr)
    return ffi::Error::InvalidArgument("unknown weight format code " + std::to_string(fcode) +
                                       " (this build knows " +
                                       std::to_string(abi::kNumWeightFormats) + " formats)");
  const formats::FormatSpec& spec = *entry->spec;
  const bool plain_call = v.intermediate < 0;  // no views given: plain, I from gate's shape
  if (!plain_call && v.views.size() != abi::kNumViewFields * abi::kNumProjections)
    return ffi::Error::InvalidArgument("views must hold " +
                                       std::to_string(abi::kNumViewFields * abi::kNumProjections) +
                                       " values; got " + std::to_string(v.views.size()));
  if (format != WeightFormat::kDense && v.fused_gate_up)
    return ffi::Error::InvalidArgument(
        "quantized weights take the plain layout only (no fused gate_up)");
  const int parts = spec.num_parts;
  const int nproj_groups = v.fused_gate_up ? 2 : abi::kNumProjections;
  const int64_t per = stacked ? 1 : E;
  const int64_t nbias = v.has_bias ? abi::kNumBiases : 0;
  const int64_t nscales = v.tensor_scales ? abi::kNumProjections : 0;
  if (v.tensor_scales && !spec.tensor_scale)
    return ffi::Error::InvalidArgument(std::string(spec.name) + " weights take no tensor scales");
  const bool mapped = v.expert_store != 0;
  if (mapped && stacked)
    return ffi::Error::InvalidArgument("an expert store's experts are per-expert (stacked=false)");
  const int64_t nweights = mapped ? 0 : parts * nproj_groups * per;
  const int64_t want = nweights + nbias + nscales;
  if (E < 1 || static_cast<int64_t>(count) != want || first + count > args.size())
    return ffi::Error::InvalidArgument(
        "expected " + std::to_string(want) + " " + abi::kWeightFormatNames[fcode] +
        " weight buffers (" +
        (mapped ? std::string("none: the expert store's")
                : std::to_string(parts * nproj_groups) + " groups of " + std::to_string(per)) +
        (nbias ? ", then 3 biases" : "") + (nscales ? ", then 3 tensor scales" : "") +
        "); got " + std::to_string(count));
  // the weight arrays, group-major then expert: the buffers, or the lease's blocks
  std::vector<ArrayRef> refs;
  if (mapped) {
    if (ffi::Error e = LeasedArrays(v.lease, E, parts * nproj_groups, out, &refs); e.failure())
      return e;
  } else {
    refs.reserve(static_cast<size_t>(nweights));
    for (int64_t i = 0; i < nweights; ++i) {
      auto b = args.get<ffi::AnyBuffer>(first + i);
      if (b.has_error()) return b.error();
      auto d = b->dimensions();
      refs.push_back(ArrayRef{b->element_type(), std::vector<int64_t>(d.begin(), d.end()),
                              b->untyped_data(), static_cast<int64_t>(b->element_count())});
    }
  }
  if (refs[0].dims.size() < 1)
    return ffi::Error::InvalidArgument("gate must have at least one axis");
  const int64_t I = plain_call ? refs[0].dims.back() : v.intermediate;
  // The views, and whether they are the plain ones (then shapes are checked exactly).
  int64_t view[abi::kNumProjections][abi::kNumViewFields];
  bool plain = !v.fused_gate_up;
  for (int proj = 0; proj < abi::kNumProjections; ++proj) {
    const int64_t N = proj < 2 ? I : H;
    const int64_t pv[3] = {0, N, 1};
    for (int f = 0; f < abi::kNumViewFields; ++f) {
      view[proj][f] = plain_call ? pv[f] : v.views[proj * abi::kNumViewFields + f];
      plain = plain && view[proj][f] == pv[f];
    }
  }
  if (format != WeightFormat::kDense && !plain)
    return ffi::Error::InvalidArgument("quantized weights take the plain views only");
  if (view[0][1] != view[1][1] || view[0][2] != view[1][2])
    return ffi::Error::InvalidArgument("gate and up views must share their strides");
  if (!formats::GroupSizeOk(spec, group_size))
    return ffi::Error::InvalidArgument(
        std::string(spec.name) + " group size " + std::to_string(group_size) +
        (spec.num_group_sizes ? " must be one of the format's group sizes"
                              : " must be 0 (the format has no groups)"));
  // each projection's K (gate and up: H; down: I) against the group and the packing
  for (const int64_t K : {H, I}) {
    if (!formats::GroupFitsK(spec, group_size, K))
      return ffi::Error::InvalidArgument(
          std::string(spec.name) + " group size " + std::to_string(group_size) +
          " must divide H=" + std::to_string(H) + " and I=" + std::to_string(I) + " (" +
          spec.name + " takes whole groups along K; got K=" + std::to_string(K) + ")");
    if (K % spec.values_per_byte)
      return ffi::Error::InvalidArgument(
          std::string(spec.name) + " packs " + std::to_string(spec.values_per_byte) +
          " values per byte along K: H=" + std::to_string(H) + " and I=" + std::to_string(I) +
          " must be multiples of " + std::to_string(spec.values_per_byte));
  }
  out->E = E;
  out->H = H;
  out->I = I;
  out->format = format;
  out->fused = v.fused_gate_up;
  for (int proj = 0; proj < abi::kNumProjections; ++proj) {
    out->off[proj] = view[proj][0];
    out->sk[proj] = view[proj][1];
    out->sn[proj] = view[proj][2];
  }
  out->table.assign(abi::kNumProjections * E, nullptr);
  out->quant.assign(format == WeightFormat::kDense ? 0 : abi::kNumProjections * E, QuantMatrix{});
  ffi::DataType dense_type = ffi::DataType::INVALID;
  // each part's dtype per array (group * per + i), for the spec's ties
  std::vector<ffi::DataType> part_type[abi::kNumParts];
  for (auto& v : part_type) v.assign(static_cast<size_t>(nproj_groups * per), ffi::DataType::INVALID);
  for (int part = 0; part < parts; ++part) {
    for (int grp = 0; grp < nproj_groups; ++grp) {
      // the projections this group's buffers hold (-1: none)
      const int proj = v.fused_gate_up && grp == 1 ? 2 : grp;
      const int projs[2] = {proj, v.fused_gate_up && grp == 0 ? 1 : -1};
      const int64_t K = proj < 2 ? H : I, N = proj < 2 ? I : H;
      std::vector<int64_t> shape = PartShape(spec, part, K, N, group_size);
      if (stacked) shape.insert(shape.begin(), E);
      for (int64_t i = 0; i < per; ++i) {
        const ArrayRef* b = &refs[static_cast<size_t>((part * nproj_groups + grp) * per + i)];
        const ffi::DataType t = b->type;
        const std::vector<int64_t>& got = b->dims;
        const std::string where =
            v.fused_gate_up && grp == 0 ? (stacked ? std::string("gate_up")
                                                   : "gate_up expert " + std::to_string(i))
                                        : Where(proj, part, format, stacked, i);
        if (plain && got != shape)
          return ffi::Error::InvalidArgument(where + " has shape " + Dims(got) + "; expected " +
                                             Dims(shape));
        if (!plain && (got.size() != (stacked ? 3u : 2u) || (stacked && got[0] != E)))
          return ffi::Error::InvalidArgument(where + " has shape " + Dims(got) + "; expected " +
                                             (stacked ? "[E=" + std::to_string(E) + ", rows, cols]"
                                                      : std::string("[rows, cols]")));
        const formats::PartSpec& ps = spec.parts[part];
        if (!(DTypeBitOf(t) & ps.dtypes))
          return ffi::Error::InvalidArgument(where + " has the wrong dtype for " + spec.name +
                                             " weights: expected " + DTypeNames(ps.dtypes));
        // a part the spec ties to an earlier one shares its dtype (per
        // array); dense weights take one dtype for all
        const size_t slot = static_cast<size_t>(grp * per + i);
        if (ps.same_dtype_as >= 0 && t != part_type[ps.same_dtype_as][slot])
          return ffi::Error::InvalidArgument(where + " has the wrong dtype for " + spec.name +
                                             " weights: it must be its " +
                                             abi::kPartNames[ps.same_dtype_as] + "'s dtype");
        if (format == WeightFormat::kDense && dense_type != ffi::DataType::INVALID &&
            t != dense_type)
          return ffi::Error::InvalidArgument(where + " has the wrong dtype for dense weights: "
                                             "one dtype for every projection and expert");
        part_type[part][slot] = t;
        if (format == WeightFormat::kDense) dense_type = t;
        const size_t es = ffi::ByteWidth(t);
        const int64_t elems = b->elems / (stacked ? E : 1);
        if (part == 0) out->group_elems[grp] = elems;
        // every element of each view lies inside the expert's array
        for (int pj : projs) {
          if (pj < 0 || format != WeightFormat::kDense) continue;
          const int64_t Kp = pj < 2 ? H : I, Np = pj < 2 ? I : H;
          const int64_t off = view[pj][0], sk = view[pj][1], sn = view[pj][2];
          if (off < 0 || sk < 0 || sn < 0 ||
              (Kp > 0 && Np > 0 && off + (Kp - 1) * sk + (Np - 1) * sn >= elems))
            return ffi::Error::InvalidArgument(
                std::string("the ") + abi::kProjectionNames[pj] + " view (offset " +
                std::to_string(off) + ", strides " + std::to_string(sk) + ", " +
                std::to_string(sn) + ") of a [" + std::to_string(Kp) + ", " +
                std::to_string(Np) + "] matrix leaves " + where + "'s " + std::to_string(elems) +
                " elements per expert");
        }
        for (int64_t e = stacked ? 0 : i; e < (stacked ? E : i + 1); ++e) {
          if (b->data == nullptr) continue;  // not leased: no call of this lease reads it
          const char* base = static_cast<const char*>(b->data) +
                             (stacked ? e * elems * static_cast<int64_t>(es) : 0);
          if (format == WeightFormat::kDense) {
            for (int pj : projs)
              if (pj >= 0) out->table[pj * E + e] = base + view[pj][0] * static_cast<int64_t>(es);
            continue;
          }
          QuantMatrix& m = out->quant[proj * E + e];
          m.N = N;
          m.group = group_size > 0 ? group_size : K;
          m.format = format;
          if (part == 0) m.q = base;
          if (part == 1) {
            m.scale = base;
            m.bf16_scales = t == ffi::DataType::BF16;
          }
          if (part == 2) m.zero = base;
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
  for (int j = 0; j < nbias; ++j) {
    const int64_t n = j < 2 ? I : H;
    auto b = args.get<ffi::AnyBuffer>(first + count - nscales - nbias + j);
    if (b.has_error()) return b.error();
    auto d = b->dimensions();
    if (b->element_type() != ffi::DataType::F32 || d.size() != 2 || d[0] != E || d[1] != n)
      return ffi::Error::InvalidArgument(std::string("the ") + abi::kProjectionNames[j] +
                                         " bias must be float32 [E=" + std::to_string(E) + ", " +
                                         std::to_string(n) + "]");
    out->bias[j] = static_cast<const float*>(b->untyped_data());
  }
  for (int j = 0; j < nscales; ++j) {
    auto b = args.get<ffi::AnyBuffer>(first + count - nscales + j);
    if (b.has_error()) return b.error();
    auto d = b->dimensions();
    if (b->element_type() != ffi::DataType::F32 || d.size() != 1 || d[0] != E)
      return ffi::Error::InvalidArgument(std::string("the ") + abi::kProjectionNames[j] +
                                         " tensor scales must be float32 [E=" + std::to_string(E) +
                                         "]");
    const float* ts = static_cast<const float*>(b->untyped_data());
    for (int64_t e = 0; e < E; ++e) out->quant[j * E + e].tensor_scale = ts[e];
  }
  out->tensor_scales = nscales > 0;
  return ffi::Error::Success();
}

ffi::Error DecodeGradients(ffi::RemainingRets rets, size_t first, size_t trailing,
                           const ExpertWeights& w, bool stacked, GradientTable* out) {
  const int64_t E = w.E, per = stacked ? 1 : E;
  if (w.quantized())
    return ffi::Error::InvalidArgument("the CPU backward takes dense weights only");
  const int groups = w.groups();
  const int64_t nbias = w.bias[0] ? abi::kNumBiases : 0;
  const int64_t want = groups * per + nbias;
  if (static_cast<int64_t>(rets.size()) != static_cast<int64_t>(first + trailing) + want)
    return ffi::Error::InvalidArgument("expected " + std::to_string(want) +
                                       " weight-gradient results; got " +
                                       std::to_string(rets.size() - first - trailing));
  out->table.assign(abi::kNumProjections * E, nullptr);
  out->group_base.assign(groups * E, nullptr);
  out->buffers.clear();
  for (int grp = 0; grp < groups; ++grp) {
    const int64_t elems = w.group_elems[grp];
    for (int64_t i = 0; i < per; ++i) {
      auto g = rets.get<ffi::AnyBuffer>(first + grp * per + i);
      if (g.has_error()) return g.error();
      if ((*g)->element_type() != ffi::DataType::F32 ||
          static_cast<int64_t>((*g)->element_count()) != (stacked ? E : 1) * elems)
        return ffi::Error::InvalidArgument(
            std::string("the gradient of ") +
            (w.fused && grp == 0 ? "gate_up" : abi::kProjectionNames[w.fused ? 2 : grp]) +
            " must be float32 with the weight's shape");
      float* base = static_cast<float*>((*g)->untyped_data());
      out->buffers.emplace_back(base, (*g)->size_bytes());
      for (int64_t e = stacked ? 0 : i; e < (stacked ? E : i + 1); ++e)
        out->group_base[grp * E + e] = base + (stacked ? e * elems : 0);
    }
  }
  // each projection's view inside its group's gradient, as in the weights' table
  for (int proj = 0; proj < abi::kNumProjections; ++proj)
    for (int64_t e = 0; e < E; ++e)
      out->table[proj * E + e] = out->group_base[w.GroupOf(proj) * E + e] + w.off[proj];
  for (int j = 0; j < nbias; ++j) {
    const int64_t n = j < 2 ? w.I : w.H;
    auto g = rets.get<ffi::AnyBuffer>(first + groups * per + j);
    if (g.has_error()) return g.error();
    if ((*g)->element_type() != ffi::DataType::F32 ||
        static_cast<int64_t>((*g)->element_count()) != E * n)
      return ffi::Error::InvalidArgument(std::string("the gradient of the ") +
                                         abi::kProjectionNames[j] + " bias must be float32 [E, " +
                                         std::to_string(n) + "]");
    out->bias[j] = static_cast<float*>((*g)->untyped_data());
    out->buffers.emplace_back(out->bias[j], (*g)->size_bytes());
  }
  return ffi::Error::Success();
}

ffi::Error LeaseWeights(WeightViewAttrs* v, const int32_t* ids, int64_t n, bool skip_outside) {
  if (v->expert_store == 0) return ffi::Error::Success();
  std::string error;
  bool exhausted = false;
  if (!store::LeaseCall(v->expert_store, ids, n, skip_outside, &v->lease, &error, &exhausted))
    return exhausted ? ffi::Error(ffi::ErrorCode::kResourceExhausted, error)
                     : ffi::Error::InvalidArgument(error);
  return ffi::Error::Success();
}

ffi::Error DecodeWeightsAndLora(ffi::RemainingArgs args, size_t trailing, int64_t E, int64_t H,
                                abi::WeightFormat format, bool stacked, int64_t group_size,
                                const WeightViewAttrs& views, const LoraAttrs& lora_attrs,
                                ExpertWeights* w, Lora* lora, size_t* nlora) {
  if (ffi::Error e = LoraBufferCount(lora_attrs.ranks, nlora); e.failure()) return e;
  if (args.size() < trailing + *nlora)
    return ffi::Error::InvalidArgument("fewer inputs than the adapters' buffers");
  const size_t nweights = args.size() - trailing - *nlora;
  if (ffi::Error e =
          DecodeWeights(args, 0, nweights, E, H, format, stacked, group_size, views, w);
      e.failure())
    return e;
  return DecodeLora(args, nweights, w->E, H, w->I, lora_attrs.ranks, lora_attrs.scale, lora);
}

ffi::Error CheckKernelsRead(abi::WeightFormat format, uint32_t backend, const char* who) {
  const formats::FormatEntry* entry = formats::FindFormat(static_cast<int32_t>(format));
  if (entry == nullptr || (entry->spec->kernels & backend) != 0) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(who) + " kernels do not read " + entry->spec->name +
                                     " experts (formats/" + entry->spec->name + ".h)");
}

}  // namespace nbx
