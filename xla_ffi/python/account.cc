// jax_nbx._ffi's bindings of the account (account.h): budgets, stats,
// refusals and their advice.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <string>

#include "account.h"
#include "python/bindings.h"

namespace nbx::python {
namespace {

nb::dict StatsDict(const nbx::DeviceStats& s) {
  nb::dict d;
  d["live"] = s.live;
  d["peak"] = s.peak;
  d["budget"] = s.budget;
  d["refusals"] = s.refusals;
  d["largest_request"] = s.largest_request;
  d["allocations"] = s.allocations;
  d["cached"] = s.cached;
  nb::dict tags;
  for (const auto& [tag, bytes] : s.live_by_tag) tags[tag.c_str()] = bytes;
  d["live_by_tag"] = tags;
  return d;
}

}  // namespace

void BindAccount(nb::module_& m) {
  m.def("account_unlimited", []() { return nbx::Account::kUnlimited; });
  m.def("set_budget", [](const std::string& platform, int ordinal, int64_t bytes) {
    nbx::Account::Get().SetBudget({platform, ordinal}, bytes);
  }, nb::arg("platform"), nb::arg("ordinal"), nb::arg("bytes"));
  m.def("set_wait_ms", [](int64_t ms) { nbx::Account::Get().SetWaitMillis(ms); });
  m.def("stats", [](const std::string& platform, int ordinal) {
    return StatsDict(nbx::Account::Get().Stats({platform, ordinal}));
  }, nb::arg("platform"), nb::arg("ordinal"));
  m.def("all_stats", []() {
    nb::dict d;
    for (const auto& [name, s] : nbx::Account::Get().AllStats()) d[name.c_str()] = StatsDict(s);
    return d;
  });
  m.def("reset_peak", []() { nbx::Account::Get().ResetPeak(); });
  m.def("drop_cached", []() { nbx::Account::Get().DropCached(); });
  m.def("last_refusal", []() -> std::optional<nb::dict> {
    auto r = nbx::Account::Get().LastRefusal();
    if (!r) return std::nullopt;
    nb::dict d;
    d["device"] = r->device.Name();
    d["tag"] = r->tag;
    d["requested"] = r->requested;
    d["free"] = r->free;
    d["total"] = r->total;
    d["shortfall"] = r->shortfall;
    d["shape"] = r->shape.known() ? nb::object(nb::make_tuple(r->shape.rows, r->shape.cols))
                                  : nb::none();
    d["fixed_bytes"] = r->shape.fixed_bytes;
    d["message"] = r->message;
    return d;
  });
  m.def("what_would_have_fit", [](int64_t requested, int64_t free, int64_t total, int64_t rows,
                                  int64_t cols, int64_t fixed_bytes) {
    return nbx::WhatWouldHaveFit(requested, free, total, nbx::WorkShape{rows, cols, fixed_bytes});
  }, nb::arg("requested"), nb::arg("free"), nb::arg("total"), nb::arg("rows") = 0,
     nb::arg("cols") = 0, nb::arg("fixed_bytes") = 0);
  m.def("format_bytes", [](double b, const std::string& round) {
    if (round != "nearest" && round != "up" && round != "down")
      throw nb::value_error(("round must be 'nearest', 'up' or 'down'; got '" + round + "'").c_str());
    return nbx::FormatBytes(b, round == "up"     ? nbx::Round::kUp
                               : round == "down" ? nbx::Round::kDown
                                                 : nbx::Round::kNearest);
  }, nb::arg("bytes"), nb::arg("round") = "nearest");
}

}  // namespace nbx::python
