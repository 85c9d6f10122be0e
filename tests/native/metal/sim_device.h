// The simulated Metal device: portable C++, test-only: built into the test
// module jax_nbx._ffi_testing (CMake NBX_TESTING=ON), never into the product,
// which registers it in the product's runtime under "sim" (runtime.h
// RegisterDevice; JAX_NBX_METAL=sim).  Faithful to what device.h promises and
// loud where Metal would be silent:
//   - GPU addresses come from a synthetic range (from 2^52, above every
//     x86-64/arm64 user-space address) with an unmapped gap after each
//     buffer; resolving an address that no live buffer or wrap covers, or one
//     not made resident for the command buffer that reads it, records a
//     violation (on Metal: silent zeros or a GPU fault), and the caller fails;
//   - wraps only of 16 KiB-aligned regions (Apple's page, not this host's),
//     at most max_buffer_length long, at most max_wraps alive;
//   - host regions can be tracked (their allocation bounds and a generation
//     that changes when the memory is freed) and marked unwrappable (Metal's
//     newBufferWithBytesNoCopy returning nil), so that staging and stale
//     wraps can be tested;
//   - completions can be held by a test: a released buffer then stays until
//     the command buffers using it complete (`pending_releases`).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "metal/device.h"

namespace nbx::metal {

class SimDevice final : public Device {
 public:
  struct Config {
    int64_t working_set = int64_t{8} << 30;
    int64_t max_buffer_length = int64_t{4} << 30;
    int64_t max_wraps = 512;
  };
  explicit SimDevice(Config c) : cfg_(c) {}
  ~SimDevice() override;

  const char* implementation() const override { return "sim"; }
  DeviceInfo info() const override;
  bool supports(const std::string& primitive) const override;
  bool NewBuffer(int64_t bytes, Buffer* out, std::string* error) override;
  void Release(const Buffer& b) override;
  WrapResult Wrap(char* host, int64_t length, Buffer* out, std::string* error) override;
  int64_t live_wraps() const override;
  bool WrapCurrent(const Buffer& wrap) const override;
  void Memset(const Buffer& b, int64_t offset, int value, int64_t bytes) override;
  void Memcpy(const Buffer& dst, int64_t dst_off, const void* src, int64_t bytes) override;
  void Submit(const std::vector<Buffer>& resources, Work work) override;
  void Synchronize() override;
  // False, with Metal's error, once a test made the library "rejected" (RejectLibrary).
  bool Prepare(std::string* error) override;
  // Runs the dispatches through the MSL emulation (emulated_kernels.h); a
  // failure while running is kept for the committing thread's next Wait.
  bool Commit(const std::vector<Buffer>& resources, const std::vector<Dispatch>& dispatches,
              std::string* error) override;
  bool Wait(std::string* error) override;
  int64_t command_buffers() const override;

  // ---- the simulation's own controls (tests)
  void Configure(Config c);
  // The host pointer behind [gpu, gpu + bytes) when one live buffer or wrap
  // covers it and (inside a command buffer) it was made resident; otherwise
  // nullptr and a violation is recorded.
  char* Resolve(uint64_t gpu, int64_t bytes);
  std::vector<std::string> TakeViolations();
  // Host memory the simulation knows: [base, base + bytes) is one allocation
  // (a wrap must lie inside the pages of one, when it touches one).  Freeing
  // it makes every wrap of it stale.  `wrappable=false`: Metal refuses it.
  void TrackHost(const void* base, int64_t bytes, bool wrappable = true);
  void ForgetHost(const void* base);
  // The tracked allocation that holds p: its base and length.
  bool AllocationOf(const void* p, const char** base, int64_t* bytes) const override;
  void HoldCompletions(bool hold);  // false completes everything held
  // A kernels' library the Metal compiler rejects: `compiler_message` as
  // newLibraryWithSource's error would give it ("program_source:LINE:COL:
  // error: ..."); Prepare and Commit then fail as the Apple device does
  // (LibraryCompileError's message).  "": the library compiles again.
  void RejectLibrary(const std::string& compiler_message);
  int64_t pending_commands() const;
  int64_t pending_releases() const;
  int64_t live_buffers() const;
  int64_t wraps_made() const { return wraps_made_; }

 private:
  struct Live {
    Buffer b;
    uint64_t generation = 0;  // wraps: the tracked allocation's, 0 when untracked
    const char* region = nullptr;
    bool released = false;  // released while in use: goes at completion
  };
  struct Region {
    int64_t bytes;
    bool wrappable;
    uint64_t generation;
  };
  struct Command {
    std::set<uint64_t> ids;
    Work work;
  };
  const Region* RegionOf(const void* p, const char** base) const;  // mu_ held
  void CompleteHeld();                                             // mu_ held
  void FreeNow(uint64_t id);                                       // mu_ held

  Config cfg_;
  mutable std::mutex mu_;
  std::map<uint64_t, Live> live_;            // by gpu address
  std::map<uint64_t, uint64_t> id_to_gpu_;
  std::map<const char*, Region> regions_;    // tracked host allocations by base
  std::vector<Command> held_;
  std::mutex command_mu_;                    // command buffers run one at a time, in order
  std::set<uint64_t> resident_;              // of the command buffer running now
  bool in_command_ = false;
  bool hold_ = false;
  uint64_t next_id_ = 1, next_gpu_ = uint64_t{1} << 52, generation_ = 1;
  int64_t wraps_ = 0, wraps_made_ = 0;
  std::vector<std::string> violations_;
  int64_t command_buffers_ = 0;
  std::map<std::thread::id, std::vector<std::string>> failures_;  // by committing thread
  std::string library_rejected_;  // RejectLibrary's message ("": the library compiles)
};

// A simulated device of the default limits: the factory the test module
// registers under "sim" (runtime.h RegisterDevice).
std::unique_ptr<Device> NewSimDevice(std::string* error);
// The active device when it is the simulated one, else nullptr.
SimDevice* ActiveSim();

}  // namespace nbx::metal
