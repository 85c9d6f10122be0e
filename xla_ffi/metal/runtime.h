// The active Metal device and the account's view of it.
//
// At most one device is active: Metal itself on Apple (when the build has it
// and a GPU is present), a device registered by another module when asked for
// by its name (the simulated device, "sim": registered by the test-only module
// jax_nbx._ffi_testing, which the product never links; JAX_NBX_METAL=sim or
// jax_nbx.metal.use("sim")), else none.  Every
// buffer the Metal path allocates is a `DeviceBuffer`: counted in the
// account under "metal:0" (budget: the device's working-set size) before it
// exists, and counted free the moment it is released, while the buffer itself
// goes only when the command buffers using it have completed (device.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "account.h"
#include "metal/device.h"

namespace nbx::metal {

inline nbx::Device Ledger() { return nbx::Device{"metal", 0}; }

// The active device, or nullptr.
metal::Device* Active();
// "none", "apple" or a registered name ("sim"); returns "" or why not (e.g. no
// Metal in this build, the name not registered).  Activating sets metal:0's
// budget to the device's working set.
std::string Activate(const std::string& which);

// The seam for devices made outside the product (the test module's simulated
// device): Activate(name) then makes the device with `make` (nullptr and why
// in *error when it cannot).  Registering a name again replaces its factory;
// "apple" and "none" are the runtime's own.  The factory's code must stay
// loaded while its device is active (Python never unloads an extension).
using DeviceFactory = std::unique_ptr<metal::Device> (*)(std::string* error);
void RegisterDevice(const std::string& name, DeviceFactory make);

// Whether this build has the Apple implementation (compiled only on Apple).
bool HasAppleImplementation();
// Devices of this machine's Metal: 1 when one is active (Apple silicon has one GPU).
int DeviceCount();

// The bound on one command buffer's work, in floating-point operations of
// the expert GEMMs (macOS kills a command buffer that keeps the GPU busy too
// long: the GPU watchdog, on the order of seconds).  The handler splits a
// band's GEMMs into ranges of row tiles, one command buffer each, under it.
// Default kDefaultCommandBufferFlops (2^36: well under a second even at a
// tenth of the smallest Apple GPU's peak).
inline constexpr int64_t kDefaultCommandBufferFlops = int64_t{1} << 36;
int64_t CommandBufferFlops();
void SetCommandBufferFlops(int64_t flops);  // <= 0: the default

// A shared-storage buffer counted in the account (metal:0) under `tag`.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Refused by the account (its message and advice in *error) or by the device.
  static bool Allocate(int64_t bytes, const char* tag, const WorkShape& shape, DeviceBuffer* out,
                       std::string* error);
  const Buffer& buffer() const { return b_; }
  // The account counts the bytes free now; the device releases the buffer
  // after the work in flight that uses it.
  void Reset();

 private:
  Buffer b_;
  const char* tag_ = "";
};

}  // namespace nbx::metal
