// AVX2 + FMA micro-kernels (this file is compiled with -mavx2 -mfma).
#include "cpu/kernels/kernels.h"
// K-blocks of 128 rows (a packed block of a 256-column gate||up tile is
// 256 kB: L2), tiles of 256 columns, chunks of 16 m-panels.
NBX_DEFINE_KERNELS(KernelsAvx2, "avx2", 8, 6, 128, 256, 16)
