// Moving free memory between the heaps of a device: a heap that needs a new segment takes
// the chunks of another heap's fully free segments (or of free runs split off its busy ones)
// instead of creating physical memory.
#include <algorithm>

#include "alloc/heap.hpp"
#include "core/log.hpp"
#include "core/units.hpp"

namespace zeroalloc {

// Note [Moving free memory between classes]: classes live in separate segments, so memory
// one class frees (activations, at the end of backward) would otherwise sit cached while
// another class (gradients, optimizer states) maps new memory, and reserved memory would
// grow to the sum of every class's peak instead of the peak of their sum. So before
// creating physical memory, a heap takes the chunks of fully free segments, of any heap of
// the device, and maps them at its own addresses. No host thread waits: a physical chunk
// may be mapped at two addresses at once, so the donor's old mapping stays until fences
// recorded on its streams have passed (retire_donated), and the receiving stream waits for
// those fences before its first use. Donated segments are sized to the need (within an
// eighth, and at most eight of them), so a small heap never swallows a large segment.
void heap::gather_donations(std::size_t bytes, stream_handle stream, donated_memory& into) {
  const std::size_t eighth = std::max(bytes / 8, arena_.granularity());
  // Note [Segments at the limit]: near the limit a run split off is no larger than a whole
  // segment may be: what the new segment does not need would be held unused by its block.
  const bool tight = near_limit(bytes);
  for (heap* donor : donors_) {
    while (into.bytes < bytes) {
      const std::size_t remaining = bytes - into.bytes;
      const std::size_t least = std::min(remaining, eighth);
      const std::size_t most = remaining + eighth;
      const std::size_t most_run = tight ? most : 2 * most;
      const bool given = donor == this ? donate_locked(least, most, most_run, stream, into)
                                       : donor->try_donate(least, most, most_run, stream, into);
      if (!given) break;
    }
    if (into.bytes >= bytes) break;
  }
}

bool heap::try_donate(std::size_t least_bytes, std::size_t most_bytes, std::size_t most_run_bytes,
                      stream_handle for_stream, donated_memory& into) {
  // try_lock: the requesting heap holds its own lock, so waiting here could deadlock with a
  // heap asking this one's neighbour; a busy heap is simply skipped.
  std::unique_lock lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  if (!pending_.empty()) process_pending(false);  // an idle heap never runs it otherwise
  return donate_locked(least_bytes, most_bytes, most_run_bytes, for_stream, into);
}

// Note [Splitting free runs off a segment]: a segment whose blocks are partly in use gives
// nothing away as a whole, yet a training step leaves free runs of whole chunks inside busy
// segments (activations freed in backward, next to ones still live), and a fully free
// segment larger than the need is not given whole either. Such a run is split off into a
// segment of its own, at chunk boundaries (every chunk is mapped on its own, so the
// pieces unmap as they were mapped): the run becomes a fully free segment that another
// class can take, the rest stay segments of this heap. Only segments with no chunk pinned
// or on the host are cut (the offload engine's bookkeeping stays per chunk). A run may be
// about twice the need (chunks are large; a run that must fit within an eighth of the
// need rarely exists). On the recorded Llama traces with their four classes (simulated
// device), peak reserved / peak allocated goes from 1.204 to 1.16 (1.3B parameters),
// 1.184 to 1.118 (438M) and 1.040 to 1.016 (271M, the demo's); with one class it does not
// change. Tried and dropped: runs up to the need plus half a chunk (1.182, 1.138, 1.022),
// up to three or four times the need (no better, and less stable across traces).
segment* heap::split_free_run(std::size_t least_bytes, std::size_t most_bytes) {
  if (!unmerged_.empty()) coalesce_freed();  // free blocks at their largest
  for (auto it = segments_.begin(); it != segments_.end(); ++it) {
    segment& whole = **it;
    if (whole.pinned_chunks != 0 || whole.host_chunks != 0 || whole.chunks.size() < 2) continue;
    for (block* piece = whole.first; piece != nullptr; piece = piece->next) {
      if (piece->allocated || piece->pending || piece->bytes < least_bytes) continue;
      // The chunks wholly inside the free block, from its first chunk boundary on, up to
      // `most_bytes`.
      std::size_t first = 0;
      std::uintptr_t start = whole.address;
      while (first < whole.chunks.size() && start < piece->address) {
        start += whole.chunks[first++].bytes;
      }
      std::size_t last = first;
      std::uintptr_t end = start;
      const std::uintptr_t limit = piece->address + piece->bytes;
      while (last < whole.chunks.size() && end + whole.chunks[last].bytes <= limit &&
             end + whole.chunks[last].bytes - start <= most_bytes) {
        end += whole.chunks[last++].bytes;
      }
      if (end - start < least_bytes || last == first ||
          (first == 0 && last == whole.chunks.size())) {
        continue;
      }
      return cut_segment(it, piece, first, last, start, end);
    }
  }
  return nullptr;
}

segment* heap::cut_segment(std::vector<std::unique_ptr<segment>>::iterator owner, block* free_block,
                           std::size_t first_chunk, std::size_t last_chunk, std::uintptr_t start,
                           std::uintptr_t end) {
  segment& whole = **owner;
  // One free block exactly over [start, end), its remainders free blocks of their own.
  remove_free(free_block);
  block* middle = free_block;
  if (middle->address < start) {
    middle = split_block(middle, start);
    insert_free(middle->previous);  // binned by its final size
  }
  if (middle->address + middle->bytes > end) insert_free(split_block(middle, end));
  insert_free(middle);
  // Three runs of blocks, each a segment: before the run, the run, after it.
  std::vector<std::unique_ptr<segment>> parts;
  auto make_part = [&](block* head, std::uintptr_t address, std::size_t from, std::size_t to) {
    auto part = std::make_unique<segment>();
    part->address = address;
    part->chunks.assign(whole.chunks.begin() + static_cast<std::ptrdiff_t>(from),
                        whole.chunks.begin() + static_cast<std::ptrdiff_t>(to));
    for (const physical_handle& chunk : part->chunks) part->bytes += chunk.bytes;
    part->generation = next_activity();
    part->last_activity = whole.last_activity;
    part->first = head;
    head->previous = nullptr;
    for (block* piece = head; piece != nullptr; piece = piece->next) {
      piece->owner = part.get();
      if (piece->allocated || piece->pending) ++part->busy_blocks;
    }
    parts.push_back(std::move(part));
  };
  block* after = middle->next;
  if (middle->previous != nullptr) middle->previous->next = nullptr;
  middle->next = nullptr;
  if (first_chunk != 0) make_part(whole.first, whole.address, 0, first_chunk);
  make_part(middle, start, first_chunk, last_chunk);
  segment* run = parts.back().get();
  if (after != nullptr) make_part(after, end, last_chunk, whole.chunks.size());
  segments_.erase(owner);
  counts_.segments_split += parts.size() - 1;  // segments added
  for (auto& part : parts) segments_.push_back(std::move(part));
  return run;
}

bool heap::donate_locked(std::size_t least_bytes, std::size_t most_bytes,
                         std::size_t most_run_bytes, stream_handle for_stream,
                         donated_memory& into) {
  auto pick = [&] {
    auto chosen = segments_.end();
    for (auto it = segments_.begin(); it != segments_.end(); ++it) {
      const segment& candidate = **it;
      if (candidate.busy_blocks != 0 || candidate.pinned_chunks != 0 ||
          candidate.bytes < least_bytes || candidate.bytes > most_bytes) {
        continue;
      }
      // Host memory behind another class's fresh allocation would be a slow surprise.
      if (std::any_of(candidate.chunks.begin(), candidate.chunks.end(),
                      [](const auto& chunk) { return chunk.location == memory_location::host; })) {
        continue;
      }
      if (chosen == segments_.end() || candidate.bytes > (*chosen)->bytes) chosen = it;
    }
    return chosen;
  };
  auto chosen = pick();
  if (chosen == segments_.end()) {
    if (segment* run = split_free_run(least_bytes, most_run_bytes)) {
      chosen = std::find_if(segments_.begin(), segments_.end(),
                            [&](const auto& owned) { return owned.get() == run; });
    }
  }
  if (chosen == segments_.end()) return false;
  segment& given = **chosen;
  retiring_range old_addresses{given.address, given.bytes, given.chunks, {}};
  try {  // fenced before anything changes: if the device fails, the segment stays
    for (stream_handle stream : streams_of(given)) {
      old_addresses.fences.push_back(obtain_event());
      device_.record_event(old_addresses.fences.back(), stream);
      if (stream != for_stream) device_.stream_wait_event(for_stream, old_addresses.fences.back());
    }
  } catch (...) {
    spare_events_.insert(spare_events_.end(), old_addresses.fences.begin(),
                         old_addresses.fences.end());
    throw;
  }
  for (block* piece = given.first; piece != nullptr;) {
    block* next = piece->next;
    remove_free(piece);
    recycle_block(piece);
    piece = next;
  }
  into.chunks.insert(into.chunks.end(), given.chunks.begin(), given.chunks.end());
  into.bytes += given.bytes;
  stats_.apply(class_, [&](live_gauges& figures) {
    figures.reserved_bytes.add(-static_cast<std::int64_t>(given.bytes));
  });
  ++counts_.segments_donated;
  tell_chunks(given.chunks, /*gained=*/false);
  retiring_.push_back(std::move(old_addresses));
  segments_.erase(chosen);
  return true;
}

void heap::retire_donated(bool wait) {
  // As process_pending: a range whose fences a device call could not check stays; one
  // whose unmap failed is gone (unmap_old_addresses says what stays mapped).
  std::size_t kept = 0;
  std::size_t next = 0;
  bool gone = false;
  try {
    for (; next < retiring_.size(); ++next) {
      retiring_range& range = retiring_[next];
      gone = false;
      if (!events_done(range.fences, wait)) {
        if (kept != next) retiring_[kept] = std::move(range);
        ++kept;
        continue;
      }
      spare_events_.insert(spare_events_.end(), range.fences.begin(), range.fences.end());
      range.fences.clear();
      gone = true;
      unmap_old_addresses(range);
    }
  } catch (...) {
    retiring_.erase(retiring_.begin() + static_cast<std::ptrdiff_t>(kept),
                    retiring_.begin() + static_cast<std::ptrdiff_t>(next + (gone ? 1 : 0)));
    throw;
  }
  retiring_.resize(kept);
}

void heap::unmap_old_addresses(const retiring_range& range) {
  std::size_t offset = 0;
  try {
    for (const physical_handle& chunk : range.chunks) {
      device_.unmap(range.address + offset, chunk.bytes);
      offset += chunk.bytes;
    }
  } catch (const std::exception& failure) {
    // Note [A failed unmap]. The chunks themselves serve their new segment.
    if (offset != 0) return_addresses(range.address, offset);
    log().error(
        "unmapping the old addresses of a donated {} segment at {:#x} on {} failed ({}); its "
        "last {} stay mapped and out of use. The GPU driver is failing: restart the process",
        format_bytes(range.bytes), range.address, device_.name(), failure.what(),
        format_bytes(range.bytes - offset));
    throw;
  }
  return_addresses(range.address, range.bytes);
}

}  // namespace zeroalloc
