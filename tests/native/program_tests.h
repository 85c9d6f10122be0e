// Test hooks for the CUDA launch-program decoder (cuda/program.h), bound in
// every build, GPU or not: tests/cuda/test_program_decoder.py feeds it the
// programs jax_nbx/backends/cuda/plan.py encodes.
#pragma once

#include <nanobind/nanobind.h>

namespace nbx {
// Adds `decode_program` and `decode_kernel_table` to the module.
void BindProgramTests(nanobind::module_& m);
}  // namespace nbx
