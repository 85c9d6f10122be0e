// The embedded library source (see library_source.h; CMake writes the .inc).
#include "metal/library_source.h"

namespace nbx::metal {

const char* LibrarySource() {
  return
#include "metal/library_source.inc"
      ;
}

}  // namespace nbx::metal
