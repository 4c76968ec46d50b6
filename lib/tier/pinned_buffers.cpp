#include "tier/pinned_buffers.hpp"

#include "core/errors.hpp"
#include "core/host_memory.hpp"
#include "core/log.hpp"
#include "core/units.hpp"
#include "tier/host_pool.hpp"

namespace zeroalloc {

pinned_buffers::~pinned_buffers() {
  std::vector<released> gone;
  {
    std::lock_guard lock(mutex_);
    gone.swap(pending_);
    for (const auto& [address, bytes] : live_) {
      gone.push_back({reinterpret_cast<void*>(address), bytes, nullptr});
    }
    live_.clear();
  }
  for (const released& each : gone) {
    try {
      if (each.done != nullptr) device_.synchronize_event(each.done);
    } catch (const std::exception& failure) {
      log().error("waiting for the copies of a pinned buffer failed: {}", failure.what());
    }
  }
  free_all(gone);
}

void* pinned_buffers::create(std::size_t bytes) {
  ZA_REQUIRE(bytes != 0, "a pinned buffer of 0 bytes");
  const std::size_t page = host_page_bytes();
  const std::size_t size = (bytes + page - 1) / page * page;
  std::vector<released> done;
  {
    std::lock_guard lock(mutex_);
    done = take_done_locked();
  }
  free_all(done);
  const std::uint64_t available = host_available_bytes();
  const std::uint64_t reserve = host_reserve_bytes();
  if (available < reserve || size > available - reserve) {
    ZA_THROW(host_memory_exhausted, "pinning ", format_bytes(size),
             " for the host step's buffers would leave the host less than the ",
             format_bytes(reserve), " it keeps in reserve (", format_bytes(available),
             " available): pinned memory cannot be swapped. The step does without them; "
             "free host memory, or lower ZEROALLOC_HOST_LIMIT, to have them.");
  }
  // Without the lock: pinning takes about a quarter of a second a GiB.
  void* address = device_.create_pinned(size);
  std::lock_guard lock(mutex_);
  live_.emplace(reinterpret_cast<std::uintptr_t>(address), size);
  held_bytes_ += size;
  return address;
}

void pinned_buffers::release(void* address, stream_handle stream) {
  std::size_t bytes = 0;
  {
    std::lock_guard lock(mutex_);
    const auto found = live_.find(reinterpret_cast<std::uintptr_t>(address));
    ZA_REQUIRE(found != live_.end(), "pointer ", address,
               " is not a pinned buffer zeroalloc made, or was released already");
    bytes = found->second;
    live_.erase(found);
  }
  released gone{address, bytes, nullptr};
  try {
    gone.done = device_.create_event();
    device_.record_event(gone.done, stream);
  } catch (...) {
    // Not released: the caller may try again.
    if (gone.done != nullptr) device_.destroy_event(gone.done);
    std::lock_guard lock(mutex_);
    live_.emplace(reinterpret_cast<std::uintptr_t>(address), bytes);
    throw;
  }
  std::vector<released> done;
  {
    std::lock_guard lock(mutex_);
    pending_.push_back(gone);
    done = take_done_locked();
  }
  free_all(done);
}

bool pinned_buffers::owns(const void* address) const {
  std::lock_guard lock(mutex_);
  return live_.count(reinterpret_cast<std::uintptr_t>(address)) != 0;
}

std::uint64_t pinned_buffers::held_bytes() const {
  std::lock_guard lock(mutex_);
  return held_bytes_;
}

std::size_t pinned_buffers::pending() const {
  std::lock_guard lock(mutex_);
  return pending_.size();
}

std::vector<pinned_buffers::released> pinned_buffers::take_done_locked() {
  std::vector<released> done;
  std::vector<released> waiting;
  for (const released& each : pending_) {
    bool complete = false;
    try {
      complete = device_.event_completed(each.done);
    } catch (const std::exception& failure) {
      // Held, never freed: memory a copy may still reach must not go back to the host.
      log().error("asking whether a pinned buffer's copies are done failed: {}", failure.what());
    }
    (complete ? done : waiting).push_back(each);
  }
  pending_.swap(waiting);
  for (const released& each : done) held_bytes_ -= each.bytes;
  return done;
}

void pinned_buffers::free_all(const std::vector<released>& gone) {
  for (const released& each : gone) {
    try {
      if (each.done != nullptr) device_.destroy_event(each.done);
      device_.release_pinned(each.address, each.bytes);
    } catch (const std::exception& failure) {
      log().error("releasing a pinned buffer of {} failed: {}", format_bytes(each.bytes),
                  failure.what());
    }
  }
}

}  // namespace zeroalloc
