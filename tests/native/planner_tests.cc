// The CPU handlers' slot planner (common/slots.h) exposed for tests, which check
// its invariants on random routings (tests/library/test_planner.py).
#include "native/planner_tests.h"

#include <cstdint>
#include <vector>

#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "common/slots.h"

namespace nb = nanobind;

namespace nbx {

void BindPlannerTests(nb::module_& m) {
  m.def(
      "plan_slots",
      [](const std::vector<int32_t>& ids, int64_t s0, int64_t s1, int64_t E, int64_t pad,
         int64_t from_e, int64_t from_r, int64_t to_e, int64_t to_r) {
        if (s0 < 0 || s1 < s0 || s1 > static_cast<int64_t>(ids.size()) || E < 1 || pad < 1)
          throw nb::value_error("bad plan_slots arguments");
        const int64_t S = s1 - s0;
        std::vector<int64_t> expert_off(E + 1), real_end(E), seen(E);
        // a window may take slots from the whole of ids: size rows for all
        std::vector<int32_t> row_slot(MaxPaddedRows(static_cast<int64_t>(ids.size()), E, pad));
        std::vector<int32_t> slot_row(S);
        ExpertWindow w;
        w.from = {from_e, from_r};
        if (to_e >= 0) w.to = {to_e, to_r};
        const SlotPlan plan{expert_off.data(), real_end.data(), seen.data(), row_slot.data(),
                            slot_row.data()};
        const int64_t P = OrderSlots(ids.data(), s0, s1, E, pad, w, plan);
        row_slot.resize(P);
        return nb::make_tuple(expert_off, real_end, row_slot, slot_row);
      },
      nb::arg("ids"), nb::arg("s0"), nb::arg("s1"), nb::arg("E"), nb::arg("pad"),
      nb::arg("from_e") = 0, nb::arg("from_r") = 0, nb::arg("to_e") = -1, nb::arg("to_r") = 0,
      "OrderSlots: (expert_off, real_end, row_slot, slot_row); to_e < 0 means no end.");
  m.def(
      "count_slots",
      [](const std::vector<int32_t>& ids, int64_t E) {
        std::vector<int64_t> total(E);
        CountSlots(ids.data(), 0, static_cast<int64_t>(ids.size()), E, total.data());
        return total;
      },
      nb::arg("ids"), nb::arg("E"));
  m.def(
      "next_group",
      [](const std::vector<int64_t>& total, int64_t pad, int64_t max_rows, int64_t from_e,
         int64_t from_r) {
        const SlotPos to = NextGroup(total.data(), static_cast<int64_t>(total.size()), pad,
                                     max_rows, {from_e, from_r});
        return std::make_tuple(to.e, to.r);
      },
      nb::arg("total"), nb::arg("pad"), nb::arg("max_rows"), nb::arg("from_e"),
      nb::arg("from_r"));
  m.def(
      "cut_chunks",
      [](const std::vector<int64_t>& expert_off, const std::vector<int64_t>& real_end,
         int64_t chunk_rows) {
        const int64_t E = static_cast<int64_t>(real_end.size());
        if (static_cast<int64_t>(expert_off.size()) != E + 1 || chunk_rows < 1)
          throw nb::value_error("bad cut_chunks arguments");
        const int64_t C = MaxChunks(expert_off[E], E, chunk_rows);
        std::vector<int32_t> expert(C);
        std::vector<int64_t> begin(C), end(C);
        const int64_t n = CutChunks(expert_off.data(), real_end.data(), E, chunk_rows,
                                    Chunks{expert.data(), begin.data(), end.data()});
        expert.resize(n);
        begin.resize(n);
        end.resize(n);
        return nb::make_tuple(expert, begin, end, C);
      },
      nb::arg("expert_off"), nb::arg("real_end"), nb::arg("chunk_rows"));
}

}  // namespace nbx
