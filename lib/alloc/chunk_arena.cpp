#include "alloc/chunk_arena.hpp"

#include <utility>

#include "core/errors.hpp"
#include "core/log.hpp"
#include "core/units.hpp"

namespace zeroalloc {

chunk_arena::chunk_arena(device& backing, std::size_t chunk_bytes, memory_limiter& limiter)
    : device_(backing),
      chunk_bytes_(round_up(chunk_bytes, backing.granularity())),
      granularity_(backing.granularity()),
      limiter_(limiter) {}

chunk_arena::~chunk_arena() {
  std::lock_guard lock(mutex_);
  try {
    release_pool_locked();
  } catch (const std::exception& failure) {
    log().warn("releasing the memory of {} failed at exit: {}", device_.name(), failure.what());
  }
  // Each region on its own: one still holding a mapping (Note [A failed unmap] in
  // alloc/heap_release.cpp) fails to free, the others need not.
  for (auto [address, bytes] : regions_) {
    try {
      device_.free_addresses(address, bytes);
    } catch (const std::exception& failure) {
      log().warn("freeing the address region at {:#x} of {} failed at exit: {}", address,
                 device_.name(), failure.what());
    }
  }
}

std::uintptr_t chunk_arena::reserve_region(std::size_t bytes) {
  const std::uintptr_t address = device_.reserve_addresses(bytes, granularity_);
  std::lock_guard lock(mutex_);
  regions_.emplace_back(address, bytes);
  return address;
}

physical_handle chunk_arena::obtain_chunk(std::size_t bytes) {
  auto pooled = pool_.find(bytes);
  if (pooled != pool_.end() && !pooled->second.empty()) {
    physical_handle handle = pooled->second.back();
    pooled->second.pop_back();
    pooled_bytes_ -= bytes;
    return handle;  // already charged while pooled
  }
  if (!limiter_.try_charge(bytes)) {
    // Idle chunks of other sizes count against the limit too; give them back and retry.
    if (pooled_bytes_ == 0) return {};
    release_pool_locked();
    if (!limiter_.try_charge(bytes)) return {};
  }
  try {
    return device_.create_physical(bytes, memory_location::device);
  } catch (const device_error& failure) {
    limiter_.credit(bytes);
    if (failure.code() != kDeviceOutOfMemoryCode) throw;
    if (pooled_bytes_ == 0) return {};
    release_pool_locked();
    if (!limiter_.try_charge(bytes)) return {};
    try {
      return device_.create_physical(bytes, memory_location::device);
    } catch (const device_error& retry_failure) {
      limiter_.credit(bytes);
      if (retry_failure.code() != kDeviceOutOfMemoryCode) throw;
      return {};
    }
  }
}

bool chunk_arena::commit(std::uintptr_t address, std::size_t bytes,
                         std::vector<physical_handle>& donated,
                         std::vector<physical_handle>& chunks) {
  std::lock_guard lock(mutex_);
  const std::size_t first_new = chunks.size();
  // Undoes this call's mappings, once. Donated chunks stay in `donated` for the caller, who
  // must first let the donors' queued work finish; the others go back to the pool. An
  // unmap that fails stops it: the chunks unmapped before it leave `chunks`, which keeps
  // the failed one and those after it, still mapped (Note [A failed unmap] in heap_release.cpp).
  bool undone = false;
  auto undo = [&] {
    if (std::exchange(undone, true)) return;
    std::size_t offset = 0;
    std::size_t next = first_new;
    try {
      for (; next < chunks.size(); ++next) {
        device_.unmap(address + offset, chunks[next].bytes);
        offset += chunks[next].bytes;
        if (next - first_new >= donated.size()) {
          pool_[chunks[next].bytes].push_back(chunks[next]);
          pooled_bytes_ += chunks[next].bytes;
        }
      }
    } catch (...) {
      chunks.erase(chunks.begin() + static_cast<std::ptrdiff_t>(first_new),
                   chunks.begin() + static_cast<std::ptrdiff_t>(next));
      throw;
    }
    chunks.resize(first_new);
  };
  std::size_t offset = 0;
  std::size_t next_donated = 0;
  while (offset < bytes) {
    physical_handle handle;
    try {
      handle = next_donated < donated.size() ? donated[next_donated++]
                                             : obtain_chunk(std::min(chunk_bytes_, bytes - offset));
      if (!handle.valid()) {
        undo();
        return false;
      }
      device_.map(address + offset, handle);
    } catch (...) {
      const bool was_donated = next_donated > 0 && handle.value == donated[next_donated - 1].value;
      if (handle.valid() && !was_donated) {
        pool_[handle.bytes].push_back(handle);
        pooled_bytes_ += handle.bytes;
      }
      undo();
      throw;
    }
    chunks.push_back(handle);
    offset += handle.bytes;
  }
  donated.clear();
  return true;
}

void chunk_arena::keep_in_pool(std::vector<physical_handle>& chunks) {
  std::lock_guard lock(mutex_);
  for (const physical_handle& handle : chunks) {
    pool_[handle.bytes].push_back(handle);
    pooled_bytes_ += handle.bytes;
  }
  chunks.clear();
}

void chunk_arena::decommit(std::uintptr_t address, std::vector<physical_handle>& chunks,
                           paging_listener* listener) {
  std::vector<std::pair<physical_handle, std::uintptr_t>> on_host;  // and where it was mapped
  auto sink_host_chunks = [&] {
    for (const auto& [handle, at] : on_host) {
      if (listener != nullptr) listener->host_chunk_released(handle, at);
    }
  };
  std::size_t unmapped = 0;
  try {
    std::lock_guard lock(mutex_);
    std::size_t offset = 0;
    for (; unmapped < chunks.size(); ++unmapped) {
      const physical_handle& handle = chunks[unmapped];
      device_.unmap(address + offset, handle.bytes);
      offset += handle.bytes;
      if (handle.location == memory_location::host) {
        on_host.emplace_back(handle, address + offset - handle.bytes);
        continue;
      }
      pool_[handle.bytes].push_back(handle);
      pooled_bytes_ += handle.bytes;
    }
  } catch (...) {
    // The chunks unmapped so far are free; `chunks` keeps those still mapped.
    chunks.erase(chunks.begin(), chunks.begin() + static_cast<std::ptrdiff_t>(unmapped));
    sink_host_chunks();
    throw;
  }
  chunks.clear();
  sink_host_chunks();
}

physical_handle chunk_arena::take_chunk(std::size_t bytes) {
  std::lock_guard lock(mutex_);
  return obtain_chunk(bytes);
}

void chunk_arena::return_chunk(physical_handle chunk) {
  std::lock_guard lock(mutex_);
  pool_[chunk.bytes].push_back(chunk);
  pooled_bytes_ += chunk.bytes;
}

std::uint64_t chunk_arena::release_pool() {
  std::lock_guard lock(mutex_);
  const std::uint64_t released = pooled_bytes_;
  release_pool_locked();
  return released;
}

void chunk_arena::release_pool_locked() {
  for (auto& [bytes, handles] : pool_) {
    while (!handles.empty()) {
      device_.release_physical(handles.back());
      limiter_.credit(bytes);
      pooled_bytes_ -= bytes;
      handles.pop_back();
    }
  }
}

std::uint64_t chunk_arena::pooled_bytes() const {
  std::lock_guard lock(mutex_);
  return pooled_bytes_;
}

}  // namespace zeroalloc
