// The Metal device behind the account: the primitives the account, the pinned
// scopes and the pointer tables ask of an Apple GPU, and nothing more.
//
// JAX on Apple silicon runs on its CPU client; our handler (registered for
// "cpu") hands the MoE block to the GPU through Metal.  Unified memory: a
// shared-storage buffer has one address space for CPU and GPU, and host pages
// can be wrapped in place (no copy).  Two implementations:
//   apple_device.mm  Metal itself (compiled only when CMake targets Apple)
//   sim_device.cc    a simulated device (portable, strict where Metal is
//                    silent): test-only, built into jax_nbx._ffi_testing
//                    (NBX_TESTING=ON), which registers it in the runtime
// Neither is chosen here: runtime.h holds the active one (and the seam,
// RegisterDevice, through which a device made elsewhere is installed).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace nbx::metal {

struct Dispatch;  // dispatch.h

// Apple silicon's page: no-copy wraps start and end on it (not the host's
// 4 KiB pages on x86 Linux).
inline constexpr int64_t kPageBytes = 16384;
inline int64_t PageFloor(int64_t a) { return a / kPageBytes * kPageBytes; }
inline int64_t PageCeil(int64_t a) { return (a + kPageBytes - 1) / kPageBytes * kPageBytes; }

struct DeviceInfo {
  std::string name;
  int64_t working_set = 0;        // recommendedMaxWorkingSetSize: the account's budget
  int64_t max_buffer_length = 0;  // maxBufferLength: no buffer or wrap is longer
  int64_t max_wraps = 0;          // live no-copy wraps at most (ours: counted and bounded)
};

// A shared-storage buffer or a no-copy wrap of host pages.  `host` is the CPU
// mapping, `gpu` the GPU address of its first byte (never a host address).
struct Buffer {
  uint64_t id = 0;  // 0: none
  char* host = nullptr;
  uint64_t gpu = 0;
  int64_t length = 0;
  bool wrap = false;
  explicit operator bool() const { return id != 0; }
};

// What a command buffer reads or writes: every buffer and wrap it uses is
// made resident for it (`useResources`, or a residency set).
using Work = std::function<void()>;

class Device {
 public:
  virtual ~Device() = default;
  virtual const char* implementation() const = 0;  // "apple" or "sim"
  virtual DeviceInfo info() const = 0;
  virtual bool supports(const std::string& primitive) const = 0;

  // Shared-storage buffers.  Release: the buffer goes once every command
  // buffer in flight that uses it has completed (the account counts the
  // bytes free at once: runtime.h).
  virtual bool NewBuffer(int64_t bytes, Buffer* out, std::string* error) = 0;
  virtual void Release(const Buffer& b) = 0;

  // No-copy wrap of [host, host + length): both multiples of kPageBytes,
  // length <= max_buffer_length (else kInvalid), live wraps < max_wraps (else
  // kAtLimit); kRefused when the device will not wrap that memory (Metal's
  // newBufferWithBytesNoCopy returning nil): the caller stages a copy.
  // A wrap is released like a buffer (after the work using it completes).
  enum class WrapResult { kOk, kAtLimit, kRefused, kInvalid };
  virtual WrapResult Wrap(char* host, int64_t length, Buffer* out, std::string* error) = 0;
  virtual int64_t live_wraps() const = 0;
  // The host allocation that holds p (its base and length), when the device
  // can tell; pins wrap whole allocations, not each array in them.
  virtual bool AllocationOf(const void* p, const char** base, int64_t* bytes) const = 0;
  // Whether a wrap still maps the host memory it was made of (the simulated
  // device knows when that memory was freed; Metal cannot tell: true).
  virtual bool WrapCurrent(const Buffer& wrap) const = 0;

  virtual void Memset(const Buffer& b, int64_t offset, int value, int64_t bytes) = 0;
  virtual void Memcpy(const Buffer& dst, int64_t dst_off, const void* src, int64_t bytes) = 0;

  // One command buffer: `work` runs on the GPU timeline with `resources`
  // resident; returns when it is committed (not completed).
  virtual void Submit(const std::vector<Buffer>& resources, Work work) = 0;
  // Waits for every committed command buffer to complete.
  virtual void Synchronize() = 0;

  // Readies what the kernels need before the first command buffer (Metal: the
  // kernels' library, LibrarySource(), compiled once); false and why when it
  // cannot (a library the compiler rejects: LibraryCompileError's message,
  // naming the kernel file).  Cheap after the first call, which the Metal
  // backend makes when it is chosen (python/metal.cc metal_prepare).
  virtual bool Prepare(std::string* error) = 0;

  // One command buffer running `dispatches` in order (each sees the writes of
  // the ones before it), `resources` resident for all of them.  False when it
  // cannot be encoded (a kernel the library lacks, arguments that do not fit
  // it); what fails while it runs is reported by Wait.
  virtual bool Commit(const std::vector<Buffer>& resources, const std::vector<Dispatch>& dispatches,
                      std::string* error) = 0;
  // Synchronize, then whether every command buffer committed since the last
  // Wait completed without error (else the first error, and the rest counted).
  virtual bool Wait(std::string* error) = 0;
  // Command buffers committed by Commit since the device was made.
  virtual int64_t command_buffers() const = 0;
};

// Page-aligned host memory for staging and tests (kPageBytes alignment).
char* HostAlloc(int64_t bytes);
void HostFree(char* p);

}  // namespace nbx::metal
