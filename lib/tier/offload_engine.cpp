#include "tier/offload_engine.hpp"

#include <algorithm>
#include <chrono>
#include <exception>
#include <iterator>
#include <limits>
#include <utility>

#include "core/log.hpp"
#include "core/units.hpp"

namespace zeroalloc {

namespace {

constexpr std::uint64_t kNeverUsed = use_order::kNever;

std::uint64_t nanoseconds_since(std::chrono::steady_clock::time_point start) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
}

/// Each chunk of a hint once, with the uses the hint opens on it (two allocations of one
/// chunk open two, and count as two): the caller's own uses when a move asks whether another
/// use is open (Note [Moving a chunk in use]).
std::vector<std::pair<const chunk_info*, int>> distinct_chunks(
    const std::vector<chunk_info>& chunks) {
  std::vector<std::pair<const chunk_info*, int>> distinct;
  distinct.reserve(chunks.size());
  for (const chunk_info& chunk : chunks) {
    auto seen = std::find_if(distinct.begin(), distinct.end(), [&](const auto& each) {
      return each.first->address == chunk.address;
    });
    if (seen == distinct.end()) {
      distinct.emplace_back(&chunk, 1);
    } else {
      ++seen->second;
    }
  }
  return distinct;
}

}  // namespace

offload_engine::offload_engine(caching_allocator& allocator, host_pool& pool, bool verify,
                               offload_settings settings, disk_store* disk)
    : allocator_(allocator),
      paging_(allocator.paging()),
      device_(allocator.backing()),
      pool_(pool),
      migrator_(allocator, pool, verify, disk, settings.any_access),
      settings_(settings) {
  if (settings_.any_access) return;  // Note [Fetched ahead at a miss]: no thread moves a chunk
  prefetcher_ = std::thread([this] { prefetch_worker(); });
  reader_ = std::thread([this] { read_ahead_worker(); });
}

void offload_engine::stop_threads() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wishes_changed_.notify_all();
  reads_changed_.notify_all();
  if (prefetcher_.joinable()) prefetcher_.join();
  if (reader_.joinable()) reader_.join();
}

offload_engine::~offload_engine() {
  allocator_.paging().detach(*this);
  stop_threads();
  migrator_.drain();  // no copy may still wait on the events below
  try {
    collect_waits(/*all=*/true);
    for (auto& [address, state] : chunks_) {
      for (const auto& [stream, event] : state.released) device_.destroy_event(event);
    }
    for (event_handle event : spare_timing_events_) device_.destroy_event(event);
  } catch (const std::exception& failure) {
    log().error("offload: releasing the engine's events failed: {}", failure.what());
  }
}

bool offload_engine::plan_eviction(const victim& chosen, std::vector<planned_eviction>& into) {
  chunk_info claimed;
  if (!migrator_.claim_eviction(chosen.address, claimed)) return false;
  into.push_back(fenced_eviction(claimed));
  return true;
}

std::vector<event_handle> offload_engine::use_end_fences(std::uintptr_t address) const {
  std::vector<event_handle> fences;
  if (auto state = chunks_.find(address); state != chunks_.end()) {
    for (const auto& [stream, event] : state->second.released) fences.push_back(event);
  }
  return fences;
}

offload_engine::planned_eviction offload_engine::fenced_eviction(const chunk_info& claimed,
                                                                 bool fence_streams,
                                                                 bool may_park) const {
  // The ends of hinted uses are fenced whatever the generation: a use may have run on a
  // stream the allocator does not know of (no record_stream), which only its hint names.
  // They cover the chunk alone only while no block of its segment has been allocated or
  // freed since (work on those is not hinted): else its streams are fenced too. The
  // generation compared is the one at the claim (the pin), after which an allocation in
  // the chunk waits for the move; a victim's, read earlier, may be older.
  planned_eviction planned{claimed, use_end_fences(claimed.address), fence_streams};
  auto state = chunks_.find(claimed.address);
  if (planned.fences.empty() || state->second.released_generation != claimed.generation) {
    planned.fence_streams = true;
  }
  // Note [Parameters parked]: its next use is a hint, and nothing unhinted landed in it.
  // (Under any_access the migrator parks nothing: Note [Moves any kernel may see].)
  planned.park = may_park && settings_.park_parameters &&
                 claimed.allocation_class == static_cast<int>(allocation_class::parameter) &&
                 state != chunks_.end() && state->second.hinted && state->second.open_uses == 0 &&
                 !planned.fences.empty() && state->second.released_generation == claimed.generation;
  return planned;
}

// Note [Evictions outside the engine's lock]: a victim is chosen and claimed under mutex_
// (so no use can begin on it unseen: a use that begins now finds it moving and waits), and
// its eviction is started after mutex_ is released: that may create pinned host memory
// (about 0.2 ms per MiB) or wait for the pool's background fill, and the hints of the
// training thread and the prefetcher would wait behind it.
std::vector<std::uintptr_t> offload_engine::launch_evictions(std::vector<planned_eviction>& planned,
                                                             bool full_is_an_error,
                                                             std::string* full) {
  std::vector<std::uintptr_t> started;
  std::size_t next = 0;
  try {
    for (; next < planned.size(); ++next) {
      const planned_eviction& each = planned[next];
      const std::uintptr_t address = each.chunk.address;
      try {
        migrator_.start_claimed_eviction(each.chunk, each.fences.empty() ? nullptr : &each.fences,
                                         each.fence_streams, each.park);
      } catch (const host_memory_exhausted& exhausted) {
        // Note [Chunks on disk] in migrator.hpp: with the host tier full, what it holds that
        // is used farthest ahead goes to the disk, and the eviction tries again. The failed
        // start gave its claim up: claimed again under the lock a use takes, unless a use
        // began on it meanwhile, and fenced behind its streams too (its segment may have
        // changed since the plan).
        if (!migrator_.has_disk()) throw;
        if (make_host_room(each.chunk.handle.bytes, address) == 0 &&
            (migrator_.drain(), make_host_room(each.chunk.handle.bytes, address) == 0)) {
          ZA_THROW(host_memory_exhausted, exhausted.what(),
                   " The NVMe tier took none of what the host holds: it is full "
                   "(ZEROALLOC_NVME_SIZE), or no idle optimizer state is left on the host "
                   "(only those go to disk).");
        }
        chunk_info again;
        bool park = false;
        {
          std::lock_guard lock(mutex_);
          auto state = chunks_.find(address);
          if ((state != chunks_.end() && state->second.open_uses > 0) ||
              !migrator_.claim_eviction(address, again)) {
            continue;
          }
          // Decided again: an allocation may have landed in it meanwhile.
          park = each.park && fenced_eviction(again).park;
        }
        migrator_.start_claimed_eviction(again, each.fences.empty() ? nullptr : &each.fences,
                                         /*and_chunk_streams=*/true, park);
      }
      started.push_back(address);
    }
  } catch (const host_memory_exhausted& exhausted) {
    for (++next; next < planned.size(); ++next)
      migrator_.cancel_eviction(planned[next].chunk.address);
    if (full_is_an_error) throw;
    log().warn("offload: {}", exhausted.what());
    if (full != nullptr) *full = exhausted.what();
  } catch (...) {
    for (++next; next < planned.size(); ++next)
      migrator_.cancel_eviction(planned[next].chunk.address);
    throw;
  }
  return started;
}

std::vector<chunk_info> offload_engine::chunks_of(const void* pointer) const {
  return chunks_of(std::span<const void* const>(&pointer, 1));
}

std::vector<chunk_info> offload_engine::chunks_of(std::span<const void* const> pointers) const {
  std::vector<chunk_info> chunks;
  for (const void* pointer : pointers) allocator_.chunks_of_allocation(pointer, chunks);
  return chunks;
}

std::uint64_t offload_engine::next_use_distance(std::uintptr_t address, bool on_device) const {
  auto state = chunks_.find(address);
  const bool in_use = state != chunks_.end() && state->second.open_uses > 0;
  return (on_device ? device_order_ : every_use_).distance(address, in_use);
}

// Note [Idle memory of any class]: memory of class other (activations, and whatever a
// program allocates outside the hinted classes: a checkpoint loaded with torch.load onto the
// device, a cache, a buffer) is written and read within a step, and moving it would cost
// more than it frees. But a program may also hold such memory while nothing uses it (the
// loaded checkpoint, until load_state_dict copies it), and failing an allocation while it
// sits there is worse than moving it: its chunks stay addressable on the host, so a kernel
// that reads it later reads the right bytes over PCIe. So the allocation-failure path takes
// it as its last resort, after gradients: chunks with no use open (no hint), the least
// recently allocated or freed first, so the one a training step keeps touching goes last.
// Evictions ahead of need never take it.

// Note [Two timelines]: hints arrive in host time, and the host runs ahead of the device.
// The chunk whose next use is farthest from the host's cursor is the one the host used
// last, whose use the device has not even run yet: evicting it would make every fetch
// wait for the device to catch up. So evictions that make room ahead of need (headroom,
// prefetch) take only chunks whose use-ends fence has passed, farthest next use first;
// only the allocation-failure path, which must succeed, takes the others too.
std::vector<offload_engine::victim> offload_engine::choose_victims(std::size_t bytes,
                                                                   std::uint64_t sooner_than,
                                                                   bool only_released,
                                                                   bool last_resort) {
  std::vector<chunk_info> all;
  paging_.list_chunks(all);
  struct candidate {
    std::uintptr_t address;
    std::size_t bytes;
    std::uint64_t distance;
    std::uint64_t last_use;
    std::uint64_t last_activity;
    std::uint64_t generation;
    // 0, then 1: free space, then 2: a gradient, only when nothing else can go, then 3:
    // idle memory of class other (Note [Idle memory of any class])
    int rank;
  };
  std::vector<candidate> candidates;
  for (const chunk_info& chunk : all) {
    // Note [Residency policy]: gradients go only on the allocation-failure path, last;
    // memory of class other after them.
    const bool other = chunk.allocation_class == static_cast<int>(allocation_class::other);
    const bool gradient = chunk.allocation_class == static_cast<int>(allocation_class::gradient);
    if ((gradient || other) && only_released) continue;
    if (other && !last_resort) continue;  // Note [Idle memory of any class]
    if (chunk.handle.location != memory_location::device) continue;
    // Free space gains little on the host, and whatever is allocated there next comes back
    // (allocated_on_host). But a device held full by the free tails of segments whose
    // blocks went to the host (7 MiB blocks in 20 MiB segments leave 6 MiB tails no 7 MiB
    // request fits) has nothing else to give: the allocation-failure path takes them,
    // after every chunk holding something, before gradients.
    const bool free_space = !chunk.holds_live_blocks;
    if (free_space && only_released) continue;
    auto state = chunks_.find(chunk.address);
    if (state != chunks_.end() && state->second.open_uses > 0) continue;
    if (migrator_.where(chunk.address) != residency::device) continue;
    const std::uint64_t distance = next_use_distance(chunk.address);
    if (distance <= sooner_than) continue;
    // A move that is not waited for may overlap work queued after it starts, which only a
    // hinted chunk's user promises not to queue (Note [Fault-free migration]): evictions
    // ahead of need take chunks whose every use was hinted and whose last use has run.
    if (only_released &&
        (state == chunks_.end() || !state->second.hinted || state->second.released.empty() ||
         state->second.released_generation != chunk.generation ||
         !std::all_of(state->second.released.begin(), state->second.released.end(),
                      [&](const auto& each) { return device_.event_completed(each.second); }))) {
      continue;
    }
    candidates.push_back({chunk.address, chunk.handle.bytes, distance,
                          state == chunks_.end() ? 0 : state->second.last_use, chunk.last_activity,
                          chunk.generation,
                          other        ? 3
                          : gradient   ? 2
                          : free_space ? 1
                                       : 0});
  }
  std::sort(candidates.begin(), candidates.end(), [](const candidate& a, const candidate& b) {
    if (a.rank != b.rank) return a.rank < b.rank;
    if (a.distance != b.distance) return a.distance > b.distance;  // farthest next use first
    if (a.last_use != b.last_use) return a.last_use < b.last_use;  // then least recently used
    return a.last_activity < b.last_activity;  // then least recently allocated or freed in
  });
  // Note [Host chunk sizes]: where the driver maps only whole allocations (every driver
  // measured so far), a chunk can go only to a pinned host chunk of exactly its size, and
  // creating one costs about 0.2 ms per MiB on the training path. Among chunks whose next
  // use is equally far (never, or the same position), those a ready host chunk can take go
  // first; the policy's order between different distances stands.
  std::optional<std::unordered_map<std::size_t, std::size_t>> ready = pool_.ready_chunks();
  std::vector<victim> victims;
  std::size_t freed = 0;
  for (std::size_t run = 0; run < candidates.size() && freed < bytes;) {
    std::size_t end = run;
    while (end < candidates.size() && candidates[end].distance == candidates[run].distance &&
           candidates[end].rank == candidates[run].rank) {
      ++end;
    }
    std::vector<const candidate*> later;
    for (std::size_t i = run; i < end && freed < bytes; ++i) {
      const candidate& each = candidates[i];
      if (ready) {
        auto found = ready->find(each.bytes);
        if (found == ready->end() || found->second == 0) {
          later.push_back(&each);
          continue;
        }
        --found->second;
      }
      victims.push_back({each.address, each.generation});
      freed += each.bytes;
    }
    for (const candidate* each : later) {
      if (freed >= bytes) break;
      victims.push_back({each->address, each->generation});
      freed += each->bytes;
    }
    run = end;
  }
  return victims;
}

void offload_engine::open_use(const chunk_info& chunk) {
  chunk_state& state = chunks_[chunk.address];
  ++state.open_uses;
  state.last_use = tick_;
  state.bytes = chunk.handle.bytes;
  state.allocation_class = chunk.allocation_class;
  state.hinted = true;
}

bool offload_engine::open_and_record(const std::vector<chunk_info>& chunks, bool in_place) {
  ++tick_;
  for (const chunk_info& chunk : chunks) {
    // Note [Every use in the order]: a use that opens on a chunk with none open is a
    // position of the order, not only the chunk's first use of the step.
    auto known = chunks_.find(chunk.address);
    const bool reopened = known == chunks_.end() || known->second.open_uses == 0;
    open_use(chunk);
    if (!in_place) device_order_.record(chunk.address, reopened);
    every_use_.record(chunk.address, reopened, /*marked=*/in_place);
  }
  list_wishes(/*device=*/!in_place);
  return !wishes_.empty() || !reads_.empty();
}

void offload_engine::list_wishes(bool device) {
  std::vector<std::uintptr_t> seen;  // a chunk used twice in the window counts once
  // Note [Prefetch]: what the device's order says comes next, nearest first, up to the
  // prefetch distance. A use in place moves only the order of every use: the device's
  // wishes stay.
  if (device) wishes_.clear();
  std::uint64_t ahead = 0;
  for (std::size_t position = device_order_.cursor() + 1;
       device && position < device_order_.size() && ahead < settings_.prefetch_bytes; ++position) {
    const std::uintptr_t next = device_order_.at(position);
    window_positions_ = position - device_order_.cursor();
    if (std::find(seen.begin(), seen.end(), next) != seen.end()) continue;
    seen.push_back(next);
    auto state = chunks_.find(next);
    ahead += state != chunks_.end() ? state->second.bytes : 0;
    const residency where = migrator_.where(next);
    if (where == residency::host || where == residency::moving_to_host ||
        where == residency::disk || where == residency::moving_to_disk) {
      wishes_.push_back(next);
    }
  }
  // Note [In-place uses in the order]: the chunks the next uses in place find on disk, up
  // to as many bytes again (host memory, not device memory), while anything is on disk;
  // past the order's end, the next step's first ones.
  reads_.clear();
  const std::size_t size = every_use_.size();
  // Note [Fetched ahead at a miss]: under any_access no thread reads ahead from disk.
  if (settings_.any_access || !migrator_.has_disk() || every_use_.next_marked(0) >= size ||
      migrator_.disk_resident_bytes() == 0) {
    return;
  }
  std::uint64_t read_ahead = 0;
  seen.clear();
  bool wrapped = false;  // past the end: the next step's uses, up to the cursor
  for (std::size_t position = every_use_.next_marked(every_use_.cursor() + 1);
       read_ahead < settings_.prefetch_bytes; position = every_use_.next_marked(position + 1)) {
    if (position >= size) {
      if (wrapped) break;
      wrapped = true;
      position = every_use_.next_marked(0);
    }
    if (position >= size || (wrapped && position > every_use_.cursor())) break;
    const std::uintptr_t next = every_use_.at(position);
    if (std::find(seen.begin(), seen.end(), next) != seen.end()) continue;
    seen.push_back(next);
    auto state = chunks_.find(next);
    read_ahead += state != chunks_.end() ? state->second.bytes : 0;
    const residency where = migrator_.where(next);
    if (where == residency::disk || where == residency::moving_to_disk) reads_.push_back(next);
  }
}

// Note [Hints during a capture]: a hint sent on a stream that captures a CUDA graph is
// ignored, its end too. Serving it could move a chunk or wait on an event, which the driver
// refuses during a capture, and the refusal would invalidate the capture (Note [Nothing
// moves while a graph is captured] in alloc/caching_allocator.cpp). The captured kernels
// reach the chunks where they lie: under ZEROALLOC_ACCESS=any every chunk stays addressable
// (on the host over PCIe), and its replays run in the device's order like any kernel, so a
// later move drains them first. A use that began before a capture and ended during it
// stays open in the engine's books.
void offload_engine::use_begins(std::span<const void* const> pointers, stream_handle stream) {
  if (device_.stream_is_capturing(stream)) return;  // Note [Hints during a capture]
  const std::vector<chunk_info> chunks = chunks_of(pointers);
  if (chunks.empty()) return;
  // The hint's own uses do not keep its chunks from being fetched.
  const auto distinct = distinct_chunks(chunks);
  bool wished = false;
  {
    std::lock_guard lock(mutex_);
    wished = open_and_record(chunks, /*in_place=*/false);
    figures_.uses += chunks.size();
  }
  // Woken only with work: a wake per hint (hundreds a step) costs the hinting thread a
  // context switch and the engine lock's contention, with every chunk already resident.
  if (wished) {
    wishes_changed_.notify_all();
    reads_changed_.notify_all();
  }

  std::uint64_t resident = 0;
  bool missed = false;
  // Every chunk gets its ordering even when one fails (a device error from a move): the
  // hint's other allocations have work coming too. The first failure is reported after.
  std::exception_ptr first_failure;
  for (const auto& [chunk, opened] : distinct) {
    try {
      if (ready_for_use(*chunk, stream, opened)) {
        resident += static_cast<std::uint64_t>(opened);
      } else {
        missed = true;
      }
    } catch (...) {
      if (!first_failure) first_failure = std::current_exception();
    }
  }
  if (missed && settings_.any_access && !first_failure) {
    try {
      fetch_ahead_at_a_miss();
    } catch (const std::exception& failure) {  // the hint's own chunks are ready: only speed
      log().warn("offload: fetching ahead after a miss failed: {}", failure.what());
    }
  }
  {
    std::lock_guard lock(mutex_);
    figures_.resident += resident;
    figures_.hits += resident;  // arrivals count once their device-side wait is known
    collect_waits(false);
  }
  if (first_failure) std::rethrow_exception(first_failure);
}

// Note [Fetched ahead at a miss]: under any_access (Note [Moves any kernel may see] in
// migrator.hpp) the engine's own threads move nothing: a move made while the program
// launches kernels could meet one of them. So neither the prefetcher's thread nor the
// disk's read-ahead thread is started, and no use's end evicts ahead of need: each of those
// moves would drain
// the device, and a drain costs the host's run-ahead (the device idles while the program
// queues work again). The moves come together where the device is drained anyway: a hint
// whose chunk had to be fetched (a miss) then keeps the prefetch window's room free and
// brings back what the learned order says comes next, up to ZEROALLOC_PREFETCH_BYTES,
// before the hint returns. One drain serves the window, and the uses that follow find
// their chunks on the device.
void offload_engine::fetch_ahead_at_a_miss() {
  std::vector<planned_eviction> planned;
  std::vector<std::pair<std::uintptr_t, std::size_t>> wanted;
  {
    std::lock_guard lock(mutex_);
    if (device_order_.empty()) return;
    planned = plan_headroom();
    for (std::uintptr_t address : wishes_) {
      auto state = chunks_.find(address);
      if (state != chunks_.end()) wanted.emplace_back(address, state->second.bytes);
    }
    wishes_.clear();
  }
  const std::size_t evicted = planned.empty() ? 0 : launch_evictions(planned).size();
  std::uint64_t fetched = 0;
  for (const auto& [address, bytes] : wanted) fetched += prefetch(address, bytes) ? 1 : 0;
  std::lock_guard lock(mutex_);
  figures_.evictions += evicted;
  figures_.prefetches += fetched;
}

bool offload_engine::ready_for_use(const chunk_info& chunk, stream_handle stream, int opened) {
  off_disk(chunk.address, chunk.handle.bytes);
  const residency where = migrator_.where(chunk.address);
  if (where == residency::device) return true;
  if (where == residency::moving_to_device && wait_for_arrival(chunk.address, stream, opened)) {
    std::lock_guard lock(mutex_);  // prefetched, still arriving: the stream waits, not us
    figures_.arriving += static_cast<std::uint64_t>(opened);
    return false;
  }
  const auto started = std::chrono::steady_clock::now();
  if (where != residency::host) migrator_.wait_until_settled(chunk.address);
  if (migrator_.where(chunk.address) == residency::host) {
    // A miss: bring it now, unless another use is open on it (Note [Moving a chunk in
    // use]). If no room can be made it stays on the host, where kernels still reach it
    // (slowly).
    try {
      bring_back(chunk.address, chunk.handle.bytes, /*wait=*/false, /*urgent=*/true,
                 /*ordered_use=*/true, /*callers_uses=*/opened);
    } catch (...) {
      reachable_where_it_is(chunk.address);  // the use runs anyway (Note [Parameters parked])
      throw;
    }
  }
  if (!wait_for_arrival(chunk.address, stream, opened)) {
    migrator_.wait_until_settled(chunk.address);  // a fetch that had to be fenced
    reachable_where_it_is(chunk.address);         // used on the host after all
  }
  std::lock_guard lock(mutex_);
  figures_.waited_ns += nanoseconds_since(started);
  if (migrator_.where(chunk.address) == residency::host) {
    chunks_[chunk.address].used_on_host = true;  // its next fetch must wait for this use
    figures_.used_on_host += static_cast<std::uint64_t>(opened);
  }
  return false;
}

void offload_engine::use_in_place(std::span<const void* const> pointers, stream_handle stream) {
  if (device_.stream_is_capturing(stream)) return;  // Note [Hints during a capture]
  const std::vector<chunk_info> chunks = chunks_of(pointers);
  if (chunks.empty()) return;
  bool wished = false;
  {
    std::lock_guard lock(mutex_);
    // Open: no eviction or prefetch picks them (Note [In-place uses in the order]).
    wished = open_and_record(chunks, /*in_place=*/true);
    figures_.in_place_uses += chunks.size();
  }
  if (wished) {
    wishes_changed_.notify_all();
    reads_changed_.notify_all();
  }
  // A move started before the hint must land before the caller queues work on the chunk;
  // one failing does not leave the others unsettled (the first failure is reported after).
  std::exception_ptr first_failure;
  for (const auto& [chunk, opened] : distinct_chunks(chunks)) {
    try {
      off_disk(chunk->address, chunk->handle.bytes);  // used where it is: on the host, then
      const residency where = migrator_.where(chunk->address);
      if (where == residency::moving_to_host || where == residency::moving_to_device) {
        migrator_.wait_until_settled(chunk->address);
      }
      in_place_off_the_placeholder(chunk->address, stream, opened);
      if (migrator_.where(chunk->address) == residency::host) {
        std::lock_guard lock(mutex_);
        chunks_[chunk->address].used_on_host = true;  // its next fetch must wait for this use
        figures_.in_place_host_bytes += chunk->handle.bytes;
      }
    } catch (...) {
      if (!first_failure) first_failure = std::current_exception();
    }
  }
  if (first_failure) std::rethrow_exception(first_failure);
}

bool offload_engine::use_on_host(std::span<const void* const> pointers, stream_handle stream,
                                 std::vector<host_view>& views) {
  views.clear();
  const std::vector<chunk_info> chunks = chunks_of(pointers);
  if (chunks.empty()) return false;
  {
    std::lock_guard lock(mutex_);
    open_and_record(chunks, /*in_place=*/true);
    for (const chunk_info& chunk : chunks) ++chunks_[chunk.address].cpu_uses;
    figures_.in_place_uses += chunks.size();
  }
  bool on_host = true;
  std::exception_ptr failure;
  try {
    for (const chunk_info& chunk : chunks) {
      if (!views.empty() && views.back().address == chunk.address) continue;
      const residency where = migrator_.where(chunk.address);
      if (where == residency::moving_to_host || where == residency::moving_to_device) {
        migrator_.wait_until_settled(chunk.address);
      }
      const std::uintptr_t host = migrator_.host_address(chunk.address);
      if (host == 0) {
        on_host = false;
        break;
      }
      views.push_back({chunk.address, chunk.handle.bytes, host});
    }
    if (on_host) {
      // The device's writes must have landed before the CPUs read: hinted uses end behind
      // their fences, which cover the chunk alone while nothing was allocated or freed in
      // its segment since (the rule of fenced_eviction); else its streams are waited for
      // too. And the caller's stream. Waiting for a busy stream needlessly would hold the
      // CPUs behind device work they do not need (a window stepped on the device meanwhile).
      std::vector<event_handle> fences;
      std::vector<stream_handle> streams{stream};
      {
        std::lock_guard lock(mutex_);
        for (const chunk_info& chunk : chunks) {
          std::vector<event_handle> own = use_end_fences(chunk.address);
          auto state = chunks_.find(chunk.address);
          if (own.empty() || state == chunks_.end() ||
              state->second.released_generation != chunk.generation) {
            for (stream_handle each : chunk.streams) {
              if (std::find(streams.begin(), streams.end(), each) == streams.end()) {
                streams.push_back(each);
              }
            }
          }
          fences.insert(fences.end(), own.begin(), own.end());
        }
      }
      for (event_handle fence : fences) device_.synchronize_event(fence);
      for (stream_handle each : streams) device_.synchronize_stream(each);
    }
  } catch (...) {
    failure = std::current_exception();
    on_host = false;
  }
  if (!on_host) {
    views.clear();
    std::lock_guard lock(mutex_);
    for (const chunk_info& chunk : chunks) {
      chunk_state& state = chunks_[chunk.address];
      if (state.open_uses > 0) --state.open_uses;
      if (state.cpu_uses > 0) --state.cpu_uses;
    }
  }
  if (failure) std::rethrow_exception(failure);
  return on_host;
}

void offload_engine::use_on_host_ends(std::span<const void* const> pointers, stream_handle stream) {
  const std::vector<chunk_info> chunks = chunks_of(pointers);
  std::vector<planned_eviction> planned;
  {
    std::lock_guard lock(mutex_);
    end_uses(chunks, stream, /*cpu=*/true);
    if (!device_order_.empty() && !settings_.any_access) planned = plan_headroom();
  }
  if (planned.empty()) return;
  const std::size_t started = launch_evictions(planned).size();
  std::lock_guard lock(mutex_);
  figures_.evictions += started;
}

event_handle offload_engine::timing_event() {
  if (spare_timing_events_.empty()) return device_.create_timing_event();
  event_handle event = spare_timing_events_.back();
  spare_timing_events_.pop_back();
  return event;
}

bool offload_engine::wait_for_arrival(std::uintptr_t address, stream_handle stream, int uses) {
  event_handle before;
  event_handle after;
  {
    std::lock_guard lock(mutex_);
    before = timing_event();
    after = timing_event();
  }
  auto spare_both = [&] {  // recorded or not, never read: reusable
    std::lock_guard lock(mutex_);
    spare_timing_events_.push_back(before);
    spare_timing_events_.push_back(after);
  };
  bool arriving = false;
  try {
    device_.record_event(before, stream);
    arriving = migrator_.order_after_arrival(address, stream);
  } catch (...) {
    spare_both();
    throw;
  }
  if (!arriving) {
    spare_both();
    return false;
  }
  try {
    device_.record_event(after, stream);
  } catch (...) {
    spare_both();  // the stream is ordered after the bytes; only the timing is lost
    return true;
  }
  std::lock_guard lock(mutex_);
  pending_waits_.push_back({before, after, uses});
  return true;
}

void offload_engine::collect_waits(bool all) {
  // A wait of under 20 us is the stream noticing that the bytes had already arrived.
  constexpr float kHitThresholdMs = 0.02F;
  while (!pending_waits_.empty()) {
    const timed_wait& oldest = pending_waits_.front();
    if (all) device_.synchronize_event(oldest.after);
    if (!device_.event_completed(oldest.after)) break;
    const float waited_ms = std::max(0.0F, device_.elapsed_ms(oldest.before, oldest.after));
    figures_.device_waited_ns += static_cast<std::uint64_t>(waited_ms * 1e6F);
    if (waited_ms < kHitThresholdMs) figures_.hits += static_cast<std::uint64_t>(oldest.uses);
    spare_timing_events_.push_back(oldest.before);
    spare_timing_events_.push_back(oldest.after);
    pending_waits_.pop_front();
  }
}

void offload_engine::use_ends(std::span<const void* const> pointers, stream_handle stream) {
  if (device_.stream_is_capturing(stream)) return;  // Note [Hints during a capture]
  const std::vector<chunk_info> chunks = chunks_of(pointers);
  std::vector<planned_eviction> planned;
  {
    std::lock_guard lock(mutex_);
    end_uses(chunks, stream);
    // Under any_access each eviction drains the device: room is kept at a miss instead
    // (Note [Fetched ahead at a miss]).
    if (!device_order_.empty() && !settings_.any_access) planned = plan_headroom();
  }
  if (planned.empty()) return;
  const std::size_t started = launch_evictions(planned).size();
  std::lock_guard lock(mutex_);
  figures_.evictions += started;
}

void offload_engine::end_uses(const std::vector<chunk_info>& chunks, stream_handle stream,
                              bool cpu) {
  std::uintptr_t previous = 0;
  std::exception_ptr first_failure;  // every use still ends; the first failure is reported
  for (const chunk_info& chunk : chunks) {
    chunk_state& state = chunks_[chunk.address];
    if (cpu && state.cpu_uses > 0) --state.cpu_uses;
    if (state.open_uses > (cpu ? 0 : state.cpu_uses)) --state.open_uses;
    if (chunk.address == std::exchange(previous, chunk.address)) continue;  // one record does
    try {
      // Note [Released on every stream]: one event per stream the chunk's uses ended on,
      // each at the last use that ended there. One event re-recorded on whichever stream
      // came last lost the points of the others: a use ended on a copy stream, then another
      // on the compute stream, and an eviction fenced by that event alone could copy the
      // chunk while the copy stream still wrote it. An eviction already waiting on an
      // earlier recording keeps its point (events are captured when waited on).
      auto mine = std::find_if(state.released.begin(), state.released.end(),
                               [&](const auto& each) { return each.first == stream; });
      if (mine == state.released.end()) {
        state.released.emplace_back(stream, device_.create_event());
        mine = std::prev(state.released.end());
      }
      device_.record_event(mine->second, stream);
      state.released_generation = chunk.generation;
    } catch (...) {
      // No point marks this use's end: the chunk is not idle for evictions ahead of need
      // (they need a matching generation); the pressure path fences on its streams.
      state.released_generation = std::numeric_limits<std::uint64_t>::max();
      if (!first_failure) first_failure = std::current_exception();
    }
  }
  if (first_failure) std::rethrow_exception(first_failure);
}

std::vector<offload_engine::planned_eviction> offload_engine::plan_headroom() {
  std::vector<planned_eviction> planned;
  const std::uint64_t limit = allocator_.limit_bytes();
  const std::uint64_t held = allocator_.held_bytes();
  // An idle class's cache counts as free: a fetch that needs it releases it (bring_back).
  const std::uint64_t free_now = (limit > held ? limit - held : 0) +
                                 paging_.arena().pooled_bytes() + migrator_.bytes_leaving_device() +
                                 paging_.idle_cache_bytes();
  if (free_now >= settings_.prefetch_bytes) return planned;
  const auto started = std::chrono::steady_clock::now();
  const std::vector<victim> victims = choose_victims(settings_.prefetch_bytes - free_now,
                                                     window_positions_, /*only_released=*/true);
  ++figures_.headroom_searches;
  figures_.headroom_search_ns += nanoseconds_since(started);
  for (const victim& chosen : victims) plan_eviction(chosen, planned);
  return planned;
}

void offload_engine::step_boundary() {
  std::lock_guard lock(mutex_);
  device_order_.boundary();
  every_use_.boundary();
  // A step ends with nothing in use: hints that never closed (a caller that ends no
  // backward use) must not pin their chunks on the device for good. But no use-ends fence
  // covers the work such a use queued: until a use of the chunk ends again, its moves wait
  // for its streams, and evictions ahead of need pass it over. The CPUs' uses stay open:
  // they end when the CPUs are done, whatever the step (use_on_host_ends).
  for (auto& [address, state] : chunks_) {
    if (state.open_uses > state.cpu_uses) {
      state.released_generation = std::numeric_limits<std::uint64_t>::max();
    }
    state.open_uses = state.cpu_uses;
  }
  ++figures_.steps;
  figures_.learned_order_chunks = device_order_.size();
}

// Note [Moving a chunk in use]: a use that is open has work coming on the chunk's present
// backing, which no fence covers yet: the caller of use_in_place copies the chunk to scratch
// and back when it likes, and a use on another thread queues kernels after its own begin.
// Moving the chunk under such a use would lose the writes that land on the backing being
// left. So no fetch moves a chunk with an open use other than its caller's own: a prefetch
// none at all, a use's miss or a use in place of a parked chunk only its own (the CPUs
// write a parked chunk at its host copy). The use that finds its chunk held stays on
// the host for it, reached over PCIe, and marks the chunk used there (its next fetch waits
// for the use). Evictions pass over chunks in use the same way.
bool offload_engine::bring_back(std::uintptr_t address, std::size_t bytes, bool wait, bool urgent,
                                bool ordered_use, int callers_uses, bool* fetched) {
  off_disk(address, bytes);
  bool started = false;
  for (int attempt = 0; attempt < 4 && !started; ++attempt) {
    // Note [Idle at the claim]: whether no queued work touches the host-resident chunk (only
    // hints can say) is decided at every attempt, and the chunk is claimed under the same
    // lock a use's begin takes. Decided once before the attempts, a use that began and
    // queued work on the chunk while this thread waited for room (evictions, the cache's
    // release) went unseen, and the fetch copied the chunk without waiting for that work
    // (OffloadEngineTest.AUseBetweenTwoAttemptsOfAFetchMakesTheFetchWaitForIt).
    bool idle = false;
    std::uint64_t idle_generation = 0;
    bool claimed = false;
    std::vector<event_handle> use_ends;  // a fetch that is not idle waits for these too
    {
      std::lock_guard lock(mutex_);
      auto state = chunks_.find(address);
      if (state != chunks_.end() && state->second.open_uses > callers_uses) {
        return false;  // Note [Moving a chunk in use]
      }
      idle = ordered_use && state != chunks_.end() && state->second.hinted &&
             !state->second.used_on_host && !device_order_.empty();
      if (idle) idle_generation = state->second.released_generation;
      use_ends = use_end_fences(address);
      claimed = migrator_.claim_fetch(address);
    }
    if (claimed && migrator_.start_claimed_fetch(address, idle, idle_generation,
                                                 use_ends.empty() ? nullptr : &use_ends)) {
      started = true;
      std::lock_guard lock(mutex_);
      chunks_[address].used_on_host = false;  // the fetch waited for those uses
      break;
    }
    const residency where = migrator_.where(address);
    if (where == residency::device) return true;
    if (where != residency::host) {  // moving: let it land, then look again
      migrator_.wait_until_settled(address);
      continue;
    }
    // On the host, and no device memory within the limit: the cache of idle classes goes
    // first (Note [Idle classes' cache] in alloc/paging_view.cpp), then chunks needed
    // later than this one.
    if (paging_.release_idle_cache() > 0) continue;
    std::vector<planned_eviction> planned;
    {
      std::lock_guard lock(mutex_);
      for (const victim& chosen :
           choose_victims(bytes, next_use_distance(address), /*only_released=*/!urgent)) {
        auto state = chunks_.find(chosen.address);
        if (state != chunks_.end() && state->second.open_uses > 0) continue;
        plan_eviction(chosen, planned);
      }
    }
    const std::vector<std::uintptr_t> evicted = launch_evictions(planned);
    {
      std::lock_guard lock(mutex_);
      figures_.evictions += evicted.size();
    }
    if (evicted.empty()) return false;
    for (std::uintptr_t victim : evicted) migrator_.wait_until_settled(victim);
    if (settings_.between_fetch_attempts) settings_.between_fetch_attempts(address);
  }
  if (fetched != nullptr) *fetched = started;
  if (started && wait) migrator_.wait_until_settled(address);
  return started;
}

void offload_engine::work_through(std::deque<std::uintptr_t>& queue,
                                  std::condition_variable& changed,
                                  std::uint64_t offload_figures::*started_count, const char* what,
                                  const std::function<bool(std::uintptr_t, std::size_t)>& act) {
  std::unique_lock lock(mutex_);
  while (true) {
    changed.wait(lock, [&] { return stopping_ || !queue.empty(); });
    if (stopping_) return;
    const std::uintptr_t next = queue.front();
    queue.pop_front();
    auto state = chunks_.find(next);
    const std::size_t bytes = state != chunks_.end() ? state->second.bytes : 0;
    lock.unlock();
    bool started = false;
    try {
      if (bytes != 0) started = act(next, bytes);
    } catch (const std::exception& failure) {
      log().warn("offload: {} the chunk at {:#x} failed: {}", what, next, failure.what());
    }
    lock.lock();
    if (started) ++(figures_.*started_count);
  }
}

void offload_engine::prefetch_worker() {
  work_through(wishes_, wishes_changed_, &offload_figures::prefetches, "prefetching",
               [this](std::uintptr_t next, std::size_t bytes) { return prefetch(next, bytes); });
}

bool offload_engine::prefetch(std::uintptr_t address, std::size_t bytes) {
  bool started = false;
  bring_back(address, bytes, /*wait=*/false, /*urgent=*/false, /*ordered_use=*/true,
             /*callers_uses=*/0, &started);
  return started;
}

// Note [In-place uses in the order]: reads from disk take a thread of their own, so that a
// read (and the writes that make host room for it) never holds up a fetch to the device.
void offload_engine::read_ahead_worker() {
  work_through(
      reads_, reads_changed_, &offload_figures::disk_prefetches, "reading from disk ahead",
      [this](std::uintptr_t next, std::size_t bytes) { return off_disk_ahead(next, bytes); });
}

// Note [States never used yet]: an optimizer creates its states in its first step, one
// window after another, and the windowed step moves each into the optimizer-state class
// (a copy of the fresh zeros, then nothing until the next step's hinted use). With the
// host tier full, the states made early in that step must go to disk for the later ones
// to fit; waiting for a hint first would fail the first step of every model that needs
// the disk tier (a 16B model on one H200 did: out of memory with 96 GiB on the host and
// nothing on disk). So an optimizer-state chunk that no hint has reached yet may go to
// disk too: the class's contract (include/zeroalloc/zeroalloc.h) is that every use of it is hinted,
// so its next use brings it back first.
std::vector<offload_engine::disk_candidate> offload_engine::disk_candidates(
    std::uintptr_t keep, std::uint64_t farther_than) {
  // Note [Chunks on disk]: optimizer states go (every use of theirs is hinted, so the
  // engine brings them back first), and with ZEROALLOC_NVME_PARAMETERS parameters whose
  // uses are hinted; none with a use open; the farthest next use first (a state before a
  // parameter when they tie).
  using candidate = disk_candidate;
  // A parameter's chunk goes only while its segment has seen no allocation or free since
  // its last hinted use ended (its generation then), so the hints still describe what it
  // holds (its next hinted use brings it back, learned order or not).
  std::unordered_map<std::uintptr_t, std::uint64_t> generations;
  if (settings_.parameters_to_disk) {
    std::vector<chunk_info> all;
    paging_.list_chunks(all);
    for (const chunk_info& chunk : all) {
      if (chunk.allocation_class == static_cast<int>(allocation_class::parameter)) {
        generations[chunk.address] = chunk.generation;
      }
    }
  }
  std::vector<candidate> candidates;
  for (const auto& each : migrator_.host_resident_chunks()) {
    const bool state_class =
        each.allocation_class == static_cast<int>(allocation_class::optimizer_state);
    const bool parameter = settings_.parameters_to_disk &&
                           each.allocation_class == static_cast<int>(allocation_class::parameter);
    if (each.address == keep || !(state_class || parameter)) continue;
    // Every use of it so far hinted, or none yet for a state (Note [States never used
    // yet]); no use open.
    auto state = chunks_.find(each.address);
    if (state != chunks_.end() && (!state->second.hinted || state->second.open_uses > 0)) {
      continue;
    }
    const std::uint64_t distance = next_use_distance(each.address, /*on_device=*/false);
    if (parameter) {
      auto generation = generations.find(each.address);
      if (state == chunks_.end() || generation == generations.end() ||
          state->second.released_generation != generation->second) {
        continue;
      }
    }
    if (farther_than != 0 && distance <= farther_than) continue;  // needed sooner
    candidates.push_back({each.address, each.bytes, parameter, distance});
  }
  std::sort(candidates.begin(), candidates.end(), [](const candidate& a, const candidate& b) {
    if (a.distance != b.distance) return a.distance > b.distance;
    return !a.parameter && b.parameter;
  });
  return candidates;
}

std::uint64_t offload_engine::make_host_room(std::size_t bytes, std::uintptr_t keep,
                                             std::uint64_t farther_than) {
  if (!migrator_.has_disk()) return 0;
  std::vector<std::uintptr_t> claimed;
  std::vector<std::vector<event_handle>> fences;  // each claimed chunk's use-ends
  std::uint64_t claimed_bytes = 0;
  {
    std::lock_guard lock(mutex_);
    for (const disk_candidate& each : disk_candidates(keep, farther_than)) {
      if (claimed_bytes >= bytes) break;
      if (!migrator_.claim_spill(each.address)) continue;  // claimed under the lock a use takes
      claimed.push_back(each.address);
      fences.push_back(use_end_fences(each.address));
      claimed_bytes += each.bytes;
    }
  }
  std::uint64_t spilled = 0;
  for (std::size_t i = 0; i < claimed.size(); ++i) {
    try {
      migrator_.start_claimed_spill(claimed[i], fences[i].empty() ? nullptr : &fences[i]);
      if (migrator_.where(claimed[i]) == residency::disk) ++spilled;
    } catch (const std::exception& failure) {
      // The chunk stays on the host; so do the rest, their claims given up.
      log().warn("offload: moving a chunk to the disk failed, it stays in host memory: {}",
                 failure.what());
      for (++i; i < claimed.size(); ++i) migrator_.cancel_spill(claimed[i]);
      break;
    }
  }
  return spilled;
}

void offload_engine::off_disk(std::uintptr_t address, std::size_t bytes) {
  for (int attempt = 0;; ++attempt) {
    const residency where = migrator_.where(address);
    if (where == residency::moving_to_disk || where == residency::moving_from_disk) {
      migrator_.wait_until_settled(address);
      continue;
    }
    if (where != residency::disk) return;
    try {
      if (migrator_.restore(address)) return;
    } catch (const host_memory_exhausted&) {
      // Host chunks being fetched (the prefetcher's) are neither spillable nor free until
      // their fetch lands: let the moves in flight land before giving up.
      if (attempt >= 3) throw;
      if (make_host_room(bytes, address) == 0 && !swap_off_disk(address, bytes)) {
        migrator_.drain();
      }
    }
    // A chunk left on disk sits behind addresses no kernel may touch: never return so.
    if (attempt >= 3) {
      ZA_THROW(host_memory_exhausted, "the chunk at ", address, " (", format_bytes(bytes),
               ") could not come back from the NVMe tier: the host tier had no room for it "
               "after ",
               attempt + 1, " tries (ZEROALLOC_HOST_LIMIT)");
    }
  }
}

bool offload_engine::swap_off_disk(std::uintptr_t address, std::size_t bytes) {
  std::lock_guard swapping(swap_mutex_);  // one at a time: one room is kept for them
  std::uintptr_t claimed = 0;
  std::vector<event_handle> fences;
  {
    std::lock_guard lock(mutex_);
    for (const disk_candidate& each : disk_candidates(address, 0)) {
      if (each.bytes != bytes || !migrator_.claim_spill(each.address)) continue;
      claimed = each.address;
      fences = use_end_fences(each.address);
      break;
    }
  }
  if (claimed == 0) return false;
  try {
    return migrator_.swap(address, claimed, fences.empty() ? nullptr : &fences);
  } catch (const std::exception& failure) {
    log().warn("offload: swapping a chunk back from the disk failed: {}", failure.what());
    return false;
  }
}

bool offload_engine::off_disk_ahead(std::uintptr_t address, std::size_t bytes) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (migrator_.where(address) != residency::disk) return false;  // moving, or not there
    try {
      return migrator_.restore(address);
    } catch (const host_memory_exhausted&) {
      std::uint64_t distance = 0;
      {
        std::lock_guard lock(mutex_);
        distance = next_use_distance(address, /*on_device=*/false);
      }
      // Room only from chunks needed later (Note [In-place uses in the order]); none: the
      // use reads it when it comes.
      if (distance == 0 || make_host_room(bytes, address, distance) == 0) return false;
    }
  }
  return false;
}

std::uint64_t offload_engine::relieve_pressure(std::size_t bytes_needed) {
  std::vector<planned_eviction> planned;
  {
    std::lock_guard lock(mutex_);
    for (const victim& chosen :
         choose_victims(bytes_needed, 0, /*only_released=*/false, /*last_resort=*/true)) {
      plan_eviction(chosen, planned);
    }
    if (planned.empty()) {
      pressure_notes_[std::this_thread::get_id()] = nothing_movable_note(bytes_needed);
      return 0;
    }
  }
  std::string full;
  const std::vector<std::uintptr_t> evicted = launch_evictions(planned, false, &full);
  std::uint64_t bytes = 0;
  for (const planned_eviction& each : planned) {  // launch_evictions may skip some
    if (std::find(evicted.begin(), evicted.end(), each.chunk.address) != evicted.end()) {
      bytes += each.chunk.handle.bytes;
    }
  }
  {
    std::lock_guard lock(mutex_);
    figures_.pressure_evictions += evicted.size();
    if (!full.empty()) {
      pressure_notes_[std::this_thread::get_id()] = std::move(full);
    } else if (!evicted.empty()) {
      pressure_notes_.erase(std::this_thread::get_id());
    }
  }
  for (std::uintptr_t victim : evicted) migrator_.wait_until_settled(victim);
  if (!evicted.empty()) {
    log().debug("offload: moved {} chunks to the host to serve an allocation of {}", evicted.size(),
                format_bytes(bytes_needed));
  }
  return evicted.empty() ? 0 : std::max<std::uint64_t>(bytes, 1);
}

void offload_engine::chunk_gained(allocation_class cls, std::size_t chunk_bytes) {
  if (settings_.anticipate_state_chunks && cls == allocation_class::optimizer_state) {
    pool_.expect_chunks(chunk_bytes, +1);
  }
}

void offload_engine::chunk_lost(allocation_class cls, std::size_t chunk_bytes) {
  if (settings_.anticipate_state_chunks && cls == allocation_class::optimizer_state) {
    pool_.expect_chunks(chunk_bytes, -1);
  }
}

void offload_engine::host_chunk_released(physical_handle chunk, std::uintptr_t address) {
  migrator_.host_chunk_released(chunk, address);
}

// Note [Nothing movable]: an allocation fails with nothing on the device that the engine
// may move. Since memory of every class may go as a last resort (Note [Idle memory of any
// class]), what stays is memory with a use open (or moving): say so.
std::string offload_engine::nothing_movable_note(std::size_t bytes_needed) const {
  std::vector<chunk_info> all;
  paging_.list_chunks(all);
  std::uint64_t staying = 0;
  for (const chunk_info& chunk : all) {
    if (chunk.handle.location == memory_location::device) staying += chunk.handle.bytes;
  }
  return "nothing it may move is left on the device: every chunk there (" + format_bytes(staying) +
         ") has a use open (a layer's parameters, a window of optimizer states, or other memory "
         "between use hints) or is moving. With the " +
         format_bytes(bytes_needed) +
         " this allocation needs, this point of the program needs at least " +
         format_bytes(staying + bytes_needed) +
         " of device memory: a smaller limit cannot serve it";
}

std::string offload_engine::pressure_note() {
  std::lock_guard lock(mutex_);
  auto found = pressure_notes_.find(std::this_thread::get_id());
  if (found == pressure_notes_.end()) return {};
  std::string note = std::move(found->second);
  pressure_notes_.erase(found);
  return note;
}

void offload_engine::allocated_on_host(const void* pointer, stream_handle stream) {
  for (const chunk_info& chunk : chunks_of(pointer)) {
    // Note [Landing in a moving chunk] in alloc/heap.cpp: the move ends first.
    migrator_.wait_until_settled(chunk.address);
    try {
      off_disk(chunk.address, chunk.handle.bytes);
    } catch (const std::exception& failure) {
      // The new allocation would lie behind addresses no kernel may touch: it fails.
      ZA_THROW(::zeroalloc::out_of_memory,
               "a new allocation landed in free space of a chunk in the NVMe "
               "tier, which could not come back: ",
               failure.what());
    }
    if (migrator_.where(chunk.address) != residency::host) continue;
    // Another block of the chunk may be in use (a hint open on it): it stays for now,
    // reachable (Note [Parameters parked]: the new allocation's work is not hinted).
    bool started = false;
    try {
      started = bring_back(chunk.address, chunk.handle.bytes, /*wait=*/false, /*urgent=*/false,
                           /*ordered_use=*/true);
    } catch (...) {
      reachable_where_it_is(chunk.address);
      throw;
    }
    if (!started) {
      reachable_where_it_is(chunk.address);
      continue;
    }
    // Ordered after the bytes without timing the wait: an allocation is not a use, and
    // the prefetch hit rate counts uses only.
    if (!migrator_.order_after_arrival(chunk.address, stream)) {
      migrator_.wait_until_settled(chunk.address);
    }
  }
}

bool offload_engine::evict(const void* pointer, bool wait) {
  std::vector<chunk_info> chunks = chunks_of(pointer);
  if (chunks.empty()) return false;
  std::vector<planned_eviction> planned;
  {
    // A chunk may hold other allocations too: one with a use open (between use_begins and
    // use_ends) has work coming that no fence covers yet, and moving the chunk under it
    // would lose that work's writes. Such a chunk stays.
    std::lock_guard lock(mutex_);
    // Claimed under the lock: a use that begins now waits for the move.
    std::erase_if(chunks, [&](const chunk_info& chunk) {
      const auto known = chunks_.find(chunk.address);
      return known != chunks_.end() && known->second.open_uses > 0;
    });
    for (const chunk_info& chunk : chunks) {
      chunk_info claimed;
      if (migrator_.claim_eviction(chunk.address, claimed)) {
        // Asked for: unhinted work on the chunk may be queued, so its streams are fenced;
        // and the program may read it next, so it stays mapped.
        planned.push_back(fenced_eviction(claimed, /*fence_streams=*/true, /*may_park=*/false));
      }
    }
  }
  launch_evictions(planned, /*full_is_an_error=*/true);  // the caller asked for this move
  // Kernels still reach what was asked to move: a chunk parked before stays no longer
  // behind a placeholder (Note [Parameters parked]).
  for (const chunk_info& chunk : chunks) {
    if (migrator_.parked(chunk.address)) reachable_where_it_is(chunk.address);
  }
  if (wait) {
    for (const chunk_info& chunk : chunks) migrator_.wait_until_settled(chunk.address);
  }
  return true;
}

void offload_engine::in_place_off_the_placeholder(std::uintptr_t address, stream_handle stream,
                                                  int callers_uses) {
  // Note [Parameters parked]: with device memory free within the limit, a fetch (a device
  // map and a copy) costs less than mapping the host chunk, and the use then runs on the
  // device; with none, nothing is evicted for it: the host chunk is mapped. A parked chunk
  // untouched since its last use is idle (nothing queued can reach it: its addresses map
  // nothing), so it is mapped on the device at once and `stream` waits for its bytes; the
  // host waits only for a fetch that must be fenced.
  if (migrator_.parked(address)) {
    std::vector<event_handle> use_ends;
    bool claimed = false;
    bool idle = false;
    std::uint64_t idle_generation = 0;
    {
      std::lock_guard lock(mutex_);
      auto state = chunks_.find(address);
      idle = state != chunks_.end() && state->second.hinted && !state->second.used_on_host;
      if (idle) idle_generation = state->second.released_generation;
      use_ends = use_end_fences(address);
      // Claimed only while still parked, and while no other use is open on it (Note [Moving
      // a chunk in use]): the CPUs write a parked chunk at its host copy (use_on_host), and
      // a fetch then would copy it from under their writes and free what they write.
      // Another thread may also have mapped it on the host meanwhile for a use of its own,
      // whose work must not find it moved.
      const bool others = state != chunks_.end() && state->second.open_uses > callers_uses;
      claimed = !others && migrator_.claim_fetch(address, /*parked_only=*/true);
    }
    bool started = false;
    try {
      started = claimed && migrator_.start_claimed_fetch(address, idle, idle_generation,
                                                         use_ends.empty() ? nullptr : &use_ends);
    } catch (...) {
      reachable_where_it_is(address);  // the use still runs: on the host, mapped
      throw;
    }
    if (started) {
      if (!migrator_.order_after_arrival(address, stream)) migrator_.wait_until_settled(address);
      std::lock_guard lock(mutex_);
      ++figures_.in_place_fetches;
      return;
    }
  }
  reachable_where_it_is(address);
}

void offload_engine::reachable_where_it_is(std::uintptr_t address) {
  // A move may start between the look and the map (a prefetch, or an eviction when no use
  // is open): the loop looks again once it has settled.
  for (int attempt = 0; attempt < 64; ++attempt) {
    bool parked = false;
    const residency where = migrator_.where(address, parked);
    if (parked) {
      if (migrator_.map_on_host(address)) return;
    } else if (where == residency::device || where == residency::host || where == residency::disk) {
      return;
    } else {
      migrator_.wait_until_settled(address);
    }
  }
  ZA_THROW(error, "the parked chunk at ", address,
           " kept moving while a use waited to map it on the host");
}

bool offload_engine::fetch(const void* pointer, bool wait) {
  const std::vector<chunk_info> chunks = chunks_of(pointer);
  if (chunks.empty()) return false;
  for (const chunk_info& chunk : chunks) {
    if (migrator_.where(chunk.address) != residency::device) {
      // A plain fetch: the caller's later work is not ordered after the bytes. What stays
      // on the host is reachable there (Note [Parameters parked]).
      if (!bring_back(chunk.address, chunk.handle.bytes, wait, /*urgent=*/true,
                      /*ordered_use=*/false)) {
        reachable_where_it_is(chunk.address);
      }
    }
  }
  return true;
}

offload_figures offload_engine::figures(bool wait_for_device) {
  std::lock_guard lock(mutex_);
  collect_waits(wait_for_device);
  offload_figures now = figures_;
  now.chunks_in_use = static_cast<std::uint64_t>(std::count_if(
      chunks_.begin(), chunks_.end(), [](const auto& each) { return each.second.open_uses > 0; }));
  return now;
}

}  // namespace zeroalloc
