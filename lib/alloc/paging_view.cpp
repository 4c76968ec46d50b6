#include "alloc/paging_view.hpp"

#include <algorithm>
#include <mutex>

#include "alloc/caching_allocator.hpp"
#include "alloc/heap.hpp"
#include "core/errors.hpp"

namespace zeroalloc {

void paging_view::attach(paging_listener& listener) {
  paging_listener* none = nullptr;
  ZA_REQUIRE(
      allocator_.listener_.compare_exchange_strong(none, &listener, std::memory_order_acq_rel),
      "the allocator of ", allocator_.device_.name(), " has a paging listener already");
}

void paging_view::detach() { allocator_.listener_.store(nullptr, std::memory_order_release); }

void paging_view::detach(paging_listener& listener) {
  paging_listener* attached = &listener;
  allocator_.listener_.compare_exchange_strong(attached, nullptr, std::memory_order_acq_rel);
}

void paging_view::list_chunks(std::vector<chunk_info>& into) const {
  for (const auto& each : allocator_.heaps_) each->list_chunks(into);
}

bool paging_view::pin_chunk(std::uintptr_t address, chunk_info& into) {
  heap* owner = allocator_.heap_at(address);
  return owner != nullptr && owner->pin_chunk(address, into);
}

physical_handle paging_view::remap_pinned_chunk(std::uintptr_t address,
                                                physical_handle replacement) {
  heap* owner = allocator_.heap_at(address);
  ZA_REQUIRE(owner != nullptr, "no chunk of this allocator at ", address);
  return owner->remap_pinned_chunk(address, replacement);
}

void paging_view::unpin_chunk(std::uintptr_t address) {
  if (heap* owner = allocator_.heap_at(address)) owner->unpin_chunk(address);
}

chunk_arena& paging_view::arena() const { return allocator_.arena_; }

std::int64_t paging_view::reserved_bytes(allocation_class cls) const {
  return allocator_.stats_.classes[class_index(cls)].reserved_bytes.current();
}

// Note [Idle classes' cache]: a class with nothing allocated holds only cache, and keeps
// it until its next use: the gradients' from one step's end (zero_grad) to the next
// backward, through the whole forward. The offload engine takes it before it moves anything
// live to the host (a fetch that finds no room, the headroom kept for prefetches): an unmap
// now and a map at the class's next use cost far less than a chunk's round trip over PCIe.
// Only idle classes: the activations' cache would be taken from under the forward that is
// about to reuse it, and their next allocation would meet the pressure path instead.
std::uint64_t paging_view::idle_cache_bytes() const {
  std::uint64_t bytes = 0;
  for (allocation_class cls : kAllocationClasses) {
    const live_gauges& figures = allocator_.stats_.classes[class_index(cls)];
    if (figures.allocated_bytes.current() == 0 && figures.pending_bytes.current() == 0) {
      bytes +=
          static_cast<std::uint64_t>(std::max<std::int64_t>(0, figures.reserved_bytes.current()));
    }
  }
  return bytes;
}

std::uint64_t paging_view::release_idle_cache() {
  std::lock_guard lock(allocator_.reclaim_mutex_);
  std::uint64_t released = 0;
  for (allocation_class cls : kAllocationClasses) {
    const live_gauges& figures = allocator_.stats_.classes[class_index(cls)];
    if (figures.allocated_bytes.current() != 0 || figures.reserved_bytes.current() == 0) continue;
    released += allocator_.heaps_[2 * class_index(cls)]->release_free_segments();
    released += allocator_.heaps_[2 * class_index(cls) + 1]->release_free_segments();
  }
  return released;
}

}  // namespace zeroalloc
