#include "tier/host_pool.hpp"

#include <algorithm>
#include <chrono>

#include "core/log.hpp"
#include "core/units.hpp"

namespace zeroalloc {

host_pool::host_pool(device& backing, std::uint64_t limit_bytes, std::string limit_source)
    : device_(backing), limit_bytes_(limit_bytes), limit_source_(std::move(limit_source)) {
  // Staging addresses for every chunk the limit allows, with room for chunks of mixed sizes
  // to fragment the range: address space costs nothing.
  const std::size_t granularity = device_.granularity();
  staging_region_bytes_ =
      static_cast<std::size_t>((limit_bytes_ + granularity - 1) / granularity * granularity) * 2;
  if (staging_region_bytes_ != 0) {
    staging_region_ = device_.reserve_addresses(staging_region_bytes_, granularity);
    free_staging_.emplace(staging_region_, staging_region_bytes_);
  }
  figures_.limit_bytes = limit_bytes_;
}

host_pool::~host_pool() {
  stop_prefill();
  try {
    for (auto& [bytes, chunks] : idle_) {
      for (const host_chunk& chunk : chunks) destroy(chunk);
    }
    if (staging_region_ != 0) device_.free_addresses(staging_region_, staging_region_bytes_);
  } catch (const std::exception& failure) {
    log().error("releasing the host pool failed: {}", failure.what());
  }
}

void host_pool::start_prefill(std::size_t chunk_bytes, std::uint64_t bytes) {
  std::lock_guard lock(mutex_);
  if (prefilling_ || prefill_thread_.joinable()) return;
  prefilling_ = true;
  prefill_thread_ = std::thread([this, chunk_bytes, bytes] { prefill(chunk_bytes, bytes); });
}

void host_pool::stop_prefill() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  if (prefill_thread_.joinable()) prefill_thread_.join();
}

void host_pool::wait_for_prefill() {
  std::unique_lock lock(mutex_);
  created_.wait(lock, [&] { return !prefilling_; });
}

void host_pool::prefill(std::size_t chunk_bytes, std::uint64_t bytes) {
  const std::uint64_t target = std::min(bytes, limit_bytes_) / chunk_bytes * chunk_bytes;
  const auto started = std::chrono::steady_clock::now();
  log().info("host tier: creating {} of pinned host memory on {} in the background ({})",
             format_bytes(target), device_.name(), limit_source_);
  std::uint64_t made = 0;
  std::uint64_t next_report = target / 4;
  std::string failure;
  while (true) {
    {
      std::lock_guard lock(mutex_);
      if (stopping_ || made >= target || reserved_bytes_ + chunk_bytes > limit_bytes_) break;
      reserved_bytes_ += chunk_bytes;
    }
    host_chunk chunk;
    try {
      chunk.handle = device_.create_physical(chunk_bytes, memory_location::host);
      std::unique_lock lock(mutex_);
      chunk.staging_address = take_staging(chunk_bytes);
      lock.unlock();
      device_.map(chunk.staging_address, chunk.handle);
    } catch (const std::exception& error) {
      if (chunk.handle.valid()) device_.release_physical(chunk.handle);
      std::lock_guard lock(mutex_);
      if (chunk.staging_address != 0) return_staging(chunk.staging_address, chunk_bytes);
      reserved_bytes_ -= chunk_bytes;
      failure = error.what();
      break;
    }
    made += chunk_bytes;
    {
      std::lock_guard lock(mutex_);
      idle_[chunk_bytes].push_back(chunk);
      figures_.created_bytes += chunk_bytes;
    }
    created_.notify_all();
    if (made >= next_report && made < target) {
      log().info("host tier: {} of {} pinned", format_bytes(made), format_bytes(target));
      next_report += target / 4;
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (!failure.empty()) {
    log().warn("host tier: stopped after {} of pinned host memory: {}; offloading is limited to "
               "what was created (lower ZEROALLOC_HOST_LIMIT to silence this)",
               format_bytes(made), failure);
  } else {
    log().info("host tier: {} of pinned host memory ready in {:.1f} s", format_bytes(made),
               seconds);
  }
  {
    std::lock_guard lock(mutex_);
    prefilling_ = false;
  }
  created_.notify_all();
}

host_chunk host_pool::acquire(std::size_t bytes) {
  std::unique_lock lock(mutex_);
  while (true) {
    auto idle = idle_.find(bytes);
    if (idle != idle_.end() && !idle->second.empty()) {
      host_chunk chunk = idle->second.back();
      idle->second.pop_back();
      figures_.in_use_bytes += bytes;
      figures_.peak_in_use_bytes = std::max(figures_.peak_in_use_bytes, figures_.in_use_bytes);
      return chunk;
    }
    // The prefill has claimed the budget for chunks it has not made yet: wait for them
    // rather than creating more than the limit.
    if (prefilling_ && reserved_bytes_ + bytes > limit_bytes_) {
      created_.wait(lock);
      continue;
    }
    if (reserved_bytes_ + bytes <= limit_bytes_) {
      host_chunk chunk = create_locked(bytes, lock);
      ++figures_.created_on_demand;
      figures_.in_use_bytes += bytes;
      figures_.peak_in_use_bytes = std::max(figures_.peak_in_use_bytes, figures_.in_use_bytes);
      return chunk;
    }
    if (!free_idle_of_other_sizes(bytes, lock)) throw_exhausted(bytes);
  }
}

host_chunk host_pool::create_locked(std::size_t bytes, std::unique_lock<std::mutex>& lock) {
  reserved_bytes_ += bytes;
  host_chunk chunk;
  try {
    chunk.staging_address = take_staging(bytes);
    lock.unlock();
    chunk.handle = device_.create_physical(bytes, memory_location::host);
    device_.map(chunk.staging_address, chunk.handle);
    lock.lock();
  } catch (...) {
    if (chunk.handle.valid()) device_.release_physical(chunk.handle);
    if (!lock.owns_lock()) lock.lock();
    if (chunk.staging_address != 0) return_staging(chunk.staging_address, bytes);
    reserved_bytes_ -= bytes;
    throw;
  }
  figures_.created_bytes += bytes;
  return chunk;
}

bool host_pool::free_idle_of_other_sizes(std::size_t bytes, std::unique_lock<std::mutex>& lock) {
  std::vector<host_chunk> victims;
  std::uint64_t freed = 0;
  for (auto& [size, chunks] : idle_) {
    while (size != bytes && !chunks.empty() && reserved_bytes_ - freed + bytes > limit_bytes_) {
      victims.push_back(chunks.back());
      chunks.pop_back();
      freed += size;
    }
  }
  if (reserved_bytes_ - freed + bytes > limit_bytes_) {  // not enough: keep them
    for (const host_chunk& chunk : victims) idle_[chunk.handle.bytes].push_back(chunk);
    return false;
  }
  lock.unlock();
  for (const host_chunk& chunk : victims) destroy(chunk);
  lock.lock();
  for (const host_chunk& chunk : victims) return_staging(chunk.staging_address, chunk.handle.bytes);
  reserved_bytes_ -= freed;
  figures_.created_bytes -= freed;
  return true;
}

void host_pool::release(const host_chunk& chunk) {
  std::lock_guard lock(mutex_);
  idle_[chunk.handle.bytes].push_back(chunk);
  figures_.in_use_bytes -= chunk.handle.bytes;
}

void host_pool::destroy(const host_chunk& chunk) {
  device_.unmap(chunk.staging_address, chunk.handle.bytes);
  device_.release_physical(chunk.handle);
}

std::uintptr_t host_pool::take_staging(std::size_t bytes) {
  for (auto range = free_staging_.begin(); range != free_staging_.end(); ++range) {
    if (range->second < bytes) continue;
    const std::uintptr_t address = range->first;
    const std::size_t rest = range->second - bytes;
    free_staging_.erase(range);
    if (rest != 0) free_staging_.emplace(address + bytes, rest);
    return address;
  }
  ZA_THROW(host_memory_exhausted, "the host tier's staging addresses are exhausted (",
           format_bytes(staging_region_bytes_), " for ", limit_source_,
           "): too many chunks of mixed sizes; report this with ZEROALLOC_LOG_LEVEL=debug");
}

void host_pool::return_staging(std::uintptr_t address, std::size_t bytes) {
  auto [inserted, fresh] = free_staging_.emplace(address, bytes);
  (void)fresh;
  auto after = std::next(inserted);
  if (after != free_staging_.end() && inserted->first + inserted->second == after->first) {
    inserted->second += after->second;
    free_staging_.erase(after);
  }
  if (inserted != free_staging_.begin()) {
    auto before = std::prev(inserted);
    if (before->first + before->second == inserted->first) {
      before->second += inserted->second;
      free_staging_.erase(inserted);
    }
  }
}

void host_pool::throw_exhausted(std::size_t bytes) const {
  ZA_THROW(host_memory_exhausted, "the host tier is full: offloading ", format_bytes(bytes),
           " more would exceed the pinned host memory limit of ", format_bytes(limit_bytes_),
           " (", limit_source_, "); ", format_bytes(figures_.in_use_bytes),
           " hold offloaded chunks. Raise ZEROALLOC_HOST_LIMIT if the host has memory to "
           "spare, or lower what must be offloaded (a smaller batch, or a larger "
           "ZEROALLOC_MEMORY_LIMIT).");
}

host_pool_figures host_pool::figures() const {
  std::lock_guard lock(mutex_);
  return figures_;
}

}  // namespace zeroalloc
