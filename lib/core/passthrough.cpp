#include "core/passthrough.hpp"

#include <nlohmann/json.hpp>

namespace zeroalloc {
namespace {

struct counter {
  std::atomic<std::uint64_t> calls{0};
  std::atomic<std::uint64_t> bytes{0};
};

// Constant-initialised: hooks may count before any constructor of this library has run.
constinit counter counters[static_cast<std::size_t>(passthrough_call::count_)];

}  // namespace

void count_passthrough(passthrough_call call, std::uint64_t bytes) noexcept {
  counter& each = counters[static_cast<std::size_t>(call)];
  each.calls.fetch_add(1, std::memory_order_relaxed);
  if (bytes != 0) each.bytes.fetch_add(bytes, std::memory_order_relaxed);
}

nlohmann::ordered_json passthrough_figures() {
  nlohmann::ordered_json figures = nlohmann::ordered_json::object();
  for (std::size_t i = 0; i < std::size(counters); ++i) {
    figures[kPassthroughNames[i]] = {{"calls", counters[i].calls.load(std::memory_order_relaxed)},
                                     {"bytes", counters[i].bytes.load(std::memory_order_relaxed)}};
  }
  return figures;
}

}  // namespace zeroalloc
