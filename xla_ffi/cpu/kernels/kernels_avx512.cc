// AVX-512 micro-kernels (this file is compiled with -mavx512f -mavx512bw -mavx512vl -mfma).
#include "cpu/kernels/kernels.h"
// The same blocking as AVX2 (kernels_avx2.cc); not tuned on an AVX-512 machine.
NBX_DEFINE_KERNELS(KernelsAvx512, "avx512", 16, 12, 128, 256, 16)
