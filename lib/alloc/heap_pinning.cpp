// The offload engine's view of a heap: the chunks of its live segments, and pinning a chunk
// while the engine moves it.
#include <algorithm>

#include "alloc/heap.hpp"
#include "core/errors.hpp"

namespace zeroalloc {

// Note [Pinned chunks]: the offload engine moves a chunk in steps that outlive one lock
// hold (copy on a copy stream, wait for the copy's event, remap). Pinning keeps the chunk's
// segment in place meanwhile: a pinned segment is neither unmapped by
// release_free_segments nor donated to another class, even if its last block is freed. A
// segment with host-located chunks is never donated either: its memory is slow.

void heap::append_chunks(const segment& owner, std::vector<chunk_info>& into, std::uintptr_t from,
                         std::uintptr_t to) const {
  std::uintptr_t address = owner.address;
  const std::vector<stream_handle> streams = streams_of(owner);
  const block* piece = owner.first;
  for (const physical_handle& chunk : owner.chunks) {
    const std::uintptr_t end = address + chunk.bytes;
    if (address >= to) break;
    if (end <= from) {
      address = end;
      continue;
    }
    bool live = false;
    // Blocks are in address order: skip those before the chunk, look at those inside it.
    while (piece != nullptr && piece->address + piece->bytes <= address) piece = piece->next;
    for (const block* inside = piece; inside != nullptr && inside->address < end;
         inside = inside->next) {
      live = live || inside->allocated || inside->pending;
    }
    into.push_back({address, chunk, static_cast<int>(class_), streams, live, owner.generation,
                    owner.last_activity});
    address = end;
  }
}

void heap::list_chunks(std::vector<chunk_info>& into) const {
  std::lock_guard lock(mutex_);
  for (const auto& owned : segments_) {
    if (owned->busy_blocks != 0) append_chunks(*owned, into);
  }
}

bool heap::chunks_of_allocation(std::uintptr_t pointer, std::vector<chunk_info>& into) const {
  std::lock_guard lock(mutex_);
  const block* found = live_.find(pointer);
  if (found == nullptr) return false;
  // Only the chunks it overlaps: a parameter's segment can span a hundred chunks, and the
  // hints ask for a module's parameters several times a step.
  append_chunks(*found->owner, into, found->address, found->address + found->bytes);
  return true;
}

std::size_t heap::allocation_bytes(std::uintptr_t pointer) const {
  std::lock_guard lock(mutex_);
  const block* found = live_.find(pointer);
  return found == nullptr ? 0 : found->bytes;
}

std::pair<segment*, std::size_t> heap::chunk_at(std::uintptr_t address) const {
  for (const auto& owned : segments_) {
    if (address < owned->address || address >= owned->address + owned->bytes) continue;
    std::uintptr_t start = owned->address;
    for (std::size_t i = 0; i < owned->chunks.size(); ++i) {
      if (start == address) return {owned.get(), i};
      start += owned->chunks[i].bytes;
    }
    return {nullptr, 0};
  }
  return {nullptr, 0};
}

bool heap::pin_chunk(std::uintptr_t address, chunk_info& into) {
  std::lock_guard lock(mutex_);
  auto [owner, index] = chunk_at(address);
  if (owner == nullptr) return false;
  if (std::find(pinned_.begin(), pinned_.end(), address) != pinned_.end()) return false;
  pinned_.push_back(address);
  ++owner->pinned_chunks;
  std::vector<chunk_info> all;
  append_chunks(*owner, all);
  into = all.at(index);
  return true;
}

physical_handle heap::remap_pinned_chunk(std::uintptr_t address, physical_handle replacement) {
  std::lock_guard lock(mutex_);
  auto [owner, index] = chunk_at(address);
  ZA_REQUIRE(owner != nullptr && owner->chunks[index].bytes == replacement.bytes &&
                 std::find(pinned_.begin(), pinned_.end(), address) != pinned_.end(),
             "no pinned chunk of ", replacement.bytes, " bytes at ", address);
  const physical_handle previous = owner->chunks[index];
  device_.unmap(address, previous.bytes);
  try {
    device_.map(address, replacement);
  } catch (const std::exception& failure) {
    try {
      device_.map(address, previous);  // the bytes stay where they were
    } catch (const std::exception& again) {
      // Note [A chunk left unmapped]: nothing maps its addresses now, and the driver refused
      // twice; the bytes are intact in the old backing, which the segment keeps. A kernel
      // that touches the chunk will fail with CUDA's illegal-address error, which ends the
      // process: say so now, naming the chunk and both failures, instead of leaving that
      // error to explain itself.
      const auto* as_device = dynamic_cast<const device_error*>(&again);
      throw device_error(
          detail::concat("the chunk at ", reinterpret_cast<void*>(address), " (", previous.bytes,
                         " bytes) has no mapping: mapping its new backing failed (", failure.what(),
                         ") and mapping its old one back failed too (", again.what(),
                         "). Its bytes are intact, but no address reaches them, and a kernel "
                         "that touches them will fail with an illegal address. The GPU driver "
                         "is failing: save what you can and restart the process"),
          as_device != nullptr ? as_device->code() : 0);
    }
    throw;
  }
  owner->chunks[index] = replacement;
  if (previous.location == memory_location::host) --owner->host_chunks;
  if (replacement.location == memory_location::host) ++owner->host_chunks;
  return previous;
}

void heap::unpin_chunk(std::uintptr_t address) {
  std::lock_guard lock(mutex_);
  auto [owner, index] = chunk_at(address);
  (void)index;
  if (owner == nullptr || std::erase(pinned_, address) == 0) return;
  --owner->pinned_chunks;
}

}  // namespace zeroalloc
