// The CUDA pointer-table cache (see tables.h) and moe_cuda.h's functions
// over it (statistics, capacity, clearing).
#include "cuda/tables.h"

#include <mutex>
#include <string>
#include <utility>

#include "cuda/driver.h"
#include "cuda/moe_cuda.h"
#include "lru.h"

namespace ffi = xla::ffi;

namespace nbx {
namespace cuda {

CudaTable::~CudaTable() {
  if (ptr == 0) return;
  ScopedContext ctx;
  if (!ctx.Enter(ordinal).failure()) Driver::Get().cuMemFree(ptr);
  Account::Get().Release(Device{"cuda", ordinal}, bytes, "tables", nullptr);
}

namespace {

class TableCache {
 public:
  static TableCache& Get() {
    static TableCache c;
    return c;
  }

  // The table of `addrs` on dev; *out keeps it alive while the call uses it.
  ffi::Error Lookup(const Device& dev, const std::vector<int64_t>& addrs,
                    std::shared_ptr<CudaTable>* out) {
    std::vector<int64_t> key;
    key.reserve(addrs.size() + 1);
    key.push_back(dev.ordinal);
    key.insert(key.end(), addrs.begin(), addrs.end());
    std::lock_guard<std::mutex> lock(mu_);
    if ((*out = lru_.Find(key))) return ffi::Error::Success();
    const int64_t bytes = static_cast<int64_t>(addrs.size() * sizeof(int64_t));
    std::string err;
    void* unused = nullptr;
    if (!Account::Get().Reserve(dev, bytes, "tables", WorkShape{}, &err, &unused))
      return ffi::Error(ffi::ErrorCode::kResourceExhausted, err);
    Driver& d = Driver::Get();
    CUdeviceptr p;
    CUresult r = d.cuMemAlloc(&p, bytes);
    if (r != CUDA_SUCCESS) {
      Account::Get().Release(dev, bytes, "tables", nullptr);
      return CudaError("pointer table allocation", r);
    }
    auto t = std::make_shared<CudaTable>();
    t->ordinal = dev.ordinal;
    t->ptr = p;
    t->bytes = bytes;  // from here the table returns its bytes when dropped
    if ((r = d.cuMemcpyHtoD(p, addrs.data(), bytes)) != CUDA_SUCCESS)
      return CudaError("pointer table upload", r);
    lru_.Insert(key, t);
    *out = std::move(t);
    return ffi::Error::Success();
  }

  void Stats(int64_t* entries, int64_t* hits, int64_t* misses, int64_t* evictions,
             int64_t* bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    *entries = static_cast<int64_t>(lru_.size());
    *hits = lru_.hits();
    *misses = lru_.misses();
    *evictions = lru_.evictions();
    int64_t b = 0;
    lru_.ForEach([&](const CudaTable& t) { b += t.bytes; });
    *bytes = b;
  }

  void SetCapacity(size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    lru_.SetCapacity(n);
  }

  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    lru_.Clear();
  }

 private:
  std::mutex mu_;
  FingerprintLru<CudaTable> lru_{256};
};

}  // namespace

ffi::Error LookupTable(const Device& dev, const std::vector<int64_t>& addrs,
                       std::shared_ptr<CudaTable>* out) {
  return TableCache::Get().Lookup(dev, addrs, out);
}

}  // namespace cuda

void CudaTableStats(int64_t* entries, int64_t* hits, int64_t* misses, int64_t* evictions,
                    int64_t* bytes) {
  cuda::TableCache::Get().Stats(entries, hits, misses, evictions, bytes);
}
void CudaTableSetCapacity(int64_t n) {
  cuda::TableCache::Get().SetCapacity(static_cast<size_t>(n));
}
void CudaTableClear() { cuda::TableCache::Get().Clear(); }

}  // namespace nbx
