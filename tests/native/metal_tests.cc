// The Metal layer exposed for tests (see metal_tests.h).  Host arrays are
// passed as (address, bytes) pairs of numpy arrays the test keeps alive.
#include "native/metal_tests.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "common/slots.h"
#include "formats/registry.h"
#include "native/metal/emulated_kernels.h"
#include "metal/kernel_calls.h"
#include "metal/pins.h"
#include "metal/runtime.h"
#include "native/metal/sim_device.h"
#include "metal/tables.h"

namespace nb = nanobind;

namespace nbx {
namespace {
using metal::SimDevice;
using Ranges = std::vector<std::tuple<int64_t, int64_t>>;

SimDevice& Sim() {
  SimDevice* s = metal::ActiveSim();
  if (s == nullptr) throw nb::value_error("the simulated Metal device is not active");
  return *s;
}

std::vector<metal::HostRange> ToRanges(const Ranges& r) {
  std::vector<metal::HostRange> out;
  for (const auto& [p, n] : r)
    out.push_back({reinterpret_cast<const char*>(static_cast<uintptr_t>(p)), n});
  return out;
}

struct Pins {
  metal::PinnedScope scope;
};

// One command buffer with `resources` resident that reads [gpu, +bytes) for
// each read (through SimDevice::Resolve) and returns the first byte of each
// (-1 where the read was refused: a violation is recorded).
std::vector<int64_t> RunReads(const std::vector<metal::Buffer>& resources,
                              const std::vector<std::tuple<uint64_t, int64_t>>& reads) {
  auto out = std::make_shared<std::vector<int64_t>>(reads.size(), -2);  // -2: not run yet
  Sim().Submit(resources, [out, reads]() {
    for (size_t i = 0; i < reads.size(); ++i) {
      char* p = Sim().Resolve(std::get<0>(reads[i]), std::get<1>(reads[i]));
      (*out)[i] = p == nullptr ? -1 : static_cast<unsigned char>(*p);
    }
  });
  return *out;
}
// Host regions copied into one metal:0 buffer (each 64-byte aligned), as the
// handler stages XLA's buffers.
struct Staged {
  metal::DeviceBuffer buf;
  std::vector<std::tuple<char*, int64_t, int64_t>> regions;  // host, bytes, offset in buf
  metal::View at(size_t i) const { return metal::View{buf.buffer(), std::get<2>(regions[i])}; }
};

Staged Stage(const Ranges& regions) {
  Staged st;
  int64_t total = 0;
  for (const auto& [p, n] : regions) {
    st.regions.emplace_back(reinterpret_cast<char*>(static_cast<uintptr_t>(p)), n, total);
    total += (n + 63) / 64 * 64;
  }
  std::string err;
  if (!metal::DeviceBuffer::Allocate(std::max<int64_t>(total, 64), "test", WorkShape{1, 1, 0},
                                     &st.buf, &err))
    throw nb::value_error(err.c_str());
  for (const auto& [host, n, off] : st.regions)
    if (n > 0) std::memcpy(st.buf.buffer().host + off, host, static_cast<size_t>(n));
  return st;
}

// One command buffer of `ds`, waited for; then the regions `back` copied out.
void RunAndUnstage(const std::vector<metal::Buffer>& resident, const std::vector<metal::Dispatch>& ds,
                   const Staged& st, const std::vector<size_t>& back) {
  std::string err;
  if (!metal::Active()->Commit(resident, ds, &err) || !metal::Active()->Wait(&err))
    throw nb::value_error(err.c_str());
  for (size_t i : back) {
    const auto& [host, n, off] = st.regions[i];
    if (n > 0) std::memcpy(host, st.buf.buffer().host + off, static_cast<size_t>(n));
  }
}
// kernels/weights.metal against formats/: every element code (E2M1, E4M3,
// E8M0) exhaustively, then each format's reader, for every type of its
// compute part and every group size, on parts of random bits, element by
// element against the registry's scalar reference (NaN matches NaN, else bit
// for bit); each part cut one byte short must be refused (the reader's
// extents are the parts').  Returns (values compared, the first mismatches).
std::tuple<int64_t, std::vector<std::string>> CheckWeightReaders(uint64_t seed) {
  std::vector<std::string> bad;
  int64_t checked = 0;
  auto check = [&](const std::string& what, float got, float want) {
    ++checked;
    const bool same = (std::isnan(got) && std::isnan(want)) || std::memcmp(&got, &want, 4) == 0;
    if (!same && bad.size() < 20)
      bad.push_back(what + ": got " + std::to_string(got) + ", expected " + std::to_string(want));
  };
  for (uint32_t c = 0; c < 256; ++c) {
    if (c < 16) check("nbx_e2m1(" + std::to_string(c) + ")", metal::EmulatedMinifloat('f', c),
                      formats::kE2M1Values[c]);
    check("nbx_e4m3(" + std::to_string(c) + ")", metal::EmulatedMinifloat('8', c),
          formats::E4M3Value(static_cast<uint8_t>(c)));
    check("nbx_e8m0(" + std::to_string(c) + ")", metal::EmulatedMinifloat('s', c),
          formats::E8M0Value(static_cast<uint8_t>(c)));
  }
  std::mt19937_64 rng(seed);
  const std::pair<formats::DTypeBit, metal::WeightType> types[] = {
      {formats::kF32, metal::WeightType::kF32}, {formats::kBF16, metal::WeightType::kBF16},
      {formats::kF16, metal::WeightType::kF16}};
  for (const formats::FormatEntry& entry : formats::kFormats) {
    const formats::FormatSpec& spec = *entry.spec;
    const int ngroups = std::max(spec.num_group_sizes, 1);
    for (const auto& [bit, wt] : types) {
      const int cp = spec.compute_dtype_part;
      if (cp >= 0 ? !(spec.parts[cp].dtypes & bit) : bit != formats::kF32) continue;
      for (int gi = 0; gi < ngroups; ++gi) {
        const uint32_t group = spec.num_group_sizes ? static_cast<uint32_t>(spec.group_sizes[gi]) : 0;
        // K a multiple of the group, or past it by a partial last group
        // (FormatSpec::partial_groups; odd where a byte holds one value)
        const uint32_t tail = !spec.partial_groups ? 0 : spec.values_per_byte == 1 ? 7 : 6;
        const uint32_t K = group > 0 ? 2 * group + tail : 35, N = 9;
        std::vector<std::vector<unsigned char>> data(static_cast<size_t>(spec.num_parts));
        std::vector<metal::HostPart> parts;
        formats::PartsView v{};
        for (int part = 0; part < spec.num_parts; ++part) {
          const uint32_t dts = spec.parts[part].dtypes;
          const bool byte_part = (dts & ~uint32_t{formats::kU8 | formats::kS8}) == 0;
          const int64_t rows = formats::PartRowCount(spec, part, K, group);
          const int64_t es = byte_part ? 1 : (bit == formats::kF32 ? 4 : 2);
          data[part].resize(static_cast<size_t>((rows < 0 ? 1 : rows) * N * es));
          for (unsigned char& b : data[part]) b = static_cast<unsigned char>(rng());
          parts.push_back({data[part].data(), static_cast<int64_t>(data[part].size())});
          v.part[part] = data[part].data();
          v.dtype[part] = byte_part ? static_cast<formats::DTypeBit>(dts) : bit;
        }
        v.N = N;
        v.group = group > 0 ? group : K;  // as the CPU decoder records int8's
        const std::string name = std::string(spec.name) + "/" + formats::kDTypeBitNames[
            bit == formats::kF32 ? 0 : bit == formats::kBF16 ? 1 : 2] + "/G" + std::to_string(group);
        std::vector<float> out(static_cast<size_t>(K) * N, std::nanf(""));
        std::string err;
        if (!metal::EmulatedWeights({spec.code, wt}, parts, K, N, group, out.data(), &err)) {
          bad.push_back(name + ": " + err);
          continue;
        }
        for (uint32_t k = 0; k < K; ++k)
          for (uint32_t n = 0; n < N; ++n)
            check(name + " (" + std::to_string(k) + ", " + std::to_string(n) + ")",
                  out[static_cast<size_t>(k) * N + n], entry.reference(v, k, n));
        for (size_t part = 0; part < parts.size(); ++part) {  // one byte short: refused
          std::vector<metal::HostPart> cut = parts;
          cut[part].bytes -= 1;
          ++checked;
          if (metal::EmulatedWeights({spec.code, wt}, cut, K, N, group, out.data(), &err))
            bad.push_back(name + ": part " + std::to_string(part) + " one byte short was read");
        }
      }
    }
  }
  return {checked, bad};
}
}  // namespace

void BindMetalTests(nb::module_& m) {
  m.def("metal_sim_configure", [](int64_t working_set, int64_t max_buffer_length, int64_t max_wraps) {
    Sim().Configure({working_set, max_buffer_length, max_wraps});
    Account::Get().SetBudget(metal::Ledger(), working_set);
  }, "Sets the simulated device's working set (and metal:0's budget), maxBufferLength, wrap bound.");
  m.def("metal_sim_track_host", [](int64_t p, int64_t bytes, bool wrappable) {
    Sim().TrackHost(reinterpret_cast<const void*>(static_cast<uintptr_t>(p)), bytes, wrappable);
  }, nb::arg("ptr"), nb::arg("bytes"), nb::arg("wrappable") = true);
  m.def("metal_sim_forget_host", [](int64_t p) {
    Sim().ForgetHost(reinterpret_cast<const void*>(static_cast<uintptr_t>(p)));
  });
  m.def("metal_sim_hold_completions", [](bool hold) { Sim().HoldCompletions(hold); });
  m.def("metal_sim_reject_library", [](const std::string& compiler_message) {
    Sim().RejectLibrary(compiler_message);
  }, "Makes the kernels' library one the Metal compiler rejects with that message (\"\": compiles).");
  m.def("metal_sim_state", []() {
    nb::dict d;
    d["pending_commands"] = Sim().pending_commands();
    d["pending_releases"] = Sim().pending_releases();
    d["live_buffers"] = Sim().live_buffers();
    d["live_wraps"] = Sim().live_wraps();
    d["wraps_made"] = Sim().wraps_made();
    return d;
  });
  m.def("metal_sim_take_violations", []() { return Sim().TakeViolations(); });
  m.def("metal_sim_resolve", [](uint64_t gpu, int64_t bytes) {
    return static_cast<int64_t>(reinterpret_cast<uintptr_t>(Sim().Resolve(gpu, bytes)));
  }, "The host address behind a GPU range (0 and a violation when none covers it).");

  nb::class_<Pins>(m, "MetalPins")
      .def_prop_ro("wraps", [](const Pins& p) { return p.scope.wraps(); })
      .def_prop_ro("staged", [](const Pins& p) { return p.scope.staged(); })
      .def("gpu_address", [](const Pins& p, int64_t ptr, int64_t bytes) {
        return p.scope.GpuAddress(reinterpret_cast<const void*>(static_cast<uintptr_t>(ptr)), bytes);
      })
      .def("current", [](const Pins& p) { return p.scope.Current(); })
      .def("read", [](const Pins& p, const std::vector<std::tuple<uint64_t, int64_t>>& reads,
                      bool resident) {
        return RunReads(resident ? p.scope.resources() : std::vector<metal::Buffer>{}, reads);
      }, nb::arg("reads"), nb::arg("resident") = true,
         "A command buffer reading each (gpu, bytes): the first byte, or -1 if refused.")
      .def("release", [](Pins& p) { p.scope.Unpin(); });
  m.def("metal_pin", [](const Ranges& ranges) {
    auto p = std::make_unique<Pins>();
    std::string err;
    if (!metal::PinnedScope::Pin(ToRanges(ranges), &p->scope, &err)) throw nb::value_error(err.c_str());
    return p.release();
  }, nb::rv_policy::take_ownership, "Pins (address, bytes) host ranges on the active device.");

  nb::class_<metal::DeviceBuffer>(m, "MetalBuffer")
      .def_prop_ro("gpu", [](const metal::DeviceBuffer& b) { return b.buffer().gpu; })
      .def_prop_ro("bytes", [](const metal::DeviceBuffer& b) { return b.buffer().length; })
      .def("read", [](const metal::DeviceBuffer& b, const std::vector<std::tuple<uint64_t, int64_t>>& reads) {
        return RunReads({b.buffer()}, reads);
      })
      .def("fill", [](const metal::DeviceBuffer& b, int64_t offset, int value, int64_t bytes) {
        if (offset < 0 || bytes < 0 || offset + bytes > b.buffer().length)
          throw nb::value_error("fill outside the buffer");
        metal::Active()->Memset(b.buffer(), offset, value, bytes);
      })
      .def("release", [](metal::DeviceBuffer& b) { b.Reset(); });
  m.def("metal_buffer", [](int64_t bytes) {
    auto b = std::make_unique<metal::DeviceBuffer>();
    std::string err;
    if (!metal::DeviceBuffer::Allocate(bytes, "test buffer", WorkShape{}, b.get(), &err))
      throw nb::value_error(err.c_str());
    return b.release();
  }, nb::rv_policy::take_ownership, "A shared buffer counted in metal:0's account.");
  m.def("metal_submit_using", [](const metal::DeviceBuffer& b) {
    Sim().Submit({b.buffer()}, nullptr);
  }, "Commits an empty command buffer that uses the buffer (held while completions are held).");

  nb::class_<metal::Table>(m, "MetalTable")
      .def_prop_ro("cached", [](const metal::Table& t) { return t.cached; })
      .def_prop_ro("wraps", [](const metal::Table& t) { return t.pins.wraps(); })
      .def_prop_ro("staged", [](const metal::Table& t) { return t.pins.staged(); })
      .def("addresses", [](const metal::Table& t) {
        std::vector<int64_t> a(static_cast<size_t>(t.n));
        if (t.n > 0) std::memcpy(a.data(), t.addresses.buffer().host, a.size() * sizeof(int64_t));
        return a;
      }, "The GPU addresses the table holds (read from its shared buffer).")
      .def("read", [](const metal::Table& t, const std::vector<std::tuple<uint64_t, int64_t>>& reads) {
        return RunReads(t.pins.resources(), reads);
      });
  m.def("metal_run_gemm",
        [](const std::string& kind, const Ranges& regions, const metal::Table& table,
           const std::tuple<uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, float,
                            float>& gp,
           uint32_t rows, const std::string& wtype, bool drop_barrier, bool resident,
           const std::string& fmt, uint32_t group) {
          // regions: a, row_src, tile_expert (or row_expert), row_weight, out (copied back)
          if (regions.size() != 5) throw nb::value_error("5 regions: a, row_src, experts, row_weight, out");
          const formats::FormatEntry* entry = nullptr;
          for (const formats::FormatEntry& f : formats::kFormats)
            if (fmt == f.spec->name) entry = &f;
          if (entry == nullptr || !formats::GroupSizeOk(*entry->spec, group))
            throw nb::value_error("an unknown format, or a group size it does not take");
          Staged st = Stage(regions);
          const auto& [K, N, E, mode, act, lda, tile0, alpha, limit] = gp;
          const metal::params::GemmParams p{K, N, E, mode, act, lda, tile0, alpha, limit, group};
          const metal::WeightKind w{entry->spec->code,
                                    wtype == "f16"    ? metal::WeightType::kF16
                                    : wtype == "bf16" ? metal::WeightType::kBF16
                                                      : metal::WeightType::kF32};
          const metal::View tab{table.addresses.buffer(), 0};
          metal::Dispatch d =
              kind == "gemv" ? metal::MoeGemv(w, p, rows, st.at(0), st.at(1), st.at(2), tab, st.at(3), st.at(4))
                             : metal::MoeGemm(w, p, rows, st.at(0), st.at(1), st.at(2), tab, st.at(3), st.at(4));
          if (drop_barrier) d.kernel += "__drop_barrier";
          std::vector<metal::Buffer> res{st.buf.buffer(), table.addresses.buffer()};
          if (resident)
            for (const metal::Buffer& b : table.pins.resources()) res.push_back(b);
          RunAndUnstage(res, {d}, st, {4});
        },
        nb::arg("kind"), nb::arg("regions"), nb::arg("table"), nb::arg("gp"), nb::arg("rows"),
        nb::arg("wtype"), nb::arg("drop_barrier"), nb::arg("resident"), nb::arg("fmt") = "dense",
        nb::arg("group") = 0,
        "nbx_moe_gemm_* / nbx_moe_gemv_* (kind 'gemm' or 'gemv') through the MSL emulation on "
        "the simulated device: the host regions staged into one metal:0 buffer, the weights "
        "read through the table's GPU addresses; `out` copied back.  gp: (K, N, E, mode, act, "
        "lda, tile0, alpha, limit); rows: row tiles (gemm) or rows (gemv); the weights' format "
        "`fmt` (its table [part][gate, up, down][E]), `wtype` the dense weights' or the float "
        "scales' type (f32, f16, bf16), `group` the format's group size (0: none).");
  m.def("metal_check_weight_readers", &CheckWeightReaders, nb::arg("seed"),
        "kernels/weights.metal through the emulation against formats/<name>.h: (values "
        "compared, the first mismatches).");
  m.def("metal_order_slots", [](const std::vector<int32_t>& ids, int64_t E, int64_t pad, int64_t k,
                                 const std::vector<float>& wts) {
    const int64_t S = static_cast<int64_t>(ids.size());
    if (S > INT32_MAX || E < 1 || E > INT32_MAX || pad < 1 || k < 1 || wts.size() != ids.size())
      throw nb::value_error("sizes out of range");
    const int64_t tiles = MaxPaddedRows(S, E, pad) / pad, rows = tiles * pad;
    std::vector<int32_t> count(static_cast<size_t>(E), -7), off(static_cast<size_t>(E) + 1, -7);
    std::vector<int32_t> row_slot(static_cast<size_t>(MaxPaddedRows(S, E, pad)), -7);
    std::vector<int32_t> slot_row(static_cast<size_t>(S), -1);
    std::vector<int32_t> row_tok(static_cast<size_t>(rows), -7), row_self(static_cast<size_t>(rows), -7);
    std::vector<float> row_w(static_cast<size_t>(rows), -7.0f);
    std::vector<int32_t> tile_expert(static_cast<size_t>(tiles), -7);
    auto region = [](auto& v) {
      return std::tuple<int64_t, int64_t>(reinterpret_cast<intptr_t>(v.data()),
                                          static_cast<int64_t>(v.size() * sizeof(v[0])));
    };
    std::vector<int32_t> ids_copy = ids;
    std::vector<float> wts_copy = wts;
    Staged st = Stage({region(ids_copy), region(count), region(off), region(row_slot), region(slot_row),
                       region(wts_copy), region(row_tok), region(row_self), region(row_w),
                       region(tile_expert)});
    const metal::params::OrderParams p{static_cast<uint32_t>(S), static_cast<uint32_t>(E),
                                       static_cast<uint32_t>(pad), static_cast<uint32_t>(k),
                                       static_cast<uint32_t>(rows)};
    std::vector<metal::Dispatch> ds = metal::OrderSlots(p, st.at(0), st.at(1), st.at(2), st.at(3), st.at(4));
    ds.push_back(metal::PrepareRows(p, st.at(2), st.at(3), st.at(5), st.at(6), st.at(7), st.at(8), st.at(9)));
    RunAndUnstage({st.buf.buffer()}, ds, st, {1, 2, 3, 4, 6, 7, 8, 9});
    row_slot.resize(static_cast<size_t>(off[static_cast<size_t>(E)]));
    return nb::make_tuple(count, off, row_slot, slot_row, row_tok, row_self, row_w, tile_expert);
  }, "moe_order.metal's kernels through the emulation, in one command buffer: (count, off, row_slot, "
     "slot_row) of the ordering, then nbx_prepare_rows' (row_tok, row_self, row_w, tile_expert) over "
     "the bound on the rows.");
  m.def("metal_run_combine", [](const Ranges& regions, uint32_t H, uint32_t k, uint32_t tokens) {
    // regions: o, slot_row, y (copied back)
    if (regions.size() != 3) throw nb::value_error("3 regions: o, slot_row, y");
    Staged st = Stage(regions);
    const metal::params::CombineParams p{H, k, tokens};
    RunAndUnstage({st.buf.buffer()}, {metal::Combine(p, st.at(0), st.at(1), st.at(2))}, st, {2});
  }, "nbx_moe_combine through the emulation.");
  m.def("metal_commit", [](const std::string& kernel, uint32_t threads, int64_t tg_bytes,
                           const std::vector<int64_t>& block_sizes) {
    // a dispatch of `kernel` whose arguments are parameter blocks of the given sizes
    // (0: a one-page buffer): what Commit refuses before anything runs
    metal::DeviceBuffer b;
    std::string err;
    if (!metal::DeviceBuffer::Allocate(4096, "test", WorkShape{1, 1, 0}, &b, &err))
      throw nb::value_error(err.c_str());
    metal::Dispatch d;
    d.kernel = kernel;
    d.threads = threads;
    d.threadgroup_bytes = tg_bytes;
    for (int64_t n : block_sizes) {
      metal::Arg a;
      if (n == 0) a = metal::BufferArg(b.buffer());
      else a.bytes.assign(static_cast<size_t>(n), 0);
      d.args.push_back(a);
    }
    if (!metal::Active()->Commit({b.buffer()}, {d}, &err)) throw nb::value_error(err.c_str());
    if (!metal::Active()->Wait(&err)) throw nb::value_error(err.c_str());
  }, "Commits one dispatch (tests of what encoding refuses).");
  m.def("metal_kernel_names", &metal::EmulatedKernelNames);
  m.def("metal_erf", [](const std::vector<float>& xs) {
    std::vector<float> out;
    for (float x : xs) out.push_back(metal::EmulatedErf(x));
    return out;
  }, "prelude.metal's nbx_erf through the emulation.");
  m.def("metal_command_buffers", []() { return Sim().command_buffers(); },
        "Command buffers committed on the simulated device so far.");
  m.def("metal_table", [](const Ranges& ranges, bool cache) {
    std::shared_ptr<metal::Table> t;
    std::string err;
    if (!metal::Tables::Get().Lookup(ToRanges(ranges), cache, &t, &err))
      throw nb::value_error(err.c_str());
    return t;
  }, nb::arg("ranges"), nb::arg("cache") = true,
     "The pointer table of (address, bytes) arrays: cached in the LRU, or for this call only.");
}

}  // namespace nbx
