// Ordering the T*k slots by expert on the GPU (issue #16), deterministic:
// no atomics, order (expert, slot) -- the order the CPU planner (OrderSlots)
// and the CUDA kernels use.  Three launches:
//   nbx_count_experts  grid E x 128 threads: count[e] = slots with id e
//   nbx_expert_offsets grid 1 x 32 threads: off[e] = sum of the padded counts
//                      before e (each expert padded to `pad` rows), off[E] = P
//   nbx_scatter_slots  grid E x 128 threads: for expert e, in chunks of 128
//                      slots, a threadgroup prefix sum of (id == e) places each
//                      slot at its row; rows past the count are padding (-1).
//   nbx_prepare_rows   grid rows / 128 x 128 threads: what the GEMMs read per
//                      row (token, weight, the row itself; -1/0 for padding)
//                      and the expert of each 32-row tile (-1 past off[E]),
//                      over the bound on the rows, so that the host never
//                      waits for the ordering: tiles past off[E] do nothing.
// slot_row of a slot whose id is outside [0, E) is left to the caller's -1.
// Keeps to the subset of tests/native/metal/msl_emulation.h.

kernel void nbx_count_experts(device const int* ids [[buffer(0)]],
                              device int* count [[buffer(1)]],
                              constant OrderParams& p [[buffer(2)]],
                              threadgroup int* tg NBX_THREADGROUP(0),
                              uint3 tgpig [[threadgroup_position_in_grid]],
                              uint tiitg [[thread_index_in_threadgroup]],
                              uint sgitg [[simdgroup_index_in_threadgroup]],
                              uint tiisg [[thread_index_in_simdgroup]]) {
  (void)sgitg;
  (void)tiisg;
  const int e = (int)tgpig.x;
  int n = 0;
  for (uint s = tiitg; s < p.S; s += 128) n += ids[s] == e ? 1 : 0;
  tg[tiitg] = n;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint half_n = 64; half_n > 0; half_n /= 2) {  // tree sum
    if (tiitg < half_n) tg[tiitg] += tg[tiitg + half_n];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (tiitg == 0) count[e] = tg[0];
}

kernel void nbx_expert_offsets(device const int* count [[buffer(0)]],
                               device int* off [[buffer(1)]],
                               constant OrderParams& p [[buffer(2)]],
                               threadgroup int* tg NBX_THREADGROUP(0),
                               uint3 tgpig [[threadgroup_position_in_grid]],
                               uint tiitg [[thread_index_in_threadgroup]],
                               uint sgitg [[simdgroup_index_in_threadgroup]],
                               uint tiisg [[thread_index_in_simdgroup]]) {
  (void)tg;
  (void)tgpig;
  (void)sgitg;
  (void)tiisg;
  if (tiitg != 0) return;
  int acc = 0;
  for (uint e = 0; e < p.E; ++e) {
    off[e] = acc;
    acc += (count[e] + (int)p.pad - 1) / (int)p.pad * (int)p.pad;
  }
  off[p.E] = acc;
}

kernel void nbx_scatter_slots(device const int* ids [[buffer(0)]],
                              device const int* off [[buffer(1)]],
                              device int* row_slot [[buffer(2)]],
                              device int* slot_row [[buffer(3)]],
                              constant OrderParams& p [[buffer(4)]],
                              threadgroup int* tg NBX_THREADGROUP(0),
                              uint3 tgpig [[threadgroup_position_in_grid]],
                              uint tiitg [[thread_index_in_threadgroup]],
                              uint sgitg [[simdgroup_index_in_threadgroup]],
                              uint tiisg [[thread_index_in_simdgroup]]) {
  (void)sgitg;
  (void)tiisg;
  const int e = (int)tgpig.x;
  int placed = 0;  // rows of expert e filled by the chunks before this one
  for (uint c0 = 0; c0 < p.S; c0 += 128) {
    const uint s = c0 + tiitg;
    const int flag = (s < p.S && ids[s] == e) ? 1 : 0;
    tg[tiitg] = flag;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint d = 1; d < 128; d *= 2) {  // inclusive prefix sum (Hillis-Steele)
      const int v = tg[tiitg] + (tiitg >= d ? tg[tiitg - d] : 0);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      tg[tiitg] = v;
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (flag != 0) {
      const int row = off[e] + placed + tg[tiitg] - 1;
      row_slot[row] = (int)s;
      slot_row[s] = row;
    }
    placed += tg[127];
    threadgroup_barrier(mem_flags::mem_threadgroup);  // before the next chunk overwrites tg
  }
  for (int r = off[e] + placed + (int)tiitg; r < off[e + 1]; r += 128) row_slot[r] = -1;
}

kernel void nbx_prepare_rows(device const int* off [[buffer(0)]],
                             device const int* row_slot [[buffer(1)]],
                             device const float* wts [[buffer(2)]],
                             device int* row_tok [[buffer(3)]],
                             device int* row_self [[buffer(4)]],
                             device float* row_w [[buffer(5)]],
                             device int* tile_expert [[buffer(6)]],
                             constant OrderParams& p [[buffer(7)]],
                             threadgroup int* tg NBX_THREADGROUP(0),
                             uint3 tgpig [[threadgroup_position_in_grid]],
                             uint tiitg [[thread_index_in_threadgroup]],
                             uint sgitg [[simdgroup_index_in_threadgroup]],
                             uint tiisg [[thread_index_in_simdgroup]]) {
  (void)tg;
  (void)sgitg;
  (void)tiisg;
  const uint r = tgpig.x * 128 + tiitg;
  if (r >= p.rows) return;
  const int P = off[p.E];
  const int s = (int)r < P ? row_slot[r] : -1;
  row_tok[r] = s < 0 ? -1 : s / (int)p.k;
  row_self[r] = s < 0 ? -1 : (int)r;
  row_w[r] = s < 0 ? 0.0f : wts[s];
  if (r % p.pad == 0) {
    int e = -1;
    if ((int)r < P) {  // the largest e with off[e] <= r (an empty expert's successor starts there too)
      uint lo = 0, hi = p.E;  // off[lo] <= r < off[hi]
      while (hi - lo > 1) {
        const uint mid = (lo + hi) / 2;
        if (off[mid] <= (int)r) lo = mid;
        else hi = mid;
      }
      e = (int)lo;
    }
    tile_expert[r / p.pad] = e;
  }
}
