// The paging view of a caching allocator: what the tier (lib/tier) does with the
// allocator's memory besides allocating it; paging_listener is the other direction, what
// the allocator tells the tier. The offload engine and the migrator move the physical
// chunks of live segments between device and host memory at fixed addresses; for that they
// list chunks, pin one while it moves (Note [Pinned chunks] in heap_pinning.cpp), map
// another backing under it, take device chunks from the arena to copy into, and take the
// cache of idle classes before they move anything live. A user of the allocator needs none
// of this, so it is not on caching_allocator's own surface: the tier asks
// caching_allocator::paging() for this view and keeps it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "alloc/allocation_class.hpp"
#include "alloc/chunk_arena.hpp"
#include "alloc/paging_listener.hpp"
#include "device/device.hpp"

namespace zeroalloc {

class caching_allocator;

class paging_view {
 public:
  /// Makes `listener` the allocator's (paging_listener): once, before the allocator is used
  /// by other threads. Throws invalid_argument when one is attached already.
  void attach(paging_listener& listener);
  /// Detaches the listener, before it is destroyed; no allocation may be in flight.
  void detach();
  /// Detaches `listener` if it is the one attached, else does nothing: what a listener's
  /// destructor calls, so that none outlives its attachment whoever owns it.
  void detach(paging_listener& listener);

  /// Appends the chunks of every segment that holds live allocations.
  void list_chunks(std::vector<chunk_info>& into) const;
  /// Pins the chunk mapped at `address` so that its segment is neither unmapped nor given
  /// to another class until unpin_chunk; fills `into`. False when no chunk starts there, or
  /// it is pinned already.
  bool pin_chunk(std::uintptr_t address, chunk_info& into);
  /// Maps `replacement` at the pinned chunk's address instead of its handle (which it
  /// returns); the chunk stays pinned. No queued work may touch the chunk (the caller
  /// fences it). On failure the old handle is mapped back. Throws invalid_argument when no
  /// pinned chunk of the replacement's size is mapped at `address`.
  physical_handle remap_pinned_chunk(std::uintptr_t address, physical_handle replacement);
  void unpin_chunk(std::uintptr_t address);

  /// The arena behind the allocator's segments: device chunks for a move to copy into, and
  /// the chunk size and granularity of the device.
  [[nodiscard]] chunk_arena& arena() const;

  /// Note [Idle classes' cache]: bytes of the cache of classes with nothing allocated (the
  /// gradients' between a step and the next backward), which release_idle_cache() would give
  /// back; cheaper to take than anything live is to move.
  [[nodiscard]] std::uint64_t idle_cache_bytes() const;
  /// Releases the cache of every class with nothing allocated (waits for the work queued on
  /// it: call it off the training thread, or where a wait is due anyway); returns the bytes.
  std::uint64_t release_idle_cache();
  /// Bytes of mapped segments of `cls` now (on the device or moved to the host); no lock.
  [[nodiscard]] std::int64_t reserved_bytes(allocation_class cls) const;

 private:
  friend class caching_allocator;
  explicit paging_view(caching_allocator& allocator) : allocator_(allocator) {}

  caching_allocator& allocator_;
};

}  // namespace zeroalloc
