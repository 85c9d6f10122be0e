// The simulated Metal device (see sim_device.h).
#include "native/metal/sim_device.h"

#include "metal/dispatch.h"
#include "metal/library_source.h"
#include "native/metal/emulated_kernels.h"
#include "metal/runtime.h"

#include <cstdlib>
#include <cstring>
#include <utility>

namespace nbx::metal {

namespace {
std::string Bytes(int64_t n) { return std::to_string(n) + " bytes"; }
}  // namespace

std::unique_ptr<Device> NewSimDevice(std::string*) {
  return std::make_unique<SimDevice>(SimDevice::Config{});
}

SimDevice* ActiveSim() { return dynamic_cast<SimDevice*>(Active()); }

SimDevice::~SimDevice() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [gpu, l] : live_)
    if (!l.b.wrap) HostFree(l.b.host);
}

DeviceInfo SimDevice::info() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {"simulated Metal device", cfg_.working_set, cfg_.max_buffer_length, cfg_.max_wraps};
}

bool SimDevice::supports(const std::string& primitive) const {
  static const char* kPrimitives[] = {"malloc", "free",     "memset",   "memcpy",  "host_alloc",
                                      "map_host", "gpu_address", "residency", "submit"};
  for (const char* p : kPrimitives)
    if (primitive == p) return true;
  return false;
}

void SimDevice::Configure(Config c) {
  std::lock_guard<std::mutex> lock(mu_);
  cfg_ = c;
}

bool SimDevice::NewBuffer(int64_t bytes, Buffer* out, std::string* error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes <= 0 || bytes > cfg_.max_buffer_length) {
    *error = "Metal buffer of " + Bytes(bytes) + " outside (0, maxBufferLength = " +
             Bytes(cfg_.max_buffer_length) + "]";
    return false;
  }
  char* host = HostAlloc(bytes);
  if (host == nullptr) {
    *error = "the simulated device could not allocate " + Bytes(bytes);
    return false;
  }
  std::memset(host, 0xCD, static_cast<size_t>(PageCeil(bytes)));  // never assume zeros
  Live l;
  l.b = Buffer{next_id_++, host, next_gpu_, bytes, false};
  next_gpu_ += static_cast<uint64_t>(PageCeil(bytes) + kPageBytes);  // an unmapped gap after it
  id_to_gpu_[l.b.id] = l.b.gpu;
  *out = l.b;
  live_[l.b.gpu] = l;
  return true;
}

const SimDevice::Region* SimDevice::RegionOf(const void* p, const char** base) const {
  const char* c = static_cast<const char*>(p);
  auto it = regions_.upper_bound(c);
  if (it == regions_.begin()) return nullptr;
  --it;
  if (c >= it->first + it->second.bytes) return nullptr;
  *base = it->first;
  return &it->second;
}

bool SimDevice::AllocationOf(const void* p, const char** base, int64_t* bytes) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Region* r = RegionOf(p, base);
  if (r != nullptr) *bytes = r->bytes;
  return r != nullptr;
}

Device::WrapResult SimDevice::Wrap(char* host, int64_t length, Buffer* out, std::string* error) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto a = reinterpret_cast<uintptr_t>(host);
  if (a % kPageBytes != 0 || length <= 0 || length % kPageBytes != 0) {
    *error = "no-copy wrap of [" + std::to_string(a) + ", +" + Bytes(length) +
             ") is not aligned to Apple's 16 KiB pages";
    return WrapResult::kInvalid;
  }
  if (length > cfg_.max_buffer_length) {
    *error = "no-copy wrap of " + Bytes(length) + " exceeds maxBufferLength = " +
             Bytes(cfg_.max_buffer_length);
    return WrapResult::kInvalid;
  }
  if (wraps_ >= cfg_.max_wraps) {
    *error = "live no-copy wraps at the bound of " + std::to_string(cfg_.max_wraps);
    return WrapResult::kAtLimit;
  }
  // Tracked memory: a wrap that touches tracked allocations lies inside the
  // pages of one of them (its edge pages may hold neighbours), which Metal
  // accepts when that memory is wrappable.
  const char* base = nullptr;
  const Region* r = nullptr;
  bool touches = false;
  for (auto it = regions_.begin(); it != regions_.end() && it->first < host + length; ++it) {
    if (it->first + it->second.bytes <= host) continue;
    touches = true;
    const int64_t lo = PageFloor(reinterpret_cast<int64_t>(it->first));
    const int64_t hi = PageCeil(reinterpret_cast<int64_t>(it->first) + it->second.bytes);
    if (lo <= static_cast<int64_t>(a) && static_cast<int64_t>(a) + length <= hi) {
      r = &it->second;
      base = it->first;
    }
  }
  if (touches && r == nullptr) {
    *error = "no-copy wrap crosses the pages of its host allocation";
    return WrapResult::kRefused;
  }
  if (r != nullptr && !r->wrappable) {
    *error = "Metal refuses to wrap this host memory (newBufferWithBytesNoCopy returned nil)";
    return WrapResult::kRefused;
  }
  Live l;
  l.b = Buffer{next_id_++, host, next_gpu_, length, true};
  l.generation = r != nullptr ? r->generation : 0;
  l.region = r != nullptr ? base : nullptr;
  next_gpu_ += static_cast<uint64_t>(length + kPageBytes);
  id_to_gpu_[l.b.id] = l.b.gpu;
  *out = l.b;
  live_[l.b.gpu] = l;
  ++wraps_;
  ++wraps_made_;
  return WrapResult::kOk;
}

int64_t SimDevice::live_wraps() const {
  std::lock_guard<std::mutex> lock(mu_);
  return wraps_;
}

bool SimDevice::WrapCurrent(const Buffer& wrap) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto g = id_to_gpu_.find(wrap.id);
  if (g == id_to_gpu_.end()) return false;
  const Live& l = live_.at(g->second);
  if (l.region == nullptr) return true;
  auto r = regions_.find(l.region);
  return r != regions_.end() && r->second.generation == l.generation;
}

void SimDevice::FreeNow(uint64_t id) {
  auto g = id_to_gpu_.find(id);
  if (g == id_to_gpu_.end()) return;
  auto it = live_.find(g->second);
  if (it->second.b.wrap) --wraps_;
  else HostFree(it->second.b.host);
  live_.erase(it);
  id_to_gpu_.erase(g);
}

void SimDevice::Release(const Buffer& b) {
  std::lock_guard<std::mutex> lock(mu_);
  auto g = id_to_gpu_.find(b.id);
  if (g == id_to_gpu_.end()) {
    violations_.push_back("release of a buffer that is not live (id " + std::to_string(b.id) + ")");
    return;
  }
  for (const Command& c : held_) {
    if (c.ids.count(b.id)) {  // in flight: goes when its command buffers complete
      live_[g->second].released = true;
      return;
    }
  }
  FreeNow(b.id);
}

char* SimDevice::Resolve(uint64_t gpu, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.upper_bound(gpu);
  std::string why;
  if (it == live_.begin()) {
    why = "no buffer or wrap";
  } else {
    --it;
    const Live& l = it->second;
    if (gpu + static_cast<uint64_t>(bytes) > l.b.gpu + static_cast<uint64_t>(l.b.length)) {
      why = "no buffer or wrap";
    } else if (in_command_ && !resident_.count(l.b.id)) {
      why = "a buffer not made resident for this command buffer";
    } else if (l.released && !in_command_) {
      why = "a released buffer";
    } else {
      if (l.region != nullptr) {
        auto r = regions_.find(l.region);
        if (r == regions_.end() || r->second.generation != l.generation)
          why = "a stale wrap (its host memory was freed)";
      }
      if (why.empty()) return l.b.host + (gpu - l.b.gpu);
    }
  }
  violations_.push_back("GPU read of [" + std::to_string(gpu) + ", +" + Bytes(bytes) +
                        ") through " + why);
  return nullptr;
}

std::vector<std::string> SimDevice::TakeViolations() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(violations_, {});
}

void SimDevice::TrackHost(const void* base, int64_t bytes, bool wrappable) {
  std::lock_guard<std::mutex> lock(mu_);
  regions_[static_cast<const char*>(base)] = Region{bytes, wrappable, generation_++};
}

void SimDevice::ForgetHost(const void* base) {
  std::lock_guard<std::mutex> lock(mu_);
  regions_.erase(static_cast<const char*>(base));  // wraps of it are stale from now on
}

void SimDevice::Memset(const Buffer& b, int64_t offset, int value, int64_t bytes) {
  std::memset(b.host + offset, value, static_cast<size_t>(bytes));
}

void SimDevice::Memcpy(const Buffer& dst, int64_t dst_off, const void* src, int64_t bytes) {
  std::memcpy(dst.host + dst_off, src, static_cast<size_t>(bytes));
}

void SimDevice::Submit(const std::vector<Buffer>& resources, Work work) {
  Command c;
  for (const Buffer& b : resources) c.ids.insert(b.id);
  c.work = std::move(work);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (hold_) {
      held_.push_back(std::move(c));
      return;
    }
  }
  std::lock_guard<std::mutex> run(command_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    resident_ = c.ids;
    in_command_ = true;
  }
  if (c.work) c.work();
  std::lock_guard<std::mutex> lock(mu_);
  in_command_ = false;
  resident_.clear();
}

void SimDevice::RejectLibrary(const std::string& compiler_message) {
  std::lock_guard<std::mutex> lock(mu_);
  library_rejected_ = compiler_message;
}

bool SimDevice::Prepare(std::string* error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (library_rejected_.empty()) return true;
  *error = LibraryCompileError(library_rejected_);
  return false;
}

bool SimDevice::Commit(const std::vector<Buffer>& resources, const std::vector<Dispatch>& dispatches,
                       std::string* error) {
  if (!Prepare(error)) return false;  // the Apple device's pipelines need the library
  for (const Dispatch& d : dispatches)
    if (!CheckEmulated(d, error)) return false;  // what encoding would refuse
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++command_buffers_;
    failures_.try_emplace(std::this_thread::get_id());
  }
  const std::thread::id committer = std::this_thread::get_id();
  Submit(resources, [this, dispatches, committer] {
    for (const Dispatch& d : dispatches) {
      std::string why;
      if (!RunEmulated(*this, d, &why)) {  // the rest of the command buffer does not run
        std::lock_guard<std::mutex> lock(mu_);
        failures_[committer].push_back(why);
        return;
      }
    }
  });
  return true;
}

bool SimDevice::Wait(std::string* error) {
  Synchronize();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = failures_.find(std::this_thread::get_id());
  if (it == failures_.end()) return true;
  std::vector<std::string> f = std::move(it->second);
  failures_.erase(it);
  if (f.empty()) return true;
  *error = f.front();
  if (f.size() > 1) *error += " (and " + std::to_string(f.size() - 1) + " more failed command buffers)";
  return false;
}

int64_t SimDevice::command_buffers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return command_buffers_;
}

void SimDevice::CompleteHeld() {
  // mu_ held on entry and exit; each held command runs (in order) with its resources resident
  std::vector<Command> cmds = std::exchange(held_, {});
  for (Command& c : cmds) {
    resident_ = c.ids;
    in_command_ = true;
    mu_.unlock();
    if (c.work) c.work();
    mu_.lock();
    in_command_ = false;
    resident_.clear();
  }
  std::vector<uint64_t> done;
  for (auto& [gpu, l] : live_)
    if (l.released) done.push_back(l.b.id);
  for (uint64_t id : done) FreeNow(id);
}

void SimDevice::HoldCompletions(bool hold) {
  std::lock_guard<std::mutex> run(command_mu_);
  std::lock_guard<std::mutex> lock(mu_);
  hold_ = hold;
  if (!hold) CompleteHeld();
}

void SimDevice::Synchronize() {
  std::lock_guard<std::mutex> run(command_mu_);
  std::lock_guard<std::mutex> lock(mu_);
  CompleteHeld();  // a wait completes what a test held
}

int64_t SimDevice::pending_commands() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(held_.size());
}

int64_t SimDevice::pending_releases() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const auto& [gpu, l] : live_) n += l.released ? 1 : 0;
  return n;
}

int64_t SimDevice::live_buffers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(live_.size());
}

}  // namespace nbx::metal
