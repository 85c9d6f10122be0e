// The expert-id check after a program's launches (abi.h: `words` int32 words
// in the workspace, the minimum being the first slot whose id is outside
// [0, E), abi::kErrNone when none is), by the `check_ids` attribute
// (JAX_NBX_CUDA_CHECK_IDS): read at once, waiting for the stream, or
// deferred -- copied into a ring of pinned host records and read by a later
// call on the device, which then fails naming the earlier call's slot.
#pragma once

#include <cstdint>
#include <string>

#include <cuda.h>

#include "account.h"
#include "xla/ffi/api/ffi.h"

namespace nbx::cuda {

// The synchronous check: reads the `words` err words at `err` on `stream`,
// waits, and fails naming the bad slot of the n = T * k at `ids` and its id.
xla::ffi::Error CheckIdsNow(CUstream stream, CUdeviceptr err, int64_t words, CUdeviceptr ids,
                            int64_t n, int64_t k, int64_t E);

// Deferred checks (abi::kIdCheckDeferred).  The message of the earliest
// completed check on dev that found a bad slot ("" if none); needs the
// device's context current.
std::string PollDeferredIdChecks(const Device& dev);

// Enqueues this call's deferred check: `words` err words at `err` and the n
// slots' ids at `ids` (words, n <= abi::kMaxDeferredErrWords).  Returns an
// error for a CUDA failure, or a found bad slot of an earlier call (a full
// ring waits for its oldest record).
xla::ffi::Error EnqueueDeferredIdCheck(const Device& dev, CUstream stream, CUdeviceptr err,
                                       int64_t words, CUdeviceptr ids, int64_t n, int64_t k,
                                       int64_t E);

}  // namespace nbx::cuda
