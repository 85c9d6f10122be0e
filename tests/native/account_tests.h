// The account (account.h) exposed for tests: a workspace held from Python,
// as a concurrent call would hold it (tests/library/test_memory.py, test_soak.py).
#pragma once

#include <nanobind/nanobind.h>

namespace nbx {
// Adds AccountHold and hold_workspace to the module.
void BindAccountTests(nanobind::module_& m);
}  // namespace nbx
