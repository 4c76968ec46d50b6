#include "core/log.hpp"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_sinks.h>

#include <memory>
#include <mutex>

#include "core/options.hpp"

namespace zeroalloc {

namespace {

std::shared_ptr<spdlog::logger> make_stderr_logger() {
  auto logger = std::make_shared<spdlog::logger>("zeroalloc",
                                                 std::make_shared<spdlog::sinks::stderr_sink_mt>());
  logger->set_pattern("[zeroalloc %L %H:%M:%S.%e] %v");
  logger->set_level(spdlog::level::warn);
  return logger;
}

// Leaked on purpose: allocations can be freed by static destructors after spdlog's registry
// is gone, and those paths may still log. Made on first use (Note [Before the library's
// constructors] in core/options.cpp).
std::shared_ptr<spdlog::logger>& current_logger() {
  static auto* const logger = new std::shared_ptr<spdlog::logger>(make_stderr_logger());
  return *logger;
}
std::mutex g_configure_mutex;  // constant-initialised

}  // namespace

spdlog::logger& log() { return *current_logger(); }

void configure_logging(const options& parsed) {
  std::lock_guard lock(g_configure_mutex);
  std::shared_ptr<spdlog::logger> logger = current_logger();
  if (!parsed.log_file.empty()) {
    try {
      auto file_sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(parsed.log_file);
      logger = std::make_shared<spdlog::logger>("zeroalloc", file_sink);
      logger->set_pattern("[zeroalloc %L %Y-%m-%d %H:%M:%S.%e] %v");
      logger->flush_on(spdlog::level::warn);
    } catch (const spdlog::spdlog_ex& failure) {
      logger->warn(
          "cannot write the log file ZEROALLOC_LOG_FILE='{}' ({}); logging to standard "
          "error instead. Point ZEROALLOC_LOG_FILE at a writable path.",
          parsed.log_file, failure.what());
    }
  }
  logger->set_level(spdlog::level::from_str(parsed.log_level));
  current_logger() = logger;
}

}  // namespace zeroalloc
