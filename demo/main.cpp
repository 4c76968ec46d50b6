// zeroalloc-demo: the allocations of a few training steps of a Llama-style model, replayed
// through zeroalloc, with the memory it holds per step and per allocation class.
//
//   zeroalloc-demo                                  # generate the trace and replay it
//   zeroalloc-demo --emit-trace llama.trace         # write the trace for other allocators
//   zeroalloc-demo --trace llama.trace              # replay a trace file
//
// Runs on a GPU, or without one on the simulated device (ZEROALLOC_DEVICE=sim).
#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "replay.hpp"
#include "training_trace.hpp"

namespace {

using namespace zeroalloc::demo;

constexpr int exit_failure = 1;  // the replay failed: out of memory, library error
constexpr int exit_usage = 2;    // bad option or unreadable trace file

struct options {
  trace_shape shape;
  int shortest_sequence = 256;
  int longest_sequence = 1024;
  std::uint64_t seed = 1;
  int device = 0;
  std::string emit_trace_path;
  std::string trace_path;
  bool offload = false;
};

void print_usage(std::FILE* out) {
  std::fprintf(
      out,
      "usage: zeroalloc-demo [options]\n"
      "\n"
      "Replays the allocations of training a Llama-style model (bf16 autocast, fp32\n"
      "parameters, AdamW) through zeroalloc and prints what it holds, step by step.\n"
      "\n"
      "model and run:\n"
      "  --layers N          decoder layers (16)\n"
      "  --hidden N          hidden size (1024)\n"
      "  --ffn N             FFN width (Llama: 8/3 x hidden rounded up to 256)\n"
      "  --heads N           attention heads (hidden / 64)\n"
      "  --kv-heads N        key/value heads, for grouped-query attention (= heads)\n"
      "  --vocab N           vocabulary (32000)\n"
      "  --batch N           sequences per step (2)\n"
      "  --steps N           training steps (4)\n"
      "  --seq-min N         shortest sequence length (256)\n"
      "  --seq-max N         longest sequence length (1024); steps vary between the two\n"
      "  --seed N            seed of the sequence lengths (1)\n"
      "  --eager-attention   attention that keeps batch x heads x seq x seq probabilities\n"
      "                      (about 9 GiB at the defaults: use --batch 1 on 8 GiB)\n"
      "  --keep-grads        zero_grad(set_to_none=False): gradients stay allocated\n"
      "trace:\n"
      "  --emit-trace PATH   write the trace to PATH and exit (no device needed)\n"
      "  --trace PATH        replay the trace in PATH instead of generating one\n"
      "offload:\n"
      "  --offload           replay a second time under a limit that leaves room for only a\n"
      "                      quarter of the optimizer states, with ZEROALLOC_OFFLOAD=host:\n"
      "                      the rest moves to host memory when the device runs short\n"
      "device:\n"
      "  --device N          device index (0)\n"
      "  --help\n"
      "\n"
      "Without a GPU, set ZEROALLOC_DEVICE=sim; ZEROALLOC_SIM_MEMORY sets its memory (8GiB).\n");
}

bool parse_integer(const char* text, long long minimum, long long& value) {
  char* end = nullptr;
  errno = 0;
  value = std::strtoll(text, &end, 10);
  return errno == 0 && end != text && *end == '\0' && value >= minimum;
}

// Returns false (after saying why) when the command line is not usable.
bool parse_options(int argc, char** argv, options& parsed) {
  int ffn = 0, heads = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string name = argv[i];
    if (name == "--help" || name == "-h") {
      print_usage(stdout);
      std::exit(0);
    }
    if (name == "--eager-attention") {
      parsed.shape.eager_attention = true;
      continue;
    }
    if (name == "--keep-grads") {
      parsed.shape.gradients_set_to_none = false;
      continue;
    }
    if (name == "--offload") {
      parsed.offload = true;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "zeroalloc-demo: %s needs a value (see --help)\n", name.c_str());
      return false;
    }
    const char* value = argv[++i];
    if (name == "--emit-trace") {
      parsed.emit_trace_path = value;
      continue;
    }
    if (name == "--trace") {
      parsed.trace_path = value;
      continue;
    }
    struct integer_option {
      const char* name;
      long long minimum;
      int* target;
    };
    const integer_option integers[] = {
        {"--layers", 1, &parsed.shape.layers},
        {"--hidden", 2, &parsed.shape.hidden},
        {"--ffn", 1, &ffn},
        {"--heads", 1, &heads},
        {"--kv-heads", 1, &parsed.shape.kv_heads},
        {"--vocab", 1, &parsed.shape.vocab},
        {"--batch", 1, &parsed.shape.batch},
        {"--steps", 1, &parsed.shape.steps},
        {"--seq-min", 1, &parsed.shortest_sequence},
        {"--seq-max", 1, &parsed.longest_sequence},
        {"--device", 0, &parsed.device},
    };
    bool known = false;
    for (const integer_option& option : integers) {
      if (name != option.name) continue;
      long long number = 0;
      if (!parse_integer(value, option.minimum, number) || number > (1 << 30)) {
        std::fprintf(stderr, "zeroalloc-demo: %s wants an integer from %lld to 2^30, not '%s'\n",
                     name.c_str(), option.minimum, value);
        return false;
      }
      *option.target = static_cast<int>(number);
      known = true;
    }
    if (name == "--seed") {
      long long number = 0;
      if (!parse_integer(value, 0, number)) {
        std::fprintf(stderr, "zeroalloc-demo: --seed wants a non-negative integer, not '%s'\n",
                     value);
        return false;
      }
      parsed.seed = static_cast<std::uint64_t>(number);
      known = true;
    }
    if (!known) {
      std::fprintf(stderr, "zeroalloc-demo: unknown option %s (see --help)\n", name.c_str());
      return false;
    }
  }
  trace_shape& shape = parsed.shape;
  // Llama's rule for the FFN width and a head size of 64, as small Llamas use.
  shape.intermediate = ffn > 0 ? ffn : (8 * shape.hidden / 3 + 255) / 256 * 256;
  shape.heads = heads > 0 ? heads : std::max(1, shape.hidden / 64);
  if (parsed.longest_sequence < parsed.shortest_sequence) {
    std::fprintf(stderr, "zeroalloc-demo: --seq-max (%d) is below --seq-min (%d)\n",
                 parsed.longest_sequence, parsed.shortest_sequence);
    return false;
  }
  shape.sequence_lengths = varying_sequence_lengths(shape.steps, parsed.shortest_sequence,
                                                    parsed.longest_sequence, parsed.seed);
  try {
    validate(shape);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "zeroalloc-demo: %s\n", error.what());
    return false;
  }
  return true;
}

std::string format_bytes(std::uint64_t bytes) {
  char text[32];
  if (bytes >= (std::uint64_t{1} << 30)) {
    std::snprintf(text, sizeof text, "%.2f GiB", static_cast<double>(bytes) / (1 << 30));
  } else {
    std::snprintf(text, sizeof text, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  }
  return text;
}

double mib(std::uint64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

double microseconds_per_call(double seconds, std::uint64_t calls) {
  return calls == 0 ? 0.0 : seconds * 1e6 / static_cast<double>(calls);
}

std::string describe_shape(const trace_shape& shape) {
  char text[512];
  const int kv_heads = shape.kv_heads == 0 ? shape.heads : shape.kv_heads;
  std::snprintf(text, sizeof text,
                "Llama-style, %d layers, hidden %d, ffn %d, %d heads (%d kv), vocab %d: "
                "%.1fM parameters; batch %d, %d steps; %s attention%s",
                shape.layers, shape.hidden, shape.intermediate, shape.heads, kv_heads, shape.vocab,
                static_cast<double>(parameter_count(shape)) / 1e6, shape.batch, shape.steps,
                shape.eager_attention ? "eager" : "SDPA (flash)",
                shape.gradients_set_to_none ? "" : ", gradients kept");
  return text;
}

void print_device(const device_description& device) {
  std::printf("device %d: %s", device.device, device.name.c_str());
  if (device.limit_bytes > 0) std::printf(", limit %s", format_bytes(device.limit_bytes).c_str());
  std::printf("\n");
  if (device.simulated) {
    const char* chosen = std::getenv("ZEROALLOC_DEVICE");
    const bool forced = chosen != nullptr && std::strcmp(chosen, "sim") == 0;
    std::printf(
        "%s the simulated device (ZEROALLOC_DEVICE=sim): host memory stands in for device "
        "memory, sized by ZEROALLOC_SIM_MEMORY\n",
        forced ? "running on" : "no GPU: running on");
  }
}

void print_steps(const replay_result& result, const std::vector<int>& sequence_lengths) {
  std::printf("\n%4s %6s %12s %12s %12s %12s %8s %8s %10s %10s\n", "step", "seq", "allocated",
              "peak alloc", "reserved", "peak resv", "mallocs", "frees", "us/malloc", "us/free");
  std::printf("%4s %6s %12s %12s %12s %12s\n", "", "", "(MiB)", "(MiB)", "(MiB)", "(MiB)");
  for (std::size_t i = 0; i < result.steps.size(); ++i) {
    const step_result& step = result.steps[i];
    const allocator_figures& total = step.stats.total;
    char sequence[16] = "-";
    if (step.complete && i < sequence_lengths.size()) {
      std::snprintf(sequence, sizeof sequence, "%d", sequence_lengths[i]);
    }
    std::printf("%4zu%s %5s %12.1f %12.1f %12.1f %12.1f %8" PRIu64 " %8" PRIu64 " %10.2f %10.2f\n",
                i, step.complete ? " " : "*", sequence, mib(total.allocated_bytes),
                mib(total.allocated_peak_bytes), mib(total.reserved_bytes),
                mib(total.reserved_peak_bytes), step.malloc_calls, step.free_calls,
                microseconds_per_call(step.malloc_seconds, step.malloc_calls),
                microseconds_per_call(step.free_seconds, step.free_calls));
  }
  if (!result.steps.empty() && !result.steps.back().complete) {
    std::printf("(*: events after the last step end)\n");
  }
}

void print_classes(const replay_result& result) {
  static const char* const names[ZEROALLOC_CLASS_COUNT] = {"other", "parameter", "gradient",
                                                           "optimizer state"};
  std::printf("\n%-16s %12s %12s %12s %12s %10s %10s\n", "class", "allocated", "peak alloc",
              "peak resv", "allocations", "frees", "cache hits");
  std::printf("%-16s %12s %12s %12s\n", "", "(MiB)", "(MiB)", "(MiB)");
  auto row = [](const char* name, const allocator_figures& figures) {
    std::printf("%-16s %12.1f %12.1f %12.1f %12" PRIu64 " %10" PRIu64 " %10" PRIu64 "\n", name,
                mib(figures.allocated_bytes), mib(figures.allocated_peak_bytes),
                mib(figures.reserved_peak_bytes), figures.allocations, figures.frees,
                figures.cache_hits);
  };
  for (int c = 0; c < ZEROALLOC_CLASS_COUNT; ++c) row(names[c], result.final_stats.by_class[c]);
  row("total", result.final_stats.total);
}

// A figure of the "offload" object of zeroalloc_stats_json, or -1 (offload off: the object
// is null).
double offload_figure(int device, const char* key) {
  const int length = zeroalloc_stats_json(device, nullptr, 0);
  if (length < 0) return -1;
  std::string text(static_cast<std::size_t>(length) + 1, '\0');
  zeroalloc_stats_json(device, text.data(), text.size());
  text.resize(static_cast<std::size_t>(length));
  const nlohmann::json stats = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!stats.contains("offload")) return -1;  // also when the text did not parse
  const nlohmann::json& offload = stats["offload"];
  if (!offload.contains(key) || !offload[key].is_number()) return -1;
  return offload[key].get<double>();
}

// The second replay of --offload: a limit that holds the trace's peak minus three quarters
// of its optimizer states, so that they must go to host memory for the rest to fit.
int replay_with_offload(const options& parsed, const std::vector<trace_event>& events,
                        const std::vector<int>& sequence_lengths, const replay_result& first) {
  if (offload_figure(parsed.device, "host_limit_bytes") < 0) {
    std::fprintf(stderr, "zeroalloc-demo: --offload: the offload engine is off (%s)\n",
                 std::getenv("ZEROALLOC_OFFLOAD") != nullptr
                     ? "ZEROALLOC_OFFLOAD is set to something other than host"
                     : "ZEROALLOC_OFFLOAD was not set before the library started");
    return exit_failure;
  }
  const allocator_figures& total = first.final_stats.total;
  const std::uint64_t states =
      first.final_stats.by_class[ZEROALLOC_CLASS_OPTIMIZER_STATE].reserved_peak_bytes;
  const std::uint64_t limit = total.reserved_peak_bytes - states / 4 * 3;
  zeroalloc_empty_cache();
  zeroalloc_set_memory_fraction(static_cast<double>(limit) / static_cast<double>(first.limit_bytes),
                                parsed.device);
  std::printf(
      "\nagain with offload to host memory (ZEROALLOC_OFFLOAD=host), under a limit of %s: the "
      "peak reserved above minus three quarters of the optimizer states\n",
      format_bytes(limit).c_str());
  std::fflush(stdout);
  const replay_result second = replay_through_zeroalloc(events, parsed.device);
  print_steps(second, sequence_lengths);
  if (!second.error.empty()) {
    std::fprintf(stderr, "\nzeroalloc-demo: replay with offload stopped: %s\n",
                 second.error.c_str());
    return exit_failure;
  }
  print_classes(second);
  const double moved_out = offload_figure(parsed.device, "bytes_to_host");
  const double evictions = offload_figure(parsed.device, "pressure_evictions");
  const double host_peak = offload_figure(parsed.device, "host_peak_in_use_bytes");
  std::printf(
      "\noffload: %.0f chunks moved to host memory when allocations would have failed "
      "(%s in all, at most %s on the host at once); every allocation of the trace "
      "succeeded under the limit\n",
      evictions, format_bytes(static_cast<std::uint64_t>(moved_out)).c_str(),
      format_bytes(static_cast<std::uint64_t>(host_peak)).c_str());
  return moved_out > 0 ? 0 : exit_failure;
}

int run(const options& parsed) {
  std::vector<trace_event> events;
  std::string description;
  std::vector<int> sequence_lengths;
  if (!parsed.trace_path.empty()) {
    try {
      events = read_trace(parsed.trace_path);
    } catch (const std::exception& error) {
      std::fprintf(stderr, "zeroalloc-demo: %s\n", error.what());
      return exit_usage;
    }
    description = "trace " + parsed.trace_path;
  } else {
    events = make_training_trace(parsed.shape);
    description = describe_shape(parsed.shape);
    for (int step = 0; step < parsed.shape.steps; ++step) {
      const auto& lengths = parsed.shape.sequence_lengths;
      sequence_lengths.push_back(lengths[static_cast<std::size_t>(step) % lengths.size()]);
    }
  }
  trace_summary summary;
  try {
    summary = summarize(events);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "zeroalloc-demo: %s: %s\n", description.c_str(), error.what());
    return exit_usage;
  }

  if (!parsed.emit_trace_path.empty()) {
    try {
      write_trace(parsed.emit_trace_path, events, description);
    } catch (const std::exception& error) {
      std::fprintf(stderr, "zeroalloc-demo: %s\n", error.what());
      return exit_usage;
    }
    std::printf("wrote %" PRIu64 " events (%" PRIu64 " steps, peak live %s) to %s\n",
                summary.events, summary.steps, format_bytes(summary.peak_live_bytes).c_str(),
                parsed.emit_trace_path.c_str());
    return 0;
  }

  const device_description device = describe_device(parsed.device);
  if (!device.error.empty()) {
    std::fprintf(stderr, "zeroalloc-demo: device %d: %s\n", parsed.device, device.error.c_str());
    return exit_failure;
  }
  print_device(device);
  std::printf("model: %s\n", description.c_str());
  if (!sequence_lengths.empty()) {
    std::printf("sequence lengths:");
    for (int length : sequence_lengths) std::printf(" %d", length);
    std::printf("\n");
  }
  std::printf("trace: %" PRIu64 " events: %" PRIu64 " allocations, %" PRIu64 " frees, %" PRIu64
              " record_stream, %" PRIu64 " steps; peak live %s, largest allocation %s\n",
              summary.events, summary.allocations, summary.frees, summary.record_streams,
              summary.steps, format_bytes(summary.peak_live_bytes).c_str(),
              format_bytes(summary.largest_allocation_bytes).c_str());
  std::fflush(stdout);

  const replay_result result = replay_through_zeroalloc(events, parsed.device);
  print_steps(result, sequence_lengths);
  if (!result.error.empty()) {
    std::fprintf(stderr, "\nzeroalloc-demo: replay stopped: %s\n", result.error.c_str());
    return exit_failure;
  }
  print_classes(result);

  const allocator_figures& total = result.final_stats.total;
  std::printf("\n");
  if (total.allocated_peak_bytes > 0) {
    std::printf("peak reserved / peak allocated = %.3f\n",
                static_cast<double>(total.reserved_peak_bytes) /
                    static_cast<double>(total.allocated_peak_bytes));
  } else {
    std::printf("peak reserved / peak allocated = n/a (nothing allocated)\n");
  }
  std::printf("peak allocated %s, peak reserved %s; the trace's own peak of live bytes is %s\n",
              format_bytes(total.allocated_peak_bytes).c_str(),
              format_bytes(total.reserved_peak_bytes).c_str(),
              format_bytes(summary.peak_live_bytes).c_str());
  std::printf("zeroalloc_malloc_class: %" PRIu64 " calls, %.2f us each; zeroalloc_free: %" PRIu64
              " calls, %.2f us each\n",
              result.malloc_calls,
              microseconds_per_call(result.malloc_seconds, result.malloc_calls), result.free_calls,
              microseconds_per_call(result.free_seconds, result.free_calls));
  if (!result.missing_statistics.empty()) {
    std::printf("note: the library's statistics lacked %zu figures (shown as 0), e.g. %s\n",
                result.missing_statistics.size(), result.missing_statistics.front().c_str());
  }
  if (parsed.offload) return replay_with_offload(parsed, events, sequence_lengths, result);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  options parsed;
  if (!parse_options(argc, argv, parsed)) return exit_usage;
  // The library reads its settings when it starts, at the first call below.
  if (parsed.offload) setenv("ZEROALLOC_OFFLOAD", "host", /*overwrite=*/0);
  try {
    return run(parsed);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "zeroalloc-demo: %s\n", error.what());
    return exit_failure;
  }
}
