// Slot planning (slots.h).
#include "common/slots.h"

#include <algorithm>

namespace nbx {

int64_t OrderSlots(const int32_t* ids, int64_t s0, int64_t s1, int64_t E, int64_t pad,
                   const ExpertWindow& window, const SlotPlan& plan) {
  const SlotPos from = window.from, to = window.to;
  auto lo = [&](int64_t e) { return e == from.e ? from.r : 0; };
  auto hi = [&](int64_t e) {
    return e < to.e ? std::numeric_limits<int64_t>::max() : (e == to.e ? to.r : 0);
  };
  auto inside = [&](int64_t e) { return e >= 0 && e < E && e >= from.e && e <= to.e; };
  // Pass 1: each expert's slots in the range, then the window's share.
  std::fill(plan.seen, plan.seen + E, int64_t{0});
  for (int64_t s = s0; s < s1; ++s)
    if (inside(ids[s])) ++plan.seen[ids[s]];
  plan.expert_off[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = inside(e) ? std::max<int64_t>(std::min(plan.seen[e], hi(e)) - lo(e), 0) : 0;
    plan.expert_off[e + 1] = plan.expert_off[e] + (n + pad - 1) / pad * pad;
    plan.real_end[e] = plan.expert_off[e];  // the cursor of pass 2
  }
  const int64_t P = plan.expert_off[E];
  std::fill(plan.row_slot, plan.row_slot + P, int32_t{-1});
  // Pass 2: place each slot of the window at its expert's cursor.
  std::fill(plan.seen, plan.seen + E, int64_t{0});
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t e = ids[s];
    int32_t row = -1;
    if (inside(e)) {
      const int64_t rank = plan.seen[e]++;
      if (rank >= lo(e) && rank < hi(e)) {
        row = static_cast<int32_t>(plan.real_end[e]++);
        plan.row_slot[row] = static_cast<int32_t>(s);
      }
    }
    if (plan.slot_row != nullptr) plan.slot_row[s - s0] = row;
  }
  return P;
}

void CountSlots(const int32_t* ids, int64_t s0, int64_t s1, int64_t E, int64_t* total) {
  std::fill(total, total + E, int64_t{0});
  for (int64_t s = s0; s < s1; ++s)
    if (ids[s] >= 0 && ids[s] < E) ++total[ids[s]];
}

SlotPos NextGroup(const int64_t* total, int64_t E, int64_t pad, int64_t max_rows, SlotPos from) {
  int64_t left = max_rows, e = from.e, r = from.r;
  while (e < E && left >= pad) {
    const int64_t avail = total[e] - r;
    const int64_t padded = (avail + pad - 1) / pad * pad;
    if (padded <= left) {
      left -= padded;
      ++e;
      r = 0;
    } else {  // the expert continues in the next group
      r += left / pad * pad;
      break;
    }
  }
  return {e, r};
}

int64_t CutChunks(const int64_t* expert_off, const int64_t* real_end, int64_t E,
                  int64_t chunk_rows, const Chunks& out) {
  int64_t n = 0;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t m = expert_off[e]; m < real_end[e]; m += chunk_rows) {
      out.expert[n] = static_cast<int32_t>(e);
      out.begin[n] = m;
      out.end[n] = std::min(m + chunk_rows, real_end[e]);
      ++n;
    }
  }
  return n;
}

}  // namespace nbx
