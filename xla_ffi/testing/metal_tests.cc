// The Metal layer exposed for tests (see metal_tests.h).  Host arrays are
// passed as (address, bytes) pairs of numpy arrays the test keeps alive.
#include "testing/metal_tests.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "metal/emulated_kernels.h"
#include "cpu/slots.h"
#include "metal/pins.h"
#include "metal/runtime.h"
#include "metal/sim_device.h"
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
  m.def("metal_run_moe_gemm",
        [](int64_t a, int64_t row_src, int64_t tile_expert, const metal::Table& table,
           int64_t row_weight, int64_t out, uint32_t K, uint32_t N, uint32_t E, uint32_t mode,
           uint32_t act, uint32_t lda, int64_t P, bool drop_barrier, bool resident) {
          auto at = [](int64_t v) { return reinterpret_cast<void*>(static_cast<uintptr_t>(v)); };
          const metal::MoeGemmArgs g{static_cast<const float*>(at(a)),
                                     static_cast<const int32_t*>(at(row_src)),
                                     static_cast<const int32_t*>(at(tile_expert)),
                                     reinterpret_cast<const uint64_t*>(table.addresses.buffer().host),
                                     static_cast<const float*>(at(row_weight)),
                                     static_cast<float*>(at(out)), K, N, E, mode, act, lda, P};
          std::string err;
          if (!metal::LaunchMoeGemm(g, resident ? table.pins.resources() : std::vector<metal::Buffer>{},
                                    drop_barrier, &err))
            throw nb::value_error(err.c_str());
        },
        "nbx_moe_gemm (moe_gemm.metal) through the MSL emulation on the simulated device; numpy "
        "arrays by address, the weights through the table's GPU addresses.");
  m.def("metal_order_slots", [](const std::vector<int32_t>& ids, int64_t E, int64_t pad) {
    const int64_t S = static_cast<int64_t>(ids.size());
    std::vector<int32_t> count(static_cast<size_t>(E), -7), off(static_cast<size_t>(E) + 1, -7);
    std::vector<int32_t> row_slot(static_cast<size_t>(MaxPaddedRows(S, E, pad)), -7);
    std::vector<int32_t> slot_row(static_cast<size_t>(S), -1);
    std::string err;
    if (!metal::LaunchOrderSlots(ids.data(), S, E, pad, count.data(), off.data(), row_slot.data(),
                                 slot_row.data(), &err))
      throw nb::value_error(err.c_str());
    row_slot.resize(static_cast<size_t>(off[static_cast<size_t>(E)]));
    return nb::make_tuple(count, off, row_slot, slot_row);
  }, "moe_order.metal's three kernels through the emulation: (count, off, row_slot, slot_row).");
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
