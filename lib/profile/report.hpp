// Memory reports (ZEROALLOC_REPORT=path/prefix): prefix.json with the settings, per-device
// and per-class figures, a sampled timeline of allocated and reserved bytes and the largest
// live allocations; prefix.html, one self-contained page (no network) that draws the
// timeline and the tables from that JSON; and a short summary in the log. Written at exit,
// when an allocation fails out of memory, and on SIGUSR1.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace zeroalloc {

class caching_allocator;

class reporter {
 public:
  /// The allocators to report on (those started so far), asked at each sample and report.
  using allocator_list = std::function<std::vector<caching_allocator*>()>;
  /// Variable name and value of every setting the report shows.
  using settings_list = std::vector<std::pair<std::string, std::string>>;
  /// The offload tiers of a device, when there are any (Note [Host budget]).
  struct tier_probe {
    /// The device's offload figures as a JSON object, or "null".
    std::function<std::string(int ordinal)> offload_json;
    /// Bytes of the device's allocations that are in host memory now.
    std::function<std::uint64_t(int ordinal)> host_resident_bytes;
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

  /// Writes prefix.json and prefix.html now and logs the summary. Never throws. Returns
  /// the failure (naming the path and what to do) when a file could not be written; the
  /// program goes on either way.
  std::optional<std::string> write(const std::string& reason);
  /// An allocation is failing out of memory with `message`: writes prefix.oom.json and
  /// prefix.oom.html (at most one pair per 10 s), and later reports carry the message.
  void out_of_memory(const std::string& message);

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
  };
  // device ordinal -> samples, aligned with times_ms_
  std::vector<std::pair<int, std::vector<sample>>> samples_;
  const tier_probe tiers_;
  std::int64_t started_ms_ = 0;
  std::atomic<bool> stopping_{false};
  int wake_fd_ = -1;  // eventfd: SIGUSR1 and stop() wake the sampler
  std::thread sampler_;
};

}  // namespace zeroalloc
