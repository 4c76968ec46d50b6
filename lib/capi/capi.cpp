// The extern "C" boundary. Every function catches everything: a failure becomes the
// documented return value plus a message in zeroalloc_last_error(), never an exception.
#include <cuda.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "alloc/caching_allocator.hpp"
#include "capi/runtime.hpp"
#include "core/errors.hpp"
#include "core/host_memory.hpp"
#include "core/log.hpp"
#include "core/options.hpp"
#include "core/passthrough.hpp"
#include "dist/bootstrap.hpp"
#include "dist/nccl_transport.hpp"
#include "dist/tcp_transport.hpp"
#include "profile/report.hpp"
#include "tier/host_step.hpp"
#include "zeroalloc/zeroalloc.h"

#define ZA_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using zeroalloc::allocation_class;
using zeroalloc::runtime;

// A fixed buffer: building a std::string could throw inside a noexcept function, and a
// thread_local std::string is destroyed before the static destructors that may still free.
thread_local char t_last_error[1024];
// Global-dynamic TLS, on purpose: PyTorch dlopens this library, and initial-exec TLS would
// then need static TLS space that a process full of libraries may no longer have.
thread_local allocation_class t_class = allocation_class::other;

// The CUDA result standing for the last failure (zeroalloc::last_failure_cuda_code).
thread_local int t_last_code = 0;

// Note [Failures in the log]: a caller of zeroalloc_malloc may not read the last error (a
// program's cudaMalloc, answered by the hooks, gets only an error code), so the log says why
// an allocation failed. But programs probe with allocations that may fail (PyTorch's caching
// allocator frees its cache and retries; cuDNN and cuBLAS try workspaces of several sizes),
// and a line per probe would bury everything else: the first failure is logged, then at
// most one every kFailureLogSeconds, counting those left out. Every failure still sets the
// last error and counts in the statistics (failures).
constexpr std::int64_t kFailureLogSeconds = 10;
std::atomic<std::int64_t> g_last_failure_log_ns{INT64_MIN};
std::atomic<std::uint64_t> g_failures_not_logged{0};

void log_allocation_failure() {
  const std::int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::steady_clock::now().time_since_epoch())
                               .count();
  std::int64_t last = g_last_failure_log_ns.load(std::memory_order_relaxed);
  const std::int64_t interval = kFailureLogSeconds * 1'000'000'000;
  if ((last != INT64_MIN && now - last < interval) ||
      !g_last_failure_log_ns.compare_exchange_strong(last, now, std::memory_order_relaxed)) {
    g_failures_not_logged.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const std::uint64_t left_out = g_failures_not_logged.exchange(0, std::memory_order_relaxed);
  if (left_out == 0) {
    zeroalloc::log().error("{}", t_last_error);
  } else {
    zeroalloc::log().error(
        "{} ({} more allocations failed since the last message; at most one "
        "is logged every {} s)",
        t_last_error, left_out, kFailureLogSeconds);
  }
}

void set_error(const char* function, const char* message, int code = 999) noexcept {
  std::snprintf(t_last_error, sizeof t_last_error, "%s: %s", function, message);
  t_last_code = code;
}

int cuda_code_of(const std::exception& failure) noexcept {
  if (dynamic_cast<const zeroalloc::out_of_memory*>(&failure) != nullptr) return 2;
  if (dynamic_cast<const zeroalloc::config_error*>(&failure) != nullptr ||
      dynamic_cast<const zeroalloc::no_driver_error*>(&failure) != nullptr) {
    return 3;
  }
  if (dynamic_cast<const zeroalloc::no_such_device*>(&failure) != nullptr) return 101;
  if (dynamic_cast<const zeroalloc::invalid_argument*>(&failure) != nullptr) return 1;
  return 999;
}

// Runs `body`; on an exception records it and returns `failed`.
template <typename Result, typename Body>
Result guarded(const char* function, Result failed, Body&& body) noexcept {
  t_last_code = 0;
  try {
    return body();
  } catch (const std::exception& failure) {
    set_error(function, failure.what(), cuda_code_of(failure));
  } catch (...) {
    set_error(function, "unknown failure");
  }
  return failed;
}

// A function that returns nothing has no failure value to return: it clears the message
// on entry, so that an empty zeroalloc_last_error() after it means success, and logs its
// failure (the first few hundred: a failing device would otherwise flood the log).
template <typename Body>
void guarded_void(const char* function, Body&& body) noexcept {
  t_last_error[0] = '\0';
  const bool failed = guarded(function, false, [&] {
                        body();
                        return true;
                      }) == false;
  if (!failed) return;
  static std::atomic<int> logged{0};
  constexpr int kMostLogged = 200;
  const int count = logged.fetch_add(1, std::memory_order_relaxed);
  if (count >= kMostLogged) return;
  try {
    zeroalloc::log().warn(
        "{}{}", t_last_error,
        count + 1 == kMostLogged ? " (later failures of this kind not logged)" : "");
  } catch (...) {  // the message stays in zeroalloc_last_error()
  }
}

// A caller may pass any int as a zeroalloc_class; read it as an int, never as the enum
// (loading an out-of-range enum value is undefined behaviour).
bool valid_class(const zeroalloc_class& cls) {
  int value = 0;
  std::memcpy(&value, &cls, sizeof value);
  return value >= 0 && value < ZEROALLOC_CLASS_COUNT;
}

// CUDA's special stream handles (cudaStreamLegacy, cudaStreamPerThread) are streams to
// CUDA, passed as they are. The simulated device has one default stream, which stands for
// them (a fence recorded on one as if it were a stream of its own crashed it).
bool is_special(zeroalloc_stream_t stream) {
  const auto value = reinterpret_cast<std::uintptr_t>(stream);
  return value == 0x1 || value == 0x2;
}

bool is_null_or_special(zeroalloc_stream_t stream) {
  return stream == nullptr || is_special(stream);
}

zeroalloc_stream_t device_stream(zeroalloc_stream_t stream) {
  if (!is_special(stream)) return stream;
  return runtime::get().simulated() ? nullptr : stream;
}

}  // namespace

ZA_EXPORT int zeroalloc_abi_version(void) { return ZEROALLOC_ABI_VERSION; }

ZA_EXPORT void* zeroalloc_malloc_class(ssize_t size, int device, zeroalloc_stream_t stream,
                                       zeroalloc_class cls) {
  return guarded("zeroalloc_malloc", static_cast<void*>(nullptr), [&]() -> void* {
    if (size < 0) ZA_THROW(zeroalloc::invalid_argument, "size ", size, " is negative");
    if (!valid_class(cls))
      ZA_THROW(zeroalloc::invalid_argument, "the class is not a zeroalloc_class");
    return runtime::get().allocator(device).allocate(
        static_cast<std::size_t>(size), device_stream(stream), static_cast<allocation_class>(cls));
  });
}

ZA_EXPORT void* zeroalloc_malloc(ssize_t size, int device, zeroalloc_stream_t stream) {
  void* pointer =
      zeroalloc_malloc_class(size, device, stream, static_cast<zeroalloc_class>(t_class));
  if (pointer == nullptr && size > 0) log_allocation_failure();  // Note [Failures in the log]
  return pointer;
}

ZA_EXPORT void* zeroalloc_torch_malloc(ssize_t size, int device, zeroalloc_stream_t stream) {
  void* pointer = zeroalloc_malloc(size, device, stream);
  // PyTorch's pluggable allocator uses whatever pointer it gets: a null one becomes a tensor
  // without memory and a puzzling error much later. An exception becomes a RuntimeError
  // with zeroalloc's message, at the allocation that failed.
  if (pointer == nullptr && size > 0) throw std::runtime_error(t_last_error);
  return pointer;
}

ZA_EXPORT void zeroalloc_free(void* ptr, ssize_t /*size*/, int /*device*/,
                              zeroalloc_stream_t /*stream*/) {
  guarded_void("zeroalloc_free", [&] {
    if (ptr == nullptr) return;
    if (!runtime::get().deallocate(ptr)) {
      ZA_THROW(zeroalloc::invalid_argument, "pointer ", ptr,
               " is not a live zeroalloc allocation (freed twice, or from another allocator); "
               "ignored");
    }
  });
}

ZA_EXPORT void zeroalloc_init(int device_count) {
  guarded_void("zeroalloc_init", [&] {
    runtime& started = runtime::get();
    if (device_count > started.device_count()) {
      zeroalloc::log().warn("zeroalloc_init({}): only {} device(s) are present", device_count,
                            started.device_count());
    }
  });
}

ZA_EXPORT void zeroalloc_empty_cache(void) {
  guarded_void("zeroalloc_empty_cache", [&] {
    for (zeroalloc::caching_allocator* each : runtime::get().started_allocators()) {
      each->empty_cache();
    }
  });
}

ZA_EXPORT void zeroalloc_set_memory_fraction(double fraction, int device) {
  guarded_void("zeroalloc_set_memory_fraction", [&] {
    if (!(fraction > 0.0 && fraction <= 1.0)) {
      ZA_THROW(zeroalloc::invalid_argument, "fraction ", fraction,
               " is outside (0, 1]; the limit is unchanged");
    }
    zeroalloc::caching_allocator& target = runtime::get().allocator(device);
    const auto total = target.backing().query_memory().total_bytes;
    target.set_limit(static_cast<std::uint64_t>(static_cast<double>(total) * fraction),
                     zeroalloc::detail::concat("set_per_process_memory_fraction(", fraction, ")"));
  });
}

ZA_EXPORT void zeroalloc_record_stream(void* ptr, zeroalloc_stream_t stream) {
  guarded_void("zeroalloc_record_stream", [&] {
    zeroalloc::caching_allocator* owner = runtime::get().owner_of(ptr);
    if (owner == nullptr || !owner->record_stream(ptr, device_stream(stream))) {
      ZA_THROW(zeroalloc::invalid_argument, "pointer ", ptr, " is not a live zeroalloc allocation");
    }
  });
}

ZA_EXPORT zeroalloc_class zeroalloc_set_thread_class(zeroalloc_class cls) {
  const auto previous = static_cast<zeroalloc_class>(t_class);
  if (valid_class(cls)) t_class = static_cast<allocation_class>(cls);
  return previous;
}

ZA_EXPORT int zeroalloc_room(int device, zeroalloc_class cls, uint64_t* largest_free,
                             uint64_t* unallocated) {
  return guarded("zeroalloc_room", -1, [&] {
    if (!valid_class(cls)) {
      throw std::invalid_argument("no such allocation class: pass a zeroalloc_class value");
    }
    if (largest_free == nullptr || unallocated == nullptr) {
      throw std::invalid_argument("largest_free and unallocated must not be NULL");
    }
    const zeroalloc::caching_allocator& owner = runtime::get().allocator(device);
    const std::uint64_t limit = owner.limit_bytes();
    const std::uint64_t allocated = owner.allocated_bytes();
    *largest_free = owner.largest_free_block(static_cast<allocation_class>(cls));
    *unallocated = limit > allocated ? limit - allocated : 0;
    return 0;
  });
}

ZA_EXPORT int zeroalloc_moved_bytes(int device, zeroalloc_class cls, uint64_t* to_host,
                                    uint64_t* to_device) {
  return guarded("zeroalloc_moved_bytes", -1, [&] {
    if (!valid_class(cls)) {
      throw std::invalid_argument("no such allocation class: pass a zeroalloc_class value");
    }
    if (to_host == nullptr || to_device == nullptr) {
      throw std::invalid_argument("to_host and to_device must not be NULL");
    }
    runtime& owner = runtime::get();
    owner.allocator(device);  // checks the ordinal
    *to_host = 0;
    *to_device = 0;
    if (zeroalloc::offload_engine* engine = owner.engine(device); engine != nullptr) {
      const zeroalloc::migration_figures moved = engine->mover().figures();
      const std::size_t slot = zeroalloc::class_index(static_cast<allocation_class>(cls));
      *to_host = moved.to_host_class_bytes[slot];
      *to_device = moved.to_device_class_bytes[slot];
    }
    return 0;
  });
}

ZA_EXPORT void zeroalloc_reset_peak_stats(int device) {
  guarded_void("zeroalloc_reset_peak_stats",
               [&] { runtime::get().allocator(device).reset_peak_stats(); });
}

namespace {

// JSON as the library writes it: its keys in the order they were set, compact. A byte that
// is not UTF-8 (a variable's value can hold anything) becomes U+FFFD instead of a failure.
using json = nlohmann::ordered_json;

std::string text_of(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

// Copies `text` into the caller's buffer (NUL-terminated, truncated to fit) and returns the
// length of the whole text, so a caller can size its buffer with a first call.
int copy_out(const std::string& text, char* buffer, size_t length) {
  if (buffer != nullptr && length > 0) {
    const std::size_t copied = std::min(text.size(), length - 1);
    std::memcpy(buffer, text.data(), copied);
    buffer[copied] = '\0';
  }
  return static_cast<int>(text.size());
}

}  // namespace

ZA_EXPORT int zeroalloc_stats_json(int device, char* buffer, size_t length) {
  return guarded("zeroalloc_stats_json", -1, [&] {
    // The device's figures, and the process-wide counts of calls zeroalloc passed through.
    json stats = runtime::get().allocator(device).stats_json();
    stats["passthrough"] = zeroalloc::passthrough_figures();
    stats["offload"] = runtime::get().offload_json(device);
    return copy_out(text_of(stats), buffer, length);
  });
}

ZA_EXPORT int zeroalloc_snapshot_json(int device, char* buffer, size_t length) {
  return guarded("zeroalloc_snapshot_json", -1, [&] {
    std::vector<zeroalloc::caching_allocator*> chosen;
    if (device == -1) {
      chosen = runtime::get().started_allocators();
    } else {
      chosen.push_back(&runtime::get().allocator(device));
    }
    json devices = json::array();
    for (const zeroalloc::caching_allocator* each : chosen) {
      devices.push_back(each->snapshot_json());
    }
    json snapshot;
    snapshot["devices"] = std::move(devices);
    return copy_out(text_of(snapshot), buffer, length);
  });
}

ZA_EXPORT zeroalloc_stream_t zeroalloc_stream_create(int device) {
  return guarded("zeroalloc_stream_create", static_cast<zeroalloc_stream_t>(nullptr), [&] {
    return static_cast<zeroalloc_stream_t>(
        runtime::get().allocator(device).backing().create_stream());
  });
}

ZA_EXPORT void zeroalloc_stream_destroy(int device, zeroalloc_stream_t stream) {
  if (is_null_or_special(stream)) return;
  guarded_void("zeroalloc_stream_destroy", [&] {
    zeroalloc::caching_allocator& owner = runtime::get().allocator(device);
    owner.forget_stream(stream);
    owner.backing().destroy_stream(stream);
  });
}

ZA_EXPORT const char* zeroalloc_build_info(void) {
  static const std::string info = text_of(json{{"version", ZEROALLOC_VERSION},
                                               {"abi", ZEROALLOC_ABI_VERSION},
                                               {"cuda_version", CUDA_VERSION},
                                               {"nccl_version", NCCL_VERSION_CODE}});
  return info.c_str();
}

ZA_EXPORT int zeroalloc_options_json(char* buffer, size_t length) {
  return guarded("zeroalloc_options_json", -1, [&] {
    std::string error;
    try {
      zeroalloc::options::from_environment();
    } catch (const zeroalloc::config_error& failure) {
      error = failure.what();
    }
    json options = json::array();
    for (const zeroalloc::option_spec& spec : zeroalloc::option_table()) {
      const char* value = std::getenv(std::string(spec.name).c_str());
      options.push_back({{"name", std::string(spec.name)},
                         {"value", value != nullptr ? json(value) : json(nullptr)},
                         {"default", std::string(spec.default_value)},
                         {"accepted", std::string(zeroalloc::accepted_form(spec))},
                         {"help", std::string(spec.help)}});
    }
    json report;
    report["valid"] = error.empty();
    report["error"] = error;
    report["options"] = std::move(options);
    return copy_out(text_of(report), buffer, length);
  });
}

ZA_EXPORT int zeroalloc_report_write(const char* reason) {
  return guarded("zeroalloc_report_write", -1, [&] {
    zeroalloc::reporter* active = runtime::get().memory_reporter();
    if (active == nullptr || !runtime::get().reporting_process()) {
      ZA_THROW(zeroalloc::invalid_argument,
               "no report was asked for: set ZEROALLOC_REPORT=path/prefix before the start");
    }
    if (auto failure = active->write(reason != nullptr ? reason : "request")) {
      ZA_THROW(zeroalloc::error, *failure);
    }
    return 0;
  });
}

ZA_EXPORT int zeroalloc_report_section(const char* name, const char* json_object) {
  return guarded("zeroalloc_report_section", -1, [&] {
    ZA_REQUIRE(name != nullptr && json_object != nullptr, "a name and a JSON object are needed");
    zeroalloc::reporter* active = runtime::get().memory_reporter();
    if (active == nullptr) return 1;  // no report asked for: nothing to keep it in
    active->set_section(name, json_object);
    return 0;
  });
}

ZA_EXPORT int zeroalloc_report_render(const char* json_path, const char* html_path) {
  return guarded("zeroalloc_report_render", -1, [&] {
    ZA_REQUIRE(json_path != nullptr && html_path != nullptr, "both paths are needed");
    if (auto failure = zeroalloc::reporter::render_file(json_path, html_path)) {
      ZA_THROW(zeroalloc::invalid_argument, *failure);
    }
    return 0;
  });
}

ZA_EXPORT int zeroalloc_device_count(void) {
  return guarded("zeroalloc_device_count", -1, [] { return runtime::get().device_count(); });
}

ZA_EXPORT const char* zeroalloc_last_error(void) { return t_last_error; }

ZA_EXPORT int zeroalloc_last_error_code(void) { return t_last_code; }

// ---- Serving CUDA's own calls ------------------------------------------------------------

ZA_EXPORT int zeroalloc_free_if_owned(void* ptr, zeroalloc_stream_t stream,
                                      int (*synchronize)(void)) {
  if (ptr == nullptr) return ZEROALLOC_NOT_OWNED;
  return guarded("zeroalloc_free_if_owned", static_cast<int>(ZEROALLOC_FREE_FAILED), [&] {
    runtime* started = nullptr;
    try {
      started = &runtime::get();
    } catch (...) {  // the library could not start: it owns nothing
      return static_cast<int>(ZEROALLOC_NOT_OWNED);
    }
    zeroalloc::caching_allocator* owner = started->owner_of(ptr);
    if (owner == nullptr) return static_cast<int>(ZEROALLOC_NOT_OWNED);
    if (synchronize != nullptr) {
      synchronize();  // its error, if any, is the device's: the program's next call reports it
    } else {
      owner->record_stream(ptr, device_stream(stream));  // Note [Stream-ordered reuse]
    }
    if (!owner->deallocate(ptr)) {
      ZA_THROW(zeroalloc::invalid_argument, "pointer ", ptr,
               " lies in zeroalloc's memory but is not a live allocation (freed twice, or "
               "inside one); ignored");
    }
    return static_cast<int>(ZEROALLOC_FREED);
  });
}

ZA_EXPORT int zeroalloc_memory_info(int device, uint64_t* free_bytes, uint64_t* total_bytes) {
  return guarded("zeroalloc_memory_info", -1, [&] {
    zeroalloc::caching_allocator& allocator = runtime::get().allocator(device);
    const std::uint64_t limit = allocator.limit_bytes();
    const std::uint64_t held = allocator.held_bytes();
    if (free_bytes != nullptr) {
      *free_bytes = std::min<std::uint64_t>(held < limit ? limit - held : 0,
                                            allocator.backing().query_memory().free_bytes);
    }
    if (total_bytes != nullptr) *total_bytes = limit;
    return 0;
  });
}

ZA_EXPORT int zeroalloc_forget_stream(zeroalloc_stream_t stream) {
  if (is_null_or_special(stream)) return 0;  // never destroyed
  // Not started (nothing allocated yet): it knows no stream, and is not started for this.
  runtime* started = runtime::if_started();
  if (started == nullptr) return 0;
  return guarded("zeroalloc_forget_stream", -1, [&] {
    for (zeroalloc::caching_allocator* each : started->started_allocators()) {
      each->forget_stream(stream);
    }
    return 0;
  });
}

// ---- Offload -----------------------------------------------------------------------------

namespace {

zeroalloc::offload_engine& engine_for(const void* pointer) {
  runtime& started = runtime::get();
  if (!started.offload_enabled()) {
    ZA_THROW(zeroalloc::config_error,
             "offload is off: set ZEROALLOC_OFFLOAD=host before the program starts");
  }
  zeroalloc::offload_engine* engine = started.engine_of(pointer);
  if (engine == nullptr) {
    ZA_THROW(zeroalloc::invalid_argument, "pointer ", pointer,
             " is not memory zeroalloc allocated");
  }
  return *engine;
}

}  // namespace

ZA_EXPORT void zeroalloc_use_begins(const void* pointer, zeroalloc_stream_t stream) {
  guarded_void("zeroalloc_use_begins", [&] {
    if (zeroalloc::offload_engine* engine = runtime::get().engine_of(pointer)) {
      engine->use_begins(pointer, device_stream(stream));
    }
  });
}

ZA_EXPORT void zeroalloc_use_in_place(const void* pointer, zeroalloc_stream_t stream) {
  guarded_void("zeroalloc_use_in_place", [&] {
    if (zeroalloc::offload_engine* engine = runtime::get().engine_of(pointer)) {
      engine->use_in_place(pointer, device_stream(stream));
    }
  });
}

ZA_EXPORT void zeroalloc_use_ends(const void* pointer, zeroalloc_stream_t stream) {
  guarded_void("zeroalloc_use_ends", [&] {
    if (zeroalloc::offload_engine* engine = runtime::get().engine_of(pointer)) {
      engine->use_ends(pointer, device_stream(stream));
    }
  });
}

namespace {

/// Sends each run of `pointers` that one engine (device) serves to `hint` in one call;
/// pointers zeroalloc does not offload are left out, as the one-pointer hints ignore them.
template <typename Hint>
void hint_many(const void* const* pointers, std::size_t count, Hint hint) {
  if (count > 0 && pointers == nullptr) {
    ZA_THROW(zeroalloc::invalid_argument, "pointers is NULL with count ", count);
  }
  runtime& started = runtime::get();
  std::vector<const void*> run;
  zeroalloc::offload_engine* serving = nullptr;
  std::exception_ptr first_failure;  // one engine failing does not skip the others' hints
  const auto send = [&] {
    try {
      hint(*serving, std::span<const void* const>(run));
    } catch (...) {
      if (!first_failure) first_failure = std::current_exception();
    }
    run.clear();
  };
  for (std::size_t i = 0; i < count; ++i) {
    zeroalloc::offload_engine* engine = started.engine_of(pointers[i]);
    if (engine == nullptr) continue;
    if (engine != serving && !run.empty()) send();
    serving = engine;
    run.push_back(pointers[i]);
  }
  if (!run.empty()) send();
  if (first_failure) std::rethrow_exception(first_failure);
}

}  // namespace

ZA_EXPORT void zeroalloc_use_begins_many(const void* const* pointers, size_t count,
                                         zeroalloc_stream_t stream) {
  guarded_void("zeroalloc_use_begins_many", [&] {
    hint_many(pointers, count, [&](zeroalloc::offload_engine& engine, auto run) {
      engine.use_begins(run, device_stream(stream));
    });
  });
}

ZA_EXPORT void zeroalloc_use_in_place_many(const void* const* pointers, size_t count,
                                           zeroalloc_stream_t stream) {
  guarded_void("zeroalloc_use_in_place_many", [&] {
    hint_many(pointers, count, [&](zeroalloc::offload_engine& engine, auto run) {
      engine.use_in_place(run, device_stream(stream));
    });
  });
}

ZA_EXPORT void zeroalloc_use_ends_many(const void* const* pointers, size_t count,
                                       zeroalloc_stream_t stream) {
  guarded_void("zeroalloc_use_ends_many", [&] {
    hint_many(pointers, count, [&](zeroalloc::offload_engine& engine, auto run) {
      engine.use_ends(run, device_stream(stream));
    });
  });
}

namespace {

// Where the CPUs reach `address`, from the chunks' views (sorted by address), with the bytes
// left in its chunk in `run_bytes`; 0 when it lies in no view.
std::uintptr_t host_address_in(const std::vector<zeroalloc::offload_engine::host_view>& views,
                               std::uintptr_t address, std::size_t& run_bytes) {
  auto after =
      std::upper_bound(views.begin(), views.end(), address,
                       [](std::uintptr_t at, const auto& view) { return at < view.address; });
  if (after == views.begin()) return 0;
  const auto& view = *std::prev(after);
  if (address >= view.address + view.bytes) return 0;
  run_bytes = view.address + view.bytes - address;
  return view.host + (address - view.address);
}

// zeroalloc_adamw_on_host and, with `master` (Note [Master weights]), its bf16 variant: then
// every gradient and copy is bf16 host memory of the caller's.
int adamw_on_host_call(const char* name, bool master, void* const* parameters,
                       const void* const* gradients, void* const* exp_avgs,
                       void* const* exp_avg_sqs, void* const* copies, const size_t* counts,
                       size_t count, const zeroalloc_adamw_settings* settings,
                       zeroalloc_stream_t stream) {
  return guarded(name, -1, [&] {
    ZA_REQUIRE(settings != nullptr, "settings is NULL");
    ZA_REQUIRE(count == 0 ||
                   (parameters != nullptr && gradients != nullptr && exp_avgs != nullptr &&
                    exp_avg_sqs != nullptr && counts != nullptr && (!master || copies != nullptr)),
               "a pointer array is NULL");
    if (count == 0) return 1;
    ZA_REQUIRE(settings->beta1 >= 0 && settings->beta1 < 1 && settings->beta2 >= 0 &&
                   settings->beta2 < 1 && settings->step >= 1,
               "AdamW settings out of range: beta1=", settings->beta1, " beta2=", settings->beta2,
               " step=", settings->step, " (betas in [0, 1), step at least 1)");
    runtime& started = runtime::get();
    zeroalloc::offload_engine& engine = engine_for(parameters[0]);
    const int ordinal = started.owner_of(parameters[0])->backing().ordinal();
    // Everything the engine manages is reached through its chunks' host copies; a gradient
    // the engine does not manage is host memory of the caller's, used as it is.
    std::vector<const void*> managed;
    managed.reserve(4 * count);
    // Each allocation must hold its count: the CPUs would otherwise write a neighbour's bytes.
    auto holds = [&](const void* pointer, std::size_t elements) {
      const std::size_t bytes = started.owner_of(pointer)->allocation_bytes(pointer);
      ZA_REQUIRE(bytes != 0, "pointer ", pointer, " is not the start of a live allocation");
      ZA_REQUIRE(elements <= bytes / sizeof(float), "pointer ", pointer, " holds ", bytes,
                 " bytes, fewer than its count of ", elements, " float32 elements");
    };
    for (std::size_t i = 0; i < count; ++i) {
      for (const void* each :
           {static_cast<const void*>(parameters[i]), static_cast<const void*>(exp_avgs[i]),
            static_cast<const void*>(exp_avg_sqs[i])}) {
        ZA_REQUIRE(started.engine_of(each) == &engine, "pointer ", each,
                   " is not memory zeroalloc offloads on the device of ", parameters[0]);
        holds(each, counts[i]);
        managed.push_back(each);
      }
      if (master) {
        ZA_REQUIRE(started.owner_of(gradients[i]) == nullptr &&
                       started.owner_of(copies[i]) == nullptr && gradients[i] != nullptr &&
                       copies[i] != nullptr,
                   "a bf16 gradient or working copy (", gradients[i], ", ", copies[i],
                   ") is not host memory of the caller's");
      } else if (started.owner_of(gradients[i]) != nullptr) {
        ZA_REQUIRE(started.engine_of(gradients[i]) == &engine, "gradient ", gradients[i],
                   " is on another device than its parameter ", parameters[i]);
        holds(gradients[i], counts[i]);
        managed.push_back(gradients[i]);
      }
    }
    // Never on this driver: the host pool's memory is not open to the CPUs.
    if (zeroalloc::host_pool* pool = started.host_tier(ordinal);
        pool != nullptr && !pool->open_to_host()) {
      return 2;
    }
    zeroalloc::host_workers& workers = started.host_step_workers(ordinal);
    std::vector<zeroalloc::offload_engine::host_view> views;
    const zeroalloc::stream_handle on = device_stream(stream);
    if (!engine.use_on_host(managed, on, views)) return 0;
    // The uses end however this call ends (an exception would leave the chunks pinned).
    struct uses_end {
      zeroalloc::offload_engine& engine;
      const std::vector<const void*>& managed;
      zeroalloc::stream_handle on;
      ~uses_end() {
        try {
          engine.use_on_host_ends(managed, on);
        } catch (const std::exception& failure) {
          zeroalloc::log().error("ending the host step's uses failed: {}", failure.what());
        }
      }
    } ending{engine, managed, on};
    std::sort(views.begin(), views.end(),
              [](const auto& a, const auto& b) { return a.address < b.address; });
    // Each tensor in runs where all four lie in one chunk each (holds() made sure that the
    // chunks, whose views use_on_host returned, cover every count).
    std::vector<zeroalloc::adamw_span> spans;
    for (std::size_t i = 0; i < count; ++i) {
      const bool host_gradient = master || started.owner_of(gradients[i]) == nullptr;
      const std::size_t total = counts[i] * sizeof(float);
      for (std::size_t done = 0, run = 0; done < total; done += run) {
        run = total - done;
        std::array<std::uintptr_t, 4> host{};
        const std::array<std::uintptr_t, 4> device{
            reinterpret_cast<std::uintptr_t>(parameters[i]) + done,
            reinterpret_cast<std::uintptr_t>(gradients[i]) + done,
            reinterpret_cast<std::uintptr_t>(exp_avgs[i]) + done,
            reinterpret_cast<std::uintptr_t>(exp_avg_sqs[i]) + done};
        for (std::size_t k = 0; k < 4; ++k) {
          if (k == 1 && host_gradient) {
            host[k] = device[k];
            continue;
          }
          std::size_t left = 0;
          host[k] = host_address_in(views, device[k], left);
          ZA_REQUIRE(host[k] != 0, "internal error: ", reinterpret_cast<void*>(device[k]),
                     " lies in none of the chunks the engine opened to the CPUs");
          run = std::min(run, left);
        }
        zeroalloc::adamw_span span{reinterpret_cast<float*>(host[0]),
                                   reinterpret_cast<const float*>(host[1]),
                                   reinterpret_cast<float*>(host[2]),
                                   reinterpret_cast<float*>(host[3]), run / sizeof(float)};
        if (master) {
          // The gradient and copy arrays are bf16: half the fp32 offset.
          span.gradient = nullptr;
          span.bf16_gradient = static_cast<const std::uint16_t*>(gradients[i]) + done / 4;
          span.bf16_copy = static_cast<std::uint16_t*>(copies[i]) + done / 4;
        }
        spans.push_back(span);
      }
    }
    const zeroalloc::adamw_settings chosen{
        settings->lr,           settings->beta1, settings->beta2,        settings->eps,
        settings->weight_decay, settings->step,  settings->maximize != 0};
    zeroalloc::adamw_on_host(workers, spans, chosen);
    return 1;
  });
}

}  // namespace

ZA_EXPORT int zeroalloc_adamw_on_host(void* const* parameters, const void* const* gradients,
                                      void* const* exp_avgs, void* const* exp_avg_sqs,
                                      const size_t* counts, size_t count,
                                      const zeroalloc_adamw_settings* settings,
                                      zeroalloc_stream_t stream) {
  return adamw_on_host_call("zeroalloc_adamw_on_host", false, parameters, gradients, exp_avgs,
                            exp_avg_sqs, nullptr, counts, count, settings, stream);
}

ZA_EXPORT int zeroalloc_adamw_on_host_bf16(void* const* masters, const void* const* gradients,
                                           void* const* exp_avgs, void* const* exp_avg_sqs,
                                           void* const* copies, const size_t* counts, size_t count,
                                           const zeroalloc_adamw_settings* settings,
                                           zeroalloc_stream_t stream) {
  return adamw_on_host_call("zeroalloc_adamw_on_host_bf16", true, masters, gradients, exp_avgs,
                            exp_avg_sqs, copies, counts, count, settings, stream);
}

ZA_EXPORT int zeroalloc_host_adamw_rate(int device, size_t parameters,
                                        double* parameters_per_second) {
  return guarded("zeroalloc_host_adamw_rate", -1, [&] {
    ZA_REQUIRE(parameters_per_second != nullptr, "parameters_per_second is NULL");
    constexpr std::size_t kBytesEach = 16;  // fp32 master and moments, bf16 gradient and copy
    const std::size_t count = parameters != 0 ? parameters : std::size_t{64} << 20;
    runtime& started = runtime::get();
    zeroalloc::host_workers& workers = started.host_step_workers(device);  // checks `device`
    const std::uint64_t available = zeroalloc::host_available_bytes();
    const std::uint64_t reserve = zeroalloc::host_reserve_bytes();
    ZA_REQUIRE(available >= reserve && count <= (available - reserve) / kBytesEach,
               "measuring the host step's rate over ", count, " parameters needs ", kBytesEach,
               " bytes each of host memory above the ", reserve, " it keeps in reserve, but only ",
               available, " are available: measure fewer parameters, or free host memory");
    const double rate = zeroalloc::adamw_rate(workers, count);
    ZA_REQUIRE(rate > 0, "the host step's rate over ", count,
               " parameters could not be timed (every pass took no measurable time): "
               "measure more parameters");
    *parameters_per_second = rate;
    return 0;
  });
}

ZA_EXPORT int zeroalloc_pinned_create(int device, size_t bytes, void** address) {
  return guarded("zeroalloc_pinned_create", -1, [&] {
    ZA_REQUIRE(address != nullptr, "address is NULL");
    *address = runtime::get().pinned(device).create(bytes);  // pinned() checks `device`
    return 0;
  });
}

ZA_EXPORT int zeroalloc_pinned_release(void* address, zeroalloc_stream_t stream) {
  return guarded("zeroalloc_pinned_release", -1, [&] {
    zeroalloc::pinned_buffers* owner = runtime::get().pinned_owner(address);
    ZA_REQUIRE(owner != nullptr, "pointer ", address,
               " is not a pinned buffer zeroalloc_pinned_create made, or was released already");
    owner->release(address, device_stream(stream));
    return 0;
  });
}

ZA_EXPORT int64_t zeroalloc_pinned_bytes(int device) {
  return guarded("zeroalloc_pinned_bytes", int64_t{-1},
                 [&] { return static_cast<int64_t>(runtime::get().pinned(device).held_bytes()); });
}

ZA_EXPORT int zeroalloc_log(int level, const char* message) {
  return guarded("zeroalloc_log", -1, [&] {
    ZA_REQUIRE(message != nullptr, "message is NULL");
    constexpr std::array kLevels{spdlog::level::debug, spdlog::level::info, spdlog::level::warn,
                                 spdlog::level::err};  // ZEROALLOC_LOG_DEBUG .. _ERROR
    if (level < ZEROALLOC_LOG_DEBUG || level > ZEROALLOC_LOG_ERROR) {
      ZA_THROW(zeroalloc::invalid_argument, "log level ", level,
               " is none of ZEROALLOC_LOG_DEBUG, _INFO, _WARN and _ERROR (1 to 4)");
    }
    (void)runtime::get();  // the log's file and level are set when the library starts
    zeroalloc::log().log(kLevels[level - ZEROALLOC_LOG_DEBUG], "{}", message);
    return 0;
  });
}

ZA_EXPORT void zeroalloc_step_boundary(void) {
  guarded_void("zeroalloc_step_boundary", [&] {
    runtime& started = runtime::get();
    for (zeroalloc::caching_allocator* each : started.started_allocators()) {
      if (auto* engine = started.engine(each->backing().ordinal())) engine->step_boundary();
    }
    // Note [Step records] in profile/report.hpp: also without offload.
    if (zeroalloc::reporter* active = started.memory_reporter();
        active != nullptr && started.reporting_process()) {
      active->step_ended();
    }
  });
}

ZA_EXPORT int zeroalloc_offload(const void* pointer, int wait) {
  return guarded("zeroalloc_offload", -1, [&] {
    ZA_REQUIRE(engine_for(pointer).evict(pointer, wait != 0), "pointer ", pointer,
               " is not the start of a live allocation");
    return 0;
  });
}

ZA_EXPORT int zeroalloc_fetch(const void* pointer, int wait) {
  return guarded("zeroalloc_fetch", -1, [&] {
    ZA_REQUIRE(engine_for(pointer).fetch(pointer, wait != 0), "pointer ", pointer,
               " is not the start of a live allocation");
    return 0;
  });
}

ZA_EXPORT int zeroalloc_residency(const void* pointer) {
  return guarded("zeroalloc_residency", -1, [&] {
    runtime& started = runtime::get();
    zeroalloc::caching_allocator* owner = started.owner_of(pointer);
    std::vector<zeroalloc::chunk_info> chunks;
    ZA_REQUIRE(owner != nullptr && owner->chunks_of_allocation(pointer, chunks), "pointer ",
               pointer, " is not the start of a live allocation");
    zeroalloc::offload_engine* engine = started.engine_of(pointer);
    std::size_t device_chunks = 0;
    std::size_t host_chunks = 0;
    std::size_t parked_chunks = 0;
    std::size_t disk_chunks = 0;
    for (const zeroalloc::chunk_info& chunk : chunks) {
      bool parked = false;  // read with the residency, under one lock
      const zeroalloc::residency where = engine != nullptr
                                             ? engine->mover().where(chunk.address, parked)
                                             : zeroalloc::residency::device;
      if (where == zeroalloc::residency::device) {
        ++device_chunks;
      } else if (where == zeroalloc::residency::host) {
        ++(parked ? parked_chunks : host_chunks);
      } else if (where == zeroalloc::residency::disk) {
        ++disk_chunks;
      } else {
        return static_cast<int>(ZEROALLOC_MOVING);
      }
    }
    if (device_chunks == chunks.size()) return static_cast<int>(ZEROALLOC_ON_DEVICE);
    if (host_chunks == chunks.size()) return static_cast<int>(ZEROALLOC_ON_HOST);
    if (parked_chunks == chunks.size()) return static_cast<int>(ZEROALLOC_ON_HOST_UNMAPPED);
    if (disk_chunks == chunks.size()) return static_cast<int>(ZEROALLOC_ON_DISK);
    return static_cast<int>(ZEROALLOC_SPLIT);
  });
}

// Groups of ranks: one per process, never destroyed (a collective may still be in flight
// when the program ends).
namespace {

struct process_group {
  std::mutex mutex;
  std::unique_ptr<zeroalloc::transport> transport;
};

process_group& group() {
  static auto* made = new process_group;
  return *made;
}

zeroalloc::transport& joined_group() {
  process_group& joined = group();
  std::lock_guard lock(joined.mutex);
  ZA_REQUIRE(joined.transport != nullptr,
             "this process is in no group: call zeroalloc_group_join first");
  return *joined.transport;
}

}  // namespace

ZA_EXPORT int zeroalloc_group_join(const char* agreement, int timeout_ms) {
  return guarded("zeroalloc_group_join", -1, [&] {
    process_group& joined = group();
    std::lock_guard lock(joined.mutex);
    ZA_REQUIRE(joined.transport == nullptr, "this process joined its group already");
    zeroalloc::bootstrap_settings settings =
        zeroalloc::bootstrap_settings::from_environment(agreement != nullptr ? agreement : "");
    if (timeout_ms > 0) settings.timeout = std::chrono::milliseconds(timeout_ms);
    runtime& started = runtime::get();
    // One GPU per rank under NCCL, LOCAL_RANK's; over TCP ranks may share them; a simulated
    // device is each process's own.
    const bool over_tcp = started.simulated() || started.collectives_over_tcp();
    const int devices = started.simulated() ? 1 : started.device_count();
    ZA_REQUIRE(over_tcp || settings.local_rank < devices, "LOCAL_RANK=", settings.local_rank,
               " on a machine with ",
               devices == 1 ? std::string("one GPU") : std::to_string(devices) + " GPUs",
               ": NCCL takes one GPU per rank, so this rank would have none of its own. Start "
               "at most one rank per GPU, or set ZEROALLOC_COLLECTIVES=tcp on every rank to run "
               "several on one GPU (slow: for tests)");
    const int ordinal = devices == 1 ? 0 : settings.local_rank % devices;
    zeroalloc::device& backing = started.allocator(ordinal).backing();
    // Ranks on GPUs and ranks on the simulated device cannot form one group, nor ranks that
    // exchange bytes differently: it is part of what they must agree on.
    settings.agreement += std::string(settings.agreement.empty() ? "" : ";") +
                          "device=" + (backing.is_simulated() ? "sim" : "cuda") +
                          ";collectives=" + (over_tcp ? "tcp" : "nccl");
    if (over_tcp) {
      ZA_REQUIRE(settings.port + 1 <= 65535, "MASTER_PORT=", settings.port - 1,
                 ": collectives over TCP use MASTER_PORT + 2, not a TCP port");
      zeroalloc::bootstrap_exchange(settings, [] { return std::string(); });  // the agreement
      zeroalloc::bootstrap_settings transport_settings = settings;
      transport_settings.port = settings.port + 1;  // not the bootstrap's, closing meanwhile
      joined.transport = std::make_unique<zeroalloc::tcp_transport>(backing, transport_settings);
      return 0;
    }
    const std::string made = zeroalloc::bootstrap_exchange(settings, [] {
      const zeroalloc::nccl_transport::unique_id id = zeroalloc::nccl_transport::new_id();
      return std::string(id.begin(), id.end());
    });
    zeroalloc::nccl_transport::unique_id id{};
    ZA_REQUIRE(made.size() == id.size(), "rank 0 sent a group id of ", made.size(), " bytes");
    std::copy(made.begin(), made.end(), id.begin());
    joined.transport = std::make_unique<zeroalloc::nccl_transport>(
        backing, settings.rank, settings.world_size, id, settings.timeout);
    return 0;
  });
}

ZA_EXPORT int zeroalloc_group_rank(void) {
  process_group& joined = group();
  std::lock_guard lock(joined.mutex);
  return joined.transport != nullptr ? joined.transport->rank() : -1;
}

ZA_EXPORT int zeroalloc_group_size(void) {
  process_group& joined = group();
  std::lock_guard lock(joined.mutex);
  return joined.transport != nullptr ? joined.transport->world_size() : -1;
}

ZA_EXPORT int zeroalloc_group_all_gather(const void* send, void* receive, size_t bytes,
                                         zeroalloc_stream_t stream) {
  return guarded("zeroalloc_group_all_gather", -1, [&] {
    joined_group().all_gather(send, receive, bytes, device_stream(stream));
    return 0;
  });
}

ZA_EXPORT int zeroalloc_group_reduce_scatter(const void* send, void* receive, size_t count,
                                             int bfloat16, zeroalloc_stream_t stream) {
  return guarded("zeroalloc_group_reduce_scatter", -1, [&] {
    joined_group().reduce_scatter(
        send, receive, count,
        bfloat16 != 0 ? zeroalloc::element_type::bfloat16 : zeroalloc::element_type::float32,
        device_stream(stream));
    return 0;
  });
}

ZA_EXPORT int zeroalloc_group_broadcast(void* buffer, size_t bytes, int root,
                                        zeroalloc_stream_t stream) {
  return guarded("zeroalloc_group_broadcast", -1, [&] {
    joined_group().broadcast(buffer, bytes, root, device_stream(stream));
    return 0;
  });
}

ZA_EXPORT int zeroalloc_group_reduce(const void* send, void* receive, size_t count, int bfloat16,
                                     int root, zeroalloc_stream_t stream) {
  return guarded("zeroalloc_group_reduce", -1, [&] {
    joined_group().reduce(
        send, receive, count,
        bfloat16 != 0 ? zeroalloc::element_type::bfloat16 : zeroalloc::element_type::float32, root,
        device_stream(stream));
    return 0;
  });
}

ZA_EXPORT void zeroalloc_group_abort(const char* why) {
  guarded_void("zeroalloc_group_abort",
               [&] { joined_group().abort(why != nullptr ? why : "(no reason given)"); });
}
