// The bfloat16 dot-product kernels on the emulated instruction (portable:
// baseline instruction set; NEON on arm64), one table per packed table's
// blocking (vl x mr; K-blocks of 128 rows, as the packed tables').  Slow --
// one scalar fused multiply-add per product -- and never chosen for speed
// where the instruction exists: it runs the same kernel logic as
// kernels_dot_avx512bf16.cc, so that logic is checked against float64
// everywhere, and it gives every CPU the same bits.
#include "cpu/kernels/kernels_dot.h"
NBX_DEFINE_DOT_KERNELS(DotKernelsEmulated16x12, "emulated", DotEmulated<16>, 12, 128)
NBX_DEFINE_DOT_KERNELS(DotKernelsEmulated8x6, "emulated", DotEmulated<8>, 6, 128)
NBX_DEFINE_DOT_KERNELS(DotKernelsEmulated4x6, "emulated", DotEmulated<4>, 6, 128)
