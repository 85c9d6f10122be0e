// The Metal device on Apple (Objective-C++, ARC).  Compiled only when CMake
// targets Apple (NBX_WITH_METAL); it has NEVER been compiled or run by this
// project's CI, which has no Apple machine.  See device.h for the contract;
// sim_device.cc is the implementation the tests run.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>
#include <mach/mach.h>

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "metal/device.h"

namespace nbx::metal {
namespace {

class AppleDevice final : public Device {
 public:
  explicit AppleDevice(id<MTLDevice> d) : dev_(d), queue_([d newCommandQueue]) {}
  ~AppleDevice() override { Synchronize(); }

  const char* implementation() const override { return "apple"; }
  DeviceInfo info() const override {
    return {std::string([[dev_ name] UTF8String]),
            static_cast<int64_t>([dev_ recommendedMaxWorkingSetSize]),
            static_cast<int64_t>([dev_ maxBufferLength]), max_wraps_};
  }
  bool supports(const std::string& p) const override {
    if (p == "gpu_address") {
      if (@available(macOS 13.0, *)) return true;
      return false;
    }
    return p == "malloc" || p == "free" || p == "memset" || p == "memcpy" || p == "host_alloc" ||
           p == "map_host" || p == "residency" || p == "submit";
  }

  bool NewBuffer(int64_t bytes, Buffer* out, std::string* error) override {
    id<MTLBuffer> b = [dev_ newBufferWithLength:static_cast<NSUInteger>(bytes)
                                        options:MTLResourceStorageModeShared];
    if (b == nil) {
      *error = "MTLDevice newBufferWithLength failed for " + std::to_string(bytes) + " bytes";
      return false;
    }
    return Keep(b, bytes, false, static_cast<char*>([b contents]), out);
  }

  WrapResult Wrap(char* host, int64_t length, Buffer* out, std::string* error) override {
    if (reinterpret_cast<uintptr_t>(host) % kPageBytes != 0 || length % kPageBytes != 0 ||
        length > static_cast<int64_t>([dev_ maxBufferLength])) {
      *error = "no-copy wrap not page-aligned or past maxBufferLength";
      return WrapResult::kInvalid;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (wraps_ >= max_wraps_) {
        *error = "live no-copy wraps at the bound of " + std::to_string(max_wraps_);
        return WrapResult::kAtLimit;
      }
    }
    id<MTLBuffer> b = [dev_ newBufferWithBytesNoCopy:host
                                              length:static_cast<NSUInteger>(length)
                                             options:MTLResourceStorageModeShared
                                         deallocator:nil];
    if (b == nil) {
      *error = "newBufferWithBytesNoCopy returned nil";
      return WrapResult::kRefused;
    }
    Keep(b, length, true, host, out);
    return WrapResult::kOk;
  }

  int64_t live_wraps() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return wraps_;
  }
  bool WrapCurrent(const Buffer&) const override { return true; }  // Metal cannot tell
  bool AllocationOf(const void* p, const char** base, int64_t* bytes) const override {
    mach_vm_address_t addr = reinterpret_cast<mach_vm_address_t>(p);
    mach_vm_size_t size = 0;
    vm_region_basic_info_data_64_t info;
    mach_msg_type_number_t count = VM_REGION_BASIC_INFO_COUNT_64;
    mach_port_t object = MACH_PORT_NULL;
    if (mach_vm_region(mach_task_self(), &addr, &size, VM_REGION_BASIC_INFO_64,
                       reinterpret_cast<vm_region_info_t>(&info), &count, &object) != KERN_SUCCESS)
      return false;
    if (addr > reinterpret_cast<mach_vm_address_t>(p)) return false;
    *base = reinterpret_cast<const char*>(addr);
    *bytes = static_cast<int64_t>(size);
    return true;
  }

  void Release(const Buffer& b) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(b.id);
    if (it == live_.end()) return;
    if (b.wrap) --wraps_;
    live_.erase(it);  // in-flight command buffers retain what they use: freed at completion
  }
  void Memset(const Buffer& b, int64_t offset, int value, int64_t bytes) override {
    std::memset(b.host + offset, value, static_cast<size_t>(bytes));
  }
  void Memcpy(const Buffer& dst, int64_t off, const void* src, int64_t bytes) override {
    std::memcpy(dst.host + off, src, static_cast<size_t>(bytes));
  }
  void Submit(const std::vector<Buffer>& resources, Work work) override {
    // Part 1 has no kernels: `work` encodes nothing yet; the residency of every
    // resource is what part 2's encoders declare with useResources.
    (void)resources;
    if (work) work();
  }
  void Synchronize() override {
    id<MTLCommandBuffer> cb = [queue_ commandBuffer];
    [cb commit];
    [cb waitUntilCompleted];
  }

 private:
  bool Keep(id<MTLBuffer> b, int64_t length, bool wrap, char* host, Buffer* out) {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t gpu = 0;
    if (@available(macOS 13.0, *)) gpu = [b gpuAddress];
    *out = Buffer{next_id_++, host, gpu, length, wrap};
    live_[out->id] = b;
    if (wrap) ++wraps_;
    return true;
  }

  id<MTLDevice> dev_;
  id<MTLCommandQueue> queue_;
  mutable std::mutex mu_;
  std::map<uint64_t, id<MTLBuffer>> live_;
  uint64_t next_id_ = 1;
  int64_t wraps_ = 0;
  int64_t max_wraps_ = 256;
};

}  // namespace

std::unique_ptr<Device> NewAppleDevice(std::string* error) {
  id<MTLDevice> d = MTLCreateSystemDefaultDevice();
  if (d == nil) {
    *error = "no Metal device on this machine";
    return nullptr;
  }
  return std::make_unique<AppleDevice>(d);
}

}  // namespace nbx::metal
