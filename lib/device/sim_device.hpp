// The simulated device: a faithful model of the CUDA VMM semantics in host memory, so that
// every allocator and engine test runs in CI without a GPU (lib/README.md, "Testing
// without a GPU").
//
// - A physical handle is a memfd; device-located handles count against the device's
//   capacity, host-located ones do not.
// - map() is mmap(MAP_FIXED | MAP_SHARED) of that memfd at the reserved address, so a remap
//   really swaps the bytes behind a stable pointer, and a stale access after unmap faults.
// - A stream is a worker thread that runs its queue in order; events mark points in a queue
//   and can be waited on by other streams, as in CUDA.
// Mapping over a mapped range or unmapping an unmapped one raise device_error; a handle
// released while mapped is freed by its last unmap, as with cuMemRelease.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "device/device.hpp"

namespace zeroalloc {

class sim_stream;

class sim_device final : public device {
 public:
  /// A device with `capacity_bytes` of "device memory".
  sim_device(int ordinal, std::uint64_t capacity_bytes);
  ~sim_device() override;

  [[nodiscard]] std::string name() const override;
  [[nodiscard]] int ordinal() const override { return ordinal_; }
  [[nodiscard]] bool is_simulated() const override { return true; }
  [[nodiscard]] std::size_t granularity() const override;
  [[nodiscard]] memory_info query_memory() const override;

  physical_handle create_physical(std::size_t bytes, memory_location location) override;
  void release_physical(physical_handle handle) override;
  std::uintptr_t reserve_addresses(std::size_t bytes, std::size_t alignment) override;
  void free_addresses(std::uintptr_t address, std::size_t bytes) override;
  void map(std::uintptr_t address, physical_handle handle) override;
  /// A mapping is host memory the process maps itself: the CPU reaches it already.
  bool open_to_host(std::uintptr_t /*address*/, std::size_t /*bytes*/) override { return true; }
  void unmap(std::uintptr_t address, std::size_t bytes) override;
  /// Anonymous host pages: the simulated device's streams copy to and from any host memory.
  void* create_pinned(std::size_t bytes) override;
  void release_pinned(void* address, std::size_t bytes) override;

  stream_handle create_stream() override;
  void destroy_stream(stream_handle stream) override;
  [[nodiscard]] int host_numa_node() const override { return 0; }
  void place_host_memory_on_any_node() override {}  // host memory is host memory here
  event_handle create_event() override;
  /// Events created and not yet destroyed (tests check that long runs do not leak them).
  [[nodiscard]] std::size_t events_alive() const { return events_alive_.load(); }
  event_handle create_timing_event() override;
  [[nodiscard]] bool maps_slices() override;
  /// Whether map() accepts a slice of an allocation (default yes). CUDA 13 drivers refuse
  /// (cuMemMap: offset must be zero, size the allocation's); tests turn it off to take the
  /// paths those drivers take.
  void set_maps_slices(bool maps) { maps_slices_ = maps; }
  [[nodiscard]] float elapsed_ms(event_handle start, event_handle end) override;
  void destroy_event(event_handle event) override;
  void record_event(event_handle event, stream_handle stream) override;
  [[nodiscard]] bool event_completed(event_handle event) override;
  void synchronize_event(event_handle event) override;
  void stream_wait_event(stream_handle stream, event_handle event) override;
  void synchronize_stream(stream_handle stream) override;
  /// Synchronizes the default stream and every stream created and not yet destroyed.
  /// Refused, as CUDA refuses it, while a stream captures (begin_capture).
  void synchronize_device() override;
  bool stream_is_capturing(stream_handle stream) override;
  /// Tests: `stream` captures from now until end_capture (no work is recorded: capture
  /// here only makes the calls that CUDA refuses during capture fail).
  void begin_capture(stream_handle stream);
  void end_capture(stream_handle stream);

  void copy_async(void* destination, const void* source, std::size_t bytes,
                  stream_handle stream) override;
  void fill_async(void* destination, std::uint8_t value, std::size_t bytes,
                  stream_handle stream) override;
  void host_function_async(std::function<void()> function, stream_handle stream) override;

 private:
  struct handle_record {
    int memfd = -1;
    std::size_t bytes = 0;
    memory_location location = memory_location::device;
    int mappings = 0;
    bool released = false;  // released while mapped: destroyed by its last unmap
  };
  struct mapping_record {
    std::size_t bytes = 0;
    std::uint64_t handle = 0;
  };

  sim_stream& resolve(stream_handle stream);
  void destroy_handle_locked(std::uint64_t id);

  const int ordinal_;
  const std::uint64_t capacity_bytes_;
  mutable std::mutex mutex_;
  std::uint64_t used_bytes_ = 0;  // device-located handles alive
  std::uint64_t next_handle_ = 1;
  std::map<std::uint64_t, handle_record> handles_;
  std::map<std::uintptr_t, std::size_t> reservations_;  // start -> bytes
  std::map<std::uintptr_t, mapping_record> mappings_;   // start -> mapping
  std::unique_ptr<sim_stream> default_stream_;
  // Streams created and not yet destroyed, for synchronize_device; its lock is held while
  // they are synchronized, so that none is destroyed meanwhile.
  std::mutex streams_mutex_;
  std::set<sim_stream*> streams_;
  // Streams in a capture (begin_capture), under a lock of their own: a hint asks while
  // another thread may hold streams_mutex_ through a whole synchronize_device.
  mutable std::mutex capture_mutex_;
  std::set<const sim_stream*> capturing_;
  std::atomic<std::size_t> events_alive_{0};
  bool maps_slices_ = true;
};

}  // namespace zeroalloc
