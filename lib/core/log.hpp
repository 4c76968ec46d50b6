// The library's logger (spdlog). Nothing on the allocation fast path logs at the default
// level (warn); slow paths (new chunks, cache flushes, out-of-memory) log at debug/info.
#pragma once

#include <spdlog/spdlog.h>

namespace zeroalloc {

struct options;

/// The "zeroalloc" logger; writes to standard error until configure_logging() runs.
spdlog::logger& log();

/// Applies ZEROALLOC_LOG_LEVEL and ZEROALLOC_LOG_FILE. An unwritable log file is reported
/// on standard error, naming the path, and logging stays on standard error.
void configure_logging(const options& parsed);

}  // namespace zeroalloc
