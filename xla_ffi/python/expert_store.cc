// jax_nbx._ffi's bindings of the expert stores (common/expert_store.h): what
// jax_nbx/expert_store.py calls to fill a store and lease a call's experts.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <utility>
#include <vector>

#include "common/expert_store.h"
#include "python/bindings.h"

namespace nbx::python {
namespace {

namespace ffi = xla::ffi;

ffi::DataType TypeOf(const std::string& name) {
  if (name == "float32") return ffi::DataType::F32;
  if (name == "bfloat16") return ffi::DataType::BF16;
  if (name == "float16") return ffi::DataType::F16;
  if (name == "int8") return ffi::DataType::S8;
  if (name == "uint8") return ffi::DataType::U8;
  throw nb::value_error(("expert store: dtype " + name +
                         " is not one of float32, bfloat16, float16, int8, uint8").c_str());
}

using HostArray = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;

}  // namespace

void BindExpertStore(nb::module_& m) {
  m.def("store_create", [](const std::string& name, int64_t E,
                           const std::vector<std::pair<std::string, std::vector<int64_t>>>& arrays) {
    if (E < 1) throw nb::value_error("expert store: E must be >= 1");
    std::vector<store::ArraySpec> specs;
    for (const auto& [dtype, dims] : arrays) {
      for (int64_t d : dims)
        if (d < 0) throw nb::value_error("expert store: negative dimension");
      specs.push_back(store::ArraySpec{TypeOf(dtype), dims});
    }
    return store::Create(name, E, std::move(specs));
  }, nb::arg("name"), nb::arg("E"), nb::arg("arrays"));
  // (True, "") or (False, the refusal or error)
  m.def("store_put", [](int64_t id, int64_t e, const std::vector<HostArray>& arrays,
                        bool resident, int32_t lease) {
    std::vector<std::pair<const void*, size_t>> srcs;
    for (const HostArray& a : arrays) srcs.emplace_back(a.data(), a.nbytes());
    std::string error;
    bool ok;
    {
      nb::gil_scoped_release release;
      ok = store::Put(id, e, srcs, resident, lease, &error);
    }
    return std::make_pair(ok, error);
  }, nb::arg("store"), nb::arg("expert"), nb::arg("arrays"), nb::arg("resident"), nb::arg("lease") = 0);
  m.def("store_has", &store::Has, nb::arg("store"), nb::arg("expert"));
  // (lease, missing, error): store::Begin
  m.def("store_begin", [](int64_t id, const std::vector<int32_t>& experts) {
    std::vector<int32_t> missing;
    std::string error;
    const int32_t lease = store::Begin(id, experts, &missing, &error);
    return std::make_tuple(lease, missing, error);
  }, nb::arg("store"), nb::arg("experts"));
  // (resident experts, error): store::Finish
  m.def("store_finish", [](int64_t id, int32_t lease, const std::vector<uint8_t>& keep) {
    std::vector<int32_t> resident;
    std::string error;
    store::Finish(id, lease, keep, &resident, &error);
    return std::make_pair(resident, error);
  }, nb::arg("store"), nb::arg("lease"), nb::arg("keep"));
  // fetch(ids: bytes of int32) -> lease (int): called from a handler's
  // LeaseCall (an XLA thread) with the GIL taken; its exception becomes the handler's
  // error (a MemoryError: the account's refusal).  None removes it.
  m.def("store_set_fetch", [](int64_t id, nb::object fetch) {
    if (fetch.is_none()) {
      store::SetFetch(id, nullptr);
      return;
    }
    std::shared_ptr<nb::object> fn(new nb::object(fetch), [](nb::object* p) {
      nb::gil_scoped_acquire gil;
      delete p;
    });
    auto call = [fn](const int32_t* ids, int64_t n, std::string* error, bool* exhausted) -> int32_t {
      nb::gil_scoped_acquire gil;
      try {
        nb::bytes raw(reinterpret_cast<const char*>(ids), static_cast<size_t>(n) * sizeof(int32_t));
        return nb::cast<int32_t>((*fn)(raw));
      } catch (nb::python_error& e) {
        *exhausted = e.matches(PyExc_MemoryError);
        *error = std::string(nb::str(e.value()).c_str());
        return 0;
      } catch (const std::exception& e) {
        *error = e.what();
        return 0;
      }
    };
    store::SetFetch(id, std::make_shared<store::FetchFn>(std::move(call)));
  }, nb::arg("store"), nb::arg("fetch").none());
  m.def("store_counts", &store::Counts, nb::arg("store"));
  m.def("store_add_counts", &store::AddCounts, nb::arg("store"), nb::arg("experts"), nb::arg("counts"));
  m.def("store_release", &store::Release, nb::arg("store"), nb::arg("lease"));
  m.def("store_close", &store::Close, nb::arg("store"));
  m.def("store_totals", []() {
    const store::Totals t = store::AllStores();
    nb::dict d;
    d["mapped"] = t.mapped;
    d["resident"] = t.resident;
    d["streamed"] = t.streamed;
    d["stores"] = t.stores;
    return d;
  });
  m.def("store_expert_bytes", &store::ExpertBytes, nb::arg("store"));
  m.def("store_stats", [](int64_t id) {
    const store::StoreStats s = store::Stats(id);
    nb::dict d;
    d["resident_bytes"] = s.resident_bytes;
    d["streamed_bytes"] = s.streamed_bytes;
    d["resident_experts"] = s.resident_experts;
    d["streamed_experts"] = s.streamed_experts;
    d["leases"] = s.leases;
    d["fast_calls"] = s.fast_calls;
    d["fast_hits"] = s.fast_hits;
    d["closed"] = s.closed;
    return d;
  }, nb::arg("store"));
}

}  // namespace nbx::python
