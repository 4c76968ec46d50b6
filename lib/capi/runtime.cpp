#include "capi/runtime.hpp"

#include <pthread.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "core/errors.hpp"
#include "core/log.hpp"
#include "core/units.hpp"

namespace zeroalloc {

namespace {

reporter* g_exit_reporter = nullptr;
runtime* g_forking_runtime = nullptr;
pid_t g_reporting_process = 0;

// The outcome of the one start-up attempt: a runtime, or the reason there is none.
struct startup {
  runtime* started = nullptr;
  std::string failure;
};

}  // namespace

runtime::runtime(const options& parsed) : options_(parsed), registry_(parsed) {
  if (!parsed.report_prefix.empty()) {
    reporter::settings_list shown;
    for (const option_spec& spec : option_table()) {
      const char* value = std::getenv(std::string(spec.name).c_str());
      shown.emplace_back(
          std::string(spec.name),
          value != nullptr
              ? std::string(value)
              : detail::concat(spec.default_value.empty() ? "(unset)" : spec.default_value,
                               " (default)"));
    }
    // Under torchrun every rank inherits the variable: each writes its own files.
    std::string prefix = parsed.report_prefix;
    if (const char* rank = std::getenv("RANK")) prefix += std::string(".rank") + rank;
    reporter_ = std::make_unique<reporter>(
        prefix, [this] { return started_allocators(); }, std::move(shown));
    reporter_->start();
    // The runtime is never destroyed, so the exit report runs while everything it reads is
    // alive. (Not through runtime::get(): its static may already be destroyed by then.)
    // A forked child that exits must neither join the parent's sampler thread (it does not
    // exist there) nor overwrite the parent's report.
    g_exit_reporter = reporter_.get();
    g_reporting_process = ::getpid();
    std::atexit([] {
      if (::getpid() != g_reporting_process) return;
      g_exit_reporter->stop();
      g_exit_reporter->write("exit");
    });
  }
  // Note [Fork] in alloc/caching_allocator.cpp. Last, so that a constructor that throws
  // leaves no handler behind; the runtime then lives for the whole process.
  g_forking_runtime = this;
  pthread_atfork([] { g_forking_runtime->prepare_fork(); }, [] { g_forking_runtime->after_fork(); },
                 [] { g_forking_runtime->after_fork(); });
  log().info("zeroalloc started: {} {} device(s), chunk size {}", registry_.count(),
             registry_.kind(), format_bytes(parsed.chunk_bytes));
}

runtime& runtime::get() {
  // Leaked: static destructors of other libraries may still allocate after ours would run.
  static startup& outcome = *new startup([] {
    startup attempt;
    try {
      const options parsed = options::from_environment();
      configure_logging(parsed);
      attempt.started = new runtime(parsed);
    } catch (const std::exception& failure) {
      attempt.failure = detail::concat("zeroalloc cannot start: ", failure.what());
      log().error("{}", attempt.failure);
    }
    return attempt;
  }());
  if (outcome.started == nullptr) throw config_error(outcome.failure);
  return *outcome.started;
}

caching_allocator& runtime::allocator(int ordinal) {
  if (ordinal < 0 || ordinal >= registry_.count() || ordinal >= kMaxDevices) {
    ZA_THROW(invalid_argument, "device ", ordinal, " does not exist: zeroalloc drives ",
             registry_.count(), " ", registry_.kind(), " device(s), numbered from 0");
  }
  if (caching_allocator* ready = allocators_[ordinal].load(std::memory_order_acquire))
    return *ready;
  std::lock_guard lock(create_mutex_);
  if (caching_allocator* ready = allocators_[ordinal].load(std::memory_order_acquire))
    return *ready;
  devices_.push_back(registry_.open(ordinal));
  device& opened = *devices_.back();
  allocator_settings settings;
  settings.chunk_bytes = options_.chunk_bytes;
  if (options_.limit.is_set()) {
    settings.limit_bytes = options_.limit.resolve(opened.query_memory().total_bytes);
    settings.limit_source = "ZEROALLOC_MEMORY_LIMIT=" + options_.limit.text;
  }
  owned_allocators_.push_back(std::make_unique<caching_allocator>(opened, settings));
  caching_allocator* created = owned_allocators_.back().get();
  if (reporter_) {
    created->set_out_of_memory_observer([this](const std::string& message) {
      if (reporting_process()) reporter_->out_of_memory(message);
    });
  }
  allocators_[ordinal].store(created, std::memory_order_release);
  log().info("device {}: {}, limit {}", ordinal, opened.name(),
             format_bytes(created->limit_bytes()));
  return *created;
}

caching_allocator* runtime::owner_of(const void* pointer) {
  for (int ordinal = 0; ordinal < registry_.count() && ordinal < kMaxDevices; ++ordinal) {
    caching_allocator* candidate = allocators_[ordinal].load(std::memory_order_acquire);
    if (candidate != nullptr && candidate->owns(pointer)) return candidate;
  }
  return nullptr;
}

bool runtime::reporting_process() const { return ::getpid() == g_reporting_process; }

void runtime::prepare_fork() {
  create_mutex_.lock();
  for (caching_allocator* each : started_allocators()) each->prepare_fork();
}

void runtime::after_fork() {
  for (caching_allocator* each : started_allocators()) each->after_fork();
  create_mutex_.unlock();
}

bool runtime::deallocate(void* pointer) {
  for (int ordinal = 0; ordinal < registry_.count() && ordinal < kMaxDevices; ++ordinal) {
    caching_allocator* candidate = allocators_[ordinal].load(std::memory_order_acquire);
    if (candidate != nullptr && candidate->deallocate(pointer)) return true;
  }
  return false;
}

std::vector<caching_allocator*> runtime::started_allocators() {
  std::vector<caching_allocator*> started;
  for (int ordinal = 0; ordinal < registry_.count() && ordinal < kMaxDevices; ++ordinal) {
    if (caching_allocator* each = allocators_[ordinal].load(std::memory_order_acquire)) {
      started.push_back(each);
    }
  }
  return started;
}

}  // namespace zeroalloc
