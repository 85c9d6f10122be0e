// AVX2 + FMA micro-kernels (this file is compiled with -mavx2 -mfma).
#include "cpu/kernels.h"
NBX_DEFINE_KERNELS(KernelsAvx2, "avx2", 8, 6)
