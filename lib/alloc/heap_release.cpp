// Giving a heap's fully free segments back: unmapped, their chunks pooled in the arena.
#include <algorithm>

#include "alloc/heap.hpp"
#include "core/log.hpp"
#include "core/units.hpp"

namespace zeroalloc {

// Note [Released after every stream]: a segment's streams are the ones its blocks were
// allocated and freed on, and those record_stream named. A program may also use a block on
// a stream the allocator never saw (a copy on a side stream without record_stream) and
// free it while that work is queued. PyTorch's own allocator releases its cache through
// cudaFree, which waits for the whole device, so such work ends before the memory goes;
// here the unmap would make it fault instead, which ends the process. So under
// ZEROALLOC_ACCESS=any (allocator_settings::drain_before_release) a release waits for
// every stream of the device first. Releases run at the limit and on empty_cache, where
// the engine's moves drain the device too. During a CUDA graph capture nothing is released
// (Note [Nothing moves while a graph is captured] in caching_allocator.cpp). Under hinted
// access the known streams suffice, as the contract there says.

std::uint64_t heap::release_free_segments(std::uint64_t enough, bool free_runs_too) {
  std::lock_guard lock(mutex_);
  process_pending(true);
  retire_donated(true);
  if (free_runs_too) {  // Note [Segments at the limit]: each run becomes a free segment
    while (split_free_run(arena_.granularity(), SIZE_MAX) != nullptr) {
    }
  }
  auto unused = std::stable_partition(segments_.begin(), segments_.end(), [](const auto& owned) {
    return owned->busy_blocks != 0 || owned->pinned_chunks != 0;
  });
  if (enough != UINT64_MAX) {  // the largest free segments that release `enough`, kept last
    std::stable_sort(unused, segments_.end(),
                     [](const auto& a, const auto& b) { return a->bytes < b->bytes; });
    std::uint64_t chosen = 0;
    auto first = segments_.end();
    while (first != unused && chosen < enough) {
      --first;
      chosen += (*first)->bytes;
    }
    unused = first;
  }
  // Work queued before the frees may still touch the segments: unmap only after it ran.
  // Every fence comes first, so that a device call failing here changes nothing.
  if (unused != segments_.end() && drain_before_release_) {
    device_.synchronize_device();  // Note [Released after every stream]
  } else {
    std::vector<stream_handle> streams;
    for (auto it = unused; it != segments_.end(); ++it) {
      for (stream_handle stream : streams_of(**it)) {
        if (std::find(streams.begin(), streams.end(), stream) == streams.end())
          streams.push_back(stream);
      }
    }
    for (stream_handle stream : streams) {
      fenced(stream, [&](event_handle fence) { device_.synchronize_event(fence); });
    }
  }
  std::uint64_t released = 0;
  auto it = unused;
  try {
    for (; it != segments_.end(); ++it) released += release_segment(**it);
  } catch (...) {
    segments_.erase(unused, std::next(it));  // the failed one is out of the heap too
    throw;
  }
  segments_.erase(unused, segments_.end());
  return released;
}

// Note [A failed unmap]: a chunk that fails to unmap (a failing driver) stays mapped at its
// addresses, and so do the chunks after it; those before it are unmapped and pooled. The
// segment leaves the heap all the same, its blocks with it: what is still mapped is held
// out of use (its addresses are not given back, so no later segment is placed over them)
// and stays counted as reserved, since it still holds device memory. The caller gets the
// device_error; nothing is released twice, no block is handed out over the old mapping.
std::uint64_t heap::release_segment(segment& idle) {
  for (block* piece = idle.first; piece != nullptr;) {
    block* next = piece->next;
    remove_free(piece);
    recycle_block(piece);
    piece = next;
  }
  idle.first = nullptr;
  tell_chunks(idle.chunks, /*gained=*/false);
  auto unreserve = [&](std::size_t bytes) {
    stats_.apply(class_, [&](live_gauges& figures) {
      figures.reserved_bytes.add(-static_cast<std::int64_t>(bytes));
    });
  };
  try {
    arena_.decommit(idle.address, idle.chunks, listener_.load(std::memory_order_acquire));
  } catch (const std::exception& failure) {
    // Note [A failed unmap]: the chunks still mapped are the segment's last ones. They stay
    // told as gone: nothing can move or reuse them.
    const std::size_t still_mapped = bytes_of(idle.chunks);
    const std::size_t unmapped = idle.bytes - still_mapped;
    if (unmapped != 0) return_addresses(idle.address, unmapped);
    unreserve(unmapped);
    log().error(
        "unmapping a free {} segment of {} at {:#x} on {} failed ({}); its last {} stay mapped, "
        "out of use and counted as reserved. The GPU driver is failing: restart the process",
        format_bytes(idle.bytes), class_name(class_), idle.address, device_.name(), failure.what(),
        format_bytes(still_mapped));
    throw;
  }
  return_addresses(idle.address, idle.bytes);
  unreserve(idle.bytes);
  ++counts_.segments_unmapped;
  return idle.bytes;
}

}  // namespace zeroalloc
