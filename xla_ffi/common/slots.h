// Slot planning of the CPU handlers, as pure functions (no FFI, no threads):
// which rows a band or group runs, in what order, cut into work items.
//
// A slot is (t, j): token t's j-th choice, index s = t*k + j.  A plan orders
// slots by expert, stable in s, each expert's group padded to whole m-panels
// (`pad` rows; 1 = no padding).  The forward runs either token bands (all
// experts' slots of tokens [t0, t1)) or, for float32 x, expert-major groups
// (a window of the call's slots in (expert, t, j) order); the backward runs
// token bands unpadded.
#pragma once

#include <cstdint>
#include <limits>

namespace nbx {

// A position in the call's slots ordered by (expert, t, j): expert e, rank r
// among that expert's slots.
struct SlotPos {
  int64_t e, r;
};

// Which slots of each expert a plan takes, by rank: [from, to) in (expert,
// rank) order.  The default takes every slot of every expert.
struct ExpertWindow {
  SlotPos from{0, 0};
  SlotPos to{std::numeric_limits<int64_t>::max(), 0};
};

// Output arrays of a plan (sizes: E = experts, S = slots in the range,
// P = the padded rows, at most MaxPaddedRows(S, E, pad)).
struct SlotPlan {
  int64_t* expert_off;  // [E+1] padded row range of each expert
  int64_t* real_end;    // [E]   end of each expert's real rows (<= expert_off[e+1])
  int64_t* seen;        // [E]   scratch: slots of each expert met so far
  int32_t* row_slot;    // [P]   slot index s of each row, -1 for padding
  int32_t* slot_row;    // [S]   row of each slot of [s0, s1), -1 if not planned; may be null
};

// Padded rows at most: each non-empty expert's group rounds up to `pad`.
inline int64_t MaxPaddedRows(int64_t S, int64_t E, int64_t pad) {
  return S + (S < E ? S : E) * (pad - 1);
}

// Orders the slots [s0, s1) whose id is in [0, E) and whose rank is inside
// `window` by expert (stable in s); ids outside [0, E) are left out (the
// handler checked them, or they are experts held elsewhere).  Returns P.
int64_t OrderSlots(const int32_t* ids, int64_t s0, int64_t s1, int64_t E, int64_t pad,
                   const ExpertWindow& window, const SlotPlan& plan);

// total[e] = slots [s0, s1) routed to expert e (ids outside [0, E) not counted).
void CountSlots(const int32_t* ids, int64_t s0, int64_t s1, int64_t E, int64_t* total);

// The expert-major group starting at `from`: as many slots in (expert, t, j)
// order as fit in `max_rows` padded rows (each expert's share padded to
// `pad`; an expert that does not fit whole is split at a multiple of `pad`).
// Returns where the group ends.
SlotPos NextGroup(const int64_t* total, int64_t E, int64_t pad, int64_t max_rows, SlotPos from);

// Work items of a plan: runs of at most `chunk_rows` real rows of one expert
// (a multiple of `pad` apart).  Returns the count.
struct Chunks {
  int32_t* expert;  // [C]
  int64_t* begin;   // [C] first row
  int64_t* end;     // [C] end of the expert's real rows within the chunk
};
inline int64_t MaxChunks(int64_t P, int64_t E, int64_t chunk_rows) {
  return (P < E ? P : E) + P / chunk_rows + 1;
}
int64_t CutChunks(const int64_t* expert_off, const int64_t* real_end, int64_t E,
                  int64_t chunk_rows, const Chunks& out);

}  // namespace nbx
