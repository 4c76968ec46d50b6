#include "profile/report.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <nlohmann/json.hpp>

#include "alloc/caching_allocator.hpp"
#include "core/errors.hpp"
#include "core/log.hpp"
#include "core/passthrough.hpp"
#include "core/units.hpp"

namespace zeroalloc {

extern const char* const kReportTemplate;  // report_template.cpp, generated from the .html

namespace {

// Objects keep the order they are written in: the JSON reads top-down like the page.
using json = nlohmann::ordered_json;

constexpr std::size_t kMaxSamples = 4096;
constexpr std::size_t kMaxStepRecords = 512;  // Note [Step records]
constexpr std::uint64_t kWake = 1;            // SIGUSR1 or stop(); g_signal_pending tells which

// The eventfd the SIGUSR1 handler writes to: a handler may only do async-signal-safe work.
std::atomic<int> g_signal_fd{-1};
std::atomic<bool> g_signal_pending{false};

void on_sigusr1(int) {
  g_signal_pending.store(true, std::memory_order_relaxed);
  const int fd = g_signal_fd.load(std::memory_order_relaxed);
  if (fd >= 0) {
    const std::uint64_t value = kWake;
    [[maybe_unused]] const ssize_t written = ::write(fd, &value, sizeof value);
  }
}

std::int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string timestamp() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

// Writes `text` to `path` through a temporary file and a rename, so a reader never sees a
// half-written report and a failed write leaves the previous one intact.
std::optional<std::string> write_file(const std::string& path, const std::string& text) {
  // Per process: ranks that share a prefix must not write into one another's temporary.
  const std::string temporary = detail::concat(path, ".tmp.", ::getpid());
  std::FILE* file = std::fopen(temporary.c_str(), "w");
  if (file == nullptr) return detail::concat(path, ": ", std::strerror(errno));
  // On the disk before the rename: renamed first, a crash could leave an empty file where
  // the previous report was.
  const bool written = std::fwrite(text.data(), 1, text.size(), file) == text.size() &&
                       std::fflush(file) == 0 && ::fsync(::fileno(file)) == 0;
  const int saved_errno = errno;
  if (std::fclose(file) != 0 || !written) {
    std::remove(temporary.c_str());
    return detail::concat(path, ": ", std::strerror(written ? errno : saved_errno));
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    std::remove(temporary.c_str());
    return detail::concat(path, ": ", std::strerror(errno));
  }
  return std::nullopt;
}

}  // namespace

reporter::reporter(std::string prefix, allocator_list allocators, settings_list settings,
                   unsigned sample_interval_ms, tier_probe tiers)
    : prefix_(std::move(prefix)),
      allocators_(std::move(allocators)),
      settings_(std::move(settings)),
      interval_ms_(sample_interval_ms),
      tiers_(std::move(tiers)),
      started_ms_(now_ms()) {}

reporter::~reporter() { stop(); }

void reporter::start() {
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    log().warn(
        "report: no eventfd ({}): the timeline is not sampled and SIGUSR1 writes no "
        "report; reports at exit and on out-of-memory still come",
        std::strerror(errno));
    return;
  }
  struct sigaction current {};
  if (sigaction(SIGUSR1, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    g_signal_fd.store(wake_fd_);
    struct sigaction handler {};
    handler.sa_handler = on_sigusr1;
    sigemptyset(&handler.sa_mask);
    handler.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &handler, nullptr);
  } else {
    log().warn(
        "report: the program handles SIGUSR1 itself, so SIGUSR1 writes no zeroalloc "
        "report; reports at exit and on out-of-memory still come");
  }
  sampler_ = std::thread([this] { sample_loop(); });
}

void reporter::stop() {
  if (stopping_.exchange(true)) return;
  if (wake_fd_ >= 0) {
    const std::uint64_t value = kWake;
    [[maybe_unused]] const ssize_t written = ::write(wake_fd_, &value, sizeof value);
  }
  if (sampler_.joinable()) sampler_.join();
}

void reporter::sample_loop() {
  take_sample();
  while (!stopping_.load()) {
    pollfd waiting{wake_fd_, POLLIN, 0};
    const int ready = ::poll(&waiting, 1, static_cast<int>(interval_ms_.load()));
    if (ready > 0) {
      std::uint64_t value = 0;
      [[maybe_unused]] const ssize_t drained = ::read(wake_fd_, &value, sizeof value);
      if (g_signal_pending.exchange(false) && !stopping_.load()) write("SIGUSR1");
      continue;
    }
    take_sample();
  }
}

// Note [Held under the limit]: a program may change its limit while it runs (the demo
// replays a trace unlimited, then under a limit; PyTorch's
// set_per_process_memory_fraction). The most the device held over the whole run would then
// read as a limit broken. So the summary and the page give what the device held under the
// last limit, from when it took effect, and the most it held before, apart.
reporter::held_under_limit reporter::held_of(const std::vector<sample>& series,
                                             const std::vector<std::uint64_t>& times_ms) {
  held_under_limit held;
  std::size_t since = series.size();
  while (since > 0 && series[since - 1].limit == series.back().limit) --since;
  for (std::size_t i = 0; i < series.size(); ++i) {
    std::int64_t& most = i < since ? held.device_before : held.device;
    most = std::max(most, series[i].device);
    held.host = std::max(held.host, series[i].host);
  }
  if (since > 0 && since < times_ms.size()) held.since_ms = times_ms[since];
  return held;
}

void reporter::take_sample() {
  std::lock_guard lock(mutex_);
  const std::vector<caching_allocator*> allocators = allocators_();
  if (times_ms_.size() >= kMaxSamples) {
    // Keep every other sample and sample half as often: the timeline covers the whole run
    // in bounded memory.
    auto thin = [](auto& values) {
      for (std::size_t i = 0; 2 * i < values.size(); ++i) values[i] = values[2 * i];
      values.resize((values.size() + 1) / 2);
    };
    thin(times_ms_);
    for (auto& [ordinal, series] : samples_) thin(series);
    interval_ms_.store(interval_ms_.load() * 2);
  }
  times_ms_.push_back(static_cast<std::uint64_t>(now_ms() - started_ms_));
  for (caching_allocator* each : allocators) {
    const int ordinal = each->backing().ordinal();
    auto found = std::find_if(samples_.begin(), samples_.end(),
                              [&](const auto& entry) { return entry.first == ordinal; });
    if (found == samples_.end()) {
      // Nothing was held before the device started; its limit was the one it starts with.
      sample before_start;
      before_start.limit = static_cast<std::int64_t>(each->limit_bytes());
      samples_.emplace_back(ordinal, std::vector<sample>(times_ms_.size() - 1, before_start));
      found = std::prev(samples_.end());
    }
    const stats_snapshot figures = each->stats();
    sample taken;
    taken.allocated = figures.total.allocated_bytes.current;
    taken.reserved = figures.total.reserved_bytes.current;
    taken.device = static_cast<std::int64_t>(each->held_bytes());
    taken.limit = static_cast<std::int64_t>(each->limit_bytes());
    if (tiers_.host_resident_bytes) {
      taken.host = static_cast<std::int64_t>(tiers_.host_resident_bytes(ordinal));
    }
    found->second.push_back(taken);
  }
}

std::vector<reporter::device_reading> reporter::read_devices() const {
  std::vector<device_reading> readings;
  for (caching_allocator* each : allocators_()) {
    device_reading reading;
    reading.ordinal = each->backing().ordinal();
    if (tiers_.counters) reading.tier = tiers_.counters(reading.ordinal);
    const stats_snapshot figures = each->stats();
    for (const allocation_class cls : kAllocationClasses) {
      const std::size_t slot = class_index(cls);
      // A class's segments are on the device but for the chunks moved to the host.
      reading.device_class_bytes[slot] = std::max<std::int64_t>(
          0, figures.of(cls).reserved_bytes.current -
                 static_cast<std::int64_t>(reading.tier.host_resident_class_bytes[slot]));
    }
    readings.push_back(reading);
  }
  return readings;
}

reporter::step_record reporter::step_since_boundary(const std::vector<device_reading>& readings,
                                                    std::int64_t now) const {
  step_record step;
  step.first_step = step.last_step = steps_.empty() ? 1 : steps_.back().last_step + 1;
  step.start_ms = steps_.empty() ? 0 : steps_.back().end_ms;
  step.end_ms = now;
  for (const device_reading& reading : readings) {
    tier_counters before;  // zero: the device started during this step
    for (const device_reading& earlier : at_last_boundary_) {
      if (earlier.ordinal == reading.ordinal) before = earlier.tier;
    }
    device_step did;
    did.ordinal = reading.ordinal;
    did.device_class_bytes = reading.device_class_bytes;
    did.host_class_bytes = reading.tier.host_resident_class_bytes;
    // Never below zero: a report's reading of the step under way may be older than a
    // boundary another thread recorded meanwhile.
    const auto since = [](std::uint64_t now, std::uint64_t then) {
      return now > then ? now - then : 0;
    };
    did.bytes_to_host = since(reading.tier.bytes_to_host, before.bytes_to_host);
    did.bytes_to_device = since(reading.tier.bytes_to_device, before.bytes_to_device);
    did.device_waited_ns = since(reading.tier.device_waited_ns, before.device_waited_ns);
    did.waited_for_room_ns = since(reading.tier.waited_for_room_ns, before.waited_for_room_ns);
    did.waited_for_moves_ns = since(reading.tier.waited_for_moves_ns, before.waited_for_moves_ns);
    did.disk_resident_bytes = reading.tier.disk_resident_bytes;
    did.bytes_to_disk = since(reading.tier.bytes_to_disk, before.bytes_to_disk);
    did.bytes_from_disk = since(reading.tier.bytes_from_disk, before.bytes_from_disk);
    did.disk_ns = since(reading.tier.disk_ns, before.disk_ns);
    step.devices.push_back(did);
  }
  return step;
}

void reporter::step_ended() noexcept {
  try {
    const std::vector<device_reading> readings = read_devices();
    std::lock_guard lock(mutex_);
    step_record step = step_since_boundary(readings, now_ms() - started_ms_);
    at_last_boundary_ = readings;
    // `later` (the steps right after `into`'s) joins `into`: the traffic adds up, what is
    // resident is what it was at the end.
    const auto merge = [](step_record& into, const step_record& later) {
      into.last_step = later.last_step;
      into.end_ms = later.end_ms;
      for (const device_step& did : later.devices) {
        auto found =
            std::find_if(into.devices.begin(), into.devices.end(),
                         [&](const device_step& each) { return each.ordinal == did.ordinal; });
        if (found == into.devices.end()) {
          into.devices.push_back(did);
          continue;
        }
        found->device_class_bytes = did.device_class_bytes;
        found->host_class_bytes = did.host_class_bytes;
        found->bytes_to_host += did.bytes_to_host;
        found->bytes_to_device += did.bytes_to_device;
        found->device_waited_ns += did.device_waited_ns;
        found->waited_for_room_ns += did.waited_for_room_ns;
        found->waited_for_moves_ns += did.waited_for_moves_ns;
        found->disk_resident_bytes = did.disk_resident_bytes;
        found->bytes_to_disk += did.bytes_to_disk;
        found->bytes_from_disk += did.bytes_from_disk;
        found->disk_ns += did.disk_ns;
      }
    };
    if (!steps_.empty() &&
        steps_.back().last_step - steps_.back().first_step + 1 < steps_per_record_) {
      merge(steps_.back(), step);
    } else {
      steps_.push_back(std::move(step));
    }
    if (steps_.size() > kMaxStepRecords) {
      // Neighbours merge, and later records each cover as many steps.
      std::size_t kept = 0;
      for (std::size_t i = 0; i < steps_.size(); i += 2, ++kept) {
        step_record joined = std::move(steps_[i]);
        if (i + 1 < steps_.size()) merge(joined, steps_[i + 1]);
        steps_[kept] = std::move(joined);
      }
      steps_.resize(kept);
      steps_per_record_ *= 2;
    }
  } catch (const std::exception& failure) {
    log().warn("report: recording a step failed: {}", failure.what());
  } catch (...) {
  }
}

void reporter::set_section(const std::string& name, const std::string& json_text) {
  ZA_REQUIRE(!name.empty(), "a report section needs a name");
  json parsed = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (!parsed.is_object()) {
    ZA_THROW(invalid_argument, "report section '", name,
             "': not a JSON object: ", json_text.substr(0, 80));
  }
  std::lock_guard lock(mutex_);
  for (auto& [existing, value] : sections_) {
    if (existing == name) {
      value = std::move(parsed);
      return;
    }
  }
  sections_.emplace_back(name, std::move(parsed));
}

std::string reporter::build_json(const std::string& reason) const {
  json report;
  report["version"] = ZEROALLOC_VERSION;
  report["reason"] = reason;
  report["time"] = timestamp();
  report["pid"] = ::getpid();
  // Each part is built whole, then added: a reference into `report` would dangle once a
  // later key is added (an ordered_json object is a vector).
  json settings = json::object();
  for (const auto& [name, value] : settings_) settings[name] = value;
  report["settings"] = std::move(settings);
  json devices = json::array();
  for (caching_allocator* each : allocators_()) {
    const int ordinal = each->backing().ordinal();
    json largest = json::array();
    for (const auto& record : each->largest_allocations(20)) {
      largest.push_back({{"address", record.address},
                         {"size", record.bytes},
                         {"class", std::string(class_name(record.cls))}});
    }
    devices.push_back({{"device", ordinal},
                       {"stats", each->stats_json()},
                       {"offload", tiers_.offload_json ? tiers_.offload_json(ordinal) : json()},
                       {"largest_allocations", std::move(largest)}});
  }
  report["devices"] = std::move(devices);
  report["passthrough"] = passthrough_figures();
  const std::vector<device_reading> readings = read_devices();  // before the lock
  std::lock_guard lock(mutex_);
  report["last_out_of_memory"] =
      last_out_of_memory_
          ? json{{"time", last_out_of_memory_->time}, {"message", last_out_of_memory_->message}}
          : json();
  json timeline;
  timeline["interval_ms"] = interval_ms_.load();
  timeline["t_ms"] = times_ms_;
  json series_by_device = json::object();
  for (const auto& [ordinal, series] : samples_) {
    json allocated = json::array();
    json reserved = json::array();
    json device = json::array();
    json host = json::array();
    json limit = json::array();
    bool offloaded = false;
    for (const sample& each : series) {
      allocated.push_back(each.allocated);
      reserved.push_back(each.reserved);
      device.push_back(each.device);
      host.push_back(each.host);
      limit.push_back(each.limit);
      offloaded = offloaded || each.host != 0;
    }
    // "device": physical device memory held; "host": bytes offloaded to host memory, shown
    // when anything was.
    json of_device;
    of_device["allocated"] = std::move(allocated);
    of_device["reserved"] = std::move(reserved);
    of_device["device"] = std::move(device);
    if (offloaded) of_device["host"] = std::move(host);
    of_device["limit"] = std::move(limit);
    series_by_device[std::to_string(ordinal)] = std::move(of_device);
  }
  timeline["devices"] = std::move(series_by_device);
  report["timeline"] = std::move(timeline);
  // Note [Step records]: the steps that ended, then the one under way (when steps are known).
  const auto step_json = [](const step_record& step, bool ended) {
    json of_devices = json::object();
    for (const device_step& did : step.devices) {
      json resident = json::object();
      json on_host = json::object();
      for (const allocation_class cls : kAllocationClasses) {
        resident[std::string(class_name(cls))] = did.device_class_bytes[class_index(cls)];
        on_host[std::string(class_name(cls))] = did.host_class_bytes[class_index(cls)];
      }
      of_devices[std::to_string(did.ordinal)] = {{"device_class_bytes", std::move(resident)},
                                                 {"host_class_bytes", std::move(on_host)},
                                                 {"bytes_to_host", did.bytes_to_host},
                                                 {"bytes_to_device", did.bytes_to_device},
                                                 {"device_waited_ns", did.device_waited_ns},
                                                 {"waited_for_room_ns", did.waited_for_room_ns},
                                                 {"waited_for_moves_ns", did.waited_for_moves_ns},
                                                 {"disk_resident_bytes", did.disk_resident_bytes},
                                                 {"bytes_to_disk", did.bytes_to_disk},
                                                 {"bytes_from_disk", did.bytes_from_disk},
                                                 {"disk_ns", did.disk_ns}};
    }
    return json{{"first_step", step.first_step},
                {"last_step", step.last_step},
                {"start_ms", step.start_ms},
                {"end_ms", step.end_ms},
                {"ended", ended},
                {"devices", std::move(of_devices)}};
  };
  json steps = json::array();
  for (const step_record& step : steps_) steps.push_back(step_json(step, true));
  if (!steps_.empty()) {
    steps.push_back(step_json(step_since_boundary(readings, now_ms() - started_ms_), false));
  }
  report["steps"] = std::move(steps);
  json sections = json::object();
  for (const auto& [name, value] : sections_) sections[name] = value;
  report["sections"] = std::move(sections);
  // Strings the library did not make (settings, device names) may hold bytes that are not
  // UTF-8: replaced, not an exception that would lose the report.
  return report.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::optional<std::string> reporter::render_file(const std::string& json_path,
                                                 const std::string& html_path) {
  std::FILE* file = std::fopen(json_path.c_str(), "r");
  if (file == nullptr) return detail::concat("cannot read ", json_path, ": ", std::strerror(errno));
  std::string json;
  char chunk[65536];
  for (std::size_t got; (got = std::fread(chunk, 1, sizeof chunk, file)) > 0;)
    json.append(chunk, got);
  const bool failed = std::ferror(file) != 0;
  std::fclose(file);
  if (failed || json.find('{') == std::string::npos) {
    return detail::concat(json_path, " is not a zeroalloc report (empty or unreadable)");
  }
  return write_file(html_path, render_html(json));
}

std::string reporter::render_html(std::string_view report_json) {
  // Inline the JSON in a script element: "</" must not close it early.
  std::string safe;
  safe.reserve(report_json.size());
  for (std::size_t i = 0; i < report_json.size(); ++i) {
    safe += report_json[i];
    if (report_json[i] == '<' && i + 1 < report_json.size() && report_json[i + 1] == '/')
      safe += '\\';
  }
  std::string page = kReportTemplate;
  const std::string_view marker = "/*ZEROALLOC_REPORT_JSON*/";
  const std::size_t at = page.find(marker);
  if (at != std::string::npos) page.replace(at, marker.size(), safe);
  return page;
}

void reporter::out_of_memory(const std::string& message) {
  {
    std::lock_guard lock(mutex_);
    last_out_of_memory_ = out_of_memory_note{timestamp(), message};
    // Frameworks probe (cuDNN tries workspace sizes until one fits): one report per
    // burst of failures, not one per failure.
    const std::int64_t now = now_ms();
    if (last_out_of_memory_report_ms_ != 0 && now - last_out_of_memory_report_ms_ < 10'000) return;
    last_out_of_memory_report_ms_ = now;
  }
  write_to(prefix_ + ".oom", "out of memory: " + message);
}

std::optional<std::string> reporter::write(const std::string& reason) {
  return write_to(prefix_, reason);
}

std::optional<std::string> reporter::write_to(const std::string& prefix,
                                              const std::string& reason) {
  try {
    take_sample();  // the report ends at the moment it is written
    const std::string json = build_json(reason);
    std::lock_guard lock(mutex_);  // one writer at a time
    std::optional<std::string> failure = write_file(prefix + ".json", json);
    if (!failure) failure = write_file(prefix + ".html", render_html(json));
    if (failure) {
      const std::string message = detail::concat(
          "report: cannot write ", *failure,
          ". Set ZEROALLOC_REPORT to a path prefix in a writable directory; training goes on.");
      log().warn("{}", message);
      return message;
    }
    for (caching_allocator* each : allocators_()) {
      const stats_snapshot figures = each->stats();
      // The device first, as the page leads: what it held and what the host held, from the
      // timeline; the allocated and reserved bytes are addresses, wherever their bytes are.
      held_under_limit held;
      for (const auto& [ordinal, series] : samples_) {
        if (ordinal == each->backing().ordinal()) held = held_of(series, times_ms_);
      }
      std::string limit = format_bytes(each->limit_bytes());
      std::string device = format_bytes(static_cast<std::uint64_t>(held.device));
      if (held.since_ms) {  // Note [Held under the limit]
        limit += fmt::format(" from {:.1f} s", static_cast<double>(*held.since_ms) / 1000.0);
        device += detail::concat(" under it (",
                                 format_bytes(static_cast<std::uint64_t>(held.device_before)),
                                 " before)");
      }
      log().warn(
          "report ({}): {}: limit {}; the device held at most {}, the host at most {}; "
          "virtual: peak allocated {}, peak reserved {}; {} allocations, {} retries, {} "
          "failures; written to {}.json and {}.html",
          reason, each->backing().name(), limit, device,
          format_bytes(static_cast<std::uint64_t>(held.host)),
          format_bytes(static_cast<std::uint64_t>(figures.total.allocated_bytes.lifetime_peak)),
          format_bytes(static_cast<std::uint64_t>(figures.total.reserved_bytes.lifetime_peak)),
          figures.total.allocations, figures.total.retries, figures.total.failures, prefix, prefix);
    }
    return std::nullopt;
  } catch (const std::exception& failure) {
    log().warn("report: writing it failed: {}", failure.what());
    return std::string(failure.what());
  }
}

}  // namespace zeroalloc
