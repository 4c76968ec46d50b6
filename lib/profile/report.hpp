// Memory reports (ZEROALLOC_REPORT=path/prefix): prefix.json with the settings, per-device
// and per-class figures, a sampled timeline of allocated and reserved bytes and of the limit
// in force, the training steps (Note [Step records]) and the largest live allocations;
// prefix.html, one self-contained page (no network) that draws the timeline and the tables
// from that JSON; and a short summary in the log. Written at exit, when an allocation fails
// out of memory, and on SIGUSR1.
//
// Note [Step records]: a program that trains says where each step ends
// (zeroalloc_step_boundary, which the optimizer step of zeroalloc.torch.offload() calls, and
// which teaches the offload engine its order). The reporter then records the moment and, per
// device, what each allocation class holds on the device and on the host and the offload
// tier's counters, so that a report shows per step what was resident, what moved each way,
// how long the device waited for it and how long the program's threads waited in the
// engine (for room, and for moves of the chunks they were about to use to settle: where
// the step's time goes when activations themselves must leave). Steps are where programs repeat
// themselves: a difference between two steps is what a user looks for. The records are
// bounded as the timeline is: past kMaxStepRecords, neighbours merge (steps 1-2, 3-4, ...)
// and later records each cover as many steps.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "alloc/allocation_class.hpp"

namespace zeroalloc {

class caching_allocator;

class reporter {
 public:
  /// The allocators to report on (those started so far), asked at each sample and report.
  using allocator_list = std::function<std::vector<caching_allocator*>()>;
  /// Variable name and value of every setting the report shows.
  using settings_list = std::vector<std::pair<std::string, std::string>>;
  /// A device's offload tier as a step record reads it: what it holds now, and its
  /// counters since the start.
  struct tier_counters {
    /// Bytes of each allocation class (class_index) in host memory now.
    std::array<std::uint64_t, kAllocationClassCount> host_resident_class_bytes{};
    std::uint64_t bytes_to_host = 0;
    std::uint64_t bytes_to_device = 0;
    std::uint64_t device_waited_ns = 0;     ///< streams waiting for fetched bytes
    std::uint64_t waited_for_room_ns = 0;   ///< the program's threads: use hints waiting for room
    std::uint64_t waited_for_moves_ns = 0;  ///< ... for moves of their chunks to settle
    // The disk tier (zero without one).
    std::uint64_t disk_resident_bytes = 0;  ///< bytes of chunks on disk now
    std::uint64_t bytes_to_disk = 0;
    std::uint64_t bytes_from_disk = 0;
    std::uint64_t disk_ns = 0;  ///< time moving chunks to and from the disk
  };
  /// The offload tiers of a device, when there are any (Note [Host budget]).
  struct tier_probe {
    /// The device's offload figures as a JSON object, or null.
    std::function<nlohmann::ordered_json(int ordinal)> offload_json;
    /// Bytes of the device's allocations that are in host memory now (read at each sample).
    std::function<std::uint64_t(int ordinal)> host_resident_bytes;
    /// The device's tier counters (read at step boundaries and reports).
    std::function<tier_counters(int ordinal)> counters;
  };

  reporter(std::string prefix, allocator_list allocators, settings_list settings,
           unsigned sample_interval_ms = 200, tier_probe tiers = {});
  ~reporter();
  reporter(const reporter&) = delete;
  reporter& operator=(const reporter&) = delete;

  /// Starts the sampling thread and, unless the program handles SIGUSR1 itself, makes
  /// SIGUSR1 write a report.
  void start();
  /// Stops sampling (the last report is written by the caller).
  void stop();

  /// A training step ended and the next begins now (Note [Step records]). Never throws.
  void step_ended() noexcept;

  /// Writes prefix.json and prefix.html now and logs the summary. Never throws. Returns
  /// the failure (naming the path and what to do) when a file could not be written; the
  /// program goes on either way.
  std::optional<std::string> write(const std::string& reason);
  /// An allocation is failing out of memory with `message`: writes prefix.oom.json and
  /// prefix.oom.html (at most one pair per 10 s), and later reports carry the message.
  void out_of_memory(const std::string& message);

  /// Sets the report's section `name` (under "sections") to the JSON object `json_text`,
  /// replacing what it held: what a layer above the library knows (the Python package's
  /// ZeRO partition, say). Throws invalid_argument naming the problem when `json_text` is
  /// not a JSON object.
  void set_section(const std::string& name, const std::string& json_text);

  /// The report as JSON.
  [[nodiscard]] std::string build_json(const std::string& reason) const;
  /// The page for a report's JSON: the embedded template with the JSON inlined.
  static std::string render_html(std::string_view report_json);
  /// Renders the page of the report at `json_path` into `html_path`; the failure, if any.
  static std::optional<std::string> render_file(const std::string& json_path,
                                                const std::string& html_path);

 private:
  std::optional<std::string> write_to(const std::string& prefix, const std::string& reason);
  void sample_loop();
  void take_sample();

  /// One device at a step boundary, or at a report for the step under way.
  struct device_reading {
    int ordinal = 0;
    std::array<std::int64_t, kAllocationClassCount> device_class_bytes{};  // reserved on device
    tier_counters tier;
  };
  /// Reads every started device; takes no lock of the reporter's (the tiers take theirs).
  [[nodiscard]] std::vector<device_reading> read_devices() const;
  /// What a device did during a step (or during several merged, Note [Step records]).
  struct device_step {
    int ordinal = 0;
    std::array<std::int64_t, kAllocationClassCount> device_class_bytes{};  // at the step's end
    std::array<std::uint64_t, kAllocationClassCount> host_class_bytes{};   // at the step's end
    std::uint64_t bytes_to_host = 0;
    std::uint64_t bytes_to_device = 0;
    std::uint64_t device_waited_ns = 0;
    std::uint64_t waited_for_room_ns = 0;
    std::uint64_t waited_for_moves_ns = 0;
    std::uint64_t disk_resident_bytes = 0;  // at the step's end
    std::uint64_t bytes_to_disk = 0;
    std::uint64_t bytes_from_disk = 0;
    std::uint64_t disk_ns = 0;
  };
  struct step_record {
    std::uint64_t first_step = 0;  // counted from 1
    std::uint64_t last_step = 0;
    std::int64_t start_ms = 0;  // since the reporter started, as the timeline's times
    std::int64_t end_ms = 0;
    std::vector<device_step> devices;
  };
  /// The step from the last boundary to `reading`, at `now_ms`; mutex_ held.
  [[nodiscard]] step_record step_since_boundary(const std::vector<device_reading>& reading,
                                                std::int64_t now_ms) const;

  const std::string prefix_;
  const allocator_list allocators_;
  const settings_list settings_;
  std::atomic<unsigned> interval_ms_;
  struct out_of_memory_note {
    std::string time;
    std::string message;
  };
  std::optional<out_of_memory_note> last_out_of_memory_;
  std::int64_t last_out_of_memory_report_ms_ = 0;
  mutable std::mutex mutex_;  // timeline and writes
  std::vector<std::uint64_t> times_ms_;
  struct sample {
    std::int64_t allocated = 0;
    std::int64_t reserved = 0;
    std::int64_t device = 0;  // physical device memory held
    std::int64_t host = 0;    // bytes offloaded to host memory
    std::int64_t limit = 0;   // the limit in force (ZEROALLOC_MEMORY_LIMIT, or the device's total)
  };
  // Note [Held under the limit]: what one device held, from its samples.
  struct held_under_limit {
    std::int64_t device = 0;                // the most the device held under the last limit
    std::int64_t device_before = 0;         // ... before that limit took effect
    std::int64_t host = 0;                  // the most the host held
    std::optional<std::uint64_t> since_ms;  // when the last limit took effect, if it changed
  };
  static held_under_limit held_of(const std::vector<sample>& series,
                                  const std::vector<std::uint64_t>& times_ms);
  // device ordinal -> samples, aligned with times_ms_
  std::vector<std::pair<int, std::vector<sample>>> samples_;
  const tier_probe tiers_;
  std::vector<step_record> steps_;
  std::vector<std::pair<std::string, nlohmann::ordered_json>> sections_;  // set_section
  std::uint64_t steps_per_record_ = 1;
  std::uint64_t steps_ended_ = 0;
  std::vector<device_reading> at_last_boundary_;  // at the start when no step has ended
  std::int64_t started_ms_ = 0;
  std::atomic<bool> stopping_{false};
  int wake_fd_ = -1;  // eventfd: SIGUSR1 and stop() wake the sampler
  std::thread sampler_;
};

}  // namespace zeroalloc
