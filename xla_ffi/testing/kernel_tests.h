// Testers for the CPU micro-kernels (cpu/kernel_table.h), exported to Python
// for tests/test_kernels.py:
//   kernel_names() -> list[str]
//   run_kernel_tests(isa, kernel, seed) -> list[str]  (one line per failing case)
#pragma once

#include <nanobind/nanobind.h>

namespace nbx {

void BindKernelTests(nanobind::module_& m);

}  // namespace nbx
