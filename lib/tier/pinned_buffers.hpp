// Pinned host memory of the host step's own: the buffers its copies go through.
//
// Note [Pinned buffers made ahead]: the host step copies every gradient the CPUs read into
// pinned host memory. The CPUs write each updated master, rounded to bf16, into pinned memory
// too, and the device copies it from there (Note [Host windows] in the Python package).
// PyTorch's pinned allocator makes those buffers on the step's path. It rounds each size up
// to a power of two, and pinning costs about 0.25 s a GiB: the first host step of the 1.3B
// Llama spent about 2 s on it (bench/RESULTS.md, "Where step 1 goes"). These buffers hold a
// whole number of pages, no more. Their pages lie on the GPU's NUMA node, where the CPUs that
// read and write them run. They are made by a call that lets other threads run meanwhile, so
// the caller can make them on a thread of its own before the step needs them.
//
// Pinned memory is never swapped (Note [Host budget] in tier/host_pool.hpp). So a buffer that
// would leave the host less than its reserve (host_reserve_bytes) is refused with
// host_memory_exhausted, naming both. The caller then does without. The host tier may still
// grow to its limit (ZEROALLOC_HOST_LIMIT) after a buffer is made, as the engine moves the
// states out: a 7B model at 24 GiB had its buffers made first, and the host tier then
// refused thousands of offloads at the reserve (bench/RESULTS.md, 2026-12-06). So a buffer
// must also leave what the tier may still take (set_kept). A released buffer goes
// back to the host once the work queued so far on the stream its caller names is done: a
// thread of this object's waits for that. The buffers are not inherited by a forked child
// (MADV_DONTFORK): the kernel would otherwise copy every pinned page into each child.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "device/device.hpp"

namespace zeroalloc {

class pinned_buffers {
 public:
  explicit pinned_buffers(device& backing) : device_(backing) {}
  /// Waits for the work of the buffers released meanwhile, and releases every buffer.
  ~pinned_buffers();
  pinned_buffers(const pinned_buffers&) = delete;
  pinned_buffers& operator=(const pinned_buffers&) = delete;

  /// What the host must keep beside its reserve for the rest of the library, asked at each
  /// create(): the host tier's growth to its limit (runtime::pinned sets it).
  void set_kept(std::function<std::uint64_t()> kept);

  /// A pinned buffer of at least `bytes` (rounded up to the host's page size), on the
  /// device's NUMA node where the host lets it. Throws invalid_argument for 0 bytes,
  /// host_memory_exhausted when it would leave the host less than its reserve and what
  /// set_kept names, device_error when the driver refuses to pin it.
  [[nodiscard]] void* create(std::size_t bytes);
  /// Releases the buffer at `address` once the work queued so far on `stream` is done (a
  /// thread of this object's waits for it). Throws invalid_argument when `address` is not a
  /// buffer of this object's.
  void release(void* address, stream_handle stream);

  /// True when `address` is the start of a buffer of this object's, not released.
  [[nodiscard]] bool owns(const void* address) const;
  /// Bytes pinned now: buffers in use, and those released whose work is still queued.
  [[nodiscard]] std::uint64_t held_bytes() const;
  /// Buffers released whose work is still queued (tests).
  [[nodiscard]] std::size_t pending() const;

 private:
  struct released {
    void* address = nullptr;
    std::size_t bytes = 0;
    event_handle done = nullptr;
  };
  // The reaper: frees each released buffer once its event has completed, in order.
  void reap();
  // Gives the buffer back to the host; logs a failure (the bytes then stay pinned).
  void free_buffer(const released& gone);

  device& device_;
  mutable std::mutex mutex_;
  std::condition_variable released_;                      // a buffer released, or stopping_
  std::unordered_map<std::uintptr_t, std::size_t> live_;  // address -> bytes
  std::deque<released> pending_;
  std::uint64_t held_bytes_ = 0;
  std::function<std::uint64_t()> kept_;  // mutex_
  bool stopping_ = false;
  std::thread reaper_;  // started with the first release
};

}  // namespace zeroalloc
