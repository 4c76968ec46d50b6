// Statistics of one device's allocator, per allocation class and in total.
//
// Note [Statistics cost]: the fast path may not pay for bookkeeping. Counts (allocations,
// frees, cache hits) live in each heap as plain integers under the heap's lock and are
// summed when read. Only the byte gauges that need an exact peak across heaps (allocated,
// per class and in total) are atomics: two relaxed additions per allocation or free, and a
// compare-exchange only when a new peak is reached. Active bytes (allocated plus freed
// blocks still waiting for other streams) are derived from them and from the rarely moving
// pending bytes, so they cost nothing on the fast path.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>

#include "alloc/allocation_class.hpp"

namespace zeroalloc {

/// A byte count that remembers its highest value since the last reset, and since it began
/// (reports are about the whole run, whatever the program reset).
class gauge {
 public:
  /// Adds `delta` and returns the new value.
  std::int64_t add(std::int64_t delta) {
    const std::int64_t now = current_.fetch_add(delta, std::memory_order_relaxed) + delta;
    if (delta > 0) raise_peak(now);
    return now;
  }
  /// Raises the peak to `value` if it is higher.
  void raise_peak(std::int64_t value) {
    std::int64_t peak = peak_.load(std::memory_order_relaxed);
    if (value <= peak) return;  // the common case: one load
    while (value > peak && !peak_.compare_exchange_weak(peak, value, std::memory_order_relaxed)) {
    }
    std::int64_t lifetime = lifetime_peak_.load(std::memory_order_relaxed);
    while (value > lifetime &&
           !lifetime_peak_.compare_exchange_weak(lifetime, value, std::memory_order_relaxed)) {
    }
  }
  [[nodiscard]] std::int64_t current() const { return current_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::int64_t peak() const { return peak_.load(std::memory_order_relaxed); }
  /// The highest value ever, resets or not.
  [[nodiscard]] std::int64_t lifetime_peak() const {
    return lifetime_peak_.load(std::memory_order_relaxed);
  }
  void reset_peak(std::int64_t to) { peak_.store(to, std::memory_order_relaxed); }

 private:
  std::atomic<std::int64_t> current_{0};
  std::atomic<std::int64_t> peak_{0};
  std::atomic<std::int64_t> lifetime_peak_{0};
};

/// The live gauges of one class, or of the whole device.
struct live_gauges {
  gauge allocated_bytes;  ///< bytes of blocks handed out (rounded block sizes)
  gauge reserved_bytes;   ///< bytes of mapped segments
  gauge pending_bytes;    ///< freed, waiting for events on other streams
  gauge active_peak;      ///< only its peak is used: allocated + pending at its highest
  std::atomic<std::uint64_t> retries{0};   ///< allocations that released cache and retried
  std::atomic<std::uint64_t> failures{0};  ///< allocations that failed out of memory

  /// After allocated_bytes rose to `allocated_now`.
  void note_active(std::int64_t allocated_now) {
    active_peak.raise_peak(allocated_now + pending_bytes.current());
  }
};

/// Counts kept by each heap under its lock (Note [Statistics cost]).
struct heap_counts {
  std::uint64_t allocations = 0;
  std::uint64_t frees = 0;
  std::uint64_t cache_hits = 0;  ///< allocations served without new memory
  std::uint64_t segments_mapped = 0;
  std::uint64_t segments_unmapped = 0;
  std::uint64_t segments_donated = 0;  ///< fully free segments given to another heap
  std::uint64_t segments_split = 0;    ///< segments added by cutting free runs off others
};

/// A current value, its peak since the last reset, and its peak since the start.
struct gauge_figures {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t lifetime_peak = 0;
};

/// The figures of one class (or the total) at one moment, as reported.
struct class_figures {
  gauge_figures allocated_bytes;
  gauge_figures reserved_bytes;
  gauge_figures active_bytes;
  std::uint64_t allocations = 0;
  std::uint64_t frees = 0;
  std::uint64_t cache_hits = 0;
  std::uint64_t retries = 0;
  std::uint64_t failures = 0;
  std::uint64_t segments_mapped = 0;
  std::uint64_t segments_unmapped = 0;
  std::uint64_t segments_donated = 0;
  std::uint64_t segments_split = 0;
  std::uint64_t largest_free_block_bytes = 0;
  /// Reserved minus allocated: memory held but not handed out.
  [[nodiscard]] std::int64_t fragmentation_bytes() const {
    return reserved_bytes.current - allocated_bytes.current;
  }
};

/// What stats() returns: every class, and the device in total.
struct stats_snapshot {
  std::array<class_figures, kAllocationClassCount> classes;
  class_figures total;
  [[nodiscard]] const class_figures& of(allocation_class cls) const {
    return classes[class_index(cls)];
  }
};

/// The live statistics of one device: per class and in total.
struct allocator_stats {
  std::array<live_gauges, kAllocationClassCount> classes;
  live_gauges total;

  /// Applies `update` to the class's gauges and the totals.
  template <typename Update>
  void apply(allocation_class cls, Update&& update) {
    update(classes[class_index(cls)]);
    update(total);
  }
};

}  // namespace zeroalloc
