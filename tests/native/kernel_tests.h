// Testers for the CPU micro-kernels (cpu/kernels/kernel_table.h), exported to Python
// for tests/cpu/test_kernels.py:
//   kernel_names() -> list[str]
//   run_kernel_tests(isa, kernel, seed) -> list[str]  (one line per failing case)
// and of the bfloat16 dot-product kernels (dot_kernel_tests.cc):
//   dot_kernel_names(), dot_kernel_tables(), dot_streaming_tables() -> list[str]
//   run_dot_kernel_tests(table, kernel, seed) -> list[str]
#pragma once

#include <nanobind/nanobind.h>

namespace nbx {

void BindKernelTests(nanobind::module_& m);
void BindDotKernelTests(nanobind::module_& m);

}  // namespace nbx
