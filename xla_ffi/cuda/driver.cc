// The CUDA driver, opened at run time (see driver.h): its entry points, the
// text of its errors, the primary context of a device for a scope.
#include "cuda/driver.h"

#include <dlfcn.h>

#include <mutex>
#include <string>
#include <unordered_map>

#include "cuda/moe_cuda.h"

namespace ffi = xla::ffi;

namespace nbx {
namespace cuda {

#define NBX_STR2(x) #x
#define NBX_STR(x) NBX_STR2(x)

Driver& Driver::Get() {
  static Driver d = Load();
  return d;
}

Driver Driver::Load() {
  Driver d;
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    d.why = std::string("cannot load the CUDA driver (libcuda.so.1): ") + dlerror();
    return d;
  }
  // NBX_STR expands the macro first: the versioned name (cuMemAlloc_v2).
#define NBX_LOAD(fn)                                                                 \
  d.fn = reinterpret_cast<decltype(&::fn)>(dlsym(h, NBX_STR(fn)));                   \
  if (d.fn == nullptr) {                                                             \
    d.why = "the CUDA driver lacks " NBX_STR(fn);                                    \
    return d;                                                                        \
  }
  NBX_DRIVER_FNS(NBX_LOAD)
#undef NBX_LOAD
#define NBX_LOAD_OPTIONAL(fn)                                                        \
  d.fn = reinterpret_cast<decltype(&::fn)>(dlsym(h, NBX_STR(fn)));                   \
  if (d.fn == nullptr && d.graphs_why.empty())                                       \
    d.graphs_why = "the CUDA driver lacks " NBX_STR(fn) " (JAX_NBX_CUDA_GRAPHS needs it)";
  NBX_GRAPH_FNS(NBX_LOAD_OPTIONAL)
#undef NBX_LOAD_OPTIONAL
  CUresult r = d.cuInit(0);
  if (r != CUDA_SUCCESS) {
    d.why = "cuInit failed with CUresult " + std::to_string(static_cast<int>(r));
    return d;
  }
  d.ok = true;
  return d;
}

ffi::Error CudaError(const char* what, CUresult r) {
  const char* s = nullptr;
  Driver& d = Driver::Get();
  if (d.cuGetErrorString) d.cuGetErrorString(r, &s);
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string(what) + " failed: " + (s ? s : "unknown CUDA error") +
                        " (CUresult " + std::to_string(static_cast<int>(r)) + ")");
}

ffi::Error ScopedContext::Enter(int ordinal) {
  Driver& d = Driver::Get();
  static std::mutex mu;
  static std::unordered_map<int, CUcontext> contexts;
  CUcontext ctx;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = contexts.find(ordinal);
    if (it == contexts.end()) {
      CUdevice dev;
      NBX_CU("cuDeviceGet", d.cuDeviceGet(&dev, ordinal));
      NBX_CU("cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain(&ctx, dev));
      contexts[ordinal] = ctx;
    } else {
      ctx = it->second;
    }
  }
  NBX_CU("cuCtxPushCurrent", d.cuCtxPushCurrent(ctx));
  pushed_ = true;
  return ffi::Error::Success();
}

ScopedContext::~ScopedContext() {
  if (pushed_) {
    CUcontext c;
    Driver::Get().cuCtxPopCurrent(&c);
  }
}

}  // namespace cuda

std::string CudaDriverStatus() {
  cuda::Driver& d = cuda::Driver::Get();
  return d.ok ? std::string() : d.why;
}

}  // namespace nbx
