// The ordered combine (issue #16): y[t, c] = sum over j = 0..k-1, in that
// order, of o[slot_row[t k + j], c] (slots with slot_row -1 are skipped).
// Deterministic, and each token's sum depends on nothing but its own slots,
// so banded = unbanded bit for bit.  Grid (ceil(H / 128), tokens), 128
// threads, one column each.

kernel void nbx_moe_combine(device const float* o [[buffer(0)]],
                            device const int* slot_row [[buffer(1)]],
                            device float* y [[buffer(2)]],
                            constant CombineParams& p [[buffer(3)]],
                            threadgroup float* tg NBX_THREADGROUP(0),
                            uint3 tgpig [[threadgroup_position_in_grid]],
                            uint tiitg [[thread_index_in_threadgroup]],
                            uint sgitg [[simdgroup_index_in_threadgroup]],
                            uint tiisg [[thread_index_in_simdgroup]]) {
  (void)tg;
  (void)sgitg;
  (void)tiisg;
  const uint t = tgpig.y, c = tgpig.x * 128 + tiitg;
  if (t >= p.tokens || c >= p.H) return;
  float s = 0.0f;
  for (uint j = 0; j < p.k; ++j) {
    const int r = slot_row[t * p.k + j];
    if (r >= 0) s += o[(ulong)r * p.H + c];
  }
  y[(ulong)t * p.H + c] = s;
}
