// The decode variant of the expert GEMMs (issue #16): for a handful of slots
// (a few tokens times k), where 32-row tiles would be almost all padding.
// Needs no ordering: row r is slot r itself.  One threadgroup (128 threads)
// computes 32 output columns of one row: the K reduction is split across its
// 4 simdgroups (simdgroup q takes k = q, q + 4, q + 8, ...; the 32 threads
// of a simdgroup read 32 neighbouring columns of a weight row), and the four
// partial sums are added in the order q = 0, 1, 2, 3 (deterministic).  So a
// few rows still fill the GPU: N / 32 threadgroups per row.
//   row_src[r]: row of A (-1: the slot is skipped: nothing stored);
//   row_expert[r]: its expert; grid.y counts rows from p.tile0;
//   mode 0: out[r, n] = act(a W_gate) * (a W_up);  mode 1: row_weight[r] * (a W_down);
//   mode 2: out[r, n] = a W_gate, out[r, N + n] = a W_up (moe_gemm.metal's mode 2).
// Float32 accumulation; each weight decoded by its format's reader as it is
// read (weights.metal).  One kernel per reader, named as moe_gemm.metal's
// (nbx_moe_gemv_f32, ..., _int8_f32, ..., _nvfp4).  Uses nbx_glu and the
// readers from prelude.metal and weights.metal (the library is one source).

template <typename D>  // a weight reader (weights.metal)
inline void nbx_moe_gemv_body(device const float* a, device const int* row_src,
                              device const int* row_expert, device const ulong* table,
                              device const float* row_weight, device float* out,
                              constant GemmParams& p, threadgroup float* tg, uint3 tgpig,
                              uint sgitg, uint tiisg) {
  const uint r = p.tile0 + tgpig.y;
  const int src = row_src[r];
  const int e = row_expert[r];
  if (src < 0 || e < 0) return;  // uniform over the threadgroup
  const uint n = tgpig.x * 32 + tiisg;
  const bool gate_up = p.mode != 1;  // modes 0 and 2: gate and up
  const uint proj0 = gate_up ? 0u : 2u;
  const D W0 = D::load(table, proj0, e, p);
  D W1 = W0;
  if (gate_up) W1 = D::load(table, 1u, e, p);
  device const float* x = a + (ulong)src * p.lda;
  float s0 = 0.0f, s1 = 0.0f;
  if (n < p.N) {
    for (uint k = sgitg; k < p.K; k += 4) {
      s0 = fma(x[k], W0.at(k, n), s0);
      if (gate_up) s1 = fma(x[k], W1.at(k, n), s1);
    }
  }
  threadgroup float* part0 = tg;        // [4][32]
  threadgroup float* part1 = tg + 128;  // [4][32]
  part0[sgitg * 32 + tiisg] = s0;
  part1[sgitg * 32 + tiisg] = s1;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sgitg != 0 || n >= p.N) return;
  const float g = ((part0[tiisg] + part0[32 + tiisg]) + part0[64 + tiisg]) + part0[96 + tiisg];
  if (gate_up) {
    const float u = ((part1[tiisg] + part1[32 + tiisg]) + part1[64 + tiisg]) + part1[96 + tiisg];
    if (p.mode == 0) {
      out[(ulong)r * p.N + n] = nbx_glu(g, u, p);
    } else {
      out[(ulong)r * 2 * p.N + n] = g;
      out[(ulong)r * 2 * p.N + p.N + n] = u;
    }
  } else {
    out[(ulong)r * p.N + n] = row_weight[r] * g;
  }
}

#define NBX_MOE_GEMV_KERNEL(NAME, D)                                                           \
  kernel void NAME(device const float* a [[buffer(0)]], device const int* row_src [[buffer(1)]], \
                   device const int* row_expert [[buffer(2)]],                                  \
                   device const ulong* table [[buffer(3)]],                                     \
                   device const float* row_weight [[buffer(4)]], device float* out [[buffer(5)]], \
                   constant GemmParams& p [[buffer(6)]], threadgroup float* tg NBX_THREADGROUP(0), \
                   uint3 tgpig [[threadgroup_position_in_grid]],                                \
                   uint tiitg [[thread_index_in_threadgroup]],                                  \
                   uint sgitg [[simdgroup_index_in_threadgroup]],                               \
                   uint tiisg [[thread_index_in_simdgroup]]) {                                  \
    (void)tiitg;                                                                                \
    nbx_moe_gemv_body<D>(a, row_src, row_expert, table, row_weight, out, p, tg, tgpig, sgitg,   \
                          tiisg);                                                               \
  }
NBX_MOE_GEMV_KERNEL(nbx_moe_gemv_f32, nbx_dense<float>)
NBX_MOE_GEMV_KERNEL(nbx_moe_gemv_f16, nbx_dense<half>)
NBX_MOE_GEMV_KERNEL(nbx_moe_gemv_bf16, nbx_dense<bfloat>)
NBX_MOE_GEMV_KERNEL(nbx_moe_gemv_int8_f32, nbx_int8<float>)
NBX_MOE_GEMV_KERNEL(nbx_moe_gemv_int8_bf16, nbx_int8<bfloat>)
NBX_MOE_GEMV_KERNEL(nbx_moe_gemv_int4_f32, nbx_int4<float>)
NBX_MOE_GEMV_KERNEL(nbx_moe_gemv_int4_bf16, nbx_int4<bfloat>)
NBX_MOE_GEMV_KERNEL(nbx_moe_gemv_fp8_f32, nbx_fp8<float>)
NBX_MOE_GEMV_KERNEL(nbx_moe_gemv_fp8_bf16, nbx_fp8<bfloat>)
NBX_MOE_GEMV_KERNEL(nbx_moe_gemv_mxfp4, nbx_mxfp4)
NBX_MOE_GEMV_KERNEL(nbx_moe_gemv_mxfp8, nbx_mxfp8)
NBX_MOE_GEMV_KERNEL(nbx_moe_gemv_nvfp4, nbx_nvfp4)
