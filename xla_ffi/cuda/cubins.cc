// Cubins loaded once per device (see cubins.h).
#include "cuda/cubins.h"

#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda/driver.h"

namespace ffi = xla::ffi;

namespace nbx::cuda {

// Cubins loaded per (device, content hash); modules live for the process.
// `row` was checked against the blob by DecodeKernelTable (cuda/program.h).
ffi::Error GetKernel(int ordinal, const uint8_t* blob, const KernelRow& row, LoadedKernel* out) {
  static std::mutex mu;
  static std::unordered_map<std::string, LoadedKernel> cache;
  const std::string name(reinterpret_cast<const char*>(blob + row.name_off),
                         static_cast<size_t>(row.name_len));
  const std::string key = std::to_string(ordinal) + ":" + std::to_string(row.hash) + ":" + name;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) {
    *out = it->second;
    return ffi::Error::Success();
  }
  Driver& d = Driver::Get();
  // cuModuleLoadData wants the image in host memory that stays valid for the
  // call only; copy it so the image is suitably aligned.
  std::vector<uint64_t> image((row.cubin_len + 7) / 8 + 1, 0);
  std::memcpy(image.data(), blob + row.cubin_off, static_cast<size_t>(row.cubin_len));
  CUmodule mod;
  NBX_CU("cuModuleLoadData", d.cuModuleLoadData(&mod, image.data()));
  LoadedKernel k;
  NBX_CU("cuModuleGetFunction", d.cuModuleGetFunction(&k.fn, mod, name.c_str()));
  k.num_warps = static_cast<int>(row.num_warps);
  k.shared = static_cast<int>(row.shared);
  if (k.shared > 48 * 1024)
    NBX_CU("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
           d.cuFuncSetAttribute(k.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, k.shared));
  cache[key] = k;
  *out = k;
  return ffi::Error::Success();
}

}  // namespace nbx::cuda
