// The Metal kernels' library source (kernels/params.h then the .metal files,
// in the order prelude.metal states), embedded by CMake: what the Apple
// device compiles with newLibraryWithSource at first use.
#pragma once

namespace nbx::metal {

const char* LibrarySource();

}  // namespace nbx::metal
