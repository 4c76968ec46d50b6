// The chunk arena: physical memory for one device, in chunks, behind stable addresses.
//
// The caching allocator asks it to back an address range (a segment) with physical memory
// and, rarely, to take that memory back. The arena splits a segment into chunks of at most
// ZEROALLOC_CHUNK_SIZE bytes (the unit a later tier moves between device, host and disk),
// creates each chunk's physical handle only when its pool has none of that size, and
// charges every byte it holds, mapped or pooled, to the memory_limiter.
//
// Note [Handle pool]: creating and releasing physical memory costs 40-70 us and, unlike a
// map of an existing handle, cannot be hidden; cudaFree even waits for every running
// kernel. Decommitted chunks therefore go to a pool keyed by size and are mapped again by
// the next commit of that size; the pool is drained only by release_pool() (empty_cache,
// or a commit that needs bytes of another size under the limit).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "alloc/memory_limit.hpp"
#include "alloc/paging_listener.hpp"
#include "device/device.hpp"

namespace zeroalloc {

/// A physical chunk of a segment, as the offload engine sees it.
struct chunk_info {
  std::uintptr_t address = 0;  ///< where it is mapped; never changes while its segment lives
  physical_handle handle;      ///< what backs it now: a device- or a host-located handle
  int allocation_class = 0;    ///< the class of its segment (allocation_class as int)
  std::vector<stream_handle> streams;  ///< streams its segment's blocks were used on
  bool holds_live_blocks = false;      ///< an allocated (or pending-free) block overlaps it
  /// Changes whenever a block of its segment is allocated or freed, and differs between any
  /// two segments the process ever had (a value of the shared clock below, not a count that
  /// restarts): hints about the chunk's uses hold only while it stays the same, also when a
  /// later segment takes the same addresses.
  std::uint64_t generation = 0;
  /// When a block of its segment was last allocated or freed, on a clock shared by every
  /// heap of the process: how recently the program touched it, as far as the allocator
  /// sees (Note [Residency policy] uses it where no hint says more).
  std::uint64_t last_activity = 0;
};

class chunk_arena {
 public:
  /// `chunk_bytes`: a multiple of the device's granularity.
  chunk_arena(device& backing, std::size_t chunk_bytes, memory_limiter& limiter);
  ~chunk_arena();
  chunk_arena(const chunk_arena&) = delete;
  chunk_arena& operator=(const chunk_arena&) = delete;

  /// Reserves an address region of `bytes` (a multiple of the granularity).
  std::uintptr_t reserve_region(std::size_t bytes);

  /// Maps physical chunks over [address, address + bytes) and appends them to `chunks`:
  /// first `donated` (chunks taken from free segments, see Note [Moving free memory between
  /// classes] in heap_donation.cpp; emptied on success), then chunks from the pool or created.
  /// Returns false when the limit or the device's memory is exhausted, and throws
  /// device_error for any other failure; either way this call's mappings are undone, its new
  /// chunks are pooled, and the donated chunks are left in `donated` for the caller. When an
  /// unmap of that undo fails, `chunks` is left with the chunks still mapped (a device_error
  /// is thrown): the range is not to be reused.
  bool commit(std::uintptr_t address, std::size_t bytes, std::vector<physical_handle>& donated,
              std::vector<physical_handle>& chunks);

  /// Keeps chunks that are not mapped by their new owner in the pool.
  void keep_in_pool(std::vector<physical_handle>& chunks);

  /// Unmaps the chunks that commit() mapped at `address` and keeps them in the pool; a chunk
  /// the offload engine moved to host memory goes back to the tier instead, through
  /// `listener`'s host_chunk_released (called with no lock of the arena held).
  /// The caller guarantees that no queued work still touches the range. Throws
  /// device_error when an unmap fails: the chunks before it are unmapped and kept as above,
  /// and `chunks` is left with those still mapped (the failed one first, at the end of the
  /// range).
  void decommit(std::uintptr_t address, std::vector<physical_handle>& chunks,
                paging_listener* listener);

  /// A device chunk of `bytes` for the offload engine to copy into: from the pool, else
  /// created within the limit; invalid when neither is possible.
  physical_handle take_chunk(std::size_t bytes);
  /// Gives the offload engine's device chunk (one that take_chunk returned, or one it moved
  /// out of an allocation) to the pool.
  void return_chunk(physical_handle chunk);

  /// Releases every pooled chunk to the device; returns the bytes released.
  std::uint64_t release_pool();

  [[nodiscard]] std::uint64_t pooled_bytes() const;
  void lock_for_fork() const { mutex_.lock(); }
  void unlock_after_fork() const { mutex_.unlock(); }
  [[nodiscard]] std::size_t chunk_bytes() const { return chunk_bytes_; }
  /// The limit every byte it holds is charged against.
  [[nodiscard]] std::uint64_t limit_bytes() const { return limiter_.limit_bytes(); }
  /// Bytes charged against the limit now: chunks mapped or pooled, of every heap.
  [[nodiscard]] std::uint64_t held_bytes() const { return limiter_.used_bytes(); }
  [[nodiscard]] std::size_t granularity() const { return granularity_; }
  [[nodiscard]] device& backing() { return device_; }

 private:
  physical_handle obtain_chunk(std::size_t bytes);  // from the pool, else created
  void release_pool_locked();

  device& device_;
  const std::size_t chunk_bytes_;
  const std::size_t granularity_;
  memory_limiter& limiter_;
  mutable std::mutex mutex_;
  std::map<std::size_t, std::vector<physical_handle>> pool_;  // bytes -> idle handles
  std::uint64_t pooled_bytes_ = 0;
  std::vector<std::pair<std::uintptr_t, std::size_t>> regions_;
};

}  // namespace zeroalloc
