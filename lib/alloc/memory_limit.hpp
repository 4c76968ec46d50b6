// The device-memory budget: how many bytes of physical device memory zeroalloc may hold.
// A separate piece so that the chunk arena (and later the offload engine) share one
// account; charged before a physical chunk is created, credited after one is released.
#pragma once

#include <atomic>
#include <cstdint>

namespace zeroalloc {

class memory_limiter {
 public:
  explicit memory_limiter(std::uint64_t limit_bytes) : limit_bytes_(limit_bytes) {}

  /// Charges `bytes` if that keeps the total within the limit; false (and no charge) if not.
  bool try_charge(std::uint64_t bytes) {
    std::uint64_t used = used_bytes_.load(std::memory_order_relaxed);
    do {
      if (used + bytes > limit_bytes_.load(std::memory_order_relaxed)) return false;
    } while (!used_bytes_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
    return true;
  }
  void credit(std::uint64_t bytes) { used_bytes_.fetch_sub(bytes, std::memory_order_relaxed); }

  [[nodiscard]] std::uint64_t used_bytes() const {
    return used_bytes_.load(std::memory_order_relaxed);
  }
  [[nodiscard]] std::uint64_t limit_bytes() const {
    return limit_bytes_.load(std::memory_order_relaxed);
  }
  /// A lower limit takes effect for later charges; memory already held is not taken back.
  void set_limit_bytes(std::uint64_t bytes) {
    limit_bytes_.store(bytes, std::memory_order_relaxed);
  }

 private:
  std::atomic<std::uint64_t> limit_bytes_;
  std::atomic<std::uint64_t> used_bytes_{0};
};

}  // namespace zeroalloc
