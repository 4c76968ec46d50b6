#include "replay.hpp"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>

namespace zeroalloc::demo {

namespace {

// Walks JSON text without building anything: enough to find one value by its path.
class json_cursor {
 public:
  explicit json_cursor(std::string_view text) : text_(text) {}

  std::optional<std::string_view> find(std::string_view path) {
    skip_space();
    while (!path.empty()) {
      const std::size_t dot = path.find('.');
      const std::string_view key = path.substr(0, dot);
      path = dot == std::string_view::npos ? std::string_view{} : path.substr(dot + 1);
      if (!enter_member(key)) return std::nullopt;
    }
    const std::size_t start = position_;
    if (!skip_value(0)) return std::nullopt;
    return text_.substr(start, position_ - start);
  }

 private:
  static constexpr int max_depth = 64;

  bool at_end() const { return position_ >= text_.size(); }
  char peek() const { return at_end() ? '\0' : text_[position_]; }

  void skip_space() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) {
      ++position_;
    }
  }

  bool consume(char expected) {
    skip_space();
    if (peek() != expected) return false;
    ++position_;
    skip_space();
    return true;
  }

  // Leaves the cursor after the closing quote; `content` gets the text between the
  // quotes, escapes undecoded (keys of the statistics have none).
  bool skip_string(std::string_view* content = nullptr) {
    if (peek() != '"') return false;
    const std::size_t start = ++position_;
    while (!at_end() && peek() != '"') position_ += peek() == '\\' ? 2 : 1;
    if (at_end()) return false;
    if (content != nullptr) *content = text_.substr(start, position_ - start);
    ++position_;
    return true;
  }

  bool skip_value(int depth) {
    if (depth > max_depth) return false;
    skip_space();
    const char first = peek();
    if (first == '"') return skip_string();
    if (first == '{' || first == '[') {
      const char closing = first == '{' ? '}' : ']';
      ++position_;
      if (consume(closing)) return true;
      do {
        if (first == '{' && !(skip_string() && consume(':'))) return false;
        if (!skip_value(depth + 1)) return false;
      } while (consume(','));
      return consume(closing);
    }
    const std::size_t start = position_;
    while (!at_end() && std::string_view(",}] \t\r\n").find(peek()) == std::string_view::npos) {
      ++position_;
    }
    return position_ > start;
  }

  // From the start of an object, moves to the value of `key`.
  bool enter_member(std::string_view key) {
    if (!consume('{')) return false;
    if (peek() == '}') return false;
    do {
      std::string_view name;
      if (!skip_string(&name) || !consume(':')) return false;
      if (name == key) return true;
      if (!skip_value(0)) return false;
    } while (consume(','));
    return false;
  }

  std::string_view text_;
  std::size_t position_ = 0;
};

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

const char* const class_keys[ZEROALLOC_CLASS_COUNT] = {"other", "parameter", "gradient",
                                                       "optimizer_state"};

const char* class_key(zeroalloc_class allocation_class) {
  const int index = static_cast<int>(allocation_class);
  return index >= 0 && index < ZEROALLOC_CLASS_COUNT ? class_keys[index] : "unknown class";
}

// Returns the statistics text, or nothing with `error` set.
std::optional<std::string> read_stats_json(int device, std::string& error) {
  std::string text(4096, '\0');
  for (int attempt = 0; attempt < 4; ++attempt) {
    const int length = zeroalloc_stats_json(device, text.data(), text.size());
    if (length < 0) {
      error = std::string("zeroalloc_stats_json failed: ") + zeroalloc_last_error();
      return std::nullopt;
    }
    if (static_cast<std::size_t>(length) < text.size()) {
      text.resize(static_cast<std::size_t>(length));
      return text;
    }
    text.assign(static_cast<std::size_t>(length) + 1, '\0');  // grew: try with room for NUL
  }
  error = "zeroalloc_stats_json kept growing";
  return std::nullopt;
}

class stats_parser {
 public:
  explicit stats_parser(std::vector<std::string>& missing) : missing_(missing) {}

  allocator_stats parse(std::string_view json) {
    allocator_stats stats;
    read_figures(json, "total", stats.total);
    for (int c = 0; c < ZEROALLOC_CLASS_COUNT; ++c) {
      read_figures(json, std::string("classes.") + class_keys[c], stats.by_class[c]);
    }
    return stats;
  }

 private:
  void read_figures(std::string_view json, const std::string& prefix, allocator_figures& out) {
    auto read = [&](const char* key, std::uint64_t& value) {
      const std::string path = prefix + "." + key;
      if (const auto number = json_unsigned(json, path)) {
        value = *number;
      } else if (std::find(missing_.begin(), missing_.end(), path) == missing_.end()) {
        missing_.push_back(path);
      }
    };
    read("allocated_bytes.current", out.allocated_bytes);
    read("allocated_bytes.peak", out.allocated_peak_bytes);
    read("reserved_bytes.current", out.reserved_bytes);
    read("reserved_bytes.peak", out.reserved_peak_bytes);
    read("active_bytes.current", out.active_bytes);
    read("active_bytes.peak", out.active_peak_bytes);
    read("allocations", out.allocations);
    read("frees", out.frees);
    read("cache_hits", out.cache_hits);
    read("retries", out.retries);
    read("failures", out.failures);
    read("largest_free_block_bytes", out.largest_free_block_bytes);
    read("fragmentation_bytes", out.fragmentation_bytes);
  }

  std::vector<std::string>& missing_;
};

void keep_highest_peaks(allocator_figures& into, const allocator_figures& step) {
  into.allocated_peak_bytes = std::max(into.allocated_peak_bytes, step.allocated_peak_bytes);
  into.reserved_peak_bytes = std::max(into.reserved_peak_bytes, step.reserved_peak_bytes);
  into.active_peak_bytes = std::max(into.active_peak_bytes, step.active_peak_bytes);
}

}  // namespace

std::optional<std::string_view> json_find(std::string_view json, std::string_view path) {
  return json_cursor(json).find(path);
}

std::optional<std::uint64_t> json_unsigned(std::string_view json, std::string_view path) {
  const auto raw = json_find(json, path);
  if (!raw) return std::nullopt;
  const char* const end = raw->data() + raw->size();
  std::uint64_t integer = 0;
  if (const auto parsed = std::from_chars(raw->data(), end, integer);
      parsed.ec == std::errc{} && parsed.ptr == end) {
    return integer;
  }
  // Counters written as 1.5e9 or 12.0 are still counters.
  double number = 0;
  if (const auto parsed = std::from_chars(raw->data(), end, number);
      parsed.ec == std::errc{} && parsed.ptr == end && number >= 0 && number < 1.8e19) {
    return static_cast<std::uint64_t>(std::llround(number));
  }
  return std::nullopt;
}

std::optional<bool> json_bool(std::string_view json, std::string_view path) {
  const auto raw = json_find(json, path);
  if (raw == "true") return true;
  if (raw == "false") return false;
  return std::nullopt;
}

std::optional<std::string> json_string(std::string_view json, std::string_view path) {
  const auto raw = json_find(json, path);
  if (!raw || raw->size() < 2 || raw->front() != '"') return std::nullopt;
  std::string text;
  const std::string_view content = raw->substr(1, raw->size() - 2);
  for (std::size_t i = 0; i < content.size(); ++i) {
    if (content[i] != '\\' || i + 1 == content.size()) {
      text += content[i];
      continue;
    }
    const char escaped = content[++i];
    switch (escaped) {
      case 'n':
        text += '\n';
        break;
      case 't':
        text += '\t';
        break;
      case 'u':
        // A device name has no need for anything beyond ASCII: show the rest as '?'.
        text += '?';
        i += std::min<std::size_t>(4, content.size() - 1 - i);
        break;
      default:
        text += escaped;  // \" \\ \/ and the rarer ones, close enough for display
    }
  }
  return text;
}

device_description describe_device(int device) {
  device_description description;
  description.device = device;
  const auto json = read_stats_json(device, description.error);
  if (!json) return description;
  description.name = json_string(*json, "device_name").value_or("(unnamed device)");
  description.simulated = json_bool(*json, "simulated").value_or(false);
  description.limit_bytes = json_unsigned(*json, "limit_bytes").value_or(0);
  return description;
}

replay_result replay_through_zeroalloc(const std::vector<trace_event>& events, int device) {
  replay_result result;
  const device_description description = describe_device(device);
  if (!description.error.empty()) {
    result.error = description.error;
    return result;
  }
  result.device_name = description.name;
  result.simulated = description.simulated;
  result.limit_bytes = description.limit_bytes;

  int stream_count = 1;
  std::uint32_t id_count = 0;
  for (const trace_event& event : events) {
    stream_count = std::max(stream_count, event.stream + 1);
    if (event.event_kind == trace_event::allocate) id_count = std::max(id_count, event.id + 1);
  }
  std::vector<zeroalloc_stream_t> streams;
  for (int s = 0; s < stream_count; ++s) {
    zeroalloc_stream_t stream = zeroalloc_stream_create(device);
    if (stream == nullptr) {
      result.error = std::string("zeroalloc_stream_create failed: ") + zeroalloc_last_error();
      break;
    }
    streams.push_back(stream);
  }

  struct live_allocation {
    void* pointer = nullptr;
    std::uint64_t bytes = 0;
    int stream = 0;
  };
  std::vector<live_allocation> live(id_count);
  stats_parser parser(result.missing_statistics);
  step_result step;
  bool step_has_events = false;

  auto end_step = [&](bool complete) {
    std::string error;
    const auto json = read_stats_json(device, error);
    if (!json) {
      result.error = error;
      return false;
    }
    step.stats = parser.parse(*json);
    step.complete = complete;
    result.steps.push_back(step);
    result.malloc_calls += step.malloc_calls;
    result.free_calls += step.free_calls;
    result.malloc_seconds += step.malloc_seconds;
    result.free_seconds += step.free_seconds;
    step = step_result{};
    step_has_events = false;
    // Per-step peaks show how the footprint follows the sequence length; the peak over
    // the run is the highest of them.
    zeroalloc_reset_peak_stats(device);
    return true;
  };

  if (result.error.empty()) zeroalloc_reset_peak_stats(device);
  for (std::size_t index = 0; index < events.size() && result.error.empty(); ++index) {
    const trace_event& event = events[index];
    const auto not_live = [&](const char* what) {
      result.error = "trace event " + std::to_string(index) + ": " + what + " of allocation " +
                     std::to_string(event.id) + ", which is not live";
    };
    step_has_events = true;
    switch (event.event_kind) {
      case trace_event::allocate: {
        if (live[event.id].pointer != nullptr) {
          result.error = "trace event " + std::to_string(index) + ": allocation " +
                         std::to_string(event.id) + " is allocated twice";
          break;
        }
        const auto start = clock_type::now();
        void* pointer = zeroalloc_malloc_class(static_cast<ssize_t>(event.bytes), device,
                                               streams[static_cast<std::size_t>(event.stream)],
                                               event.allocation_class);
        step.malloc_seconds += seconds_since(start);
        ++step.malloc_calls;
        if (pointer == nullptr) {
          result.error =
              "allocation " + std::to_string(event.id) + " of " + std::to_string(event.bytes) +
              " bytes (" + class_key(event.allocation_class) + ", stream " +
              std::to_string(event.stream) + ", step " + std::to_string(result.steps.size()) +
              ") failed: " + zeroalloc_last_error();
          break;
        }
        live[event.id] = {pointer, event.bytes, event.stream};
        break;
      }
      case trace_event::free: {
        if (event.id >= live.size() || live[event.id].pointer == nullptr) {
          not_live("free");
          break;
        }
        live_allocation& freed = live[event.id];
        const auto start = clock_type::now();
        zeroalloc_free(freed.pointer, static_cast<ssize_t>(freed.bytes), device,
                       streams[static_cast<std::size_t>(freed.stream)]);
        step.free_seconds += seconds_since(start);
        ++step.free_calls;
        freed = {};
        break;
      }
      case trace_event::record_stream:
        if (event.id >= live.size() || live[event.id].pointer == nullptr) {
          not_live("record_stream");
          break;
        }
        zeroalloc_record_stream(live[event.id].pointer,
                                streams[static_cast<std::size_t>(event.stream)]);
        break;
      case trace_event::step_end:
        zeroalloc_step_boundary();  // the offload engine learns the order; reports mark steps
        end_step(true);
        break;
    }
  }
  if (result.error.empty() && (step_has_events || result.steps.empty())) end_step(false);

  if (!result.steps.empty()) {
    result.final_stats = result.steps.back().stats;
    for (const step_result& done : result.steps) {
      keep_highest_peaks(result.final_stats.total, done.stats.total);
      for (int c = 0; c < ZEROALLOC_CLASS_COUNT; ++c) {
        keep_highest_peaks(result.final_stats.by_class[c], done.stats.by_class[c]);
      }
    }
  }

  for (live_allocation& allocation : live) {
    if (allocation.pointer == nullptr) continue;
    zeroalloc_free(allocation.pointer, static_cast<ssize_t>(allocation.bytes), device,
                   streams[static_cast<std::size_t>(allocation.stream)]);
  }
  for (zeroalloc_stream_t stream : streams) zeroalloc_stream_destroy(device, stream);
  return result;
}

}  // namespace zeroalloc::demo
