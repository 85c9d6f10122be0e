// The interface between the portable driver (moe_forward.cc) and the
// micro-kernels of one instruction set (kernels_<isa>.cc); see kernels.h.
#pragma once

#include <stdint.h>

namespace nbx {

// Flags of the packed kernels: one call covers one K-block of the sum.
enum PartialFlags : int {
  kLoadPartial = 1,   // start from the partial sums in c, not from 0
  kStorePartial = 2,  // more K-blocks follow: store the sums to c, no epilogue
};

struct KernelTable {
  const char* isa;  // "avx512", "avx2", "generic"
  int vl;           // floats per vector
  int mr;           // rows per packed m-panel
  // GEMM1, packed, one K-block of K rows: out[r*rs + c*cs] = act(a@gate)*(a@up),
  // r < rows, c < cols <= vl; `c` holds mr * 2vl partial sums (PartialFlags).
  void (*gemm1)(const float* a, const float* b, int64_t K, int act, int rows, int cols,
                float* out, int64_t rs, int64_t cs, float* c, int flags);
  // GEMM2, packed, one K-block: out[r*rs + c] = w[r] * (a@down), r < rows,
  // c < cols <= 2*vl; partial sums as gemm1.
  void (*gemm2)(const float* a, const float* b, int64_t K, const float* w, int rows,
                int cols, float* out, int64_t rs, float* c, int flags);
  // Streaming (decode), rows <= 4 rows a[kk*as + r], weights read in place
  // ([0] float32, [1] bfloat16 bits), `acc` scratch of 2 * rows * ncols floats.
  void (*stream1[2])(const float* a, int64_t as, int rows, const void* wg, const void* wu,
                     int64_t ld, int64_t K, int ncols, int act, float* acc, float* out,
                     int64_t rs, int64_t cs);
  void (*stream2[2])(const float* a, int64_t as, int rows, const void* wd, int64_t ld,
                     int64_t K, int ncols, const float* w, float* acc, float* out,
                     int64_t rs);
};

// Defined where the target supports them (x86-64: all three).
const KernelTable* KernelsGeneric();
const KernelTable* KernelsAvx2();
const KernelTable* KernelsAvx512();

// The table in use: JAX_NBX_ISA (avx512|avx2|generic) if set, else the best the
// CPU supports.  SelectIsa returns false (and the reason) for an unknown name
// or one this CPU lacks.
const KernelTable* ActiveKernels();
bool SelectIsa(const char* name, const char** error);
const char* SupportedIsas();  // "avx512,avx2,generic"-style list for this CPU

}  // namespace nbx
