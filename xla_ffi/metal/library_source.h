// The Metal kernels' library source (kernels/params.h then the .metal files,
// in the order prelude.metal states), embedded by CMake: what the Apple
// device compiles with newLibraryWithSource at first use.
#pragma once

#include <string>

namespace nbx::metal {

const char* LibrarySource();

// The error of a library the Metal compiler rejected, from the compiler's
// message (newLibraryWithSource's NSError): every `program_source:LINE:COL`
// in it -- a line of LibrarySource() -- becomes the kernel file's own
// `xla_ffi/metal/kernels/<file>:<line>:COL` (CMake marks where each file
// starts: a line `// ---- <file>`), and the error names the file of the first
// error first.  Shared by the Apple device and the simulated one's test hook.
std::string LibraryCompileError(const std::string& compiler_message);

}  // namespace nbx::metal
