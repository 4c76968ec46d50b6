// Pinned host memory of the host step's own: the buffers its copies go through.
//
// Note [Pinned buffers made ahead]: the host step copies every gradient the CPUs read into
// pinned host memory, and the CPUs write each updated master, rounded to bf16, into pinned
// memory that the device copies from (Note [Host windows] in the Python package). Made by
// PyTorch's pinned allocator on the step's path, those buffers cost the first host step about
// 2 s on the 1.3B Llama at 13.3 GiB (H100, bench/RESULTS.md): that allocator rounds each size
// up to a power of two (2.7 GB of gradients took 4 GiB, a 1 GiB window's copies 2 GiB), and
// pinning costs about 0.25 s a GiB. These buffers are exact (a whole number of pages), their
// pages lie on the GPU's NUMA node, where the CPUs that read and write them run, and they are
// made by a call that lets other threads run meanwhile, so the caller can make them on a
// thread of its own before the step needs them.
//
// Pinned memory is never swapped (Note [Host budget] in tier/host_pool.hpp), so a buffer that
// would leave the host less than its reserve (host_reserve_bytes) is refused with
// host_memory_exhausted, naming both: the caller then does without. A buffer is released
// once the work queued so far on the stream its caller names (the copies into and out of it)
// is done: at once when it is, else at a later call of this object's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "device/device.hpp"

namespace zeroalloc {

class pinned_buffers {
 public:
  explicit pinned_buffers(device& backing) : device_(backing) {}
  /// Waits for the work of the buffers released meanwhile, and releases every buffer.
  ~pinned_buffers();
  pinned_buffers(const pinned_buffers&) = delete;
  pinned_buffers& operator=(const pinned_buffers&) = delete;

  /// A pinned buffer of at least `bytes` (rounded up to the host's page size), on the
  /// device's NUMA node where the host lets it. Throws invalid_argument for 0 bytes,
  /// host_memory_exhausted when it would leave the host less than its reserve, device_error
  /// when the driver refuses to pin it.
  [[nodiscard]] void* create(std::size_t bytes);
  /// Releases the buffer at `address` once the work queued so far on `stream` is done.
  /// Throws invalid_argument when `address` is not a buffer of this object's.
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
  // Takes the released buffers whose work is done out of pending_ (with the lock held): the
  // caller frees them without it.
  std::vector<released> take_done_locked();
  void free_all(const std::vector<released>& gone);

  device& device_;
  mutable std::mutex mutex_;
  std::unordered_map<std::uintptr_t, std::size_t> live_;  // address -> bytes
  std::vector<released> pending_;
  std::uint64_t held_bytes_ = 0;
};

}  // namespace zeroalloc
