// The CPU handler of jax_nbx.prepack (abi.h kTargetPrepack, "prepacked
// weights"; cpu/prepack.cc) and the size of its results.
#pragma once
#include <cstdint>

#include "abi.h"
#include "common/attr_types.h"
#include "xla/ffi/api/ffi.h"

namespace nbx {

XLA_FFI_DECLARE_HANDLER_SYMBOL(PrepackCpu);

// Words of GEMM1's (gate||up, `gemm1`) or GEMM2's (down) packed buffer,
// header included, for E experts of hidden size H and intermediate size I,
// for the kernels in use now (precision="bfloat16": the dot family's blocking).
int64_t PrepackedBufferWords(int64_t E, int64_t H, int64_t I, bool bf16_dot, bool gemm1);

}  // namespace nbx

#define NBX_PREPACK_ATTR_PARAMS NBX_ATTRS_CPU_PREPACK(NBX_ATTR_PARAM)
#define NBX_PREPACK_BIND_ATTRS NBX_ATTRS_CPU_PREPACK(NBX_BIND_ATTR)
