// AVX-512 micro-kernels (this file is compiled with -mavx512f -mavx512bw -mavx512vl -mfma).
#include "cpu/kernels.h"
NBX_DEFINE_KERNELS(KernelsAvx512, "avx512", 16, 12)
