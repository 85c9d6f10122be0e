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
#include <thread>
#include <vector>

#include "metal/device.h"
#include "metal/dispatch.h"
#include "metal/library_source.h"

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
           p == "map_host" || p == "residency" || p == "submit" || p == "dispatch";
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
    // Host work on the GPU timeline (part 1's primitive; the kernels go through Commit).
    (void)resources;
    if (work) work();
  }
  void Synchronize() override {
    id<MTLCommandBuffer> cb = [queue_ commandBuffer];
    [cb commit];
    [cb waitUntilCompleted];
  }

  bool Prepare(std::string* error) override {
    std::lock_guard<std::mutex> lock(lib_mu_);
    return Library(error) != nil;
  }

  bool Commit(const std::vector<Buffer>& resources, const std::vector<Dispatch>& dispatches,
              std::string* error) override {
    // everything that can be refused is looked up before encoding starts
    std::vector<id<MTLComputePipelineState>> pipes;
    for (const Dispatch& d : dispatches) {
      id<MTLComputePipelineState> p = Pipeline(d.kernel, error);
      if (p == nil) return false;
      if (d.threads == 0 || d.threads > [p maxTotalThreadsPerThreadgroup] ||
          d.threadgroup_bytes > static_cast<int64_t>([dev_ maxThreadgroupMemoryLength])) {
        *error = d.kernel + ": threadgroup size or memory beyond what the pipeline allows";
        return false;
      }
      pipes.push_back(p);
    }
    std::vector<id<MTLBuffer>> used;
    std::vector<std::vector<id<MTLBuffer>>> bound(dispatches.size());
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const Buffer& b : resources) {
        auto it = live_.find(b.id);
        if (it == live_.end()) {
          *error = "a resource of the command buffer is not a live buffer";
          return false;
        }
        used.push_back(it->second);
      }
      for (size_t i = 0; i < dispatches.size(); ++i)
        for (const Arg& a : dispatches[i].args) {
          id<MTLBuffer> mb = nil;
          if (a.bytes.empty()) {
            auto it = live_.find(a.buffer.id);
            if (it == live_.end()) {
              *error = dispatches[i].kernel + ": an argument is not a live buffer";
              return false;
            }
            mb = it->second;
          }
          bound[i].push_back(mb);
        }
    }
    id<MTLCommandBuffer> cb = [queue_ commandBuffer];
    id<MTLComputeCommandEncoder> enc = [cb computeCommandEncoder];  // serial: in order
    for (id<MTLBuffer> b : used)  // the pins' wraps the kernels reach through table addresses
      [enc useResource:b usage:(MTLResourceUsageRead | MTLResourceUsageWrite)];
    for (size_t i = 0; i < dispatches.size(); ++i) {
      const Dispatch& d = dispatches[i];
      if (d.grid[0] == 0 || d.grid[1] == 0 || d.grid[2] == 0) continue;
      [enc setComputePipelineState:pipes[i]];
      for (size_t j = 0; j < d.args.size(); ++j) {
        const Arg& a = d.args[j];
        if (!a.bytes.empty())
          [enc setBytes:a.bytes.data() length:a.bytes.size() atIndex:j];
        else
          [enc setBuffer:bound[i][j] offset:static_cast<NSUInteger>(a.offset) atIndex:j];
      }
      if (d.threadgroup_bytes > 0)  // a multiple of 16 bytes
        [enc setThreadgroupMemoryLength:static_cast<NSUInteger>((d.threadgroup_bytes + 15) / 16 * 16)
                                atIndex:0];
      [enc dispatchThreadgroups:MTLSizeMake(d.grid[0], d.grid[1], d.grid[2])
          threadsPerThreadgroup:MTLSizeMake(d.threads, 1, 1)];
    }
    [enc endEncoding];
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_[std::this_thread::get_id()].push_back(cb);
      ++command_buffers_;
    }
    [cb commit];
    return true;
  }

  bool Wait(std::string* error) override {
    std::vector<id<MTLCommandBuffer>> cbs;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(std::this_thread::get_id());
      if (it != pending_.end()) {
        cbs = std::move(it->second);
        pending_.erase(it);
      }
    }
    int failed = 0;
    for (id<MTLCommandBuffer> cb : cbs) {
      [cb waitUntilCompleted];
      if ([cb status] == MTLCommandBufferStatusError) {
        if (failed++ == 0) {
          NSError* e = [cb error];
          *error = std::string("command buffer failed: ") +
                   (e != nil ? [[e localizedDescription] UTF8String] : "unknown error");
        }
      }
    }
    if (failed > 1) *error += " (and " + std::to_string(failed - 1) + " more)";
    return failed == 0;
  }

  int64_t command_buffers() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return command_buffers_;
  }

 private:
  // The kernels' library (LibrarySource()), compiled at the first call; a
  // failure is kept and given again.  lib_mu_ held.
  id<MTLLibrary> Library(std::string* error) {
    if (lib_ != nil) return lib_;
    if (lib_error_.empty()) {
      MTLCompileOptions* opts = [MTLCompileOptions new];
      if (@available(macOS 14.0, *)) {
        opts.languageVersion = MTLLanguageVersion3_1;  // bfloat
        opts.fastMathEnabled = NO;  // exp and tanh as the emulation computes them
        NSError* err = nil;
        lib_ = [dev_ newLibraryWithSource:[NSString stringWithUTF8String:LibrarySource()]
                                  options:opts
                                    error:&err];
        if (lib_ == nil)  // the compiler's message, its lines named in the kernel files
          lib_error_ = LibraryCompileError(
              err != nil ? std::string([[err localizedDescription] UTF8String]) : "unknown error");
      } else {
        lib_error_ = "the Metal kernels need macOS 14 or later (Metal Shading Language 3.1)";
      }
    }
    if (lib_ == nil) *error = lib_error_;
    return lib_;
  }

  // The pipeline of a kernel of the library.
  id<MTLComputePipelineState> Pipeline(const std::string& name, std::string* error) {
    std::lock_guard<std::mutex> lock(lib_mu_);
    auto it = pipes_.find(name);
    if (it != pipes_.end()) return it->second;
    if (Library(error) == nil) return nil;
    id<MTLFunction> f = [lib_ newFunctionWithName:[NSString stringWithUTF8String:name.c_str()]];
    if (f == nil) {
      *error = "the Metal library has no kernel '" + name + "'";
      return nil;
    }
    NSError* err = nil;
    id<MTLComputePipelineState> p = [dev_ newComputePipelineStateWithFunction:f error:&err];
    if (p == nil) {
      *error = "pipeline of " + name + ": " +
               (err != nil ? std::string([[err localizedDescription] UTF8String]) : "unknown error");
      return nil;
    }
    pipes_[name] = p;
    return p;
  }

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
  int64_t command_buffers_ = 0;
  std::map<std::thread::id, std::vector<id<MTLCommandBuffer>>> pending_;  // by committing thread
  std::mutex lib_mu_;
  id<MTLLibrary> lib_ = nil;
  std::string lib_error_;  // why the library did not compile ("" until it failed)
  std::map<std::string, id<MTLComputePipelineState>> pipes_;
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
