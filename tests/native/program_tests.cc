// The launch-program decoder of the CUDA handler, exposed for tests.
#include "native/program_tests.h"

#include <cstdint>
#include <string>
#include <vector>

#include <nanobind/stl/vector.h>

#include "cuda/program.h"

namespace nb = nanobind;

namespace nbx {

void BindProgramTests(nb::module_& m) {
  m.def(
      "decode_program",
      [](const std::vector<int64_t>& program, int64_t n_kernels, int64_t n_inputs,
         int64_t n_tables, int64_t workspace_bytes, int64_t n_outputs) {
        std::vector<LaunchRef> launches;
        const std::string why = DecodeProgram(program.data(), program.size(), n_kernels, n_inputs,
                                              n_tables, workspace_bytes, &launches, n_outputs);
        if (!why.empty()) throw nb::value_error(why.c_str());
        nb::list out;
        for (const LaunchRef& ln : launches) {
          nb::list args;
          for (const ArgRef& a : ln.args)
            args.append(nb::make_tuple(static_cast<int64_t>(a.kind), a.index, a.offset));
          out.append(nb::make_tuple(ln.kernel, nb::make_tuple(ln.grid[0], ln.grid[1], ln.grid[2]),
                                    args));
        }
        return out;
      },
      nb::arg("program"), nb::arg("n_kernels"), nb::arg("n_inputs"), nb::arg("n_tables"),
      nb::arg("workspace_bytes"), nb::arg("n_outputs") = 1,
      "Decodes an int64 launch program as the CUDA handler does (xla_ffi/cuda/program.h): a\n"
      "list of (kernel, (gx, gy, gz), [(kind, index, offset), ...]); ValueError says what is\n"
      "wrong with a malformed one.  n_outputs: 1 (the forward's y), 2 (the backward's dx, dw).");
  m.def(
      "decode_kernel_table",
      [](const std::vector<int64_t>& table, int64_t blob_size) {
        if (blob_size < 0) throw nb::value_error("blob_size must be >= 0");
        std::vector<KernelRow> rows;
        const std::string why =
            DecodeKernelTable(table.data(), table.size(), static_cast<size_t>(blob_size), &rows);
        if (!why.empty()) throw nb::value_error(why.c_str());
        nb::list out;
        for (const KernelRow& r : rows)
          out.append(nb::make_tuple(r.name_off, r.name_len, r.cubin_off, r.cubin_len, r.num_warps,
                                    r.shared, r.hash));
        return out;
      },
      nb::arg("table"), nb::arg("blob_size"),
      "Decodes a flat int64 kernel table as the CUDA handler does: one tuple of\n"
      "abi.KERNEL_FIELDS per kernel; ValueError when a row points outside the blob.");
}

}  // namespace nbx
