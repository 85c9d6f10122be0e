// abi.h as a Python dict (the nanobind module's `abi()`).
#pragma once

#include <nanobind/nanobind.h>

namespace nbx {
nanobind::dict AbiDict();
}  // namespace nbx
