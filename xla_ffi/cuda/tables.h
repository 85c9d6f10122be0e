// The weights' pointer tables on a CUDA device: one device table per distinct
// set of expert addresses, [G][E] int64 (gate, up, down; or the quantized and
// fused groups), kept in the fingerprinted LRU the Metal tables use too
// (lru.h; its statistics, capacity and clearing are moe_cuda.h's
// CudaTable* functions).  Each table's bytes are counted in the account (tag
// "tables") and returned when its last holder drops it (evicted, and no call
// using it any more).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <cuda.h>

#include "account.h"
#include "xla/ffi/api/ffi.h"

namespace nbx::cuda {

struct CudaTable {
  int ordinal = 0;
  CUdeviceptr ptr = 0;
  int64_t bytes = 0;
  CudaTable() = default;
  CudaTable(const CudaTable&) = delete;
  CudaTable& operator=(const CudaTable&) = delete;
  ~CudaTable();  // frees the device memory, returns the bytes to the account
};

// The table of `addrs` on dev, uploaded on a miss; *out keeps it alive while
// the call uses it.  Needs the device's context current.
xla::ffi::Error LookupTable(const Device& dev, const std::vector<int64_t>& addrs,
                            std::shared_ptr<CudaTable>* out);

}  // namespace nbx::cuda
