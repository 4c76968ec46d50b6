// The paging listener: what a caching allocator tells the tier above it (lib/tier) and the
// two things it asks of it. The allocator knows nothing of the offload engine: it calls the
// one listener attached to it (paging_view::attach), on slow paths only (a new segment, a
// segment released, an allocation that finds no room or lands on the host); a cached block
// handed out or freed calls nothing. With no listener attached the allocator moves nothing:
// an allocation that still finds no room after the cache was released fails.
//
// Every method has an empty default, so that a listener overrides what it handles (the
// migrator on its own takes back host chunks only). The offload engine implements them all.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "alloc/allocation_class.hpp"
#include "device/device.hpp"

namespace zeroalloc {

class paging_listener {
 public:
  virtual ~paging_listener() = default;

  // What the allocator asks.

  /// An allocation found no room even after the cache was released: free device memory for
  /// a new segment of `bytes_needed` (move chunks to the host), waiting until it is free.
  /// Returns the bytes freed, 0 when nothing more could go; asked again (a few times) while
  /// it frees something and the allocation still finds no room. Called with no lock of the
  /// allocator held; may throw (the allocation fails with that exception).
  virtual std::uint64_t relieve_pressure(std::size_t /*bytes_needed*/) { return 0; }
  /// Asked when the allocation fails all the same, after relieve_pressure: why it could not
  /// free more on this thread (the host tier is full, say), for the out-of-memory message;
  /// empty when there is nothing to say. No lock held; must not throw.
  virtual std::string pressure_note() { return {}; }

  // What the allocator tells.

  /// A new allocation at `pointer`, for `stream`, lies in memory moved to the host or being
  /// moved (Note [Landing in a moving chunk] in heap.cpp): bring it back, ordered before the
  /// stream's next work, or leave it there. No lock held; an exception is logged and the
  /// allocation stands where it is, except out_of_memory (it lies where no kernel may reach
  /// it: a chunk on disk that could not come back), which frees it and fails the allocation.
  virtual void allocated_on_host(const void* /*pointer*/, stream_handle /*stream*/) {}
  /// A segment of `cls` gained a physical chunk of `chunk_bytes` (mapped), or lost one
  /// (unmapped, or given to another class). Called with the heap's lock held: brief, never
  /// calls into the allocator, never throws.
  virtual void chunk_gained(allocation_class /*cls*/, std::size_t /*chunk_bytes*/) {}
  virtual void chunk_lost(allocation_class /*cls*/, std::size_t /*chunk_bytes*/) {}
  /// A segment was unmapped while `chunk`, host memory the tier mapped into it at
  /// `address`, still backed part of it: the host memory is the tier's again. Called with
  /// the heap's lock held (not the arena's); never calls into the allocator, never throws.
  virtual void host_chunk_released(physical_handle /*chunk*/, std::uintptr_t /*address*/) {}
  /// An allocation is about to throw out_of_memory with `message` (reports keep it). No lock
  /// held; must not throw.
  virtual void out_of_memory(const std::string& /*message*/) {}
};

}  // namespace zeroalloc
