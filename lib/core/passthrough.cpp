#include "core/passthrough.hpp"

#include "core/json.hpp"

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

std::string passthrough_json() {
  std::string out = "{";
  for (std::size_t i = 0; i < std::size(counters); ++i) {
    if (i > 0) out += ',';
    out += json_quote(kPassthroughNames[i]);
    out += ":{\"calls\":" + std::to_string(counters[i].calls.load(std::memory_order_relaxed)) +
           ",\"bytes\":" + std::to_string(counters[i].bytes.load(std::memory_order_relaxed)) + "}";
  }
  return out + "}";
}

}  // namespace zeroalloc
