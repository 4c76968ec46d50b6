// The caching allocator of one device: stream-ordered, size-binned best fit over segments
// that the chunk arena backs with physical memory.
//
// Memory is organised in heaps, one per (allocation class, size kind): small requests
// (up to 1 MiB) are packed into 2 MiB segments, large ones into segments of their own size
// (rounded to 2 MiB; requests under 10 MiB share 20 MiB segments), as PyTorch's allocator
// does, because that is what keeps reserved memory within a few percent of allocated
// memory on training workloads. Each heap has its own address region, lock, free-block
// index and address lookup, so threads allocating different classes or sizes never
// contend, and the fast path (a cached block of the right stream) takes one uncontended
// lock and allocates nothing.
//
// Note [Stream-ordered reuse]: a freed block keeps the stream it was used on. A request on
// that stream may reuse it at once: the stream orders the new work after the old. A
// request on another stream takes it only after recording an event on the old stream and
// making the new stream wait for that event, so the block is never handed out while work
// that may still touch it is queued elsewhere; no host thread waits. Blocks used on more
// streams (record_stream) are not reused at all until events recorded on each of those
// streams at free time have completed.
//
// The tier above (lib/tier) meets the allocator at two small interfaces, one each way: the
// paging_listener it attaches is what the allocator tells it and asks of it (relieve
// pressure, a chunk gained or lost, ...), and the paging_view it obtains from paging() is
// what it may do with the allocator's chunks. The surface below is a user's.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "alloc/allocation_class.hpp"
#include "alloc/allocator_stats.hpp"
#include "alloc/chunk_arena.hpp"
#include "alloc/memory_limit.hpp"
#include "alloc/paging_listener.hpp"
#include "alloc/paging_view.hpp"
#include "device/device.hpp"

namespace zeroalloc {

class heap;

/// Settings of one device's allocator.
struct allocator_settings {
  std::size_t chunk_bytes = 64ull << 20;  ///< ZEROALLOC_CHUNK_SIZE
  std::uint64_t limit_bytes = 0;          ///< 0: the device's total memory
  std::string limit_source;               ///< what set the limit, for error messages
  /// Most bytes the host tier may hold for this device (0: no offload). The address regions
  /// of the classes the offload engine moves grow by this much (Note [Address regions]).
  std::uint64_t host_tier_bytes = 0;
  /// Releases of cached memory wait for every stream of the device, not only the streams
  /// its blocks knew (ZEROALLOC_ACCESS=any; Note [Released after every stream]).
  bool drain_before_release = false;
};

class caching_allocator {
 public:
  /// Every allocation is aligned to this many bytes and rounded up to a multiple of it.
  static constexpr std::size_t kAlignment = 512;
  /// Requests up to this size are small: packed into 2 MiB segments.
  static constexpr std::size_t kSmallRequestBytes = 1ull << 20;

  caching_allocator(device& backing, const allocator_settings& settings);
  ~caching_allocator();
  caching_allocator(const caching_allocator&) = delete;
  caching_allocator& operator=(const caching_allocator&) = delete;

  /// Returns `bytes` (0 allowed: a unique minimal block) of memory usable on `stream`.
  /// Throws out_of_memory after releasing the cache and retrying.
  void* allocate(std::size_t bytes, stream_handle stream, allocation_class cls);

  /// Frees memory from allocate(). Returns false (and changes nothing) when `pointer` is
  /// not the start of a live allocation of this allocator.
  bool deallocate(void* pointer);

  /// True when `pointer` lies in this allocator's address regions.
  [[nodiscard]] bool owns(const void* pointer) const;

  /// Marks the allocation at `pointer` as used on `stream` too. Returns false when `pointer`
  /// is not the start of a live allocation.
  bool record_stream(void* pointer, stream_handle stream);

  /// Call before destroying a stream that allocations were used on: waits for its work and
  /// detaches its cached blocks, so no event is ever recorded on the destroyed stream (a
  /// stream no block was used on returns at once).
  void forget_stream(stream_handle stream);

  /// Unmaps every fully free segment and returns the physical memory to the device, after
  /// waiting for the work queued on those segments' streams.
  void empty_cache();

  /// Changes the limit on physical memory held; `source` names what set it.
  void set_limit(std::uint64_t bytes, std::string source);
  [[nodiscard]] std::uint64_t limit_bytes() const { return limiter_.limit_bytes(); }
  /// Physical device memory held: mapped segments and idle pooled chunks.
  [[nodiscard]] std::uint64_t held_bytes() const { return limiter_.used_bytes(); }

  /// Every figure of every class, read now.
  [[nodiscard]] stats_snapshot stats() const;
  /// Sets every peak to its current value.
  void reset_peak_stats();
  /// Bytes of live allocations, every class.
  [[nodiscard]] std::uint64_t allocated_bytes() const;
  /// Largest free block of a class: the biggest request it could serve without new memory.
  [[nodiscard]] std::size_t largest_free_block(allocation_class cls) const;
  /// A live allocation, for reports.
  struct allocation_record {
    std::uintptr_t address = 0;
    std::size_t bytes = 0;
    allocation_class cls = allocation_class::other;
  };
  /// The `count` largest live allocations, largest first.
  [[nodiscard]] std::vector<allocation_record> largest_allocations(std::size_t count) const;

  /// Every segment with its blocks (a device's entry of zeroalloc_snapshot_json).
  [[nodiscard]] nlohmann::ordered_json snapshot_json() const;
  /// Statistics (the object zeroalloc_stats_json returns, less what the runtime adds).
  [[nodiscard]] nlohmann::ordered_json stats_json() const;

  [[nodiscard]] device& backing() { return device_; }

  /// Appends the physical chunks the live allocation at `pointer` spans, with where each is
  /// now (chunk_info); false when there is none. The tier reads it, and so does the C ABI's
  /// residency query.
  bool chunks_of_allocation(const void* pointer, std::vector<chunk_info>& into) const;
  /// Bytes of the live allocation starting at `pointer` (at least what was asked for), or 0
  /// when none starts there.
  [[nodiscard]] std::size_t allocation_bytes(const void* pointer) const;

  /// What the tier works with besides allocations: its listener (paging_listener), chunks
  /// to pin and remap, the arena, the idle classes' cache.
  [[nodiscard]] paging_view paging() { return paging_view(*this); }

  /// Around fork(): take every lock of this allocator, in the one order the allocator
  /// itself takes them, and give them back in parent and child (Note [Fork]).
  void prepare_fork();
  void after_fork();

 private:
  friend class paging_view;

  heap& heap_for(allocation_class cls, std::size_t rounded_bytes);
  /// The heap whose address region holds `address`, or nullptr.
  heap* heap_at(std::uintptr_t address) const;
  /// `on_host`: as heap::allocate's.
  void* allocate_after_pressure(std::size_t rounded_bytes, std::size_t requested_bytes,
                                stream_handle stream, allocation_class cls, bool& on_host);
  /// Releases cache (what the new segment of `needed` bytes needs, then all of it with the
  /// free runs of segments in use), then tries a segment of what is left under the limit,
  /// then asks `listener` (when attached) to relieve the pressure, retrying the allocation
  /// after each; nullptr when none made room.
  void* make_room_and_allocate(std::size_t needed, std::size_t rounded_bytes,
                               std::size_t requested_bytes, stream_handle stream,
                               allocation_class cls, bool& on_host, paging_listener* listener);
  void bring_back_from_host(void* pointer, stream_handle stream);
  /// With `free_runs_too`, free runs of whole chunks in segments still in use go too
  /// (Note [Segments at the limit] in heap.cpp).
  std::uint64_t release_all_cached(bool free_runs_too = false);
  std::uint64_t release_cached(std::uint64_t enough);  // Note [Releasing what is needed]
  [[nodiscard]] std::string out_of_memory_message(std::size_t bytes, allocation_class cls) const;

  device& device_;
  memory_limiter limiter_;
  chunk_arena arena_;
  allocator_stats stats_;
  std::array<std::unique_ptr<heap>, 2 * kAllocationClassCount> heaps_;
  struct region {  // heaps_[i]'s address region, kept flat for the lookup on every free
    std::uintptr_t start = 0;
    std::size_t bytes = 0;
  };
  std::array<region, 2 * kAllocationClassCount> regions_{};
  // The tier's listener (paging_view::attach), or none; the heaps read it too. Read on slow
  // paths only, so it lies after what every allocation and free reads.
  std::atomic<paging_listener*> listener_{nullptr};
  std::mutex reclaim_mutex_;  // one thread at a time releases cache across heaps
  mutable std::mutex settings_mutex_;
  std::string limit_source_;
};

}  // namespace zeroalloc
