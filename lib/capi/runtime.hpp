// The process-wide state behind the C ABI: options, devices and one caching allocator per
// device, created on first use. It is never destroyed: PyTorch and CUDA libraries free
// memory from static destructors, after which a destroyed allocator would crash them.
#pragma once

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "alloc/caching_allocator.hpp"
#include "core/options.hpp"
#include "device/device_registry.hpp"
#include "profile/report.hpp"
#include "tier/host_step.hpp"
#include "tier/offload_engine.hpp"
#include "tier/pinned_buffers.hpp"

namespace zeroalloc {

class runtime {
 public:
  /// The runtime, started on the first call. Throws config_error (or no_driver_error) on
  /// every call when the start failed, with the same message.
  static runtime& get();
  /// The runtime if a call has started it, else nullptr; never starts it.
  static runtime* if_started() noexcept;

  [[nodiscard]] int device_count() const { return registry_.count(); }
  /// True when the devices are simulated (ZEROALLOC_DEVICE=sim, or no GPU).
  [[nodiscard]] bool simulated() const { return registry_.kind() == "sim"; }
  /// The allocator of `ordinal`, created on first use. Throws invalid_argument for a bad
  /// ordinal.
  caching_allocator& allocator(int ordinal);
  /// The allocator that owns `pointer`, or nullptr; never creates one.
  caching_allocator* owner_of(const void* pointer);
  /// Frees `pointer` through the allocator that owns it; false when none does or it is not
  /// a live allocation.
  bool deallocate(void* pointer);
  /// Allocators created so far (for empty_cache over all devices).
  std::vector<caching_allocator*> started_allocators();
  /// The offload engine of the device whose allocator owns `pointer`; nullptr when there is
  /// none or offload is off (ZEROALLOC_OFFLOAD=none).
  offload_engine* engine_of(const void* pointer);
  /// The offload engine of `ordinal` (creating its allocator), or nullptr when offload is off.
  offload_engine* engine(int ordinal);
  /// The host pool of `ordinal`, or nullptr.
  host_pool* host_tier(int ordinal);
  /// The threads of the host step for the device `ordinal` (Note [Stepped on the host] in
  /// tier/host_step.hpp), bound to the CPUs of its NUMA node; made on first use.
  host_workers& host_step_workers(int ordinal);
  /// The host step's pinned buffers for the device `ordinal` (Note [Pinned buffers made
  /// ahead] in tier/pinned_buffers.hpp); made on first use.
  pinned_buffers& pinned(int ordinal);
  /// The device's pinned buffers that hold the buffer at `address`, or nullptr.
  pinned_buffers* pinned_owner(const void* address);
  /// The offload figures of `ordinal` as a JSON object, or "null" when offload is off.
  nlohmann::ordered_json offload_json(int ordinal);
  /// Stops the host tiers' background creation of pinned memory and the engines' prefetch
  /// and read-ahead threads (at exit).
  void stop_background_work();
  /// True when ZEROALLOC_OFFLOAD asks for a host tier.
  [[nodiscard]] bool offload_enabled() const { return options_.offload == "host"; }
  /// True when ranks on GPUs exchange bytes through rank 0 over TCP (ZEROALLOC_COLLECTIVES).
  [[nodiscard]] bool collectives_over_tcp() const { return options_.collectives == "tcp"; }
  /// The NVMe tier behind the host tier (ZEROALLOC_NVME_PATH and ZEROALLOC_NVME_SIZE).
  [[nodiscard]] bool disk_tier_enabled() const {
    return offload_enabled() && !options_.nvme_path.empty() && options_.nvme_bytes != 0;
  }

  /// pthread_atfork handlers (Note [Fork] in alloc/caching_allocator.cpp).
  void prepare_fork();
  void after_fork();
  /// False in a child forked from the process that started the reporter: a child writes
  /// no report (it would overwrite its parent's).
  [[nodiscard]] bool reporting_process() const;
  /// The memory reporter (ZEROALLOC_REPORT), or nullptr when no report was asked for.
  [[nodiscard]] reporter* memory_reporter() { return reporter_.get(); }

 private:
  explicit runtime(const options& parsed);

  static constexpr int kMaxDevices = kMostDevices;
  options options_;
  device_registry registry_;
  std::mutex create_mutex_;
  std::array<std::atomic<caching_allocator*>, kMaxDevices> allocators_{};
  std::vector<std::unique_ptr<device>> devices_;
  std::vector<std::unique_ptr<caching_allocator>> owned_allocators_;
  /// Creates the host pool and offload engine of `ordinal` (the caller attaches the engine).
  void start_offload(int ordinal, caching_allocator& allocator);
  /// The devices and processes a share of the host's memory is split among.
  [[nodiscard]] std::uint64_t host_sharers() const;
  /// The pinned host memory one device's host tier may hold (ZEROALLOC_HOST_LIMIT).
  [[nodiscard]] std::uint64_t host_tier_limit() const;
  std::array<std::atomic<offload_engine*>, kMaxDevices> engines_{};
  std::array<std::atomic<host_pool*>, kMaxDevices> host_pools_{};
  std::vector<std::unique_ptr<host_pool>> owned_host_pools_;
  std::vector<std::unique_ptr<disk_store>> owned_disk_stores_;  // destroyed after the engines
  std::vector<std::unique_ptr<offload_engine>> owned_engines_;
  std::vector<std::unique_ptr<paging_listener>> owned_listeners_;
  std::unique_ptr<reporter> reporter_;
  std::array<std::unique_ptr<host_workers>, kMaxDevices> host_step_workers_;  // create_mutex_
  std::array<std::unique_ptr<pinned_buffers>, kMaxDevices> pinned_;           // create_mutex_
};

}  // namespace zeroalloc
