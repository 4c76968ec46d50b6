// A lock for short critical sections on the allocation fast path: one atomic exchange to
// take it, a plain release store to give it back (std::mutex pays a second atomic
// read-modify-write on unlock). Waiters spin briefly, then yield the processor, so a
// holder that was descheduled does not burn the other cores.
//
// A lock sits alone on its cache lines (two of them: adjacent-line prefetch pairs lines on
// x86): the data it guards or its neighbours' counters, written by the holder, must not
// share the line that the waiters spin on.
#pragma once

#include <atomic>
#include <thread>

namespace zeroalloc {

class alignas(128) spin_lock {
 public:
  void lock() noexcept {
    for (;;) {
      if (!locked_.exchange(true, std::memory_order_acquire)) return;
      for (int spins = 0; locked_.load(std::memory_order_relaxed); ++spins) {
        if (spins < 64) {
          relax();
        } else {
          std::this_thread::yield();
        }
      }
    }
  }
  bool try_lock() noexcept {
    return !locked_.load(std::memory_order_relaxed) &&
           !locked_.exchange(true, std::memory_order_acquire);
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  static void relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  std::atomic<bool> locked_{false};
};

static_assert(alignof(spin_lock) == 128 && sizeof(spin_lock) == 128,
              "a spin lock has its cache lines to itself");

}  // namespace zeroalloc
