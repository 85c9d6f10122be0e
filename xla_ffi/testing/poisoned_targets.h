// Test-only FFI targets (abi::kTargetForwardPoisoned, kTargetBackwardPoisoned),
// kept out of the product's handlers: registered only by the test suite.
#pragma once

#include <nanobind/nanobind.h>

namespace nbx {
// {target name: handler capsule} for platform "cpu".
nanobind::dict TestingHandlers();
}  // namespace nbx
