// The device a behaviour test runs on: ZEROALLOC_DEVICE=sim (the default) or cuda. Each
// device-generic suite is registered with CTest once per device (labels sim and gpu), so a
// test is written once and runs everywhere.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "core/errors.hpp"
#include "core/units.hpp"
#include "device/cuda_device.hpp"
#include "device/sim_device.hpp"

namespace zeroalloc::testing {

inline std::string test_device_kind() {
  const char* kind = std::getenv("ZEROALLOC_DEVICE");
  return kind == nullptr ? "sim" : kind;
}

/// Opens device `ordinal` of the kind under test; nullptr when it is absent (the caller
/// skips). The simulated device gets `sim_bytes` of memory, and maps only whole allocations
/// under ZEROALLOC_SIM_MAPS_SLICES=0 (as CUDA drivers do).
inline std::unique_ptr<device> open_test_device(int ordinal = 0,
                                                std::uint64_t sim_bytes = 1 * GiB) {
  if (test_device_kind() != "cuda") {
    auto simulated = std::make_unique<sim_device>(ordinal, sim_bytes);
    const char* slices = std::getenv("ZEROALLOC_SIM_MAPS_SLICES");
    if (slices != nullptr && std::string(slices) == "0") simulated->set_maps_slices(false);
    return simulated;
  }
  try {
    if (cuda_device::count() <= ordinal) return nullptr;
    return std::make_unique<cuda_device>(ordinal);
  } catch (const no_driver_error&) {
    return nullptr;
  }
}

#define ZA_OPEN_TEST_DEVICE_OR_SKIP(variable, ...)                \
  variable = ::zeroalloc::testing::open_test_device(__VA_ARGS__); \
  if (!variable)                                                  \
  GTEST_SKIP() << "skipped: no " << ::zeroalloc::testing::test_device_kind() << " device present"

/// Copies device memory to a host vector (synchronously).
inline std::vector<std::uint8_t> read_back(device& from, const void* source, std::size_t bytes,
                                           stream_handle stream = nullptr) {
  std::vector<std::uint8_t> host(bytes);
  from.copy_async(host.data(), source, bytes, stream);
  from.synchronize_stream(stream);
  return host;
}

}  // namespace zeroalloc::testing
