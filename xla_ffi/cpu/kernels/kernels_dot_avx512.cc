// The bfloat16 dot-product kernels on float32 fused multiply-adds (DotFma,
// kernels_dot.h), 16 lanes x 12 rows on 512-bit registers (the avx512
// table's blocking; K-blocks of 128 rows), with streaming kernels.  Compiled
// with the avx512 table's flags; isa.cc lists it only on a CPU that runs it.
#include "cpu/kernels/kernels_dot.h"
NBX_DEFINE_DOT_KERNELS(DotKernelsFma16x12, "fma", DotFma<16>, 12, 128)
