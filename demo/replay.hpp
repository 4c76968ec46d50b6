// Replays an allocation trace through zeroalloc's C ABI and collects its statistics.
//
// Only include/zeroalloc/zeroalloc.h is used: the statistics come from
// zeroalloc_stats_json, read with the small JSON lookup below, so the demo and the
// benchmarks see exactly what any other user of the library sees.
#pragma once

#include <zeroalloc/zeroalloc.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "training_trace.hpp"

namespace zeroalloc::demo {

/// The figures zeroalloc reports for one allocation class, or for all of them.
struct allocator_figures {
  std::uint64_t allocated_bytes = 0;
  std::uint64_t allocated_peak_bytes = 0;
  std::uint64_t reserved_bytes = 0;
  std::uint64_t reserved_peak_bytes = 0;
  std::uint64_t active_bytes = 0;
  std::uint64_t active_peak_bytes = 0;
  std::uint64_t allocations = 0;
  std::uint64_t frees = 0;
  std::uint64_t cache_hits = 0;
  std::uint64_t retries = 0;
  std::uint64_t failures = 0;
  std::uint64_t largest_free_block_bytes = 0;
  std::uint64_t fragmentation_bytes = 0;
};

struct allocator_stats {
  allocator_figures total;
  std::array<allocator_figures, ZEROALLOC_CLASS_COUNT> by_class;  ///< indexed by zeroalloc_class
};

/// What the library says about a device (from its statistics).
struct device_description {
  std::string error;  ///< empty when the library answered
  int device = 0;
  std::string name;
  bool simulated = false;
  std::uint64_t limit_bytes = 0;
};

/// Starts the library if needed and describes `device`.
device_description describe_device(int device);

struct step_result {
  /// Currents at the end of the step; peaks since the end of the previous step (the
  /// replay resets zeroalloc's peaks at every step end).
  allocator_stats stats;
  std::uint64_t malloc_calls = 0;
  std::uint64_t free_calls = 0;
  double malloc_seconds = 0;  ///< inside zeroalloc_malloc_class
  double free_seconds = 0;    ///< inside zeroalloc_free
  bool complete = true;       ///< false: events after the last step_end
};

struct replay_result {
  /// Empty on success. Otherwise why the replay stopped (an allocation that failed, with
  /// zeroalloc_last_error(); a malformed trace; statistics that could not be read).
  std::string error;
  std::string device_name;
  bool simulated = false;
  std::uint64_t limit_bytes = 0;
  std::vector<step_result> steps;
  /// Currents after the last event; peaks are the highest of any step, i.e. over the whole
  /// replay. Read before the replay frees what the trace left allocated.
  allocator_stats final_stats;
  std::uint64_t malloc_calls = 0;
  std::uint64_t free_calls = 0;
  double malloc_seconds = 0;
  double free_seconds = 0;
  /// Statistics the library did not report (read as 0), e.g. "total.retries".
  std::vector<std::string> missing_statistics;
};

/// Creates one zeroalloc stream per stream the trace uses, issues every event through
/// zeroalloc_malloc_class / zeroalloc_free / zeroalloc_record_stream on `device`, reads
/// zeroalloc_stats_json at every step end, and at the end frees whatever the trace left
/// allocated (parameters, optimizer states) and destroys the streams. Stops at the first
/// failure, which `error` describes.
replay_result replay_through_zeroalloc(const std::vector<trace_event>& events, int device);

/// A minimal JSON lookup, enough for the library's statistics: the raw text of the value
/// at a dotted path of object keys ("total.allocated_bytes.peak"), or nothing when the
/// path is absent or the text is not well-formed up to that value.
std::optional<std::string_view> json_find(std::string_view json, std::string_view path);
std::optional<std::uint64_t> json_unsigned(std::string_view json, std::string_view path);
std::optional<bool> json_bool(std::string_view json, std::string_view path);
std::optional<std::string> json_string(std::string_view json, std::string_view path);

}  // namespace zeroalloc::demo
