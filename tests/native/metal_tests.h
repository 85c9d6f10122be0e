// The Metal layer (xla_ffi/metal/) exposed for tests, against the simulated
// device: its controls, pinned scopes, account-counted buffers, command
// buffers that read through GPU addresses, and the table cache
// (tests/metal/test_metal_device.py).
#pragma once

#include <nanobind/nanobind.h>

namespace nbx {
// Adds the metal_sim_* functions and the MetalPins/MetalBuffer/MetalTable classes.
void BindMetalTests(nanobind::module_& m);
}  // namespace nbx
