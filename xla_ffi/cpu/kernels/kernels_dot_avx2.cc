// The bfloat16 dot-product kernels on float32 fused multiply-adds (DotFma,
// kernels_dot.h), 8 lanes x 6 rows on 256-bit registers (the avx2 table's
// blocking; K-blocks of 128 rows), with streaming kernels.  Compiled with
// -mavx2 -mfma; isa.cc lists it only on a CPU that runs the avx2 table.
#include "cpu/kernels/kernels_dot.h"
NBX_DEFINE_DOT_KERNELS(DotKernelsFma8x6, "fma", DotFma<8>, 6, 128)
