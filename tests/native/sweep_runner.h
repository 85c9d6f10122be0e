// The testers' Python-facing runner (kernel_tests.cc, dot_kernel_tests.cc):
// an entry of a registry found by name, one sweep run without the GIL.
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "native/kernel_test_support.h"

namespace nbx {
namespace kernel_testing {

// The names of a registry's entries, in order.
template <class Entry, size_t N>
std::vector<std::string> EntryNames(const Entry (&entries)[N]) {
  std::vector<std::string> names;
  for (const Entry& k : entries) names.push_back(k.name);
  return names;
}

// The entry of `entries` named `name`, else a ValueError naming it.
template <class Entry, size_t N>
const Entry* FindEntry(const Entry (&entries)[N], const std::string& name, const char* what,
                       const char* listing) {
  for (const Entry& k : entries)
    if (name == k.name) return &k;
  throw nanobind::value_error(("unknown " + std::string(what) + " '" + name + "' (see " + listing + ")").c_str());
}

// One entry's sweep over one table, without the GIL; the failing cases' lines.
template <class Entry, class Table>
std::vector<std::string> RunSweep(const Entry& entry, const Table& t, const std::string& label,
                                  uint32_t seed) {
  Report report(label);
  {
    nanobind::gil_scoped_release release;
    Rng rng(seed);
    entry.sweep(t, rng, report);
  }
  return report.Lines();
}

}  // namespace kernel_testing
}  // namespace nbx
