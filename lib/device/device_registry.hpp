// Chooses and opens the devices the library drives (ZEROALLOC_DEVICE).
#pragma once

#include <memory>
#include <string>

#include "core/options.hpp"
#include "device/device.hpp"

namespace zeroalloc {

/// Which devices are present, and how to open one.
class device_registry {
 public:
  /// Resolves ZEROALLOC_DEVICE: "cuda" requires a driver and a GPU (no_driver_error
  /// otherwise); "auto" falls back to the simulated device, and says so in the log.
  explicit device_registry(const options& parsed);

  [[nodiscard]] int count() const { return count_; }
  [[nodiscard]] const std::string& kind() const { return kind_; }
  /// Opens device `ordinal` (0 <= ordinal < count()).
  [[nodiscard]] std::unique_ptr<device> open(int ordinal) const;

 private:
  std::string kind_;  // "cuda" or "sim"
  int count_ = 0;
  std::uint64_t sim_memory_bytes_ = 0;
  bool sim_maps_slices_ = true;
};

}  // namespace zeroalloc
