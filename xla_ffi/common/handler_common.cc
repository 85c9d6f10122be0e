// The CPU handlers' shared state (see handler_common.h): defined once, in the
// core library, for every module that loads it.
#include "common/handler_common.h"

namespace nbx {

std::atomic<bool>& ProfileStages() {
  static std::atomic<bool> on{false};
  return on;
}

}  // namespace nbx
