// The bfloat16 dot-product kernels on the emulated instruction (portable:
// baseline instruction set; NEON on arm64).  Slow -- one scalar fused
// multiply-add per product -- and never chosen for speed: it runs the same
// kernel logic as kernels_dot_avx512bf16.cc where the CPU lacks the
// instruction, so that logic is checked against float64 everywhere.
#include "cpu/kernels_dot.h"
NBX_DEFINE_DOT_KERNELS(DotKernelsEmulated, "emulated", DotEmulated<16>, 12, 256)
