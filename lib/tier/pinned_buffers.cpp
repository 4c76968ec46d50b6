#include "tier/pinned_buffers.hpp"

#include "core/errors.hpp"
#include "core/host_memory.hpp"
#include "core/log.hpp"
#include "core/units.hpp"
#include "tier/host_pool.hpp"

namespace zeroalloc {

pinned_buffers::~pinned_buffers() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  released_.notify_all();
  if (reaper_.joinable()) reaper_.join();  // it frees what was released first
  for (const auto& [address, bytes] : live_) {
    free_buffer({reinterpret_cast<void*>(address), bytes, nullptr});
  }
}

void pinned_buffers::set_kept(std::function<std::uint64_t()> kept) {
  std::lock_guard lock(mutex_);
  kept_ = std::move(kept);
}

void* pinned_buffers::create(std::size_t bytes) {
  ZA_REQUIRE(bytes != 0, "a pinned buffer of 0 bytes");
  const std::size_t page = host_page_bytes();
  const std::size_t size = (bytes + page - 1) / page * page;
  std::function<std::uint64_t()> kept_for;
  {
    std::lock_guard lock(mutex_);
    kept_for = kept_;
  }
  // The tier's growth first: a slab it makes between the two reads is then counted twice,
  // not missed.
  const std::uint64_t kept = kept_for ? kept_for() : 0;
  const std::uint64_t available = host_available_bytes();
  const std::uint64_t reserve = host_reserve_bytes();
  if (available < reserve + kept || size > available - reserve - kept) {
    ZA_THROW(host_memory_exhausted, "pinning ", format_bytes(size),
             " for the host step's buffers would leave the host less than the ",
             format_bytes(reserve), " it keeps in reserve",
             kept == 0 ? std::string()
                       : " and the " + format_bytes(kept) +
                             " its host tier may still take up to ZEROALLOC_HOST_LIMIT",
             " (", format_bytes(available),
             " available): pinned memory cannot be swapped. The host step makes its own when it "
             "first needs them. "
             "Free host memory, or lower ZEROALLOC_HOST_LIMIT, to have them.");
  }
  // Without the lock: pinning takes about a quarter of a second a GiB.
  void* address = device_.create_pinned(size);
  std::lock_guard lock(mutex_);
  live_.emplace(reinterpret_cast<std::uintptr_t>(address), size);
  held_bytes_ += size;
  return address;
}

void pinned_buffers::release(void* address, stream_handle stream) {
  const auto key = reinterpret_cast<std::uintptr_t>(address);
  released gone{address, 0, nullptr};
  {
    std::lock_guard lock(mutex_);
    const auto found = live_.find(key);
    ZA_REQUIRE(found != live_.end(), "pointer ", address,
               " is not a pinned buffer zeroalloc made, or was released already");
    gone.bytes = found->second;
  }
  // Still live until the event is recorded: a failure leaves the buffer the caller's.
  gone.done = device_.create_event();
  try {
    device_.record_event(gone.done, stream);
  } catch (...) {
    try {
      device_.destroy_event(gone.done);
    } catch (const std::exception& failure) {
      log().error("destroying an event of a pinned buffer failed: {}", failure.what());
    }
    throw;
  }
  {
    std::lock_guard lock(mutex_);
    live_.erase(key);
    pending_.push_back(gone);
    if (!reaper_.joinable()) reaper_ = std::thread([this] { reap(); });
  }
  released_.notify_one();
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

void pinned_buffers::reap() {
  std::unique_lock lock(mutex_);
  for (;;) {
    released_.wait(lock, [this] { return stopping_ || !pending_.empty(); });
    if (pending_.empty()) return;  // stopping, and nothing left to free
    const released gone = pending_.front();
    lock.unlock();
    bool done = true;
    try {
      device_.synchronize_event(gone.done);
    } catch (const std::exception& failure) {
      // Held for good: memory a copy may still reach must not go back to the host.
      log().error("waiting for the copies of a pinned buffer of {} failed ({}); it stays pinned",
                  format_bytes(gone.bytes), failure.what());
      done = false;
    }
    if (done) free_buffer(gone);
    lock.lock();
    pending_.pop_front();
    if (done) held_bytes_ -= gone.bytes;
  }
}

void pinned_buffers::free_buffer(const released& gone) {
  if (gone.done != nullptr) {
    try {
      device_.destroy_event(gone.done);
    } catch (const std::exception& failure) {
      log().error("destroying an event of a pinned buffer failed: {}", failure.what());
    }
  }
  try {
    device_.release_pinned(gone.address, gone.bytes);
  } catch (const std::exception& failure) {
    log().error("releasing a pinned buffer of {} failed: {}", format_bytes(gone.bytes),
                failure.what());
  }
}

}  // namespace zeroalloc
