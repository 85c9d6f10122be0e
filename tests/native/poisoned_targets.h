// Test-only FFI targets, kept out of the product's handlers and its contract:
// registered only by the test suite (tests/support/ffi_testing.py).  They take
// the CPU forward's and backward's attributes (abi.h's "forward", "backward").
#pragma once

#include <nanobind/nanobind.h>

namespace nbx {
inline constexpr const char* kTargetForwardPoisoned = "nbx_testing_fused_moe_fwd_poisoned";
inline constexpr const char* kTargetBackwardPoisoned = "nbx_testing_fused_moe_bwd_poisoned";
// {target name: handler capsule} for platform "cpu".
nanobind::dict TestingHandlers();
}  // namespace nbx
