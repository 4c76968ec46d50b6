// A device that forwards every call to another one and fails the unmaps, or the event
// records, a test picks out, the way a driver does (device_error), so that tests can check
// what a failed CUDA call in the middle of a migration leaves behind; damages the bytes of a
// copy a test picks out (a write that lands in memory being moved), for ZEROALLOC_VERIFY to
// find; holds a copy a test picks out until the test lets it run (a copy engine that is
// busy), so that a test can act while the copy's bytes are still on their way; and counts
// the events alive, so that tests can see a failure path leak none.
#pragma once

#include <algorithm>
#include <array>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "core/errors.hpp"
#include "device/device.hpp"

namespace zeroalloc::testing {

/// The calls a test can make fail with fail_call.
enum class device_call { record_event, synchronize_event, stream_wait_event, map, count };

class faulty_device final : public device {
 public:
  explicit faulty_device(std::unique_ptr<device> inner) : inner_(std::move(inner)) {}

  /// From now on, unmap(address, bytes) throws once for the first `address` the predicate
  /// accepts (the mapping stays); then the predicate is dropped.
  void fail_next_unmap(std::function<bool(std::uintptr_t)> which) {
    std::lock_guard lock(mutex_);
    fail_unmap_ = std::move(which);
  }
  /// From now on, the `nth` copy_async (counting from 1) whose source the predicate accepts
  /// is followed, in its stream, by a fill of the first 64 bytes of its destination with
  /// 0x5a; then the predicate is dropped.
  void damage_copy(std::function<bool(const void* source)> which, int nth) {
    std::lock_guard lock(mutex_);
    damage_ = std::move(which);
    damage_countdown_ = nth;
  }
  /// From now on, the first copy_async whose source the predicate accepts arms a failure:
  /// the next record_event made by the same thread throws (the event is not recorded, the
  /// copy stays queued); then the predicate is dropped. This is a request failing after its
  /// copy was queued.
  void fail_record_after_copy(std::function<bool(const void* source)> which) {
    std::lock_guard lock(mutex_);
    fail_after_copy_ = std::move(which);
    armed_thread_ = std::thread::id();
  }
  /// From now on, the first copy_async whose destination the predicate accepts waits in
  /// its stream (behind a host function) until `released` is ready, and so does everything
  /// queued on that stream after it; then the predicate is dropped.
  void hold_copy(std::function<bool(const void* destination)> which,
                 std::shared_future<void> released) {
    std::lock_guard lock(mutex_);
    hold_ = std::move(which);
    released_ = std::move(released);
  }
  /// From now on, the `nth` call of `which` (counting from 1, on any thread) and the
  /// `times - 1` after it throw a device_error and do nothing, as a failing driver call does.
  void fail_call(device_call which, int nth = 1, int times = 1) {
    std::lock_guard lock(mutex_);
    call_countdown_[static_cast<int>(which)] = nth;
    call_repeats_[static_cast<int>(which)] = times;
  }
  [[nodiscard]] int failed_unmaps() const {
    std::lock_guard lock(mutex_);
    return failed_unmaps_;
  }
  [[nodiscard]] int failed_records() const {
    std::lock_guard lock(mutex_);
    return failed_records_;
  }
  /// Events created and not destroyed (timing events included).
  [[nodiscard]] long events_alive() const {
    std::lock_guard lock(mutex_);
    return events_alive_;
  }

  [[nodiscard]] std::string name() const override { return inner_->name(); }
  [[nodiscard]] int ordinal() const override { return inner_->ordinal(); }
  [[nodiscard]] bool is_simulated() const override { return inner_->is_simulated(); }
  [[nodiscard]] std::size_t granularity() const override { return inner_->granularity(); }
  [[nodiscard]] memory_info query_memory() const override { return inner_->query_memory(); }
  [[nodiscard]] int host_numa_node() const override { return inner_->host_numa_node(); }
  void place_host_memory_on_any_node() override { inner_->place_host_memory_on_any_node(); }
  physical_handle create_physical(std::size_t bytes, memory_location location) override {
    return inner_->create_physical(bytes, location);
  }
  void release_physical(physical_handle handle) override { inner_->release_physical(handle); }
  std::uintptr_t reserve_addresses(std::size_t bytes, std::size_t alignment) override {
    return inner_->reserve_addresses(bytes, alignment);
  }
  void free_addresses(std::uintptr_t address, std::size_t bytes) override {
    inner_->free_addresses(address, bytes);
  }
  void map(std::uintptr_t address, physical_handle handle) override {
    fail_if_chosen(device_call::map, "cuMemMap");
    inner_->map(address, handle);
  }
  bool open_to_host(std::uintptr_t address, std::size_t bytes) override {
    return inner_->open_to_host(address, bytes);
  }
  [[nodiscard]] bool maps_slices() override { return inner_->maps_slices(); }
  void* create_pinned(std::size_t bytes) override { return inner_->create_pinned(bytes); }
  void release_pinned(void* address, std::size_t bytes) override {
    inner_->release_pinned(address, bytes);
  }
  void unmap(std::uintptr_t address, std::size_t bytes) override {
    {
      std::lock_guard lock(mutex_);
      if (fail_unmap_ && fail_unmap_(address)) {
        fail_unmap_ = nullptr;
        ++failed_unmaps_;
        throw device_error("cuMemUnmap failed (injected by the test)", 999);
      }
    }
    inner_->unmap(address, bytes);
  }
  stream_handle create_stream() override { return inner_->create_stream(); }
  void destroy_stream(stream_handle stream) override { inner_->destroy_stream(stream); }
  event_handle create_event() override {
    event_handle event = inner_->create_event();
    std::lock_guard lock(mutex_);
    ++events_alive_;
    return event;
  }
  void destroy_event(event_handle event) override {
    inner_->destroy_event(event);
    if (event == nullptr) return;
    std::lock_guard lock(mutex_);
    --events_alive_;
  }
  void record_event(event_handle event, stream_handle stream) override {
    fail_if_chosen(device_call::record_event, "cuEventRecord");
    {
      std::lock_guard lock(mutex_);
      if (armed_thread_ != std::thread::id() && armed_thread_ == std::this_thread::get_id()) {
        armed_thread_ = std::thread::id();
        ++failed_records_;
        throw device_error("cuEventRecord failed (injected by the test)", 999);
      }
    }
    inner_->record_event(event, stream);
  }
  [[nodiscard]] bool event_completed(event_handle event) override {
    return inner_->event_completed(event);
  }
  void synchronize_event(event_handle event) override {
    fail_if_chosen(device_call::synchronize_event, "cuEventSynchronize");
    inner_->synchronize_event(event);
  }
  event_handle create_timing_event() override {
    event_handle event = inner_->create_timing_event();
    std::lock_guard lock(mutex_);
    ++events_alive_;
    return event;
  }
  [[nodiscard]] float elapsed_ms(event_handle start, event_handle end) override {
    return inner_->elapsed_ms(start, end);
  }
  void stream_wait_event(stream_handle stream, event_handle event) override {
    fail_if_chosen(device_call::stream_wait_event, "cuStreamWaitEvent");
    inner_->stream_wait_event(stream, event);
  }
  void synchronize_stream(stream_handle stream) override { inner_->synchronize_stream(stream); }
  void synchronize_device() override { inner_->synchronize_device(); }
  bool stream_is_capturing(stream_handle stream) override {
    return inner_->stream_is_capturing(stream);
  }
  void copy_async(void* destination, const void* source, std::size_t bytes,
                  stream_handle stream) override {
    std::shared_future<void> held;
    {
      std::lock_guard lock(mutex_);
      if (hold_ && hold_(destination)) {
        hold_ = nullptr;
        held = std::exchange(released_, {});
      }
    }
    if (held.valid()) inner_->host_function_async([held] { held.wait(); }, stream);
    inner_->copy_async(destination, source, bytes, stream);
    bool damage = false;
    {
      std::lock_guard lock(mutex_);
      if (fail_after_copy_ && fail_after_copy_(source)) {
        fail_after_copy_ = nullptr;
        armed_thread_ = std::this_thread::get_id();
      }
      if (damage_ && damage_(source) && --damage_countdown_ == 0) {
        damage_ = nullptr;
        damage = true;
      }
    }
    if (damage) inner_->fill_async(destination, 0x5a, std::min<std::size_t>(bytes, 64), stream);
  }
  void fill_async(void* destination, std::uint8_t value, std::size_t bytes,
                  stream_handle stream) override {
    inner_->fill_async(destination, value, bytes, stream);
  }
  void host_function_async(std::function<void()> function, stream_handle stream) override {
    inner_->host_function_async(std::move(function), stream);
  }

 private:
  void fail_if_chosen(device_call which, const char* name) {
    std::lock_guard lock(mutex_);
    int& countdown = call_countdown_[static_cast<int>(which)];
    if (countdown == 0 || --countdown != 0) return;
    if (--call_repeats_[static_cast<int>(which)] > 0) countdown = 1;  // the next fails too
    throw device_error(std::string(name) + " failed (injected by the test)", 999);
  }

  std::unique_ptr<device> inner_;
  std::array<int, static_cast<int>(device_call::count)> call_countdown_{};
  std::array<int, static_cast<int>(device_call::count)> call_repeats_{};
  mutable std::mutex mutex_;
  std::function<bool(std::uintptr_t)> fail_unmap_;
  int failed_unmaps_ = 0;
  std::function<bool(const void*)> fail_after_copy_;
  std::thread::id armed_thread_;  // its next record_event fails; none when default
  int failed_records_ = 0;
  long events_alive_ = 0;
  std::function<bool(const void*)> damage_;
  int damage_countdown_ = 0;
  std::function<bool(const void*)> hold_;
  std::shared_future<void> released_;
};

}  // namespace zeroalloc::testing
