// The account exposed for tests: `hold_workspace` takes bytes through the
// same `Workspace` the handlers use (counted, waited for, refused alike) and
// keeps them until `release()` or the object's end, as a concurrent call
// holding its band's workspace would.
#include "native/account_tests.h"

#include <cstdint>
#include <string>

#include <nanobind/stl/string.h>

#include "account.h"

namespace nb = nanobind;

namespace nbx {
namespace {
struct AccountHold {
  Workspace ws;
};
}  // namespace

void BindAccountTests(nb::module_& m) {
  nb::class_<AccountHold>(m, "AccountHold")
      .def_prop_ro("bytes", [](const AccountHold& h) { return static_cast<int64_t>(h.ws.size()); })
      .def("release", [](AccountHold& h) { h.ws = Workspace(); },
           "Returns the bytes to the account (idempotent).");
  m.def(
      "hold_workspace",
      [](const std::string& platform, int ordinal, int64_t bytes) {
        if (bytes < 0) throw nb::value_error("bytes must be >= 0");
        auto* h = new AccountHold;
        std::string err;
        if (!Workspace::Allocate(Device{platform, ordinal}, static_cast<size_t>(bytes), "test hold",
                                 WorkShape{}, &h->ws, &err)) {
          delete h;
          throw nb::value_error(err.c_str());
        }
        return h;
      },
      nb::arg("platform"), nb::arg("ordinal"), nb::arg("bytes"), nb::rv_policy::take_ownership,
      "Takes `bytes` from the account as a handler's workspace would (waiting, or refused with "
      "the account's message as ValueError); held until release().");
}

}  // namespace nbx
