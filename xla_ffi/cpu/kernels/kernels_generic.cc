// Portable micro-kernels (baseline instruction set; NEON on arm64).
#include "cpu/kernels/kernels.h"
NBX_DEFINE_KERNELS(KernelsGeneric, "generic", 4, 6, 128, 256, 16)
