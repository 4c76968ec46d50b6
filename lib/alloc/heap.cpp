#include "alloc/heap.hpp"

#include <algorithm>
#include <atomic>
#include <bit>
#include <nlohmann/json.hpp>

#include "core/errors.hpp"
#include "core/log.hpp"
#include "core/units.hpp"

namespace zeroalloc {

namespace {

constexpr std::size_t kMinBlockBytes = 512;
constexpr std::size_t kSmallSegmentBytes = 2 * MiB;
constexpr std::size_t kSmallRequestBytes = 1 * MiB;
constexpr std::size_t kMediumRequestBytes = 10 * MiB;
constexpr std::size_t kMediumSegmentBytes = 20 * MiB;

}  // namespace

std::size_t heap::bytes_of(const std::vector<physical_handle>& chunks) {
  std::size_t bytes = 0;
  for (const physical_handle& chunk : chunks) bytes += chunk.bytes;
  return bytes;
}

// The clock of segment::last_activity and segment::generation, one for the process:
// allocations and frees in any heap tick it, so chunks of different classes compare, and a
// segment made at addresses an earlier one had never starts at that one's generation (the
// offload engine's hints about the earlier segment's chunks must not match it).
std::uint64_t heap::next_activity() {
  // Alone on its cache lines: every allocation and free of every thread ticks it.
  struct alignas(128) padded_clock {
    std::atomic<std::uint64_t> ticks{0};
  };
  static padded_clock clock;
  return clock.ticks.fetch_add(1, std::memory_order_relaxed) + 1;
}

heap::heap(chunk_arena& arena, allocator_stats& stats,
           const std::atomic<paging_listener*>& listener, allocation_class cls, size_kind kind,
           std::size_t region_bytes, bool drain_before_release)
    : arena_(arena),
      device_(arena.backing()),
      stats_(stats),
      class_(cls),
      kind_(kind),
      drain_before_release_(drain_before_release),
      listener_(listener) {
  region_bytes_ = round_up(region_bytes, arena.granularity());
  region_start_ = arena.reserve_region(region_bytes_);
  free_addresses_.give_back(region_start_, region_bytes_);
}

heap::~heap() {
  try {
    std::lock_guard lock(mutex_);
    retire_donated(true);
    for (auto& owned : segments_) {
      if (!owned->chunks.empty()) {
        arena_.decommit(owned->address, owned->chunks, listener_.load(std::memory_order_acquire));
      }
    }
    for (event_handle event : all_events_) device_.destroy_event(event);
  } catch (const std::exception& failure) {
    log().warn("releasing a heap of {} failed: {}", device_.name(), failure.what());
  }
}

std::size_t heap::bin_of(std::size_t bytes) {
  const int power = std::bit_width(bytes) - 1;  // bytes >= 512, so power >= 9
  const std::size_t quarter = (bytes >> (power - 2)) & 3;
  return std::min<std::size_t>((static_cast<std::size_t>(power) - 9) * 4 + quarter, kBinCount - 1);
}

heap::free_index& heap::index_for(stream_handle stream) {
  for (auto& index : indexes_) {
    if (index->stream == stream) return *index;
  }
  indexes_.push_back(std::make_unique<free_index>());
  indexes_.back()->stream = stream;
  return *indexes_.back();
}

void heap::insert_free(block* free_block) {
  free_index& index = index_for(free_block->stream);
  const std::size_t bin = bin_of(free_block->bytes);
  free_block->bin_previous = nullptr;
  free_block->bin_next = index.heads[bin];
  if (index.heads[bin] != nullptr) index.heads[bin]->bin_previous = free_block;
  index.heads[bin] = free_block;
  index.nonempty[bin / 64] |= std::uint64_t{1} << (bin % 64);
}

void heap::remove_free(block* free_block) {
  remove_free(index_for(free_block->stream), free_block);
}

void heap::remove_free(free_index& index, block* free_block) {
  const std::size_t bin = bin_of(free_block->bytes);
  if (free_block->bin_previous != nullptr) {
    free_block->bin_previous->bin_next = free_block->bin_next;
  } else {
    index.heads[bin] = free_block->bin_next;
    if (index.heads[bin] == nullptr) index.nonempty[bin / 64] &= ~(std::uint64_t{1} << (bin % 64));
  }
  if (free_block->bin_next != nullptr)
    free_block->bin_next->bin_previous = free_block->bin_previous;
  free_block->bin_previous = free_block->bin_next = nullptr;
}

block* heap::find_fit(free_index& index, std::size_t bytes) {
  // The request's own bin holds blocks both smaller and larger than it: take the best fit
  // there. Any block of a higher bin fits; take the smallest of the first non-empty one.
  std::size_t bin = bin_of(bytes);
  block* best = nullptr;
  for (block* candidate = index.heads[bin]; candidate != nullptr; candidate = candidate->bin_next) {
    if (candidate->bytes >= bytes && (best == nullptr || candidate->bytes < best->bytes)) {
      best = candidate;
      if (best->bytes == bytes) return best;
    }
  }
  if (best != nullptr) return best;
  ++bin;
  while (bin < kBinCount) {
    const std::uint64_t word = index.nonempty[bin / 64] >> (bin % 64);
    if (word == 0) {
      bin = (bin / 64 + 1) * 64;
      continue;
    }
    bin += static_cast<std::size_t>(std::countr_zero(word));
    for (block* candidate = index.heads[bin]; candidate != nullptr;
         candidate = candidate->bin_next) {
      if (best == nullptr || candidate->bytes < best->bytes) best = candidate;
    }
    return best;
  }
  return nullptr;
}

block* heap::take_from_other_stream(std::size_t bytes, stream_handle stream) {
  block* best = nullptr;
  for (auto& index : indexes_) {
    if (index->stream == stream) continue;
    block* candidate = find_fit(*index, bytes);
    if (candidate != nullptr && (best == nullptr || candidate->bytes < best->bytes))
      best = candidate;
  }
  if (best == nullptr) return nullptr;
  // Note [Stream-ordered reuse]: the new stream waits for everything queued on the old one.
  // Fenced before the block leaves its list: if the device fails, the cache is unchanged.
  if (best->stream != kDetachedStream) {
    fenced(best->stream, [&](event_handle fence) { device_.stream_wait_event(stream, fence); });
  }
  remove_free(best);
  best->stream = stream;
  return best;
}

// Note [Segments at the limit]: under a limit, blocks of one size allocated until refused
// must reach at least 7/8 of it, and a cache full of one size's free segments must not keep
// another size from the same. Four rules, all on slow paths, give that:
// - A medium request's segment holds as many whole requests as 20 MiB does, rounded up to
//   the granularity, not 20 MiB: two 8 MiB blocks in a 20 MiB segment left 4 MiB that no
//   later 8 MiB request could use, and filling the limit with them stopped at 3/4 of it.
// - When even that segment finds no room (the cache released, whole-chunk free runs too),
//   the allocator tries one last segment of what is left under the limit, down to the
//   request itself (caching_allocator::make_room_and_allocate): the last megabytes of the
//   limit are worth a segment that holds fewer blocks.
// - On the same path, free runs of whole chunks inside segments still in use are split off
//   and unmapped (Note [Splitting free runs off a segment] cuts them), so that the memory
//   behind a free tail can back the new segment. Only whole chunks can go: a chunk is one
//   physical allocation, which the driver maps and releases only whole. So donated chunks
//   are mapped largest first: what a segment holds beyond its need is then whole chunks.
// - Near the limit (the request's own segment would bring what is held into the limit's
//   last eighth, or an allocation has already had to make room), a request that would take
//   a whole free segment and strand an eighth of it (what no block of its size could use
//   once the segment is filled with them) unmaps it and maps its own instead: carved, that
//   rest would be held for as long as the blocks live (12 MiB blocks in the free 20 MiB
//   segments of 2 MiB ones stopped at 156 MiB of 256 MiB). For the same reason a free run
//   split off for a new segment is then no larger than a whole donated segment may be
//   (gather_donations). Away from the limit both are as before: a cache hit maps nothing,
//   and a run may be twice the need. With the offload engine attached the exchange never
//   waits: while work queued on the free segment's streams has yet to run, the cache hit
//   stands (a training loop keeps its streams busy, stalling its thread there would cost
//   more than the stranded bytes, and the engine can make room by moving memory).
std::size_t heap::segment_bytes_for(std::size_t rounded_bytes) const {
  if (kind_ == size_kind::small) return kSmallSegmentBytes;
  if (rounded_bytes < kMediumRequestBytes) {  // Note [Segments at the limit]
    const std::size_t whole_requests = kMediumSegmentBytes / rounded_bytes;
    return round_up(whole_requests * rounded_bytes, arena_.granularity());
  }
  // Saturates instead of wrapping to 0 for a size near the top of size_t: such a segment
  // is larger than any limit, and fails as one.
  if (rounded_bytes > SIZE_MAX - arena_.granularity()) return SIZE_MAX;
  return round_up(rounded_bytes, arena_.granularity());
}

std::size_t heap::least_segment_bytes(std::size_t rounded_bytes) const {
  if (kind_ == size_kind::small) return kSmallSegmentBytes;
  if (rounded_bytes > SIZE_MAX - arena_.granularity()) return SIZE_MAX;  // as segment_bytes_for
  return round_up(rounded_bytes, arena_.granularity());
}

std::vector<stream_handle> heap::streams_of(const segment& owner) const {
  std::vector<stream_handle> streams;
  auto add = [&](stream_handle stream) {
    if (stream != kDetachedStream &&
        std::find(streams.begin(), streams.end(), stream) == streams.end()) {
      streams.push_back(stream);
    }
  };
  for (const block* piece = owner.first; piece != nullptr; piece = piece->next) {
    add(piece->stream);
    for (stream_handle other : piece->other_streams) add(other);  // record_stream's
  }
  return streams;
}

void heap::return_addresses(std::uintptr_t address, std::size_t bytes) {
  free_addresses_.give_back(address, bytes);
}

block* heap::map_new_segment(std::size_t rounded_bytes, stream_handle stream,
                             std::size_t most_segment_bytes) {
  if (!retiring_.empty()) retire_donated(false);
  // Note [Segments at the limit]: a segment capped below the usual size still holds the
  // request.
  const std::size_t needed =
      std::max(std::min(segment_bytes_for(rounded_bytes), most_segment_bytes),
               least_segment_bytes(rounded_bytes));
  // A segment larger than the limit can never be mapped: strip no donor for it.
  if (needed > arena_.limit_bytes()) return nullptr;
  // Donations seldom exceed the need by more than an eighth (gather_donations): check that
  // much address space first, so a request that cannot be placed strips no donor.
  if (!free_addresses_.fits(needed + std::max(needed / 8, arena_.granularity()))) {
    log().warn("address region of {} {} memory on {} is exhausted ({} reserved)",
               class_name(class_), kind_ == size_kind::small ? "small" : "large", device_.name(),
               format_bytes(region_bytes_));
    return nullptr;
  }
  donated_memory donated;
  auto pool_donations = [&] {
    if (donated.chunks.empty()) return;
    // The donors' queued work may still touch these chunks; only `stream` waited for it.
    device_.synchronize_stream(stream);
    arena_.keep_in_pool(donated.chunks);
  };
  // On a failure: the donations made (their donors gave them up) go to the pool, else their
  // memory would be held by nobody; the failure in hand is the one the caller sees.
  auto pool_donations_after_failure = [&] {
    try {
      pool_donations();
    } catch (const std::exception& again) {
      log().error("{} of memory donated to {} is lost: waiting for its donors' work failed ({})",
                  format_bytes(donated.bytes), class_name(class_), again.what());
    }
  };
  try {
    gather_donations(needed, stream, donated);
  } catch (...) {
    pool_donations_after_failure();  // a later donor failed
    throw;
  }
  // The smallest donated chunks last: what the segment holds beyond the need is then whole
  // chunks as far as it can be, which the out-of-memory path can unmap (Note [Segments at
  // the limit]).
  std::stable_sort(
      donated.chunks.begin(), donated.chunks.end(),
      [](const physical_handle& a, const physical_handle& b) { return a.bytes > b.bytes; });
  const std::size_t bytes = std::max(needed, donated.bytes);
  // A run split off a busy segment may give more than the eighth checked above.
  const std::optional<std::uintptr_t> placed = free_addresses_.take_best_fit(bytes);
  if (!placed) {
    pool_donations();  // their memory serves the next request that fits
    log().warn("address region of {} {} memory on {} has no {} left for {} of donations",
               class_name(class_), kind_ == size_kind::small ? "small" : "large", device_.name(),
               format_bytes(bytes), format_bytes(donated.bytes));
    return nullptr;
  }
  const std::uintptr_t address = *placed;
  auto owned = std::make_unique<segment>();
  owned->address = address;
  owned->bytes = bytes;
  owned->generation = next_activity();
  try {
    if (!arena_.commit(address, bytes, donated.chunks, owned->chunks)) {
      pool_donations();
      free_addresses_.give_back(address, bytes);
      return nullptr;
    }
  } catch (const std::exception& failure) {
    if (!owned->chunks.empty()) {
      // Note [A failed unmap]: undoing the commit left chunks mapped in the range. The
      // range stays out of use, with them; donated chunks among them stay out of the pool.
      std::erase_if(donated.chunks, [&](const physical_handle& chunk) {
        return std::any_of(owned->chunks.begin(), owned->chunks.end(),
                           [&](const physical_handle& mapped) {
                             return mapped.value == chunk.value && mapped.offset == chunk.offset;
                           });
      });
      const std::size_t still_mapped = bytes_of(owned->chunks);
      log().error(
          "undoing a failed {} segment of {} at {:#x} on {} left {} mapped ({}); that memory "
          "stays held and out of use. The GPU driver is failing: restart the process",
          format_bytes(bytes), class_name(class_), address, device_.name(),
          format_bytes(still_mapped), failure.what());
    } else {
      free_addresses_.give_back(address, bytes);
    }
    pool_donations_after_failure();
    throw;
  }

  block* whole = new_block();
  whole->address = address;
  whole->bytes = bytes;
  whole->owner = owned.get();
  whole->stream = stream;
  owned->first = whole;
  tell_chunks(owned->chunks, /*gained=*/true);
  segments_.push_back(std::move(owned));
  stats_.apply(class_, [&](live_gauges& figures) {
    figures.reserved_bytes.add(static_cast<std::int64_t>(bytes));
  });
  ++counts_.segments_mapped;
  log().debug("mapped a {} segment for {} ({} request, {} donated) on {}", format_bytes(bytes),
              class_name(class_), format_bytes(rounded_bytes), format_bytes(donated.bytes),
              device_.name());
  return whole;
}

bool heap::wastes_a_free_segment(const block& chosen, std::size_t rounded_bytes) const {
  const segment& owner = *chosen.owner;
  if (owner.busy_blocks != 0 || chosen.bytes != owner.bytes || owner.pinned_chunks != 0 ||
      owner.host_chunks != 0) {
    return false;
  }
  // What no block of this size could use once the segment is filled with them.
  const std::size_t stranded_bytes = owner.bytes % rounded_bytes;
  const std::size_t own_bytes = segment_bytes_for(rounded_bytes);
  return stranded_bytes >= owner.bytes / 8 && own_bytes <= owner.bytes - owner.bytes / 8 &&
         near_limit(own_bytes);
}

bool heap::near_limit(std::size_t more_bytes) const {
  // Once an allocation has had to make room, the program runs at the limit: what it holds
  // then drops as free segments are exchanged, but the next requests will fill it again.
  if (stats_.total.retries.load(std::memory_order_relaxed) != 0) return true;
  const std::uint64_t limit = arena_.limit_bytes();
  return arena_.held_bytes() + more_bytes > limit - limit / 8;
}

block* heap::replace_free_segment(block* whole, std::size_t rounded_bytes, stream_handle stream) {
  segment* owner = whole->owner;
  // Work queued before its blocks were freed may still touch the segment. With the offload
  // engine attached, waiting for it would stall a training loop on an allocation that the
  // cache can serve while the engine can make room by moving memory: unless every stream of
  // the segment is idle, the cache hit stands. Without it, the program is at the limit with
  // nothing else to free, and waits as a release of the cache would.
  const bool may_wait = listener_.load(std::memory_order_acquire) == nullptr;
  try {
    for (stream_handle used : streams_of(*owner)) {
      bool idle = false;
      fenced(used, [&](event_handle fence) {
        if (may_wait) device_.synchronize_event(fence);
        idle = may_wait || device_.event_completed(fence);
      });
      if (!idle) return whole;
    }
  } catch (...) {
    insert_free(whole);  // a failed fence: it stays cached, free, as it was
    throw;
  }
  insert_free(whole);  // as release_segment expects
  auto owned = std::find_if(segments_.begin(), segments_.end(),
                            [&](const auto& each) { return each.get() == owner; });
  const std::size_t released_bytes = owner->bytes;
  try {
    release_segment(*owner);
  } catch (...) {
    segments_.erase(owned);  // Note [A failed unmap]
    throw;
  }
  segments_.erase(owned);
  log().debug("released a free {} segment of {} on {} near the limit for a {} request",
              format_bytes(released_bytes), class_name(class_), device_.name(),
              format_bytes(rounded_bytes));
  return map_new_segment(rounded_bytes, stream);
}

void* heap::allocate(std::size_t rounded_bytes, std::size_t requested_bytes, stream_handle stream,
                     bool* on_host, std::size_t most_segment_bytes) {
  std::lock_guard lock(mutex_);
  if (!pending_.empty()) process_pending(false);
  bool from_cache = true;
  free_index& own = index_for(stream);
  block* chosen = find_fit(own, rounded_bytes);
  if (chosen == nullptr && !unmerged_.empty()) {
    coalesce_freed();
    chosen = find_fit(own, rounded_bytes);
  }
  if (chosen != nullptr) {
    remove_free(own, chosen);
  } else {
    chosen = take_from_other_stream(rounded_bytes, stream);
  }
  if (chosen == nullptr) {
    chosen = map_new_segment(rounded_bytes, stream, most_segment_bytes);
    from_cache = false;
    if (chosen == nullptr) return nullptr;
  } else if (chosen->bytes - rounded_bytes >= chosen->bytes / 8 &&
             wastes_a_free_segment(*chosen, rounded_bytes)) {
    block* replaced =
        replace_free_segment(chosen, rounded_bytes, stream);  // Note [Segments at the limit]
    if (replaced == nullptr) return nullptr;
    from_cache = replaced == chosen;
    chosen = replaced;
  }

  const std::size_t remainder = chosen->bytes - rounded_bytes;
  const bool split =
      kind_ == size_kind::small ? remainder >= kMinBlockBytes : remainder > kSmallRequestBytes;
  if (split) {
    block* rest = split_block(chosen, chosen->address + rounded_bytes);
    insert_free(rest);
    unmerged_.push_back(rest);  // it may border a free block of its stream
  }
  chosen->allocated = true;
  chosen->requested_bytes = requested_bytes;
  ++chosen->owner->busy_blocks;
  chosen->owner->generation = chosen->owner->last_activity = next_activity();
  live_.insert(chosen->address, chosen);

  const auto bytes = static_cast<std::int64_t>(chosen->bytes);
  stats_.apply(class_, [&](live_gauges& figures) {
    figures.note_active(figures.allocated_bytes.add(bytes));
  });
  ++counts_.allocations;
  if (from_cache) ++counts_.cache_hits;
  // Note [Landing in a moving chunk]: a chunk the migrator is moving (pinned) may hold free
  // space that this block takes. Its copy may have read the bytes already: writes made now
  // would land in the backing being left and be lost at the remap. So such a block is
  // reported like one on the host: the caller waits for the move, then brings it back.
  if (on_host != nullptr &&
      (chosen->owner->host_chunks != 0 || chosen->owner->pinned_chunks != 0)) {
    std::uintptr_t start = chosen->owner->address;
    for (const physical_handle& chunk : chosen->owner->chunks) {
      const bool overlaps =
          start < chosen->address + chosen->bytes && chosen->address < start + chunk.bytes;
      if (overlaps && (chunk.location == memory_location::host ||
                       std::find(pinned_.begin(), pinned_.end(), start) != pinned_.end())) {
        *on_host = true;
        break;
      }
      start += chunk.bytes;
    }
  }
  return reinterpret_cast<void*>(chosen->address);
}

bool heap::deallocate(std::uintptr_t pointer) {
  std::lock_guard lock(mutex_);
  block* freed = live_.find(pointer);
  if (freed == nullptr) return false;
  // Record the other streams' fences first: if the device fails, nothing has changed.
  std::vector<event_handle> fences;
  try {
    for (stream_handle other : freed->other_streams) {
      fences.push_back(obtain_event());
      device_.record_event(fences.back(), other);
    }
  } catch (...) {
    spare_events_.insert(spare_events_.end(), fences.begin(), fences.end());
    throw;
  }
  live_.erase(pointer);
  freed->allocated = false;
  const auto bytes = static_cast<std::int64_t>(freed->bytes);
  const bool waits_for_other_streams = !fences.empty();
  // Pending bytes rise before allocated bytes fall, so active bytes never dip.
  if (waits_for_other_streams)
    stats_.apply(class_, [&](live_gauges& figures) { figures.pending_bytes.add(bytes); });
  stats_.apply(class_, [&](live_gauges& figures) { figures.allocated_bytes.add(-bytes); });
  ++counts_.frees;
  if (waits_for_other_streams) {
    freed->pending_events = std::move(fences);
    // other_streams stays until the events complete: while the block is pending, work on
    // those streams may still touch it, and the offload engine fences a chunk's moves on
    // every stream its blocks were used on (streams_of). The generation changes now, not
    // when the block is released: hints about the chunk (its use-ends' events) do not
    // cover the recorded streams' work, so they must stop matching.
    freed->owner->generation = next_activity();
    freed->pending = true;
    pending_.push_back(freed);
    return true;
  }
  release_block(freed);
  return true;
}

bool heap::record_stream(std::uintptr_t pointer, stream_handle stream) {
  std::lock_guard lock(mutex_);
  block* used = live_.find(pointer);
  if (used == nullptr) return false;
  if (stream == used->stream) return true;
  if (std::find(used->other_streams.begin(), used->other_streams.end(), stream) ==
      used->other_streams.end()) {
    used->other_streams.push_back(stream);
  }
  return true;
}

bool heap::uses_stream(stream_handle stream) const {
  std::lock_guard lock(mutex_);
  for (const auto& owned : segments_) {
    for (const block* piece = owned->first; piece != nullptr; piece = piece->next) {
      if (piece->stream == stream ||
          std::find(piece->other_streams.begin(), piece->other_streams.end(), stream) !=
              piece->other_streams.end()) {
        return true;
      }
    }
  }
  return false;
}

void heap::forget_stream(stream_handle stream) {
  std::lock_guard lock(mutex_);
  for (auto& owned : segments_) {
    for (block* piece = owned->first; piece != nullptr; piece = piece->next) {
      std::erase(piece->other_streams, stream);
      if (piece->stream != stream) continue;
      const bool listed = !piece->allocated && !piece->pending;
      if (listed) remove_free(piece);
      piece->stream = kDetachedStream;
      if (listed) {
        insert_free(piece);
        unmerged_.push_back(piece);  // detached neighbours can merge now
      }
    }
  }
}

// Note [Deferred coalescing]: a freed block goes back to its bin as it is, so the next
// request of the same size (the common case in a training loop) takes it without a split,
// and its free costs no merge. Freed blocks are merged with their free neighbours in one
// pass when a request finds nothing that fits (before any new memory is mapped, so reserved
// memory is not affected) or when enough frees have accumulated: thousands in a small heap,
// a handful in a large one. Large blocks left unmerged until a miss fragment a training
// run: free memory stays in pieces, and when a miss finally merges it, the requests that
// follow carve the merged runs up at new places, so the layout drifts every step and
// reserved memory grows with it. On the recorded Llama traces (peak reserved / peak
// allocated, everything in one class), merging large blocks only on a miss gives 1.156
// (1.3B shape, 6 steps: growing every step) and 1.072 (271M); after every free, 1.046 and
// 1.006; after four, 1.029 and 1.007: the block freed just before a request of its size is
// still whole for it.
void heap::release_block(block* freed) {
  --freed->owner->busy_blocks;
  freed->owner->generation = freed->owner->last_activity = next_activity();
  insert_free(freed);
  unmerged_.push_back(freed);
  const std::size_t most_unmerged =
      kind_ == size_kind::large ? kMaxUnmergedLargeBlocks : kMaxUnmergedSmallBlocks;
  if (unmerged_.size() >= most_unmerged) coalesce_freed();
}

void heap::coalesce_freed() {
  for (block* freed : unmerged_) {
    // The entry may be stale: since allocated again, or merged away and recycled.
    if (freed->owner == nullptr || freed->allocated || freed->pending) continue;
    merge_free_neighbours(freed);
  }
  unmerged_.clear();
}

void heap::merge_free_neighbours(block* freed) {
  auto mergeable = [&](block* neighbour) {
    return neighbour != nullptr && !neighbour->allocated && !neighbour->pending &&
           neighbour->stream == freed->stream;
  };
  if (!mergeable(freed->previous) && !mergeable(freed->next)) return;
  remove_free(freed);
  while (mergeable(freed->previous)) {
    block* previous = freed->previous;
    remove_free(previous);
    previous->bytes += freed->bytes;
    previous->next = freed->next;
    if (freed->next != nullptr) freed->next->previous = previous;
    recycle_block(freed);
    freed = previous;
  }
  while (mergeable(freed->next)) {
    block* next = freed->next;
    remove_free(next);
    freed->bytes += next->bytes;
    freed->next = next->next;
    if (next->next != nullptr) next->next->previous = freed;
    recycle_block(next);
  }
  insert_free(freed);
}

bool heap::events_done(const std::vector<event_handle>& events, bool wait) {
  for (event_handle event : events) {
    if (wait) {
      device_.synchronize_event(event);
    } else if (!device_.event_completed(event)) {
      return false;
    }
  }
  return true;
}

void heap::process_pending(bool wait) {
  // A block leaves the list only once all its events are done; a device call that throws
  // leaves it, and every block after it, pending as before (none is released twice).
  std::size_t kept = 0;
  std::size_t next = 0;
  try {
    for (; next < pending_.size(); ++next) {
      block* waiting = pending_[next];
      if (!events_done(waiting->pending_events, wait)) {
        pending_[kept++] = waiting;
        continue;
      }
      spare_events_.insert(spare_events_.end(), waiting->pending_events.begin(),
                           waiting->pending_events.end());
      waiting->pending_events.clear();
      waiting->other_streams.clear();
      waiting->pending = false;
      const auto bytes = static_cast<std::int64_t>(waiting->bytes);
      stats_.apply(class_, [&](live_gauges& figures) { figures.pending_bytes.add(-bytes); });
      release_block(waiting);
    }
  } catch (...) {
    pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(kept),
                   pending_.begin() + static_cast<std::ptrdiff_t>(next));
    throw;
  }
  pending_.resize(kept);
}

void heap::tell_chunks(const std::vector<physical_handle>& chunks, bool gained) {
  paging_listener* listener = listener_.load(std::memory_order_acquire);
  if (listener == nullptr) return;
  for (const physical_handle& chunk : chunks) {
    if (gained) {
      listener->chunk_gained(class_, chunk.bytes);
    } else {
      listener->chunk_lost(class_, chunk.bytes);
    }
  }
}

std::uint64_t heap::host_resident_bytes() const {
  std::lock_guard lock(mutex_);
  std::uint64_t bytes = 0;
  for (const auto& owned : segments_) {
    if (owned->host_chunks == 0) continue;
    for (const physical_handle& chunk : owned->chunks) {
      if (chunk.location == memory_location::host) bytes += chunk.bytes;
    }
  }
  return bytes;
}

std::size_t heap::largest_free_block() const {
  std::lock_guard lock(mutex_);
  std::size_t largest = 0;
  for (const auto& index : indexes_) {
    for (std::size_t word = index->nonempty.size(); word-- > 0;) {
      if (index->nonempty[word] == 0) continue;
      const std::size_t bin =
          word * 64 + 63 - static_cast<std::size_t>(std::countl_zero(index->nonempty[word]));
      for (block* candidate = index->heads[bin]; candidate != nullptr;
           candidate = candidate->bin_next) {
        largest = std::max(largest, candidate->bytes);
      }
      break;
    }
  }
  return largest;
}

void heap::append_snapshot(nlohmann::ordered_json& segments) const {
  // Copied under the lock, written as JSON after it: the lock is the allocation path's.
  struct block_record {
    std::uintptr_t address;
    std::size_t bytes;
    std::size_t requested_bytes;
    const char* state;
  };
  struct segment_record {
    std::uintptr_t address;
    std::size_t bytes;
    std::uintptr_t stream;
    std::size_t blocks_end;  // its blocks end here in `blocks`
  };
  std::vector<segment_record> records;
  std::vector<block_record> blocks;
  {
    std::lock_guard lock(mutex_);
    records.reserve(segments_.size());
    for (const auto& owned : segments_) {
      for (const block* piece = owned->first; piece != nullptr; piece = piece->next) {
        const char* state = piece->allocated ? "active_allocated"
                            : piece->pending ? "active_pending_free"
                                             : "inactive";
        blocks.push_back({piece->address, piece->bytes,
                          piece->allocated ? piece->requested_bytes : piece->bytes, state});
      }
      records.push_back({owned->address, owned->bytes,
                         reinterpret_cast<std::uintptr_t>(owned->first->stream), blocks.size()});
    }
  }
  const char* kind = kind_ == size_kind::small ? "small" : "large";
  std::size_t next_block = 0;
  for (const segment_record& record : records) {
    nlohmann::ordered_json listed = nlohmann::ordered_json::array();
    for (; next_block < record.blocks_end; ++next_block) {
      const block_record& piece = blocks[next_block];
      listed.push_back({{"address", piece.address},
                        {"size", piece.bytes},
                        {"requested_size", piece.requested_bytes},
                        {"state", piece.state}});
    }
    segments.push_back({{"address", record.address},
                        {"total_size", record.bytes},
                        {"class", class_name(class_)},
                        {"kind", kind},
                        {"stream", record.stream},
                        {"blocks", std::move(listed)}});
  }
}

void heap::list_allocations(std::vector<std::pair<std::uintptr_t, std::size_t>>& into) const {
  std::lock_guard lock(mutex_);
  for (const auto& owned : segments_) {
    for (const block* piece = owned->first; piece != nullptr; piece = piece->next) {
      if (piece->allocated) into.emplace_back(piece->address, piece->bytes);
    }
  }
}

heap_counts heap::counts() const {
  std::lock_guard lock(mutex_);
  return counts_;
}

block* heap::split_block(block* left, std::uintptr_t at) {
  block* right = new_block();
  right->address = at;
  right->bytes = left->address + left->bytes - at;
  right->owner = left->owner;
  right->stream = left->stream;
  right->previous = left;
  right->next = left->next;
  if (left->next != nullptr) left->next->previous = right;
  left->next = right;
  left->bytes = at - left->address;
  return right;
}

block* heap::new_block() {
  if (spare_blocks_.empty()) {
    block_storage_.push_back(std::make_unique<block>());
    return block_storage_.back().get();
  }
  block* reused = spare_blocks_.back();
  spare_blocks_.pop_back();
  return reused;
}

void heap::recycle_block(block* unused) {
  // Field by field: the vectors keep their capacity, so recycling never frees memory.
  unused->address = 0;
  unused->bytes = 0;
  unused->requested_bytes = 0;
  unused->owner = nullptr;
  unused->previous = unused->next = nullptr;
  unused->bin_previous = unused->bin_next = nullptr;
  unused->stream = nullptr;
  unused->allocated = false;
  unused->pending = false;
  unused->other_streams.clear();
  unused->pending_events.clear();
  spare_blocks_.push_back(unused);
}

event_handle heap::obtain_event() {
  if (!spare_events_.empty()) {
    event_handle event = spare_events_.back();
    spare_events_.pop_back();
    return event;
  }
  event_handle event = device_.create_event();
  all_events_.push_back(event);
  return event;
}

}  // namespace zeroalloc
