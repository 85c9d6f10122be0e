// The fused MoE block's expert GEMMs in Metal Shading Language (issue #16).
// Shipped as source (compiled at run time on Apple by newLibraryWithSource,
// after kernels/params.h), and compiled unchanged as C++ on Linux through
// tests/native/metal/msl_emulation.h, which runs it on the simulated device.  Keeps to the
// subset that header documents.
//
// One threadgroup (128 threads = 4 simdgroups in 2x2) computes a 32x32 tile
// of out = A[rows] @ W_e for one row tile of one expert e, in 8-deep K
// steps through threadgroup memory and 8x8 simdgroup matrices (float32
// accumulation; 16-bit weights widened and quantized ones dequantized to
// float32 as they are loaded, weights.metal).
// Rows are the padded rows of the slots ordered by expert: row_src[r] is the
// row of A it reads (-1: padding, reads zeros, never stored), tile_expert[r /
// 32] the expert of its tile.  grid.y counts row tiles from p.tile0 (a
// problem too long for one command buffer is dispatched in ranges of tiles).
// The weights are read in place through the pointer table (GPU addresses of
// their parts, weights.metal: gate, up, down, each a logical [K][N]), each
// element decoded by the format's reader as the tile is loaded.
//   mode 0 (GEMM1): out[r, n] = act(A W_gate)[r, n] * (A W_up)[r, n]
//   mode 1 (GEMM2): out[r, n] = row_weight[r] * (A W_down)[r, n]
//   mode 2 (GEMM1 with LoRA adapters): out[r, n] = (A W_gate)[r, n] and
//     out[r, N + n] = (A W_up)[r, n] (rows of 2N: moe_lora.metal adds the
//     adapters' terms, then applies the activation)
// One kernel per reader (weights.metal): dense nbx_moe_gemm_f32, _f16, _bf16;
// quantized nbx_moe_gemm_<format>[_<scale type>]: _int8_f32, _int8_bf16,
// _int4_f32, _int4_bf16, _fp8_f32, _fp8_bf16, _mxfp4, _mxfp8, _nvfp4.

#define NBX_BM 32
#define NBX_BN 32
#define NBX_BK 8

template <typename D>  // a weight reader (weights.metal)
inline void nbx_moe_gemm_body(device const float* a, device const int* row_src,
                              device const int* tile_expert, device const ulong* table,
                              device const float* row_weight, device float* out,
                              constant GemmParams& p, threadgroup float* tg, uint3 tgpig,
                              uint tiitg, uint sgitg) {
  threadgroup float* As = tg;                        // [BM][BK]
  threadgroup float* Bs0 = tg + NBX_BM * NBX_BK;     // [BK][BN] gate or down
  threadgroup float* Bs1 = Bs0 + NBX_BK * NBX_BN;    // [BK][BN] up (mode 0)
  threadgroup float* Cs = Bs1 + NBX_BK * NBX_BN;     // [BM][BN] staging of the result
  const uint n0 = tgpig.x * NBX_BN;
  const uint tile = p.tile0 + tgpig.y;
  const uint r0 = tile * NBX_BM;
  const int e = tile_expert[tile];
  if (e < 0) return;  // a tile of padding only (uniform over the threadgroup)
  const bool gate_up = p.mode != 1;  // modes 0 and 2: gate and up
  const uint proj0 = gate_up ? 0u : 2u;
  const uint ldo = p.mode == 2 ? 2 * p.N : p.N;
  const D W0 = D::load(table, proj0, e, p);
  D W1 = W0;
  if (gate_up) W1 = D::load(table, 1u, e, p);
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
      Bs0[q] = in ? W0.at(k0 + k, n0 + n) : 0.0f;
      if (gate_up) Bs1[q] = in ? W1.at(k0 + k, n0 + n) : 0.0f;
    }
#ifndef NBX_TEST_DROP_BARRIER
    threadgroup_barrier(mem_flags::mem_threadgroup);
#endif
    simdgroup_float8x8 fa[2], fb;
    for (uint i = 0; i < 2; ++i) simdgroup_load(fa[i], As + (sm + 8 * i) * NBX_BK, NBX_BK);
    for (uint j = 0; j < 2; ++j) {
      simdgroup_load(fb, Bs0 + sn + 8 * j, NBX_BN);
      for (uint i = 0; i < 2; ++i) simdgroup_multiply_accumulate(acc0[i][j], fa[i], fb, acc0[i][j]);
      if (gate_up) {
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
    if (gate_up) {
      out[(ulong)(r0 + r) * ldo + n0 + n] = v;  // the gate: glu(gate, up) below (mode 0)
    } else {
      out[(ulong)(r0 + r) * p.N + n0 + n] = row_weight[r0 + r] * v;
    }
  }
  if (gate_up) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint i = 0; i < 2; ++i)
      for (uint j = 0; j < 2; ++j) simdgroup_store(acc1[i][j], Cs + (sm + 8 * i) * NBX_BN + sn + 8 * j, NBX_BN);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint q = tiitg; q < NBX_BM * NBX_BN; q += 128) {
      const uint r = q / NBX_BN, n = q % NBX_BN;
      if (row_src[r0 + r] < 0 || n0 + n >= p.N) continue;
      device float* h = out + (ulong)(r0 + r) * ldo + n0 + n;
      if (p.mode == 0) *h = nbx_glu(*h, Cs[q], p);
      else h[p.N] = Cs[q];  // mode 2: up after the gate
    }
  }
}

#define NBX_MOE_GEMM_KERNEL(NAME, D)                                                           \
  kernel void NAME(device const float* a [[buffer(0)]], device const int* row_src [[buffer(1)]], \
                   device const int* tile_expert [[buffer(2)]],                                 \
                   device const ulong* table [[buffer(3)]],                                     \
                   device const float* row_weight [[buffer(4)]], device float* out [[buffer(5)]], \
                   constant GemmParams& p [[buffer(6)]], threadgroup float* tg NBX_THREADGROUP(0), \
                   uint3 tgpig [[threadgroup_position_in_grid]],                                \
                   uint tiitg [[thread_index_in_threadgroup]],                                  \
                   uint sgitg [[simdgroup_index_in_threadgroup]],                               \
                   uint tiisg [[thread_index_in_simdgroup]]) {                                  \
    (void)tiisg;                                                                                \
    nbx_moe_gemm_body<D>(a, row_src, tile_expert, table, row_weight, out, p, tg, tgpig, tiitg,  \
                          sgitg);                                                               \
  }
NBX_MOE_GEMM_KERNEL(nbx_moe_gemm_f32, nbx_dense<float>)
NBX_MOE_GEMM_KERNEL(nbx_moe_gemm_f16, nbx_dense<half>)
NBX_MOE_GEMM_KERNEL(nbx_moe_gemm_bf16, nbx_dense<bfloat>)
NBX_MOE_GEMM_KERNEL(nbx_moe_gemm_int8_f32, nbx_int8<float>)
NBX_MOE_GEMM_KERNEL(nbx_moe_gemm_int8_bf16, nbx_int8<bfloat>)
NBX_MOE_GEMM_KERNEL(nbx_moe_gemm_int4_f32, nbx_int4<float>)
NBX_MOE_GEMM_KERNEL(nbx_moe_gemm_int4_bf16, nbx_int4<bfloat>)
NBX_MOE_GEMM_KERNEL(nbx_moe_gemm_fp8_f32, nbx_fp8<float>)
NBX_MOE_GEMM_KERNEL(nbx_moe_gemm_fp8_bf16, nbx_fp8<bfloat>)
NBX_MOE_GEMM_KERNEL(nbx_moe_gemm_mxfp4, nbx_mxfp4)
NBX_MOE_GEMM_KERNEL(nbx_moe_gemm_mxfp8, nbx_mxfp8)
NBX_MOE_GEMM_KERNEL(nbx_moe_gemm_nvfp4, nbx_nvfp4)
