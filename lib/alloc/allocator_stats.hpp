// Statistics of one device's allocator, per allocation class and in total.
//
// Byte figures (allocated, reserved, active) are gauges with a peak; counts only grow.
// Gauges are updated with relaxed atomics from any heap's lock, so a reader sees each
// figure exact but two figures not necessarily from the same instant.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

#include "alloc/allocation_class.hpp"

namespace zeroalloc {

/// A byte count that remembers its highest value since the last reset.
class gauge {
 public:
  void add(std::int64_t delta) {
    const std::int64_t now = current_.fetch_add(delta, std::memory_order_relaxed) + delta;
    std::int64_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
  [[nodiscard]] std::int64_t current() const { return current_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::int64_t peak() const { return peak_.load(std::memory_order_relaxed); }
  void reset_peak() { peak_.store(current(), std::memory_order_relaxed); }

 private:
  std::atomic<std::int64_t> current_{0};
  std::atomic<std::int64_t> peak_{0};
};

/// Figures of one class, or of the whole device.
struct class_stats {
  gauge allocated_bytes;  ///< bytes of blocks handed out (rounded block sizes)
  gauge reserved_bytes;   ///< bytes of mapped segments
  gauge active_bytes;     ///< allocated, plus freed blocks still waiting for other streams
  std::atomic<std::uint64_t> allocations{0};
  std::atomic<std::uint64_t> frees{0};
  std::atomic<std::uint64_t> cache_hits{0};  ///< allocations served without new memory
  std::atomic<std::uint64_t> retries{0};     ///< allocations that released cache and retried
  std::atomic<std::uint64_t> failures{0};    ///< allocations that failed out of memory
  std::atomic<std::uint64_t> segments_mapped{0};
  std::atomic<std::uint64_t> segments_unmapped{0};

  void reset_peaks() {
    allocated_bytes.reset_peak();
    reserved_bytes.reset_peak();
    active_bytes.reset_peak();
  }
};

/// One device's statistics: per class, and totals over all classes.
struct allocator_stats {
  std::array<class_stats, kAllocationClassCount> classes;
  class_stats total;

  /// Applies `update` to the class's figures and the totals.
  template <typename Update>
  void apply(allocation_class cls, Update&& update) {
    update(classes[class_index(cls)]);
    update(total);
  }
  void reset_peaks() {
    for (class_stats& figures : classes) figures.reset_peaks();
    total.reset_peaks();
  }
};

}  // namespace zeroalloc
