// The CPU handlers' slot planner (common/slots.h), exposed for tests.
#pragma once

#include <nanobind/nanobind.h>

namespace nbx {
// Adds plan_slots, next_group and cut_chunks to the module.
void BindPlannerTests(nanobind::module_& m);
}  // namespace nbx
