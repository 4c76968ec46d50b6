#include "tier/migrator.hpp"

#include <chrono>
#include <cstdlib>

#include "core/log.hpp"
#include "core/units.hpp"

namespace zeroalloc {
namespace {

// A chunk_info's class (an int) as an index of the figures by class.
std::size_t class_slot(int cls) { return class_index(static_cast<allocation_class>(cls)); }

constexpr std::size_t kStagingSlots = 8;

std::uint64_t nanoseconds_since(std::chrono::steady_clock::time_point started) {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now() - started)
                                        .count());
}  // fetches whose copies may be in flight at once

std::uint64_t fnv1a(const std::vector<std::uint64_t>& words) {
  std::uint64_t hash = 0xcbf29ce484222325ull;
  for (std::uint64_t word : words) {
    hash ^= word;
    hash *= 0x100000001b3ull;
  }
  return hash;
}

}  // namespace

migrator::migrator(caching_allocator& allocator, host_pool& pool, bool verify, disk_store* disk,
                   bool any_access)
    : paging_(allocator.paging()),
      device_(allocator.backing()),
      pool_(pool),
      verify_(verify),
      disk_(disk),
      any_access_(any_access) {
  out_stream_ = device_.create_stream();
  in_stream_ = device_.create_stream();
  if (disk_ != nullptr) {
    write_lane_.stream = device_.create_stream();
    read_lane_.stream = device_.create_stream();
  }
  staging_slot_bytes_ = paging_.arena().chunk_bytes();
  staging_region_ =
      device_.reserve_addresses(staging_slot_bytes_ * kStagingSlots, paging_.arena().granularity());
  for (std::size_t i = kStagingSlots; i-- > 0;) {
    free_slots_.push_back(staging_region_ + i * staging_slot_bytes_);
  }
  worker_ = std::thread([this] { worker(); });
}

migrator::~migrator() {
  paging_.detach(*this);
  // Chunks on the host come home: the host pool may go away after this, the allocations
  // may not.
  try {
    drain();
    std::vector<std::uintptr_t> away;
    {
      std::lock_guard lock(mutex_);
      for (const auto& [address, chunk] : on_host_) away.push_back(address);
    }
    std::size_t stranded = 0;
    for (std::uintptr_t address : away) {
      try {  // each chunk on its own: one failing does not strand the rest
        if (!fetch_async(address)) ++stranded;
      } catch (const std::exception& failure) {
        ++stranded;
        log().error("offload: bringing the chunk at {:#x} back failed: {}", address,
                    failure.what());
      }
    }
    drain();
    // Those that stay are reached over PCIe from now on: none is left behind a placeholder.
    for (std::uintptr_t address : away) {
      try {
        map_on_host(address);
      } catch (const std::exception& failure) {
        log().error("offload: mapping the parked chunk at {:#x} on the host failed: {}", address,
                    failure.what());
      }
    }
    restore_all();  // then the disk's, through the host memory those left, one at a time
    if (stranded != 0) {
      log().warn("offload: {} chunks stay in host memory: no device memory to bring them back",
                 stranded);
    }
  } catch (const std::exception& failure) {
    log().error("offload: finishing the migrations in flight failed: {}", failure.what());
  }
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  worker_.join();
  try {
    for (event_handle event : spare_events_) device_.destroy_event(event);
    for (const auto& [address, bytes] : retired_slots_) {
      try {
        device_.unmap(address, bytes);  // one more try, so that the addresses can go
      } catch (const std::exception& failure) {
        log().warn("offload: a retired staging address stays mapped: {}", failure.what());
      }
    }
    device_.destroy_stream(out_stream_);
    device_.destroy_stream(in_stream_);
    for (disk_lane* lane : {&write_lane_, &read_lane_}) {
      if (lane->stream != nullptr) device_.destroy_stream(lane->stream);
    }
    // A placeholder still mapped behind a chunk that could not come back stays.
    if (on_disk_.empty()) {
      for (const auto& [bytes, placeholder] : placeholders_) device_.release_physical(placeholder);
    }
    device_.free_addresses(staging_region_, staging_slot_bytes_ * kStagingSlots);
  } catch (const std::exception& failure) {
    log().error("offload: releasing the migrator's streams failed: {}", failure.what());
  }
}

event_handle migrator::obtain_event() {
  {
    std::lock_guard lock(mutex_);
    if (!spare_events_.empty()) {
      event_handle event = spare_events_.back();
      spare_events_.pop_back();
      return event;
    }
  }
  return device_.create_event();
}

void migrator::fence_behind_chunk_streams(const chunk_info& chunk, stream_handle copy_stream) {
  for (stream_handle stream : chunk.streams) {
    event_handle fence = obtain_event();
    try {
      device_.record_event(fence, stream);
      device_.stream_wait_event(copy_stream, fence);
    } catch (...) {
      return_event(fence);  // unrecorded, or recorded and not waited on: either is reusable
      throw;
    }
    return_event(fence);  // a recorded event may be re-recorded once waited on
  }
}

void migrator::drain_before_move(std::uintptr_t address,
                                 void (migrator::*give_up)(std::uintptr_t)) {
  try {
    device_.synchronize_device();
  } catch (...) {
    (this->*give_up)(address);
    throw;
  }
}

void migrator::release_claim(std::uintptr_t address) {
  {
    std::lock_guard lock(mutex_);
    moving_.erase(address);
  }
  changed_.notify_all();
}

void migrator::return_event(event_handle event) {
  std::lock_guard lock(mutex_);
  spare_events_.push_back(event);
}

std::uint64_t migrator::checksum_of(std::uintptr_t address, std::size_t bytes,
                                    stream_handle stream) {
  std::vector<std::uint64_t> words(bytes / sizeof(std::uint64_t));
  device_.copy_async(words.data(), reinterpret_cast<const void*>(address), bytes, stream);
  device_.synchronize_stream(stream);
  return fnv1a(words);
}

bool migrator::evict_async(std::uintptr_t address, const std::vector<event_handle>* after,
                           bool and_chunk_streams) {
  chunk_info claimed;
  if (!claim_eviction(address, claimed)) return false;
  start_claimed_eviction(claimed, after, and_chunk_streams);
  return true;
}

bool migrator::claim_eviction(std::uintptr_t address, chunk_info& claimed) {
  // Claimed before any work is queued (Note [Claiming a chunk]), and before the pin: an
  // allocation landing in the chunk once it is pinned is told to wait for the move (Note
  // [Landing in a moving chunk] in alloc/heap.cpp), and that wait must find the move.
  // Pinned first, an allocation in between found it pinned, yet not moving, went on at
  // once, and its writes could land in the device chunk being left.
  {
    std::lock_guard lock(mutex_);
    if (moving_.contains(address) || on_host_.contains(address) || on_disk_.contains(address)) {
      return false;
    }
    moving_[address] = residency::moving_to_host;
  }
  bool pinned = false;
  try {  // not under mutex_: the heaps call in under theirs
    pinned = paging_.pin_chunk(address, claimed);
  } catch (...) {
    release_claim(address);
    throw;
  }
  if (pinned && claimed.handle.location == memory_location::device) return true;
  if (pinned) paging_.unpin_chunk(address);
  release_claim(address);
  return false;
}

void migrator::cancel_eviction(std::uintptr_t address) {
  paging_.unpin_chunk(address);
  release_claim(address);
}

void migrator::start_claimed_eviction(const chunk_info& chunk,
                                      const std::vector<event_handle>* after,
                                      bool and_chunk_streams, bool park) {
  const std::uintptr_t address = chunk.address;
  if (any_access_) {  // Note [Moves any kernel may see]
    park = false;
    drain_before_move(address, &migrator::cancel_eviction);
  }
  transfer moving;
  moving.chunk = chunk;
  moving.to_host = true;
  moving.device_chunk = chunk.handle;
  moving.park = park;
  bool copy_queued = false;
  try {
    if (park) moving.placeholder = placeholder_for(chunk.handle.bytes);  // Note [Parked chunks]
    moving.host = pool_.acquire(chunk.handle.bytes);
    moving.copied = obtain_event();
    if (after != nullptr) {
      for (event_handle fence : *after) device_.stream_wait_event(out_stream_, fence);
    }
    if (after == nullptr || and_chunk_streams) fence_behind_chunk_streams(chunk, out_stream_);
    if (verify_) moving.checksum = checksum_of(address, chunk.handle.bytes, out_stream_);
    device_.copy_async(reinterpret_cast<void*>(moving.host.staging_address),
                       reinterpret_cast<const void*>(address), chunk.handle.bytes, out_stream_);
    copy_queued = true;
    device_.record_event(moving.copied, out_stream_);
  } catch (...) {
    if (copy_queued) settle(out_stream_);  // the copy may still write the host chunk
    if (moving.host.valid()) pool_.release(moving.host);
    if (moving.copied != nullptr) return_event(moving.copied);
    cancel_eviction(address);
    throw;
  }
  {
    std::lock_guard lock(mutex_);
    bytes_leaving_device_ += chunk.handle.bytes;
    in_flight_.push_back(std::move(moving));
  }
  changed_.notify_all();
  if (any_access_) wait_until_settled(address);  // Note [Moves any kernel may see]
}

bool migrator::fetch_async(std::uintptr_t address, bool chunk_idle, std::uint64_t idle_generation,
                           const std::vector<event_handle>* after) {
  return claim_fetch(address) && start_claimed_fetch(address, chunk_idle, idle_generation, after);
}

bool migrator::claim_fetch(std::uintptr_t address, bool parked_only) {
  std::lock_guard lock(mutex_);
  auto found = on_host_.find(address);
  if (found == on_host_.end() || moving_.contains(address)) return false;
  if (parked_only && !found->second.parked) return false;
  // Note [Claiming a chunk]: a chunk is "moving" from the moment one thread decides to
  // move it, before its remap or copy. Claimed only after the remap, a use beginning in
  // between on another thread saw "host", queued its writes without waiting for the
  // arriving bytes, and the copy-in overwrote them (a prefetch against a use, found by
  // OffloadEngineTest.WindowsFetchedAheadAndEvictedBehindKeepEveryWrite with prefetch on).
  moving_[address] = residency::moving_to_device;
  return true;
}

bool migrator::start_claimed_fetch(std::uintptr_t address, bool chunk_idle,
                                   std::uint64_t idle_generation,
                                   const std::vector<event_handle>* after) {
  host_chunk host;
  bool parked = false;
  {
    std::lock_guard lock(mutex_);
    auto found = on_host_.find(address);
    if (found != on_host_.end()) {
      host = found->second.host;
      parked = found->second.parked;
    }
  }
  if (!host.valid()) {  // its segment went while the claim was being made
    release_claim(address);
    return false;
  }
  if (any_access_) {  // Note [Moves any kernel may see]
    chunk_idle = false;
    drain_before_move(address, &migrator::release_claim);
  }
  chunk_info chunk;
  if (!paging_.pin_chunk(address, chunk)) {
    release_claim(address);
    return false;
  }
  if (!maps_host_copy(chunk.handle, host, parked)) {
    // remapped behind our back: not ours
    paging_.unpin_chunk(address);
    release_claim(address);
    return false;
  }
  // Blocks allocated or freed in the segment since the hints were given: someone may have
  // queued work on the chunk that no hint covers.
  if (chunk.generation != idle_generation) chunk_idle = false;
  transfer moving;
  moving.chunk = chunk;
  moving.to_host = false;
  moving.host = host;
  moving.device_chunk = paging_.arena().take_chunk(chunk.handle.bytes);
  if (!moving.device_chunk.valid()) {
    paging_.unpin_chunk(address);
    release_claim(address);
    return false;
  }
  if (chunk_idle) {
    std::uint64_t early_remap_ns = 0;
    bool copies_queued = false;  // copies that may run into memory given back on failure
    // Nothing queued touches the chunk: map the device chunk now and let its bytes arrive
    // in stream order (Note [Fault-free migration]); users wait on the copy's event.
    try {
      moving.copied = obtain_event();
      if (verify_) {
        moving.checksum = checksum_of(host.staging_address, chunk.handle.bytes, in_stream_);
      }
      const auto remap_started = std::chrono::steady_clock::now();
      paging_.remap_pinned_chunk(address, moving.device_chunk);
      moving.remapped_early = true;
      early_remap_ns =
          static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                         std::chrono::steady_clock::now() - remap_started)
                                         .count());
      device_.copy_async(reinterpret_cast<void*>(address),
                         reinterpret_cast<const void*>(host.staging_address), chunk.handle.bytes,
                         in_stream_);
      copies_queued = true;
      if (verify_) {
        // Read back before the event users wait on: once it completes, their kernels may
        // write the chunk, and a checksum taken later would see their bytes.
        moving.arrived.resize(chunk.handle.bytes / sizeof(std::uint64_t));
        device_.copy_async(moving.arrived.data(), reinterpret_cast<const void*>(address),
                           chunk.handle.bytes, in_stream_);
      }
      device_.record_event(moving.copied, in_stream_);
    } catch (...) {
      if (copies_queued) settle(in_stream_);  // the copy in and the read-back may still run
      bool stays_on_device = false;
      if (moving.remapped_early) {
        try {
          paging_.remap_pinned_chunk(address, chunk.handle);  // the host chunk or placeholder
        } catch (const std::exception& again) {
          // Its addresses still map the device chunk: that is where it is now, with the
          // bytes the copy brought (synchronized above) or without them.
          stays_on_device = true;
          log().critical(
              "offload: the chunk at {:#x} could not be mapped back to its host copy after "
              "its fetch failed ({}); it stays on the device{}",
              address, again.what(),
              copies_queued ? "" : ", without its bytes: expect wrong results, restart");
        }
      }
      if (moving.copied != nullptr) return_event(moving.copied);
      if (stays_on_device) {
        forget_host_copy(moving);
      } else {
        paging_.arena().return_chunk(moving.device_chunk);
      }
      paging_.unpin_chunk(address);
      release_claim(address);
      throw;
    }
    std::lock_guard lock(mutex_);
    figures_.remap_ns += early_remap_ns;
    arriving_[address] = moving.copied;
    in_flight_.push_back(std::move(moving));
    changed_.notify_all();
    return true;
  }
  bool mapped = false;
  bool copy_queued = false;
  try {
    moving.staging = take_staging_slot();
    device_.map(moving.staging, moving.device_chunk);
    mapped = true;
    moving.copied = obtain_event();
    fence_behind_chunk_streams(chunk, in_stream_);  // not idle: whatever may touch it
    if (after != nullptr) {
      for (event_handle fence : *after) device_.stream_wait_event(in_stream_, fence);
    }
    if (verify_) {  // the host chunk's bytes (a parked chunk's addresses reach none)
      moving.checksum = checksum_of(host.staging_address, chunk.handle.bytes, in_stream_);
    }
    device_.copy_async(reinterpret_cast<void*>(moving.staging),
                       reinterpret_cast<const void*>(host.staging_address), chunk.handle.bytes,
                       in_stream_);
    copy_queued = true;
    device_.record_event(moving.copied, in_stream_);
  } catch (...) {
    if (copy_queued) settle(in_stream_);  // it may still write into the staged device chunk
    if (moving.staging != 0) {
      give_back_staging(moving.staging, moving.device_chunk, mapped);
    } else {
      paging_.arena().return_chunk(moving.device_chunk);  // no slot was free
    }
    if (moving.copied != nullptr) return_event(moving.copied);
    paging_.unpin_chunk(address);
    release_claim(address);
    throw;
  }
  {
    std::lock_guard lock(mutex_);
    in_flight_.push_back(std::move(moving));
  }
  changed_.notify_all();
  if (any_access_) wait_until_settled(address);  // Note [Moves any kernel may see]
  return true;
}

// Note [Committing a move]: a move commits when the chunk's addresses map its new backing
// (the remap; for an early-remapped fetch, at the request). A failure before that is undone
// by the worker: the chunk keeps its old backing. Nothing after it may undo it: the chunk's
// bytes are where its addresses point, so what follows (unmapping the staging address,
// verifying) only logs its failures. A staging address whose unmap failed still maps the
// device chunk now behind the chunk, so it is retired rather than reused.
void migrator::finish(transfer& done) {
  const std::uintptr_t address = done.chunk.address;
  const std::size_t bytes = done.chunk.handle.bytes;
  stream_handle stream = done.to_host ? out_stream_ : in_stream_;
  const auto remap_started = std::chrono::steady_clock::now();
  physical_handle left_behind;  // to host: the device chunk the chunk no longer uses
  if (done.to_host) {
    // Stays pinned until on_host_ knows the chunk (below): a segment unmapped in between
    // would hand its host slice to host_chunk_released before it could be found.
    left_behind =
        paging_.remap_pinned_chunk(address, done.park ? done.placeholder : done.host.handle);
  } else if (!done.remapped_early) {
    // Stays pinned through the verification below, which reads the chunk's addresses: a
    // segment released in between would leave them unmapped, or mapping another's bytes.
    paging_.remap_pinned_chunk(address, done.device_chunk);  // the host chunk: below
  }
  done.committed = true;
  if (done.to_host) {
    paging_.arena().return_chunk(left_behind);
  } else if (!done.remapped_early) {
    try {
      device_.unmap(done.staging, bytes);
      return_staging_slot(done.staging);
    } catch (const std::exception& failure) {
      retire_staging_slot(done.staging, bytes);
      log().error(
          "offload: unmapping the staging address {:#x} after a fetch failed ({}); the "
          "fetch stands, the address is not used again",
          done.staging, failure.what());
    }
  }
  if (verify_) {
    std::uint64_t after = 0;
    try {
      // A parked chunk's bytes are read where they are: its addresses reach none.
      after = done.remapped_early ? fnv1a(done.arrived)
              : done.park         ? checksum_of(done.host.staging_address, bytes, stream)
                                  : checksum_of(address, bytes, stream);
    } catch (const std::exception& failure) {
      log().error(
          "ZEROALLOC_VERIFY: the chunk at {:#x} moved to the {} but could not be read "
          "back to check it: {}",
          address, done.to_host ? "host" : "device", failure.what());
      after = done.checksum;
    }
    if (after != done.checksum) {
      log().critical(
          "ZEROALLOC_VERIFY: the chunk at {:#x} ({}, {}) changed while moving to the {}: "
          "checksum {:#x} before, {:#x} after. Stopping before the damage spreads; please "
          "report this with the log (ZEROALLOC_LOG_LEVEL=debug).",
          address, class_name(static_cast<allocation_class>(done.chunk.allocation_class)),
          format_bytes(bytes), done.to_host ? "host" : "device", done.checksum, after);
      std::abort();
    }
  }
  if (!done.to_host) {
    paging_.unpin_chunk(address);  // a fetch: after the verification that reads it
    forget_host_copy(done);
  }
  const auto remap_ns =
      static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::steady_clock::now() - remap_started)
                                     .count());
  std::unique_lock lock(mutex_);
  figures_.remap_ns += remap_ns;
  if (done.to_host) {
    bytes_leaving_device_ -= bytes;
    on_host_[address] = {done.host, done.chunk.allocation_class, done.park};
    host_owner_[{done.host.handle.value, done.host.handle.offset}] = address;
    if (done.park) {
      ++figures_.chunks_parked;
      figures_.parked_bytes += bytes;
    }
    ++figures_.chunks_to_host;
    figures_.bytes_to_host += bytes;
    figures_.host_resident_bytes += bytes;
    figures_.host_resident_class_bytes[class_slot(done.chunk.allocation_class)] += bytes;
    figures_.to_host_class_bytes[class_slot(done.chunk.allocation_class)] += bytes;
  }
  if (verify_) ++figures_.verified_chunks;
  spare_events_.push_back(std::exchange(done.copied, nullptr));
  if (done.to_host) {  // Note [Unpinned before settled]
    lock.unlock();
    paging_.unpin_chunk(address);
    lock.lock();
  }
  moving_.erase(address);
  arriving_.erase(address);
}

void migrator::worker() {
  std::unique_lock lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return stopping_ || !in_flight_.empty(); });
    if (in_flight_.empty()) return;         // stopping, and nothing left
    transfer& oldest = in_flight_.front();  // stays valid: the deque only grows at the back
    lock.unlock();
    try {
      device_.synchronize_event(oldest.copied);
      finish(oldest);
    } catch (const std::exception& failure) {
      // Before the commit (Note [Committing a move]) the chunk keeps its old backing
      // (remap_pinned_chunk maps it back on failure); a failure after it (the bookkeeping
      // only) leaves the move standing.
      log().error("offload: moving the chunk at {:#x} to the {} failed: {}", oldest.chunk.address,
                  oldest.to_host ? "host" : "device", failure.what());
      // The copy may still run (the wait for it is what failed): it ends before the memory
      // it reads or writes goes back.
      if (!oldest.committed) settle(oldest.to_host ? out_stream_ : in_stream_);
      if (oldest.committed) {
        // The move stands; nothing to give back.
      } else if (oldest.to_host) {
        pool_.release(oldest.host);
      } else if (oldest.remapped_early) {
        // Committed at its request: users were ordered after its copy and may have queued
        // work on the device mapping, which mapping the host chunk back would lose. It
        // stays on the device, its host copy goes back.
        log().critical(
            "offload: the bytes of the chunk at {:#x} may not have reached the device; it "
            "stays there (expect wrong results, restart)",
            oldest.chunk.address);
        forget_host_copy(oldest);
      } else {
        give_back_staging(oldest.staging, oldest.device_chunk, /*mapped=*/true);
      }
      paging_.unpin_chunk(oldest.chunk.address);
      std::lock_guard relock(mutex_);
      if (oldest.to_host) bytes_leaving_device_ -= oldest.chunk.handle.bytes;
      moving_.erase(oldest.chunk.address);
      arriving_.erase(oldest.chunk.address);
      if (oldest.copied != nullptr) spare_events_.push_back(oldest.copied);  // not leaked
    }
    lock.lock();
    in_flight_.pop_front();
    changed_.notify_all();
  }
}

bool migrator::order_after_arrival(std::uintptr_t address, stream_handle stream) {
  std::lock_guard lock(mutex_);  // held: the event is not recycled while waited on
  auto arriving = arriving_.find(address);
  if (arriving == arriving_.end()) return false;
  device_.stream_wait_event(stream, arriving->second);
  return true;
}

std::uint64_t migrator::wait_until_settled(std::uintptr_t address) {
  std::unique_lock lock(mutex_);
  if (!moving_.contains(address)) return 0;
  const auto started = std::chrono::steady_clock::now();
  changed_.wait(lock, [&] { return !moving_.contains(address); });
  const auto waited =
      static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::steady_clock::now() - started)
                                     .count());
  ++figures_.waits;
  figures_.waited_ns += waited;
  return waited;
}

void migrator::drain() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return in_flight_.empty(); });
}

residency migrator::where(std::uintptr_t address, bool& parked) const {
  std::lock_guard lock(mutex_);
  parked = false;
  if (auto found = moving_.find(address); found != moving_.end()) return found->second;
  if (auto found = on_host_.find(address); found != on_host_.end()) {
    parked = found->second.parked;
    return residency::host;
  }
  return on_disk_.contains(address) ? residency::disk : residency::device;
}

residency migrator::where(std::uintptr_t address) const {
  bool parked = false;
  return where(address, parked);
}

std::uintptr_t migrator::host_address(std::uintptr_t address) const {
  if (!pool_.open_to_host()) return 0;
  std::lock_guard lock(mutex_);
  if (moving_.contains(address)) return 0;
  auto found = on_host_.find(address);
  return found == on_host_.end() ? 0 : found->second.host.staging_address;
}

std::uint64_t migrator::bytes_leaving_device() const {
  std::lock_guard lock(mutex_);
  return bytes_leaving_device_;
}

std::uint64_t migrator::disk_resident_bytes() const {
  std::lock_guard lock(mutex_);
  return figures_.disk_resident_bytes;
}

migration_figures migrator::figures() const {
  std::lock_guard lock(mutex_);
  return figures_;
}

std::uintptr_t migrator::take_staging_slot() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock,
                [&] { return !free_slots_.empty() || retired_slots_.size() == kStagingSlots; });
  if (free_slots_.empty()) {
    throw device_error(
        "offload: every staging address of the migrator failed to unmap earlier (see the "
        "log); host-resident chunks cannot be brought back without one. The GPU driver is "
        "failing: restart the process",
        0);
  }
  const std::uintptr_t slot = free_slots_.back();
  free_slots_.pop_back();
  return slot;
}

void migrator::retire_staging_slot(std::uintptr_t address, std::size_t bytes) {
  {
    std::lock_guard lock(mutex_);
    retired_slots_.emplace_back(address, bytes);
  }
  changed_.notify_all();
}

void migrator::return_staging_slot(std::uintptr_t address) {
  {
    std::lock_guard lock(mutex_);
    free_slots_.push_back(address);
  }
  changed_.notify_all();
}

void migrator::settle(stream_handle stream) {
  try {
    device_.synchronize_stream(stream);
  } catch (...) {  // the stream failed: nothing runs on it any more
  }
}

void migrator::forget_host_copy(transfer& fetched) {
  pool_.release(fetched.host);
  std::lock_guard lock(mutex_);
  if (auto found = on_host_.find(fetched.chunk.address);
      found != on_host_.end() && found->second.parked) {
    figures_.parked_bytes -= fetched.chunk.handle.bytes;
  }
  on_host_.erase(fetched.chunk.address);
  host_owner_.erase({fetched.host.handle.value, fetched.host.handle.offset});
  ++figures_.chunks_to_device;
  figures_.bytes_to_device += fetched.chunk.handle.bytes;
  figures_.host_resident_bytes -= fetched.chunk.handle.bytes;
  figures_.host_resident_class_bytes[class_slot(fetched.chunk.allocation_class)] -=
      fetched.chunk.handle.bytes;
  figures_.to_device_class_bytes[class_slot(fetched.chunk.allocation_class)] +=
      fetched.chunk.handle.bytes;
}

void migrator::give_back_staging(std::uintptr_t slot, physical_handle device_chunk, bool mapped) {
  if (mapped) {
    try {
      device_.unmap(slot, device_chunk.bytes);
    } catch (const std::exception& failure) {
      // Still mapped there: neither the address nor the device chunk may serve anything
      // else (a later map at the slot would fail; the chunk's memory would be shared).
      retire_staging_slot(slot, device_chunk.bytes);
      log().error(
          "offload: unmapping the staging address {:#x} of a fetch that failed failed too "
          "({}); the address and the {} of device memory it maps are not used again",
          slot, failure.what(), format_bytes(device_chunk.bytes));
      return;
    }
  }
  return_staging_slot(slot);
  paging_.arena().return_chunk(device_chunk);
}

// Note [Chunks on disk]: the disk tier sits behind the host tier. A chunk reaches it only
// from the host (the engine spills host-resident chunks when the host tier is full) and
// comes back to the host before anything else (restore), then to the device as any
// host-resident chunk. While its bytes are on disk, its addresses map a placeholder: host
// memory of its size, shared by every disk-resident chunk of that size and mapped with no
// access, so that the heap sees a mapped chunk as before (its segment unmaps and releases it
// as it would a host chunk, handing it to host_chunk_released, which frees the disk slot),
// and a kernel or copy that touches the chunk faults instead of reading wrong bytes. The
// engine brings a chunk back before every hinted use; only hinted classes go to disk.
// The disk store reads and writes CPU-addressable memory, and a host chunk is reached
// through the device (its staging address): the bytes pass through a bounce buffer (one
// for writes, one for reads: Note [Two disk lanes]), by a copy on the lane's own stream,
// then one request to the store for the whole chunk. A
// write that fails leaves the chunk on the host, untouched (Note [A failed write loses
// nothing] in disk_store.hpp); a read that fails leaves it on disk. The placeholders are
// host memory outside ZEROALLOC_HOST_LIMIT: one per size of chunk on disk (most chunks are
// ZEROALLOC_CHUNK_SIZE; a segment's last one may be smaller), until the migrator goes.
//
// Note [Room kept for restores]: a chunk on disk comes back into a host chunk, and a full
// host tier makes room by sending another chunk to the disk, which needs a disk slot before
// the restore frees one. With the disk full too (the largest model a machine trains fills
// every tier), nothing could come back. So a spill leaves the room of the largest chunk
// spilled so far free in the store, except the one of a swap: a chunk of the same size goes
// to the disk, into that room, and the chunk coming back takes its host chunk directly
// (never through the pool, where another move could take it first); the restore then frees
// its slot, and the room is there again. The engine makes one swap at a time. The tier
// holds one chunk less than its capacity; a model that needs that last chunk fails its
// allocation with the usual message instead of failing later, at a use.

physical_handle migrator::placeholder_for(std::size_t bytes) {
  {
    std::lock_guard lock(mutex_);
    if (auto found = placeholders_.find(bytes); found != placeholders_.end()) return found->second;
  }
  physical_handle made = device_.create_physical(bytes, memory_location::host);
  made.inaccessible = true;
  std::lock_guard lock(mutex_);
  auto [where, inserted] = placeholders_.emplace(bytes, made);
  if (!inserted) device_.release_physical(made);  // another thread made one meanwhile
  return where->second;
}

bool migrator::maps_host_copy(const physical_handle& mapped, const host_chunk& host, bool parked) {
  if (parked) return mapped.inaccessible;  // Note [Parked chunks]: the placeholder
  return mapped.value == host.handle.value && mapped.offset == host.handle.offset;
}

bool migrator::parked(std::uintptr_t address) const {
  bool parked = false;
  static_cast<void>(where(address, parked));  // false while it moves
  return parked;
}

bool migrator::map_on_host(std::uintptr_t address) {
  host_chunk host;
  {
    std::lock_guard lock(mutex_);
    auto found = on_host_.find(address);
    if (found == on_host_.end() || !found->second.parked || moving_.contains(address)) {
      return false;
    }
    host = found->second.host;
    moving_[address] = residency::moving_to_host;  // uses that begin now wait for the map
  }
  chunk_info chunk;
  if (!paging_.pin_chunk(address, chunk)) {  // its segment went meanwhile
    release_claim(address);
    return false;
  }
  const auto started = std::chrono::steady_clock::now();
  try {
    if (!chunk.handle.inaccessible) {
      ZA_THROW(error, "the parked chunk at ", address, " is not mapped to its placeholder");
    }
    paging_.remap_pinned_chunk(address, host.handle);  // on failure it stays parked
  } catch (...) {
    paging_.unpin_chunk(address);
    release_claim(address);
    throw;
  }
  {
    std::lock_guard lock(mutex_);
    if (auto found = on_host_.find(address); found != on_host_.end()) found->second.parked = false;
    figures_.parked_bytes -= host.handle.bytes;
    ++figures_.chunks_unparked;
    figures_.remap_ns += nanoseconds_since(started);
  }
  paging_.unpin_chunk(address);  // Note [Unpinned before settled]
  release_claim(address);
  return true;
}

std::vector<migrator::host_resident_chunk> migrator::host_resident_chunks() const {
  std::lock_guard lock(mutex_);
  std::vector<host_resident_chunk> chunks;
  chunks.reserve(on_host_.size());
  for (const auto& [address, away] : on_host_) {
    if (moving_.contains(address)) continue;
    chunks.push_back({address, away.host.handle.bytes, away.allocation_class});
  }
  return chunks;
}

// Note [Unpinned before settled]: a move pins its chunk in the heap (pin_chunk) for its whole
// course, and the next move of the chunk pins it again, which fails while the first still
// holds it. So a move gives its pin back before it stops counting as moving (moving_), after
// its bookkeeping: a thread that sees the chunk settled can always pin it, and a segment
// released in between finds the chunk where the bookkeeping says it is. The other order
// failed a restore from disk that began between the two (found by
// OffloadEngineDiskTest.RandomMovesBetweenTheThreeTiersRacingWithKernelsKeepEveryByte).
bool migrator::claim_spill(std::uintptr_t address) {
  std::lock_guard lock(mutex_);
  if (disk_ == nullptr || !on_host_.contains(address) || moving_.contains(address)) return false;
  moving_[address] = residency::moving_to_disk;
  return true;
}

bool migrator::swap(std::uintptr_t from_disk, std::uintptr_t claimed,
                    const std::vector<event_handle>* after) {
  host_chunk freed;
  spill(claimed, after, &freed);
  if (!freed.valid()) return false;  // its segment went meanwhile: nothing moved
  return restore_into(from_disk, &freed);
}

void migrator::spill(std::uintptr_t address, const std::vector<event_handle>* after,
                     host_chunk* freed) {
  const bool for_restore = freed != nullptr;
  const auto started = std::chrono::steady_clock::now();
  host_chunk host;
  int cls = 0;
  bool parked = false;
  {
    std::lock_guard lock(mutex_);
    auto found = on_host_.find(address);
    if (found != on_host_.end()) {
      host = found->second.host;
      cls = found->second.allocation_class;
      parked = found->second.parked;
    }
  }
  // Note [Moves any kernel may see]: no kernel still reading the host chunk may meet the
  // placeholder.
  if (any_access_ && host.valid()) drain_before_move(address, &migrator::release_claim);
  chunk_info chunk;
  if (!host.valid() || !paging_.pin_chunk(address, chunk)) {  // its segment went meanwhile
    release_claim(address);
    return;
  }
  const std::size_t bytes = host.handle.bytes;
  std::uint64_t leave_free = 0;  // Note [Room kept for restores]
  {
    std::lock_guard lock(mutex_);
    largest_spill_bytes_ = std::max(largest_spill_bytes_, bytes);
    if (!for_restore) leave_free = largest_spill_bytes_;
  }
  disk_slot slot = 0;
  try {
    if (!maps_host_copy(chunk.handle, host, parked)) {
      ZA_THROW(error, "the chunk at ", address, " was remapped while moving to the disk");
    }
    const physical_handle placeholder = placeholder_for(bytes);
    slot = disk_->allocate(bytes, leave_free);
    {
      std::lock_guard io(write_lane_.mutex);  // Note [Two disk lanes]
      std::byte* const bounce = write_lane_.buffer(bytes);
      const stream_handle disk_stream = write_lane_.stream;
      // As an eviction's copy: after the ends of its hinted uses and everything queued on
      // its streams (the host runs ahead of the device: a use that ended in host time may
      // still be running, an in-place step writing the chunk among them).
      if (after != nullptr) {
        for (event_handle fence : *after) device_.stream_wait_event(disk_stream, fence);
      }
      fence_behind_chunk_streams(chunk, disk_stream);
      try {
        device_.copy_async(bounce, reinterpret_cast<const void*>(host.staging_address), bytes,
                           disk_stream);
        device_.synchronize_stream(disk_stream);
      } catch (...) {
        settle(disk_stream);
        throw;
      }
      const disk_store::ticket written = disk_->write(slot, bounce, bytes);
      try {
        disk_->wait(written);
      } catch (...) {
        slot = 0;  // a failed write released it (Note [A failed write loses nothing])
        throw;
      }
    }
    // On failure the host chunk stays mapped; a parked chunk maps its placeholder already.
    if (!parked) paging_.remap_pinned_chunk(address, placeholder);
  } catch (...) {
    if (slot != 0) disk_->release(slot);
    paging_.unpin_chunk(address);
    release_claim(address);
    throw;
  }
  {
    std::lock_guard lock(mutex_);
    on_host_.erase(address);
    host_owner_.erase({host.handle.value, host.handle.offset});
    if (parked) figures_.parked_bytes -= bytes;
    on_disk_[address] = {slot, bytes, cls};
    figures_.host_resident_bytes -= bytes;
    figures_.host_resident_class_bytes[class_slot(cls)] -= bytes;
    figures_.disk_resident_bytes += bytes;
    figures_.bytes_to_disk += bytes;
    ++figures_.chunks_to_disk;
    figures_.disk_ns += nanoseconds_since(started);
  }
  paging_.unpin_chunk(address);  // Note [Unpinned before settled]
  {
    std::lock_guard lock(mutex_);
    moving_.erase(address);
  }
  changed_.notify_all();
  if (freed != nullptr) {
    *freed = host;  // straight to the chunk coming back (swap)
  } else {
    pool_.release(host);
  }
}

std::byte* migrator::disk_lane::buffer(std::size_t bytes) {
  if (bounce_bytes < bytes) {  // the new buffer first: a failure keeps the old one
    std::unique_ptr<std::byte, void (*)(void*)> larger(
        static_cast<std::byte*>(std::aligned_alloc(4 * KiB, round_up(bytes, 4 * KiB))), std::free);
    if (!larger) throw std::bad_alloc();
    bounce = std::move(larger);
    bounce_bytes = bytes;
  }
  return bounce.get();
}

bool migrator::restore_into(std::uintptr_t address, const host_chunk* into) {
  const auto started = std::chrono::steady_clock::now();
  chunk_on_disk away;
  bool refused = false;
  {
    std::lock_guard lock(mutex_);
    auto found = on_disk_.find(address);
    refused = found == on_disk_.end() || moving_.contains(address) ||
              (into != nullptr && into->handle.bytes != found->second.bytes);
    if (!refused) {
      away = found->second;
      moving_[address] = residency::moving_from_disk;
    }
  }
  if (refused) {
    if (into != nullptr) pool_.release(*into);
    return false;
  }
  host_chunk host;
  chunk_info chunk;
  bool pinned = false;
  try {
    // host_memory_exhausted: the caller makes room
    host = into != nullptr ? *into : pool_.acquire(away.bytes);
    pinned = paging_.pin_chunk(address, chunk);
    if (!pinned) ZA_THROW(error, "the chunk at ", address, " is pinned by another move");
    if (!chunk.handle.inaccessible) {
      ZA_THROW(error, "the chunk at ", address, " is not mapped to its placeholder");
    }
    {
      std::lock_guard io(read_lane_.mutex);  // Note [Two disk lanes]
      std::byte* const bounce = read_lane_.buffer(away.bytes);
      disk_->wait(disk_->read(away.slot, bounce, away.bytes));
      try {
        device_.copy_async(reinterpret_cast<void*>(host.staging_address), bounce, away.bytes,
                           read_lane_.stream);
        device_.synchronize_stream(read_lane_.stream);
      } catch (...) {
        settle(read_lane_.stream);  // the copy may still write the host chunk given back below
        throw;
      }
    }
    paging_.remap_pinned_chunk(address, host.handle);
  } catch (...) {
    if (host.valid()) pool_.release(host);
    if (pinned) paging_.unpin_chunk(address);
    release_claim(address);
    throw;
  }
  {
    std::lock_guard lock(mutex_);
    on_disk_.erase(address);
    on_host_[address] = {host, away.allocation_class};
    host_owner_[{host.handle.value, host.handle.offset}] = address;
    figures_.disk_resident_bytes -= away.bytes;
    figures_.host_resident_bytes += away.bytes;
    figures_.host_resident_class_bytes[class_slot(away.allocation_class)] += away.bytes;
    figures_.bytes_from_disk += away.bytes;
    ++figures_.chunks_from_disk;
    figures_.disk_ns += nanoseconds_since(started);
  }
  paging_.unpin_chunk(address);  // Note [Unpinned before settled]
  {
    std::lock_guard lock(mutex_);
    moving_.erase(address);
  }
  changed_.notify_all();
  disk_->release(away.slot);
  return true;
}

void migrator::restore_all() {
  std::vector<std::uintptr_t> on_disk;
  {
    std::lock_guard lock(mutex_);
    for (const auto& [address, away] : on_disk_) on_disk.push_back(address);
  }
  std::size_t stranded = 0;
  for (std::uintptr_t address : on_disk) {
    try {
      wait_until_settled(address);
      if (restore(address) && fetch_async(address)) drain();  // its host chunk free again
    } catch (const std::exception& failure) {
      ++stranded;
      log().error("offload: bringing the chunk at {:#x} back from the disk failed: {}", address,
                  failure.what());
    }
  }
  if (stranded != 0) {
    log().error("offload: {} chunks stay on the disk, behind addresses no kernel may touch",
                stranded);
  }
}

void migrator::host_chunk_released(physical_handle handle, std::uintptr_t address) {
  if (handle.inaccessible) {
    {
      // A parked chunk's placeholder (Note [Parked chunks]): its host chunk goes back.
      std::unique_lock lock(mutex_);
      auto parked = on_host_.find(address);
      if (parked != on_host_.end() && parked->second.parked) {
        const host_chunk away = parked->second.host;
        figures_.host_resident_class_bytes[class_slot(parked->second.allocation_class)] -=
            away.handle.bytes;
        figures_.host_resident_bytes -= away.handle.bytes;
        figures_.parked_bytes -= away.handle.bytes;
        host_owner_.erase({away.handle.value, away.handle.offset});
        on_host_.erase(parked);
        lock.unlock();
        pool_.release(away);
        return;
      }
    }
    // A disk-resident chunk's placeholder: its slot is free again.
    std::uint64_t slot = 0;
    {
      std::lock_guard lock(mutex_);
      auto found = on_disk_.find(address);
      if (found == on_disk_.end()) return;
      slot = found->second.slot;
      figures_.disk_resident_bytes -= found->second.bytes;
      on_disk_.erase(found);
    }
    try {
      disk_->release(slot);
    } catch (const std::exception& failure) {  // never throws to the heap
      log().error("offload: freeing the disk slot of a released chunk failed: {}", failure.what());
    }
    return;
  }
  host_chunk chunk;
  chunk.handle = handle;  // if no migration knows it, the slice still goes back to the pool
  {
    std::lock_guard lock(mutex_);
    auto owner = host_owner_.find({handle.value, handle.offset});
    if (owner == host_owner_.end()) {
      log().warn("offload: a host chunk of {} came back that no migration recorded; pooled",
                 format_bytes(handle.bytes));
    } else {
      const chunk_on_host& away = on_host_.at(owner->second);
      chunk = away.host;
      figures_.host_resident_class_bytes[class_slot(away.allocation_class)] -= handle.bytes;
      on_host_.erase(owner->second);
      host_owner_.erase(owner);
      figures_.host_resident_bytes -= handle.bytes;
    }
  }
  pool_.release(chunk);
}

}  // namespace zeroalloc
