#include "alloc/caching_allocator.hpp"

#include <algorithm>
#include <exception>
#include <nlohmann/json.hpp>

#include "alloc/heap.hpp"
#include "core/errors.hpp"
#include "core/log.hpp"
#include "core/units.hpp"

namespace zeroalloc {

caching_allocator::caching_allocator(device& backing, const allocator_settings& settings)
    : device_(backing),
      limiter_(settings.limit_bytes != 0 ? settings.limit_bytes
                                         : backing.query_memory().total_bytes),
      arena_(backing, settings.chunk_bytes, limiter_),
      limit_source_(settings.limit_source) {
  // Note [Address regions]: each heap may at most map the whole device; twice that leaves
  // room for the holes that unmapped segments leave in its address region. Chunks the
  // offload engine moves to the host stay mapped in their segments, so the large heaps of
  // the classes it moves (parameters, gradients, optimizer states) also hold the host tier:
  // sized to the device alone, a class whose states outgrew twice the device failed with
  // its region exhausted while the host tier had room. Address space costs nothing until
  // mapped.
  const std::size_t region_bytes = 2 * backing.query_memory().total_bytes;
  for (allocation_class cls : kAllocationClasses) {
    const bool paged = cls != allocation_class::other;
    heaps_[2 * class_index(cls)] =
        std::make_unique<heap>(arena_, stats_, listener_, cls, heap::size_kind::small, region_bytes,
                               settings.drain_before_release);
    heaps_[2 * class_index(cls) + 1] = std::make_unique<heap>(
        arena_, stats_, listener_, cls, heap::size_kind::large,
        region_bytes + (paged ? static_cast<std::size_t>(settings.host_tier_bytes) : 0),
        settings.drain_before_release);
  }
  std::vector<heap*> all;
  for (std::size_t i = 0; i < heaps_.size(); ++i) {
    all.push_back(heaps_[i].get());
    regions_[i] = {heaps_[i]->region_start(), heaps_[i]->region_bytes()};
  }
  for (auto& each : heaps_) each->set_donors(all);
}

caching_allocator::~caching_allocator() = default;

heap& caching_allocator::heap_for(allocation_class cls, std::size_t rounded_bytes) {
  return *heaps_[2 * class_index(cls) + (rounded_bytes > kSmallRequestBytes ? 1 : 0)];
}

void* caching_allocator::allocate(std::size_t bytes, stream_handle stream, allocation_class cls) {
  const std::size_t rounded = round_up(bytes == 0 ? 1 : bytes, kAlignment);
  if (rounded < bytes)
    ZA_THROW(out_of_memory, "cannot allocate ", bytes, " bytes: the size overflows");
  bool on_host = false;
  void* pointer = heap_for(cls, rounded).allocate(rounded, bytes, stream, &on_host);
  if (pointer == nullptr) pointer = allocate_after_pressure(rounded, bytes, stream, cls, on_host);
  // Note [Nothing moves while a graph is captured]: it stays on the host, addressable.
  if (on_host && !device_.stream_is_capturing(stream)) bring_back_from_host(pointer, stream);
  return pointer;
}

void caching_allocator::bring_back_from_host(void* pointer, stream_handle stream) {
  paging_listener* listener = listener_.load(std::memory_order_acquire);
  if (listener == nullptr) return;
  try {
    listener->allocated_on_host(pointer, stream);
  } catch (const out_of_memory&) {  // it cannot be reached where it lies: it fails
    deallocate(pointer);
    throw;
  } catch (const std::exception& failure) {  // the allocation stands, on the host
    log().warn("bringing a new allocation back from host memory failed: {}", failure.what());
  }
}

void* caching_allocator::make_room_and_allocate(std::size_t needed, std::size_t rounded_bytes,
                                                std::size_t requested_bytes, stream_handle stream,
                                                allocation_class cls, bool& on_host,
                                                paging_listener* listener) {
  std::uint64_t released = release_cached(needed);
  // Told at info only when the cache gave something back: a model's first allocations each
  // find an empty cache, hundreds of lines that say nothing.
  log().log(released > 0 ? spdlog::level::info : spdlog::level::debug,
            "allocating {} of {} on {} needed new memory: released {} of cache and retrying",
            format_bytes(rounded_bytes), class_name(cls), device_.name(), format_bytes(released));
  if (void* pointer =
          heap_for(cls, rounded_bytes).allocate(rounded_bytes, requested_bytes, stream, &on_host))
    return pointer;
  released = release_all_cached(/*free_runs_too=*/true);
  if (released > 0) {
    log().info("allocating {} of {} on {}: released the rest of the cache, {}, and retrying",
               format_bytes(rounded_bytes), class_name(cls), device_.name(),
               format_bytes(released));
    if (void* pointer =
            heap_for(cls, rounded_bytes).allocate(rounded_bytes, requested_bytes, stream, &on_host))
      return pointer;
  }
  // Note [Segments at the limit]: the last of the limit is worth a smaller segment.
  const std::uint64_t held = arena_.held_bytes();
  const std::size_t granularity = arena_.granularity();
  const std::size_t left = held < limiter_.limit_bytes()
                               ? (limiter_.limit_bytes() - held) / granularity * granularity
                               : 0;
  if (left < needed && left >= heap_for(cls, rounded_bytes).least_segment_bytes(rounded_bytes)) {
    log().info("allocating {} of {} on {}: trying a segment of the {} left under the limit",
               format_bytes(rounded_bytes), class_name(cls), device_.name(), format_bytes(left));
    if (void* pointer = heap_for(cls, rounded_bytes)
                            .allocate(rounded_bytes, requested_bytes, stream, &on_host, left))
      return pointer;
  }
  // The listener frees device memory for a whole new segment, a few times if it must (the
  // chunks it frees need not match the sizes the segment needs).
  for (int round = 0; listener != nullptr && round < 4 && listener->relieve_pressure(needed) > 0;
       ++round) {
    if (void* pointer =
            heap_for(cls, rounded_bytes).allocate(rounded_bytes, requested_bytes, stream, &on_host))
      return pointer;
  }
  return nullptr;
}

void* caching_allocator::allocate_after_pressure(std::size_t rounded_bytes,
                                                 std::size_t requested_bytes, stream_handle stream,
                                                 allocation_class cls, bool& on_host) {
  // Out of new memory: give back cached free segments (of every class), the largest first,
  // as many as the new segment needs, and retry; then all of them (Note [Releasing what is
  // needed]); then let the listener (the offload engine) free memory, and retry once more.
  stats_.apply(
      cls, [](live_gauges& figures) { figures.retries.fetch_add(1, std::memory_order_relaxed); });
  const std::size_t needed = heap_for(cls, rounded_bytes).segment_bytes_for(rounded_bytes);
  // The smallest segment that holds the request (Note [Segments at the limit] in heap.cpp).
  const std::size_t least = heap_for(cls, rounded_bytes).least_segment_bytes(rounded_bytes);
  paging_listener* listener = listener_.load(std::memory_order_acquire);
  // Note [Nothing moves while a graph is captured]
  const bool capturing = device_.stream_is_capturing(stream);
  if (capturing) {
    log().info(
        "allocating {} of {} on {}: a CUDA graph is being captured on its stream, so "
        "nothing is released or moved to make room",
        format_bytes(rounded_bytes), class_name(cls), device_.name());
  } else if (least > limiter_.limit_bytes()) {
    // Nothing freed could make room: releasing the cache and moving every movable chunk
    // to the host first would only slow the program down before the same failure.
    log().info("allocating {} of {} on {}: its segment of {} exceeds the limit of {}",
               format_bytes(rounded_bytes), class_name(cls), device_.name(), format_bytes(least),
               format_bytes(limiter_.limit_bytes()));
  } else if (void* pointer = make_room_and_allocate(needed, rounded_bytes, requested_bytes, stream,
                                                    cls, on_host, listener)) {
    return pointer;
  }
  stats_.apply(
      cls, [](live_gauges& figures) { figures.failures.fetch_add(1, std::memory_order_relaxed); });
  std::string message = out_of_memory_message(rounded_bytes, cls);
  if (capturing) {
    message +=
        " A CUDA graph was being captured on the allocation's stream: zeroalloc releases and "
        "moves no memory during a capture (either would wait for the device, which a capture "
        "forbids). Keep the captured work within the limit, or capture it before memory runs "
        "short.";
  } else if (listener != nullptr && least <= limiter_.limit_bytes()) {
    if (const std::string why = listener->pressure_note(); !why.empty()) {
      message += " Offloading could not make room: " + why;
    }
  }
  if (listener != nullptr) listener->out_of_memory(message);
  throw out_of_memory(message);
}

// Note [Nothing moves while a graph is captured]: during a CUDA graph capture the driver
// refuses every call that waits for the device (cuCtxSynchronize, an event's wait), and the
// refusal invalidates the capture. Releasing cached memory waits for the streams that used
// it, and under ZEROALLOC_ACCESS=any every move drains the device first. So an allocation
// on a capturing stream that finds no room fails at once, with a message that says why,
// before any such call: PyTorch raises its out-of-memory error and the capture ends cleanly.
// An allocation served from a chunk on the host stays there, reached over PCIe, and hints
// sent on a capturing stream move nothing (Note [Hints during a capture] in
// tier/offload_engine.cpp). PyTorch's own allocator, likewise, releases no cached memory
// during a capture.

// Note [Releasing what is needed]: an allocation that finds no room under the limit used to
// release every cached free segment of every class. After a step's large scratch buffers
// that was gigabytes of activations' cache, mapped again by the next forward, one map call
// per chunk. Now the largest free segments go first, only as many bytes as the new segment
// needs (idle pooled chunks are released by the arena itself when sizes do not match); the
// whole cache goes only if that was not enough (fragmentation, pinned chunks).
namespace {

// Runs `body`, keeping the first exception of several such calls for later: a heap that
// fails to release its cache does not keep the other heaps (and the pool) from theirs.
template <typename Body>
void keeping_first_failure(std::exception_ptr& first_failure, Body&& body) {
  try {
    body();
  } catch (...) {
    if (!first_failure) first_failure = std::current_exception();
  }
}

}  // namespace

std::uint64_t caching_allocator::release_cached(std::uint64_t enough) {
  std::lock_guard lock(reclaim_mutex_);
  std::uint64_t released = 0;
  std::exception_ptr first_failure;
  for (auto& each : heaps_) {
    if (released >= enough) break;
    keeping_first_failure(first_failure,
                          [&] { released += each->release_free_segments(enough - released); });
  }
  if (first_failure) std::rethrow_exception(first_failure);
  return released;
}

std::uint64_t caching_allocator::release_all_cached(bool free_runs_too) {
  std::lock_guard lock(reclaim_mutex_);
  std::uint64_t released = 0;
  std::exception_ptr first_failure;
  for (auto& each : heaps_) {
    keeping_first_failure(
        first_failure, [&] { released += each->release_free_segments(UINT64_MAX, free_runs_too); });
  }
  keeping_first_failure(first_failure, [&] { arena_.release_pool(); });
  if (first_failure) std::rethrow_exception(first_failure);
  return released;
}

// Note [Out-of-memory message]: say what was asked for, what the device has, what zeroalloc
// holds and why it could not use it, which limit applied and which variable sets it, so the
// user can act without reading code.
std::string caching_allocator::out_of_memory_message(std::size_t bytes,
                                                     allocation_class cls) const {
  const memory_info info = device_.query_memory();
  const std::int64_t reserved = stats_.total.reserved_bytes.current();
  const std::int64_t allocated = stats_.total.allocated_bytes.current();
  std::string source;
  {
    std::lock_guard lock(settings_mutex_);
    source = limit_source_;
  }
  const std::string limit_text =
      source.empty() ? detail::concat(format_bytes(limiter_.limit_bytes()),
                                      " (the whole device; set ZEROALLOC_MEMORY_LIMIT to lower it)")
                     : detail::concat(format_bytes(limiter_.limit_bytes()), ", set by ", source);
  std::size_t largest_free = 0;
  for (allocation_class each : kAllocationClasses) {
    largest_free = std::max(largest_free, largest_free_block(each));
  }
  std::uint64_t on_host = 0;
  for (const auto& each : heaps_) on_host += each->host_resident_bytes();
  return detail::concat(
      "out of memory on ", device_.name(), ": tried to allocate ", format_bytes(bytes), " (",
      class_name(cls), "); the device has ", format_bytes(info.free_bytes), " free of ",
      format_bytes(info.total_bytes), "; zeroalloc holds ",
      format_bytes(static_cast<std::uint64_t>(reserved)), " of which ",
      format_bytes(static_cast<std::uint64_t>(allocated)), " is allocated and ",
      format_bytes(static_cast<std::uint64_t>(reserved - allocated)),
      " is cached but free (the largest free block is ", format_bytes(largest_free),
      "); of what it holds, ", format_bytes(on_host),
      " is offloaded to host memory (it does not count against the limit); limit in force: ",
      limit_text, ". Free tensors you no longer need, lower the batch size, or raise the limit.");
}

heap* caching_allocator::heap_at(std::uintptr_t address) const {
  for (std::size_t i = 0; i < regions_.size(); ++i) {
    if (address - regions_[i].start < regions_[i].bytes) return heaps_[i].get();
  }
  return nullptr;
}

bool caching_allocator::owns(const void* pointer) const {
  return heap_at(reinterpret_cast<std::uintptr_t>(pointer)) != nullptr;
}

bool caching_allocator::deallocate(void* pointer) {
  const auto address = reinterpret_cast<std::uintptr_t>(pointer);
  heap* owner = heap_at(address);
  return owner != nullptr && owner->deallocate(address);
}

bool caching_allocator::record_stream(void* pointer, stream_handle stream) {
  const auto address = reinterpret_cast<std::uintptr_t>(pointer);
  heap* owner = heap_at(address);
  return owner != nullptr && owner->record_stream(address, stream);
}

void caching_allocator::forget_stream(stream_handle stream) {
  // A stream none of its blocks knows needs no wait (a program destroying its streams under
  // the preload interposer pays nothing for the ones zeroalloc never saw).
  if (std::none_of(heaps_.begin(), heaps_.end(),
                   [&](const auto& each) { return each->uses_stream(stream); })) {
    return;
  }
  device_.synchronize_stream(stream);
  for (auto& each : heaps_) each->forget_stream(stream);
}

void caching_allocator::empty_cache() {
  const std::uint64_t released = release_all_cached();
  log().debug("empty_cache released {} on {}", format_bytes(released), device_.name());
}

void caching_allocator::set_limit(std::uint64_t bytes, std::string source) {
  limiter_.set_limit_bytes(bytes);
  std::lock_guard lock(settings_mutex_);
  limit_source_ = std::move(source);
}

// Note [Fork]: a child of fork() has only the forking thread. A lock that another thread
// held at that moment would stay locked in the child forever, so that the child's first
// free (a DataLoader worker dropping a tensor, say) would hang. The runtime registers
// pthread_atfork handlers that take every lock before fork() and release them after it, in
// the order the allocator nests them: the reclaim lock, the heaps', then the arena's (a
// heap calls the arena while holding its own lock; release_all_cached takes heaps one at a
// time under the reclaim lock). The device and its streams are not usable in a child;
// freeing and re-allocating cached memory is.
void caching_allocator::prepare_fork() {
  reclaim_mutex_.lock();
  settings_mutex_.lock();
  for (auto& each : heaps_) each->lock_for_fork();
  arena_.lock_for_fork();
}

void caching_allocator::after_fork() {
  arena_.unlock_after_fork();
  for (auto it = heaps_.rbegin(); it != heaps_.rend(); ++it) (*it)->unlock_after_fork();
  settings_mutex_.unlock();
  reclaim_mutex_.unlock();
}

std::vector<caching_allocator::allocation_record> caching_allocator::largest_allocations(
    std::size_t count) const {
  std::vector<allocation_record> records;
  for (const auto& each : heaps_) {
    std::vector<std::pair<std::uintptr_t, std::size_t>> live;
    each->list_allocations(live);
    for (auto [address, bytes] : live) records.push_back({address, bytes, each->cls()});
  }
  const std::size_t kept = std::min(count, records.size());
  std::partial_sort(
      records.begin(), records.begin() + static_cast<long>(kept), records.end(),
      [](const allocation_record& a, const allocation_record& b) { return a.bytes > b.bytes; });
  records.resize(kept);
  return records;
}

std::uint64_t caching_allocator::allocated_bytes() const {
  return static_cast<std::uint64_t>(
      std::max<std::int64_t>(0, stats_.total.allocated_bytes.current()));
}

std::size_t caching_allocator::largest_free_block(allocation_class cls) const {
  return std::max(heaps_[2 * class_index(cls)]->largest_free_block(),
                  heaps_[2 * class_index(cls) + 1]->largest_free_block());
}

stats_snapshot caching_allocator::stats() const {
  stats_snapshot snapshot;
  auto read = [](const live_gauges& live, class_figures& figures) {
    figures.allocated_bytes = {live.allocated_bytes.current(), live.allocated_bytes.peak(),
                               live.allocated_bytes.lifetime_peak()};
    figures.reserved_bytes = {live.reserved_bytes.current(), live.reserved_bytes.peak(),
                              live.reserved_bytes.lifetime_peak()};
    figures.active_bytes = {live.allocated_bytes.current() + live.pending_bytes.current(),
                            live.active_peak.peak(), live.active_peak.lifetime_peak()};
    figures.retries = live.retries.load(std::memory_order_relaxed);
    figures.failures = live.failures.load(std::memory_order_relaxed);
  };
  read(stats_.total, snapshot.total);
  for (allocation_class cls : kAllocationClasses) {
    class_figures& figures = snapshot.classes[class_index(cls)];
    read(stats_.classes[class_index(cls)], figures);
    for (int kind = 0; kind < 2; ++kind) {
      const heap_counts counts = heaps_[2 * class_index(cls) + kind]->counts();
      for (class_figures* into : {&figures, &snapshot.total}) {
        into->allocations += counts.allocations;
        into->frees += counts.frees;
        into->cache_hits += counts.cache_hits;
        into->segments_mapped += counts.segments_mapped;
        into->segments_unmapped += counts.segments_unmapped;
        into->segments_donated += counts.segments_donated;
        into->segments_split += counts.segments_split;
      }
    }
    figures.largest_free_block_bytes = largest_free_block(cls);
    snapshot.total.largest_free_block_bytes =
        std::max(snapshot.total.largest_free_block_bytes, figures.largest_free_block_bytes);
  }
  return snapshot;
}

void caching_allocator::reset_peak_stats() {
  auto reset = [](live_gauges& live) {
    live.allocated_bytes.reset_peak(live.allocated_bytes.current());
    live.reserved_bytes.reset_peak(live.reserved_bytes.current());
    live.active_peak.reset_peak(live.allocated_bytes.current() + live.pending_bytes.current());
  };
  for (live_gauges& live : stats_.classes) reset(live);
  reset(stats_.total);
}

namespace {

nlohmann::ordered_json gauge_json(const gauge_figures& figures) {
  return {{"current", figures.current},
          {"peak", figures.peak},
          {"lifetime_peak", figures.lifetime_peak}};
}

nlohmann::ordered_json figures_json(const class_figures& figures) {
  return {{"allocated_bytes", gauge_json(figures.allocated_bytes)},
          {"reserved_bytes", gauge_json(figures.reserved_bytes)},
          {"active_bytes", gauge_json(figures.active_bytes)},
          {"allocations", figures.allocations},
          {"frees", figures.frees},
          {"cache_hits", figures.cache_hits},
          {"retries", figures.retries},
          {"failures", figures.failures},
          {"segments_mapped", figures.segments_mapped},
          {"segments_unmapped", figures.segments_unmapped},
          {"segments_donated", figures.segments_donated},
          {"segments_split", figures.segments_split},
          {"largest_free_block_bytes", figures.largest_free_block_bytes},
          {"fragmentation_bytes", figures.fragmentation_bytes()}};
}

}  // namespace

bool caching_allocator::chunks_of_allocation(const void* pointer,
                                             std::vector<chunk_info>& into) const {
  heap* owner = heap_at(reinterpret_cast<std::uintptr_t>(pointer));
  return owner != nullptr &&
         owner->chunks_of_allocation(reinterpret_cast<std::uintptr_t>(pointer), into);
}

std::size_t caching_allocator::allocation_bytes(const void* pointer) const {
  heap* owner = heap_at(reinterpret_cast<std::uintptr_t>(pointer));
  return owner == nullptr ? 0 : owner->allocation_bytes(reinterpret_cast<std::uintptr_t>(pointer));
}

nlohmann::ordered_json caching_allocator::snapshot_json() const {
  nlohmann::ordered_json segments = nlohmann::ordered_json::array();
  for (const auto& each : heaps_) each->append_snapshot(segments);
  return {{"device", device_.ordinal()}, {"segments", std::move(segments)}};
}

nlohmann::ordered_json caching_allocator::stats_json() const {
  std::string source;
  {
    std::lock_guard lock(settings_mutex_);
    source = limit_source_;
  }
  nlohmann::ordered_json out = {{"device", device_.ordinal()},
                                {"device_name", device_.name()},
                                {"simulated", device_.is_simulated()},
                                {"limit_bytes", limiter_.limit_bytes()},
                                {"limit_source", source},
                                {"held_bytes", limiter_.used_bytes()},
                                {"pooled_bytes", arena_.pooled_bytes()}};
  const stats_snapshot snapshot = stats();
  out["total"] = figures_json(snapshot.total);
  nlohmann::ordered_json& classes = out["classes"] = nlohmann::ordered_json::object();
  for (allocation_class cls : kAllocationClasses) {
    classes[std::string(class_name(cls))] = figures_json(snapshot.of(cls));
  }
  return out;
}

}  // namespace zeroalloc
