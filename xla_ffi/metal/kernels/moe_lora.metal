// LoRA adapters on the experts (abi.h "LoRA adapters": per adapted
// projection p with input z and rank r, out_p = z W_p + s (z A_p) B_p), as
// three small kernels around the expert GEMMs (metal/moe_metal.cc):
//   GEMM1 in mode 2 (g | u raw) -> nbx_lora_xa (gate, up) -> nbx_lora_add
//   (gate, up) -> nbx_lora_glu (h) -> GEMM2 -> nbx_lora_xa (down, from h) ->
//   nbx_lora_add (down, times the routed weight, onto the slot's output row).
// Rows are those of the GEMMs: the padded rows of the slots ordered by
// expert (row_expert = tile_expert, one entry per 32 rows: p.div = 32) or,
// on the decode path, the slots themselves (p.div = 1), in tiles of 32 rows
// from p.tile0 (grid.y: one tile per threadgroup; the decode path marks the
// rows past its slots -1).  A row whose row_src is -1 (padding, a skipped
// slot) is neither read nor written.
// The adapters are float32 and stacked (A [E, K, r], B [E, r, N]), staged
// in the workspace; xa [rows][R] holds s z A_p in columns [col, col + r).
// Float32 sums in a fixed order (k, then c ascending): deterministic.

kernel void nbx_lora_xa(device const float* a [[buffer(0)]], device const int* row_src [[buffer(1)]],
                        device const int* row_expert [[buffer(2)]], device const float* A [[buffer(3)]],
                        device float* xa [[buffer(4)]], constant LoraParams& p [[buffer(5)]],
                        threadgroup float* tg NBX_THREADGROUP(0),
                        uint3 tgpig [[threadgroup_position_in_grid]],
                        uint tiitg [[thread_index_in_threadgroup]],
                        uint sgitg [[simdgroup_index_in_threadgroup]],
                        uint tiisg [[thread_index_in_simdgroup]]) {
  // one threadgroup of 128 threads per (32 adapter columns, 32 rows); thread t takes column
  // t % 32 of rows t / 32, t / 32 + 4, ...:  xa[row, col + c] = s z A_e[:, c]
  (void)tg;
  (void)sgitg;
  (void)tiisg;
  const uint c = tgpig.x * 32 + tiitg % 32;
  if (c >= p.r) return;
  for (uint i = tiitg / 32; i < 32; i += 4) {
    const uint row = p.tile0 + tgpig.y * 32 + i;
    const int src = row_src[row];
    const int e = row_expert[row / p.div];
    if (src < 0 || e < 0) continue;
    device const float* z = a + (ulong)src * p.lda;
    device const float* Ae = A + (ulong)e * p.K * p.r + c;
    float s = 0.0f;
    for (uint k = 0; k < p.K; ++k) s = fma(z[k], Ae[(ulong)k * p.r], s);
    xa[(ulong)row * p.R + p.col + c] = p.scale * s;
  }
}

kernel void nbx_lora_add(device const float* xa [[buffer(0)]], device const int* row_src [[buffer(1)]],
                         device const int* row_expert [[buffer(2)]], device const float* B [[buffer(3)]],
                         device const float* row_weight [[buffer(4)]], device float* out [[buffer(5)]],
                         constant LoraParams& p [[buffer(6)]], threadgroup float* tg NBX_THREADGROUP(0),
                         uint3 tgpig [[threadgroup_position_in_grid]],
                         uint tiitg [[thread_index_in_threadgroup]],
                         uint sgitg [[simdgroup_index_in_threadgroup]],
                         uint tiisg [[thread_index_in_simdgroup]]) {
  // one threadgroup of 128 threads per (128 columns, 32 rows), a thread per column:
  //   out[row, off + n] += (row_weight[row] if weighted) * sum_c xa[row, col + c] B_e[c, n]
  (void)tg;
  (void)sgitg;
  (void)tiisg;
  const uint n = tgpig.x * 128 + tiitg;
  if (n >= p.N) return;
  for (uint i = 0; i < 32; ++i) {
    const uint row = p.tile0 + tgpig.y * 32 + i;
    const int src = row_src[row];
    const int e = row_expert[row / p.div];
    if (src < 0 || e < 0) continue;
    device const float* z = xa + (ulong)row * p.R + p.col;
    device const float* Be = B + (ulong)e * p.r * p.N + n;
    float v = 0.0f;
    for (uint c = 0; c < p.r; ++c) v = fma(z[c], Be[(ulong)c * p.N], v);
    device float* o = out + (ulong)row * p.ldo + p.off + n;
    *o = *o + (p.weighted != 0 ? row_weight[row] * v : v);
  }
}

kernel void nbx_lora_glu(device const float* gu [[buffer(0)]], device const int* row_src [[buffer(1)]],
                         device float* h [[buffer(2)]], constant GemmParams& p [[buffer(3)]],
                         threadgroup float* tg NBX_THREADGROUP(0),
                         uint3 tgpig [[threadgroup_position_in_grid]],
                         uint tiitg [[thread_index_in_threadgroup]],
                         uint sgitg [[simdgroup_index_in_threadgroup]],
                         uint tiisg [[thread_index_in_simdgroup]]) {
  // one threadgroup of 128 threads per (128 columns, 32 rows from row p.tile0):
  //   h[row, n] = glu(gu[row, n], gu[row, N + n])
  (void)tg;
  (void)sgitg;
  (void)tiisg;
  const uint n = tgpig.x * 128 + tiitg;
  if (n >= p.N) return;
  for (uint i = 0; i < 32; ++i) {
    const uint row = p.tile0 + tgpig.y * 32 + i;
    if (row_src[row] < 0) continue;
    device const float* g = gu + (ulong)row * 2 * p.N;
    h[(ulong)row * p.N + n] = nbx_glu(g[n], g[p.N + n], p);
  }
}
