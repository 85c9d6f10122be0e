// The active Metal device and account-counted buffers (see runtime.h).
#include "metal/runtime.h"

#include <atomic>

#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "optional_backends.h"  // NBX_WITH_METAL, NBX_METAL_NOT_BUILT (CMake: cmake/optional_backend.cmake)

namespace nbx::metal {

#ifdef NBX_WITH_METAL
std::unique_ptr<metal::Device> NewAppleDevice(std::string* error);  // apple_device.mm
#endif

char* HostAlloc(int64_t bytes) {
  const size_t n = static_cast<size_t>(PageCeil(bytes > 0 ? bytes : 1));
  return static_cast<char*>(std::aligned_alloc(static_cast<size_t>(kPageBytes), n));
}

void HostFree(char* p) { std::free(p); }

namespace {
struct State {
  std::mutex mu;
  std::unique_ptr<metal::Device> device;
  std::map<std::string, DeviceFactory> factories;  // RegisterDevice's
};
State& S() {
  static State s;
  return s;
}
}  // namespace

metal::Device* Active() { return S().device.get(); }

void RegisterDevice(const std::string& name, DeviceFactory make) {
  std::lock_guard<std::mutex> lock(S().mu);
  S().factories[name] = make;
}

bool HasAppleImplementation() {
#ifdef NBX_WITH_METAL
  return true;
#else
  return false;
#endif
}

int DeviceCount() { return Active() != nullptr ? 1 : 0; }

namespace {
std::atomic<int64_t> g_command_buffer_flops{kDefaultCommandBufferFlops};
}  // namespace

namespace {
// Buffers whose bytes the account keeps idle for reuse (its cache of blocks,
// by host address): a call's workspace of the same size comes back without a
// new allocation (no fresh pages to fault in).  The account frees them under
// budget pressure, on DropCached and when the device is switched.
std::mutex g_pool_mu;
std::map<const void*, Buffer> g_pooled;

void FreePooled(void* host) {  // the account's block free for metal:0 (its lock held)
  Buffer b;
  {
    std::lock_guard<std::mutex> lock(g_pool_mu);
    auto it = g_pooled.find(host);
    if (it == g_pooled.end()) return;
    b = it->second;
    g_pooled.erase(it);
  }
  if (metal::Device* d = Active()) d->Release(b);
}

Buffer TakePooled(const void* host) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  auto it = g_pooled.find(host);
  if (it == g_pooled.end()) return Buffer{};
  Buffer b = it->second;
  g_pooled.erase(it);
  return b;
}
}  // namespace

int64_t CommandBufferFlops() { return g_command_buffer_flops.load(); }
void SetCommandBufferFlops(int64_t flops) {
  g_command_buffer_flops.store(flops > 0 ? flops : kDefaultCommandBufferFlops);
}

std::string Activate(const std::string& which) {
  std::lock_guard<std::mutex> lock(S().mu);
  const DeviceStats st = Account::Get().Stats(Ledger());
  if (S().device != nullptr && st.live > 0)
    return "cannot switch the Metal device while the account holds " + FormatBytes(st.live) +
           " on metal:0";
  std::unique_ptr<metal::Device> next;
  if (auto f = S().factories.find(which);
      f != S().factories.end() && which != "apple" && which != "none") {
    std::string err;
    next = f->second(&err);
    if (next == nullptr) return err;
  } else if (which == "sim") {
    // registered by the test-only module (tests/native/module.cc), which `import jax_nbx` never loads
    return "the simulated Metal device is test-only: it lives in jax_nbx._ffi_testing (registered "
           "when that module is imported), built only with NBX_TESTING=ON (the README's test "
           "command: pip install -e \".[test]\" --config-settings=cmake.define.NBX_TESTING=ON)";
  } else if (which == "apple") {
#ifdef NBX_WITH_METAL
    std::string err;
    next = NewAppleDevice(&err);
    if (next == nullptr) return err;
#else
    return NBX_METAL_NOT_BUILT;  // e.g. "this build of jax_nbx has no Metal implementation: it is compiled only on Apple"
#endif
  } else if (which != "none") {
    return "unknown Metal device '" + which + "' (expected 'apple', 'sim' or 'none')";
  }
  if (S().device != nullptr) S().device->Synchronize();
  Account::Get().SetBlockFree(Ledger(), &FreePooled);
  Account::Get().DropCached();  // pooled buffers go with the device that made them
  S().device = std::move(next);
  if (S().device != nullptr) Account::Get().SetBudget(Ledger(), S().device->info().working_set);
  return "";
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    Reset();
    b_ = std::exchange(o.b_, Buffer{});
    tag_ = o.tag_;
  }
  return *this;
}

bool DeviceBuffer::Allocate(int64_t bytes, const char* tag, const WorkShape& shape,
                            DeviceBuffer* out, std::string* error) {
  out->Reset();
  metal::Device* d = Active();
  if (d == nullptr) {
    *error = "no Metal device is active";
    return false;
  }
  void* reuse = nullptr;
  if (!Account::Get().Reserve(Ledger(), bytes, tag, shape, error, &reuse)) return false;
  Buffer b = reuse != nullptr ? TakePooled(reuse) : Buffer{};
  if (!b && !d->NewBuffer(bytes, &b, error)) {
    Account::Get().Release(Ledger(), bytes, tag, nullptr);
    return false;
  }
  out->b_ = b;
  out->tag_ = tag;
  return true;
}

void DeviceBuffer::Reset() {
  if (!b_) return;
  {
    std::lock_guard<std::mutex> lock(g_pool_mu);
    g_pooled[b_.host] = b_;
  }
  // counted free now; the account keeps it idle for reuse or frees it (FreePooled: the device
  // releases it after its work completes)
  Account::Get().Release(Ledger(), b_.length, tag_, b_.host);
  b_ = Buffer{};
}

}  // namespace nbx::metal
