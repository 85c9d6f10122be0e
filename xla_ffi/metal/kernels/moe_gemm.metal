// The fused MoE block's expert GEMMs in Metal Shading Language (issue #16,
// first kernel).  Shipped as source (compiled at run time on Apple by
// newLibraryWithSource), and compiled unchanged as C++ on Linux through
// metal/msl_emulation.h, which runs it on the simulated device.  Keeps to the
// subset that header documents.
//
// One threadgroup (128 threads = 4 simdgroups in 2x2) computes a 32x32 tile
// of out = A[rows] @ W_e for one row tile of one expert e, in 8-deep K
// steps through threadgroup memory and 8x8 simdgroup matrices (float32
// accumulation).  Rows are the padded rows of the slots ordered by expert:
// row_src[r] is the row of A it reads (-1: padding, reads zeros, never
// stored), tile_expert[r / 32] the expert of its tile.  The weights are read
// in place through the pointer table (GPU addresses, [3][E]: gate, up, down).
//   mode 0 (GEMM1): out[r, n] = act(A W_gate)[r, n] * (A W_up)[r, n]
//   mode 1 (GEMM2): out[r, n] = row_weight[r] * (A W_down)[r, n]
#ifndef NBX_MSL_EMULATION
#include <metal_stdlib>
using namespace metal;
#define NBX_THREADGROUP(n) [[threadgroup(n)]]
#endif

struct GemmParams {
  uint K;      // reduction length (H for GEMM1, I for GEMM2)
  uint N;      // output columns (I for GEMM1, H for GEMM2)
  uint E;      // experts (table rows of one projection)
  uint mode;   // 0: gate|up + activation; 1: down x routed weight
  uint act;    // 0: SiLU, 1: GELU (tanh approximation)
  uint lda;    // elements between rows of A
};

#define NBX_BM 32
#define NBX_BN 32
#define NBX_BK 8

inline float nbx_act(float g, uint act) {
  if (act == 1) {
    const float c = 0.7978845608028654f;  // sqrt(2/pi), abi.h's kGeluC
    return 0.5f * g * (1.0f + tanh(c * (g + 0.044715f * g * g * g)));
  }
  return g / (1.0f + exp(-g));
}

kernel void nbx_moe_gemm(device const float* a [[buffer(0)]],
                         device const int* row_src [[buffer(1)]],
                         device const int* tile_expert [[buffer(2)]],
                         device const ulong* table [[buffer(3)]],
                         device const float* row_weight [[buffer(4)]],
                         device float* out [[buffer(5)]],
                         constant GemmParams& p [[buffer(6)]],
                         threadgroup float* tg NBX_THREADGROUP(0),
                         uint3 tgpig [[threadgroup_position_in_grid]],
                         uint tiitg [[thread_index_in_threadgroup]],
                         uint sgitg [[simdgroup_index_in_threadgroup]],
                         uint tiisg [[thread_index_in_simdgroup]]) {
  (void)tiisg;
  threadgroup float* As = tg;                        // [BM][BK]
  threadgroup float* Bs0 = tg + NBX_BM * NBX_BK;     // [BK][BN] gate or down
  threadgroup float* Bs1 = Bs0 + NBX_BK * NBX_BN;    // [BK][BN] up (mode 0)
  threadgroup float* Cs = Bs1 + NBX_BK * NBX_BN;     // [BM][BN] staging of the result
  const uint n0 = tgpig.x * NBX_BN;
  const uint r0 = tgpig.y * NBX_BM;
  const int e = tile_expert[tgpig.y];
  if (e < 0) return;  // a tile of padding only (uniform over the threadgroup)
  const uint proj0 = p.mode == 0 ? 0u : 2u;
  device const float* W0 = nbx_device_ptr<const float>(table[proj0 * p.E + e], (long)p.K * p.N);
  device const float* W1 = W0;
  if (p.mode == 0) W1 = nbx_device_ptr<const float>(table[1 * p.E + e], (long)p.K * p.N);

  // simdgroup sg owns the 16x16 quarter (sg / 2, sg % 2): 2x2 fragments
  const uint sm = (sgitg / 2) * 16, sn = (sgitg % 2) * 16;
  simdgroup_float8x8 acc0[2][2], acc1[2][2];
  for (uint i = 0; i < 2; ++i)
    for (uint j = 0; j < 2; ++j) {
      acc0[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      acc1[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  for (uint k0 = 0; k0 < p.K; k0 += NBX_BK) {
    // cooperative loads: 256 elements of each tile, 2 per thread, zeros outside
    for (uint q = tiitg; q < NBX_BM * NBX_BK; q += 128) {
      const uint r = q / NBX_BK, k = q % NBX_BK;
      const int src = row_src[r0 + r];
      As[q] = (src >= 0 && k0 + k < p.K) ? a[(ulong)src * p.lda + k0 + k] : 0.0f;
    }
    for (uint q = tiitg; q < NBX_BK * NBX_BN; q += 128) {
      const uint k = q / NBX_BN, n = q % NBX_BN;
      const bool in = k0 + k < p.K && n0 + n < p.N;
      Bs0[q] = in ? W0[(ulong)(k0 + k) * p.N + n0 + n] : 0.0f;
      if (p.mode == 0) Bs1[q] = in ? W1[(ulong)(k0 + k) * p.N + n0 + n] : 0.0f;
    }
#ifndef NBX_TEST_DROP_BARRIER
    threadgroup_barrier(mem_flags::mem_threadgroup);
#endif
    simdgroup_float8x8 fa[2], fb;
    for (uint i = 0; i < 2; ++i) simdgroup_load(fa[i], As + (sm + 8 * i) * NBX_BK, NBX_BK);
    for (uint j = 0; j < 2; ++j) {
      simdgroup_load(fb, Bs0 + sn + 8 * j, NBX_BN);
      for (uint i = 0; i < 2; ++i) simdgroup_multiply_accumulate(acc0[i][j], fa[i], fb, acc0[i][j]);
      if (p.mode == 0) {
        simdgroup_load(fb, Bs1 + sn + 8 * j, NBX_BN);
        for (uint i = 0; i < 2; ++i) simdgroup_multiply_accumulate(acc1[i][j], fa[i], fb, acc1[i][j]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // before the next step overwrites the tiles
  }
  // epilogue: stage gate (and up) through threadgroup memory, then each thread finishes elements
  for (uint i = 0; i < 2; ++i)
    for (uint j = 0; j < 2; ++j) simdgroup_store(acc0[i][j], Cs + (sm + 8 * i) * NBX_BN + sn + 8 * j, NBX_BN);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint q = tiitg; q < NBX_BM * NBX_BN; q += 128) {
    const uint r = q / NBX_BN, n = q % NBX_BN;
    if (row_src[r0 + r] < 0 || n0 + n >= p.N) continue;
    const float v = Cs[q];
    if (p.mode == 0) {
      out[(ulong)(r0 + r) * p.N + n0 + n] = nbx_act(v, p.act);  // times up below
    } else {
      out[(ulong)(r0 + r) * p.N + n0 + n] = row_weight[r0 + r] * v;
    }
  }
  if (p.mode == 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint i = 0; i < 2; ++i)
      for (uint j = 0; j < 2; ++j) simdgroup_store(acc1[i][j], Cs + (sm + 8 * i) * NBX_BN + sn + 8 * j, NBX_BN);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint q = tiitg; q < NBX_BM * NBX_BN; q += 128) {
      const uint r = q / NBX_BN, n = q % NBX_BN;
      if (row_src[r0 + r] < 0 || n0 + n >= p.N) continue;
      out[(ulong)(r0 + r) * p.N + n0 + n] *= Cs[q];
    }
  }
}
