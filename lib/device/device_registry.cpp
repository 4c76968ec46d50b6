#include "device/device_registry.hpp"

#include "core/errors.hpp"
#include "core/log.hpp"
#include "device/cuda_device.hpp"
#include "device/sim_device.hpp"

namespace zeroalloc {

device_registry::device_registry(const options& parsed)
    : sim_memory_bytes_(parsed.sim_memory_bytes), sim_maps_slices_(parsed.sim_maps_slices) {
  if (parsed.device == "sim") {
    kind_ = "sim";
    count_ = parsed.sim_device_count;
    return;
  }
  try {
    count_ = cuda_device::count();
    kind_ = "cuda";
    if (count_ == 0) {
      if (parsed.device == "cuda") {
        ZA_THROW(no_driver_error,
                 "ZEROALLOC_DEVICE=cuda, but the CUDA driver sees no GPU. "
                 "Check nvidia-smi and CUDA_VISIBLE_DEVICES, or run with "
                 "ZEROALLOC_DEVICE=sim.");
      }
      log().warn(
          "the CUDA driver sees no GPU: zeroalloc runs on the simulated device (host "
          "memory). Set ZEROALLOC_DEVICE=sim to silence this, or =cuda to require a GPU.");
      kind_ = "sim";
      count_ = parsed.sim_device_count;
    }
  } catch (const no_driver_error& failure) {
    if (parsed.device == "cuda") throw;
    log().warn(
        "{}. zeroalloc runs on the simulated device (host memory). Set "
        "ZEROALLOC_DEVICE=sim to silence this, or =cuda to require a GPU.",
        failure.what());
    kind_ = "sim";
    count_ = parsed.sim_device_count;
  }
}

std::unique_ptr<device> device_registry::open(int ordinal) const {
  if (kind_ == "sim") {
    auto simulated = std::make_unique<sim_device>(ordinal, sim_memory_bytes_);
    simulated->set_maps_slices(sim_maps_slices_);
    return simulated;
  }
  return std::make_unique<cuda_device>(ordinal);
}

}  // namespace zeroalloc
