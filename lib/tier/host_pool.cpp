#include "tier/host_pool.hpp"

#include <algorithm>
#include <chrono>

#include "core/host_memory.hpp"
#include "core/log.hpp"
#include "core/units.hpp"

namespace zeroalloc {
namespace {

constexpr std::size_t kLargestSlabBytes = std::size_t{1} << 30;

}  // namespace

host_pool::host_pool(device& backing, std::uint64_t limit_bytes, std::string limit_source)
    : device_(backing),
      limit_bytes_(limit_bytes),
      limit_source_(std::move(limit_source)),
      slices_(limit_bytes != 0 && backing.maps_slices()) {
  const std::size_t granularity = device_.granularity();
  slab_bytes_ =
      slices_ ? std::min<std::size_t>(kLargestSlabBytes, limit_bytes_ / granularity * granularity)
              : 0;
  // Staging addresses for everything the limit allows, with room for slabs of mixed sizes
  // to fragment the range: address space costs nothing.
  staging_region_bytes_ = round_up(static_cast<std::size_t>(limit_bytes_), granularity) * 2;
  if (staging_region_bytes_ != 0) {
    staging_region_ = device_.reserve_addresses(staging_region_bytes_, granularity);
    free_staging_.give_back(staging_region_, staging_region_bytes_);
  }
  figures_.limit_bytes = limit_bytes_;
  host_available_ = host_available_bytes;
  host_reserve_ = host_reserve_bytes();
}

void host_pool::set_host_memory_probe(std::function<std::uint64_t()> available,
                                      std::uint64_t reserve) {
  std::lock_guard lock(mutex_);
  host_available_ = std::move(available);
  host_reserve_ = reserve;
}

std::string host_pool::host_room_problem(std::size_t bytes, bool background) const {
  const std::uint64_t available = host_available_();
  const std::uint64_t reserve = background ? 4 * host_reserve_ : host_reserve_;
  if (available >= bytes + reserve) return {};
  return detail::concat("the host has ", format_bytes(available),
                        " of memory available, and pinning ", format_bytes(bytes),
                        " more would leave less than ", format_bytes(reserve),
                        " to the rest of the machine");
}

host_pool::~host_pool() {
  stop_prefill();
  destroy_detached(slabs_);  // each on its own; failures logged
  try {
    if (staging_region_ != 0) device_.free_addresses(staging_region_, staging_region_bytes_);
  } catch (const std::exception& failure) {
    log().error("releasing the host pool failed: {}", failure.what());
  }
}

std::size_t host_pool::new_slab_bytes(std::size_t at_least) const {
  if (!slices_) return at_least;
  // A whole slab when the budget allows, else what is left of it (enough for this chunk).
  const std::uint64_t left = limit_bytes_ - std::min(limit_bytes_, reserved_bytes_);
  const std::size_t granularity = device_.granularity();
  const std::size_t fits = static_cast<std::size_t>(left) / granularity * granularity;
  return std::max(at_least, std::min(slab_bytes_, fits));
}

std::unique_ptr<host_pool::slab> host_pool::create_slab(std::size_t bytes) {
  auto made = std::make_unique<slab>();
  made->handle = device_.create_physical(bytes, memory_location::host);
  try {
    {
      std::lock_guard lock(mutex_);
      made->staging_address = take_staging(bytes);
    }
    device_.map(made->staging_address, made->handle);
    if (!device_.open_to_host(made->staging_address, bytes) &&
        open_to_host_.exchange(false, std::memory_order_acq_rel)) {
      log().warn(
          "the driver did not open host memory mapped through it to the CPUs; the "
          "optimizer step runs on the device (ZEROALLOC_HOST_STEP has no effect)");
    }
  } catch (...) {
    std::lock_guard lock(mutex_);
    if (made->staging_address != 0) free_staging_.give_back(made->staging_address, bytes);
    device_.release_physical(made->handle);
    throw;
  }
  made->free.give_back(0, bytes);
  made->free_bytes = bytes;
  return made;
}

void host_pool::destroy_slab(const slab& gone) {
  device_.unmap(gone.staging_address, gone.handle.bytes);
  device_.release_physical(gone.handle);
}

// Note [A slab that cannot be destroyed]: a slab is destroyed to make room under
// ZEROALLOC_HOST_LIMIT for one of another size. When its unmap or release fails (a failing
// driver), its pinned memory is still held: it goes back to the pool retired (never used,
// never destroyed again, its staging address kept) and stays counted against the limit.
// The rest of the pool goes on; an escaping exception killed the prefill thread (and with it
// the process), or left the detached slabs counted but listed nowhere, a budget lost for
// good.
std::vector<bool> host_pool::destroy_detached(const std::vector<std::unique_ptr<slab>>& victims) {
  std::vector<bool> destroyed(victims.size(), false);
  for (std::size_t i = 0; i < victims.size(); ++i) {
    try {
      destroy_slab(*victims[i]);
      destroyed[i] = true;
    } catch (const std::exception& failure) {
      log().error(
          "host tier: releasing {} of pinned host memory failed ({}); it stays held, out of "
          "use, and counted against {}. The GPU driver is failing: restart the process",
          format_bytes(victims[i]->handle.bytes), failure.what(), limit_source_);
    }
  }
  return destroyed;
}

void host_pool::settle_destroyed_locked(std::vector<std::unique_ptr<slab>>& victims,
                                        const std::vector<bool>& destroyed) {
  for (std::size_t i = 0; i < victims.size(); ++i) {
    slab& victim = *victims[i];
    if (destroyed[i]) {
      free_staging_.give_back(victim.staging_address, victim.handle.bytes);
      reserved_bytes_ -= victim.handle.bytes;
      figures_.created_bytes -= victim.handle.bytes;
      continue;
    }
    victim.retired = true;
    victim.free_bytes = 0;
    slabs_.push_back(std::move(victims[i]));
  }
  victims.clear();
}

void host_pool::start_prefill(std::size_t chunk_bytes, std::uint64_t bytes) {
  std::lock_guard lock(mutex_);
  if (prefilling_ || prefill_thread_.joinable()) return;
  prefilling_ = true;
  const std::size_t slab = slices_ ? slab_bytes_ : chunk_bytes;
  prefill_thread_ = std::thread([this, slab, bytes] { prefill(slab, bytes); });
}

void host_pool::stop_prefill() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    work_.notify_all();
  }
  if (prefill_thread_.joinable()) prefill_thread_.join();
}

void host_pool::wait_for_prefill() {
  std::unique_lock lock(mutex_);
  created_.wait(lock, [&] { return !prefilling_; });
}

void host_pool::prefill(std::size_t slab_bytes, std::uint64_t bytes) {
  const std::uint64_t target = std::min(bytes, limit_bytes_);
  const auto started = std::chrono::steady_clock::now();
  log().info("host tier: creating {} of pinned host memory on {} in the background ({})",
             format_bytes(target), device_.name(), limit_source_);
  std::uint64_t made = 0;  // by the prefill, anticipated sizes included
  std::uint64_t next_report = target / 4;
  std::string failure;
  bool filling = slab_bytes != 0;
  auto finish_filling = [&] {  // with the lock held
    filling = false;
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (!failure.empty()) {
      log().warn(
          "host tier: stopped after {} of pinned host memory: {}; offloading is limited to "
          "what was created (lower ZEROALLOC_HOST_LIMIT to silence this)",
          format_bytes(made), failure);
    } else {
      log().info("host tier: {} of pinned host memory ready in {:.1f} s", format_bytes(made),
                 seconds);
    }
    prefilling_ = false;
    created_.notify_all();
  };
  // Then, where slabs are whole chunks, the sizes the allocator's paged classes want (Note
  // [Anticipated sizes]), until stopped.
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    std::size_t size = failure.empty() ? wanted_size_locked() : 0;
    const bool anticipated = size != 0;
    if (!anticipated && filling) {
      size = slices_ ? new_slab_bytes(device_.granularity()) : slab_bytes;
      if (!failure.empty() || made >= target || size == 0 ||
          reserved_bytes_ + size > limit_bytes_) {
        finish_filling();
        continue;
      }
      if (const std::string problem = host_room_problem(size, /*background=*/true);
          !problem.empty()) {
        log().info("host tier: the background creation stops at {}: {} (Note [Host budget])",
                   format_bytes(made), problem);
        finish_filling();
        continue;
      }
    }
    if (size == 0) {
      if (filling) finish_filling();
      if (slices_) break;  // nothing is ever anticipated
      work_.wait(lock);
      continue;
    }
    if (reserved_bytes_ + size > limit_bytes_) {
      // Surplus slabs go first; they stay counted until destroyed, so that no acquire in
      // between creates past the limit.
      std::vector<std::unique_ptr<slab>> surplus = take_surplus_locked(size);
      if (surplus.empty()) {
        stalled_[size] = change_;  // until a slab is freed or the wanted sizes change
        continue;
      }
      lock.unlock();
      const std::vector<bool> destroyed = destroy_detached(surplus);
      lock.lock();
      settle_destroyed_locked(surplus, destroyed);
      continue;  // and look again: the budget, and what is wanted, may have changed
    }
    reserved_bytes_ += size;
    lock.unlock();
    std::unique_ptr<slab> made_slab;
    std::string error;
    try {
      made_slab = create_slab(size);
    } catch (const std::exception& failed) {
      error = failed.what();
    }
    lock.lock();
    if (!error.empty()) {
      reserved_bytes_ -= size;
      failure = error;
      if (!filling) {
        log().warn(
            "host tier: creating {} of pinned host memory in the background failed: {}; "
            "chunks of that size are created when first needed",
            format_bytes(size), failure);
      }
      continue;
    }
    slabs_.push_back(std::move(made_slab));
    figures_.created_bytes += size;
    created_.notify_all();
    if (filling) {
      made += size;
      if (made >= next_report && made < target) {
        log().info("host tier: {} of {} pinned", format_bytes(made), format_bytes(target));
        next_report += target / 4;
      }
    } else {
      log().debug("host tier: created a slab of {} in the background for a chunk size in use",
                  format_bytes(size));
    }
  }
  if (filling) finish_filling();
}

void host_pool::expect_chunks(std::size_t bytes, int change) {
  if (slices_ || bytes == 0 || change == 0) return;
  std::lock_guard lock(mutex_);
  std::int64_t& wanted = wanted_[bytes];
  wanted = std::max<std::int64_t>(0, wanted + change);
  ++change_;
  work_.notify_one();
}

std::size_t host_pool::wanted_size_locked() const {
  std::unordered_map<std::size_t, std::int64_t> have;
  for (const auto& each : slabs_) {
    if (!each->retired) ++have[each->handle.bytes];
  }
  for (const auto& [bytes, wanted] : wanted_) {
    if (have[bytes] >= wanted) continue;
    const auto stalled = stalled_.find(bytes);
    if (stalled != stalled_.end() && stalled->second == change_) continue;
    return bytes;
  }
  return 0;
}

std::vector<std::unique_ptr<host_pool::slab>> host_pool::take_surplus_locked(std::size_t bytes) {
  std::unordered_map<std::size_t, std::int64_t> spare;  // slabs beyond the chunks of a size
  for (const auto& each : slabs_) {
    if (!each->retired) ++spare[each->handle.bytes];
  }
  for (auto& [size, count] : spare) {
    const auto wanted = wanted_.find(size);
    if (wanted != wanted_.end()) count -= wanted->second;
  }
  std::vector<std::unique_ptr<slab>> taken =
      detach_free_slabs_locked(bytes, [&](const slab& candidate) {
        std::int64_t& left = spare[candidate.handle.bytes];
        if (left <= 0 || candidate.handle.bytes == bytes) return false;
        --left;
        return true;
      });
  return taken;
}

std::vector<std::unique_ptr<host_pool::slab>> host_pool::detach_free_slabs_locked(
    std::size_t bytes, const std::function<bool(const slab&)>& may_go) {
  std::vector<std::unique_ptr<slab>> taken;
  std::uint64_t freed = 0;
  for (auto it = slabs_.begin();
       it != slabs_.end() && reserved_bytes_ - freed + bytes > limit_bytes_;) {
    if ((*it)->free_bytes == (*it)->handle.bytes && may_go(**it)) {
      freed += (*it)->handle.bytes;
      taken.push_back(std::move(*it));
      it = slabs_.erase(it);
    } else {
      ++it;
    }
  }
  if (reserved_bytes_ - freed + bytes > limit_bytes_) {  // not enough: keep them
    for (auto& each : taken) slabs_.push_back(std::move(each));
    taken.clear();
  }
  return taken;
}

host_chunk host_pool::take_slice_locked(std::size_t bytes) {
  for (const auto& each : slabs_) {
    slab& candidate = *each;
    if (candidate.free_bytes < bytes) continue;
    if (!slices_ && (candidate.handle.bytes != bytes || candidate.free_bytes != bytes)) continue;
    const std::optional<std::uintptr_t> offset = candidate.free.take_first_fit(bytes);
    if (!offset) continue;
    candidate.free_bytes -= bytes;
    host_chunk chunk;
    chunk.handle = candidate.handle;
    chunk.handle.offset = static_cast<std::size_t>(*offset);
    chunk.handle.bytes = bytes;
    chunk.staging_address = candidate.staging_address + *offset;
    figures_.in_use_bytes += bytes;
    figures_.peak_in_use_bytes = std::max(figures_.peak_in_use_bytes, figures_.in_use_bytes);
    return chunk;
  }
  return {};
}

host_chunk host_pool::acquire(std::size_t bytes) {
  std::unique_lock lock(mutex_);
  while (true) {
    if (host_chunk chunk = take_slice_locked(bytes); chunk.valid()) return chunk;
    const std::size_t size = new_slab_bytes(bytes);
    // The prefill has claimed the budget for slabs it has not made yet: wait for them
    // rather than creating more than the limit.
    if (prefilling_ && reserved_bytes_ + size > limit_bytes_) {
      created_.wait(lock);
      continue;
    }
    if (reserved_bytes_ + size <= limit_bytes_) {
      if (const std::string problem = host_room_problem(size, /*background=*/false);
          !problem.empty()) {
        ZA_THROW(host_memory_exhausted, "the host tier cannot offload a chunk of ",
                 format_bytes(bytes), ": ", problem, " (", format_bytes(figures_.in_use_bytes),
                 " of pinned memory hold offloaded chunks, ", format_bytes(reserved_bytes_),
                 " created). Free host memory (other processes), or lower what must be "
                 "offloaded (a smaller batch, or a larger ZEROALLOC_MEMORY_LIMIT).");
      }
      reserved_bytes_ += size;
      lock.unlock();
      std::unique_ptr<slab> made;
      try {
        made = create_slab(size);
      } catch (...) {
        lock.lock();
        reserved_bytes_ -= size;
        throw;
      }
      lock.lock();
      slabs_.push_back(std::move(made));
      figures_.created_bytes += size;
      ++figures_.created_on_demand;
      log().debug("host tier: created {} of pinned memory on demand for a chunk of {}",
                  format_bytes(size), format_bytes(bytes));
      continue;
    }
    if (!release_free_slabs_locked(size, lock)) throw_exhausted(bytes);
  }
}

bool host_pool::release_free_slabs_locked(std::size_t bytes, std::unique_lock<std::mutex>& lock) {
  std::vector<std::unique_ptr<slab>> victims =
      detach_free_slabs_locked(bytes, [](const slab&) { return true; });
  if (victims.empty()) return reserved_bytes_ + bytes <= limit_bytes_;
  lock.unlock();
  const std::vector<bool> destroyed = destroy_detached(victims);
  lock.lock();
  settle_destroyed_locked(victims, destroyed);
  return true;  // the caller looks again (retired slabs are never detached twice)
}

void host_pool::release(const host_chunk& chunk) {
  std::lock_guard lock(mutex_);
  for (const auto& each : slabs_) {
    slab& owner = *each;
    if (owner.handle.value != chunk.handle.value) continue;
    owner.free.give_back(chunk.handle.offset, chunk.handle.bytes);
    owner.free_bytes += chunk.handle.bytes;
    figures_.in_use_bytes -= chunk.handle.bytes;
    if (!stalled_.empty()) {  // a free slab may be what a stalled size waits for
      ++change_;
      work_.notify_one();
    }
    return;
  }
  log().error("host tier: a chunk of {} came back that no slab owns; ignored",
              format_bytes(chunk.handle.bytes));
}

std::uintptr_t host_pool::take_staging(std::size_t bytes) {
  if (const std::optional<std::uintptr_t> address = free_staging_.take_first_fit(bytes)) {
    return *address;
  }
  ZA_THROW(host_memory_exhausted, "the host tier's staging addresses are exhausted (",
           format_bytes(staging_region_bytes_), " for ", limit_source_,
           "): too many slabs of mixed sizes; report this with ZEROALLOC_LOG_LEVEL=debug");
}

void host_pool::throw_exhausted(std::size_t bytes) const {
  ZA_THROW(host_memory_exhausted, "the host tier is full: offloading ", format_bytes(bytes),
           " more would exceed the pinned host memory limit of ", format_bytes(limit_bytes_), " (",
           limit_source_, "); ", format_bytes(figures_.in_use_bytes),
           " hold offloaded chunks. Raise ZEROALLOC_HOST_LIMIT if the host has memory to "
           "spare, or lower what must be offloaded (a smaller batch, or a larger "
           "ZEROALLOC_MEMORY_LIMIT).");
}

std::optional<std::unordered_map<std::size_t, std::size_t>> host_pool::ready_chunks() const {
  if (slices_) return std::nullopt;
  std::unordered_map<std::size_t, std::size_t> ready;
  std::lock_guard lock(mutex_);
  for (const auto& each : slabs_) {
    if (each->free_bytes == each->handle.bytes) ++ready[each->handle.bytes];
  }
  return ready;
}

host_pool_figures host_pool::figures() const {
  std::lock_guard lock(mutex_);
  return figures_;
}

}  // namespace zeroalloc
