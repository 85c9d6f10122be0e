#pragma once
#include "xla/ffi/api/ffi.h"
namespace nbx {
XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedMoeForwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedMoeForwardIntoCpu);
}
