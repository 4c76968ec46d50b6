// A heap: the blocks of one allocation class and one size kind (small or large) of one
// device, in segments inside the heap's own address region. Used by caching_allocator only;
// see Note [Stream-ordered reuse] in caching_allocator.hpp.
//
// One class, one source per subject: heap.cpp (blocks, free lists, new segments),
// heap_donation.cpp (free segments given to another heap), heap_release.cpp (free segments
// unmapped), heap_pinning.cpp (the offload engine's chunks).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "alloc/allocation_class.hpp"
#include "alloc/allocator_stats.hpp"
#include "alloc/chunk_arena.hpp"
#include "alloc/paging_listener.hpp"
#include "alloc/pointer_map.hpp"
#include "core/free_ranges.hpp"
#include "core/spin_lock.hpp"
#include "device/device.hpp"

namespace zeroalloc {

struct segment;

/// A range of a segment: allocated, free, or freed but waiting for other streams.
struct block {
  std::uintptr_t address = 0;
  std::size_t bytes = 0;
  std::size_t requested_bytes = 0;  // what the caller asked for, while allocated
  segment* owner = nullptr;
  block* previous = nullptr;  // neighbours by address, within the segment
  block* next = nullptr;
  block* bin_previous = nullptr;  // free-list links, while free
  block* bin_next = nullptr;
  stream_handle stream = nullptr;
  bool allocated = false;
  bool pending = false;                      // freed, waiting for events on other streams
  std::vector<stream_handle> other_streams;  // record_stream targets
  std::vector<event_handle> pending_events;
};

/// Mapped memory with its physical chunks; carved into blocks.
struct segment {
  std::uintptr_t address = 0;
  std::size_t bytes = 0;
  std::vector<physical_handle> chunks;
  std::size_t busy_blocks = 0;      // allocated or pending
  std::size_t pinned_chunks = 0;    // chunks the offload engine is moving (Note [Pinned chunks])
  std::size_t host_chunks = 0;      // chunks backed by host memory now
  std::uint64_t generation = 0;     // a new value at each allocation and free (chunk_info)
  std::uint64_t last_activity = 0;  // chunk_info::last_activity
  block* first = nullptr;
};

/// Physical chunks a heap gave up for another (Note [Moving free memory between classes]).
struct donated_memory {
  std::vector<physical_handle> chunks;
  std::size_t bytes = 0;
};

class heap {
 public:
  /// The stream tag of blocks whose stream was destroyed after its work completed: any
  /// stream may take them without waiting.
  static inline const stream_handle kDetachedStream =
      reinterpret_cast<stream_handle>(~std::uintptr_t{0});

  enum class size_kind { small, large };

  /// `listener`: the allocator's, told of the chunks this heap's segments gain and lose
  /// and of host chunks it unmaps (paging_listener), with the heap's lock held.
  /// `drain_before_release`: Note [Released after every stream] (heap_release.cpp).
  heap(chunk_arena& arena, allocator_stats& stats, const std::atomic<paging_listener*>& listener,
       allocation_class cls, size_kind kind, std::size_t region_bytes,
       bool drain_before_release = false);
  ~heap();

  /// A block of `rounded_bytes` (asked for as `requested_bytes`) for `stream`, or nullptr
  /// when new memory is needed and
  /// the arena has none (the caller releases cache and retries).
  /// `on_host`, when given, is set when the block lies (partly) in a chunk the offload engine
  /// moved to host memory or is moving (Note [Landing in a moving chunk]).
  /// A new segment is at most `most_segment_bytes` (a multiple of the granularity), and never
  /// less than the request: the allocator's last try under the limit (Note [Segments at the
  /// limit] in heap.cpp).
  void* allocate(std::size_t rounded_bytes, std::size_t requested_bytes, stream_handle stream,
                 bool* on_host = nullptr, std::size_t most_segment_bytes = SIZE_MAX);
  /// Frees; false when `pointer` is not a live allocation of this heap.
  bool deallocate(std::uintptr_t pointer);
  bool record_stream(std::uintptr_t pointer, stream_handle stream);
  /// Detaches every block tagged with `stream` (which the caller has synchronized and is
  /// about to destroy), so that no event is ever recorded on it again.
  void forget_stream(stream_handle stream);
  /// Whether a block was freed on `stream` or is tagged with it (record_stream).
  [[nodiscard]] bool uses_stream(stream_handle stream) const;
  /// Waits for pending frees and for the work that may still touch the segments (the
  /// whole device with drain_before_release), then unmaps fully free segments, largest first, until
  /// `enough` bytes are unmapped (all of them by default). With `free_runs_too`, first
  /// splits every free run of whole chunks off the segments still in use, so that those
  /// runs are released too (Note [Segments at the limit] in heap.cpp). Returns bytes unmapped.
  std::uint64_t release_free_segments(std::uint64_t enough = UINT64_MAX,
                                      bool free_runs_too = false);

  [[nodiscard]] std::uintptr_t region_start() const { return region_start_; }
  [[nodiscard]] std::size_t region_bytes() const { return region_bytes_; }
  [[nodiscard]] std::size_t largest_free_block() const;
  /// Bytes of this heap's segments that the offload engine moved to host memory.
  [[nodiscard]] std::uint64_t host_resident_bytes() const;
  /// Bytes of the segment this heap maps for a request of `rounded_bytes`.
  [[nodiscard]] std::size_t segment_bytes_for(std::size_t rounded_bytes) const;
  /// Bytes of the smallest segment that holds a request of `rounded_bytes` (Note [Segments
  /// at the limit] in heap.cpp).
  [[nodiscard]] std::size_t least_segment_bytes(std::size_t rounded_bytes) const;
  /// The heaps (this one included) whose fully free segments may back this heap's new
  /// segments. Set once, before use.
  void set_donors(std::vector<heap*> donors) { donors_ = std::move(donors); }
  /// Unless the heap is busy, gives up one fully free segment of `least_bytes` to
  /// `most_bytes` (or a free run of at most `most_run_bytes` split off a segment):
  /// `for_stream` is made to wait for the work queued on it, its chunks are appended to
  /// `into`, and its old addresses are unmapped once that work has run.
  bool try_donate(std::size_t least_bytes, std::size_t most_bytes, std::size_t most_run_bytes,
                  stream_handle for_stream, donated_memory& into);
  // The offload engine's view (Note [Pinned chunks] in heap_pinning.cpp).
  /// Appends the chunks of every segment that holds live allocations.
  void list_chunks(std::vector<chunk_info>& into) const;
  /// Appends the chunks that the live allocation starting at `pointer` spans; false when
  /// there is no such allocation.
  bool chunks_of_allocation(std::uintptr_t pointer, std::vector<chunk_info>& into) const;
  /// Bytes of the live block at `pointer` (at least what was asked for), or 0.
  [[nodiscard]] std::size_t allocation_bytes(std::uintptr_t pointer) const;
  /// Pins the chunk mapped at `address` so that its segment is neither unmapped nor given
  /// to another class until unpin_chunk; fills `into`. False when no chunk starts there, or
  /// it is pinned already.
  bool pin_chunk(std::uintptr_t address, chunk_info& into);
  /// Maps `replacement` at the pinned chunk's address instead of its handle (which it
  /// returns); the chunk stays pinned. No queued work may touch the chunk (the engine
  /// fences it). On failure the old handle is mapped back.
  physical_handle remap_pinned_chunk(std::uintptr_t address, physical_handle replacement);
  void unpin_chunk(std::uintptr_t address);

  /// Appends this heap's segments, with their blocks, to the JSON array `segments`, in the
  /// shape of PyTorch's memory snapshot.
  void append_snapshot(nlohmann::ordered_json& segments) const;
  /// Appends (address, bytes) of every live allocation.
  void list_allocations(std::vector<std::pair<std::uintptr_t, std::size_t>>& into) const;
  /// Takes and gives back the heap's lock around fork() (Note [Fork] in caching_allocator.cpp).
  void lock_for_fork() const { mutex_.lock(); }
  void unlock_after_fork() const { mutex_.unlock(); }
  /// The heap's counts (Note [Statistics cost] in allocator_stats.hpp).
  [[nodiscard]] heap_counts counts() const;
  [[nodiscard]] allocation_class cls() const { return class_; }

 private:
  static constexpr std::size_t kBinCount = 4 * 48;
  struct free_index {  // free blocks of one stream, binned by size
    stream_handle stream = nullptr;
    std::array<block*, kBinCount> heads{};
    std::array<std::uint64_t, kBinCount / 64> nonempty{};
  };

  struct retiring_range {  // a donated segment's old addresses, unmapped once fences pass
    std::uintptr_t address = 0;
    std::size_t bytes = 0;
    std::vector<physical_handle> chunks;
    std::vector<event_handle> fences;
  };

  static std::size_t bin_of(std::size_t bytes);
  free_index& index_for(stream_handle stream);
  void insert_free(block* free_block);
  void remove_free(block* free_block);
  void remove_free(free_index& index, block* free_block);  // index: the block's stream's
  block* find_fit(free_index& index, std::size_t bytes);
  block* take_from_other_stream(std::size_t bytes, stream_handle stream);
  block* map_new_segment(std::size_t rounded_bytes, stream_handle stream,
                         std::size_t most_segment_bytes = SIZE_MAX);
  /// Whether `chosen`, a free block taken from the cache for `rounded_bytes`, is a whole free
  /// segment better replaced by one of the request's own size (Note [Segments at the limit]).
  bool wastes_a_free_segment(const block& chosen, std::size_t rounded_bytes) const;
  /// Unmaps `whole`'s segment (its only block, out of the free lists) and maps one for the
  /// request instead; nullptr when that finds no room (the memory stays pooled in the arena).
  /// With a paging listener attached, returns `whole` itself, untouched, while work queued
  /// on any of its streams has yet to run (that is then never waited for); without, waits.
  block* replace_free_segment(block* whole, std::size_t rounded_bytes, stream_handle stream);
  void release_block(block* freed);
  void coalesce_freed();
  void merge_free_neighbours(block* freed);
  bool donate_locked(std::size_t least_bytes, std::size_t most_bytes, std::size_t most_run_bytes,
                     stream_handle for_stream, donated_memory& into);
  /// Whether `more_bytes` beyond what the arena holds would reach the last eighth of the
  /// limit, or an allocation already had to make room (Note [Segments at the limit]).
  bool near_limit(std::size_t more_bytes) const;
  void gather_donations(std::size_t bytes, stream_handle stream, donated_memory& into);
  /// Makes a free run of whole chunks, `least_bytes` to `most_bytes`, a fully free segment
  /// of its own (Note [Splitting free runs off a segment]); nullptr when there is none.
  segment* split_free_run(std::size_t least_bytes, std::size_t most_bytes);
  segment* cut_segment(std::vector<std::unique_ptr<segment>>::iterator owner, block* free_block,
                       std::size_t first_chunk, std::size_t last_chunk, std::uintptr_t start,
                       std::uintptr_t end);
  void retire_donated(bool wait);
  void unmap_old_addresses(const retiring_range& range);
  /// Unmaps a fully free segment (its fences done) and gives its addresses back; returns its
  /// bytes. When an unmap fails it gives back what was unmapped and throws; the segment is
  /// then to be dropped (Note [A failed unmap]).
  std::uint64_t release_segment(segment& idle);
  void return_addresses(std::uintptr_t address, std::size_t bytes);
  std::vector<stream_handle> streams_of(const segment& owner) const;
  void process_pending(bool wait);
  /// Whether every event has completed; with `wait`, waits for each (true, or throws).
  bool events_done(const std::vector<event_handle>& events, bool wait);
  /// Records a fence on `on` and hands it to `then` (a wait); the event is reused after,
  /// and also when either throws.
  template <typename Then>
  void fenced(stream_handle on, Then&& then);
  /// The next value of the process-wide clock of segment::generation and last_activity.
  static std::uint64_t next_activity();
  static std::size_t bytes_of(const std::vector<physical_handle>& chunks);
  /// The segment and chunk index of the chunk mapped at `address`, or {nullptr, 0}.
  std::pair<segment*, std::size_t> chunk_at(std::uintptr_t address) const;
  /// Only those overlapping [from, to) when given.
  void append_chunks(const segment& owner, std::vector<chunk_info>& into, std::uintptr_t from = 0,
                     std::uintptr_t to = UINTPTR_MAX) const;
  /// Cuts `left` at `at` (inside it); returns the new block after the cut, with `left`'s
  /// stream and segment. Neither is put in a free list.
  block* split_block(block* left, std::uintptr_t at);
  block* new_block();
  void recycle_block(block* unused);
  event_handle obtain_event();
  /// Tells the listener, if any, that a segment gained (or lost) `chunks`.
  void tell_chunks(const std::vector<physical_handle>& chunks, bool gained);

  chunk_arena& arena_;
  device& device_;
  allocator_stats& stats_;
  const allocation_class class_;
  const size_kind kind_;
  const bool drain_before_release_;
  std::uintptr_t region_start_ = 0;
  std::size_t region_bytes_ = 0;

  // A spin lock: the sections it guards are a few hundred instructions, except
  // release_free_segments, which runs on the out-of-memory and empty_cache paths only.
  mutable spin_lock mutex_;
  const std::atomic<paging_listener*>& listener_;  // the allocator's; read on slow paths
  heap_counts counts_;
  free_ranges free_addresses_;  // unmapped parts of the region
  std::vector<std::unique_ptr<free_index>> indexes_;
  pointer_map<block> live_;
  std::vector<std::unique_ptr<segment>> segments_;
  std::vector<std::unique_ptr<block>> block_storage_;
  std::vector<block*> spare_blocks_;
  std::vector<block*> pending_;
  static constexpr std::size_t kMaxUnmergedSmallBlocks = 4096;  // Note [Deferred coalescing]
  static constexpr std::size_t kMaxUnmergedLargeBlocks = 4;
  std::vector<block*> unmerged_;  // Note [Deferred coalescing]
  std::vector<event_handle> spare_events_;
  std::vector<event_handle> all_events_;
  std::vector<retiring_range> retiring_;
  std::vector<heap*> donors_;
  std::vector<std::uintptr_t> pinned_;  // chunk addresses (Note [Pinned chunks])
};

template <typename Then>
inline void heap::fenced(stream_handle on, Then&& then) {
  event_handle fence = obtain_event();
  try {
    device_.record_event(fence, on);
    then(fence);
  } catch (...) {
    spare_events_.push_back(fence);  // unrecorded, or recorded and never waited on
    throw;
  }
  spare_events_.push_back(fence);  // the wait captured the recorded point: reusable now
}

}  // namespace zeroalloc
