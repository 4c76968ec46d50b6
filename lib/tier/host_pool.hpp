// The host tier's memory: pinned host physical chunks (host-located VMM handles on the GPU's
// NUMA node), each mapped once at a staging address of its own so that copies can reach it
// while it backs no allocation.
//
// Note [Host budget]: pinned memory cannot be swapped, so a host that runs out of it does
// not slow down, it kills the process (the OOM killer) or fails every later pinned
// allocation of every program. The pool therefore holds at most ZEROALLOC_HOST_LIMIT bytes
// (default: half of the GPU's NUMA node), creates them in the background at start-up
// (creating pinned memory costs about 0.25 s per GiB, far too slow for the training path),
// and reuses them forever. Running out is a clear error that names the variable, never a
// host OOM kill.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/errors.hpp"
#include "device/device.hpp"

namespace zeroalloc {

/// Thrown when the host tier would exceed ZEROALLOC_HOST_LIMIT.
class host_memory_exhausted : public error {
 public:
  using error::error;
};

/// A pinned host chunk and the address where the pool keeps it mapped.
struct host_chunk {
  physical_handle handle;
  std::uintptr_t staging_address = 0;
  [[nodiscard]] bool valid() const { return handle.valid(); }
};

/// Figures of the pool, for statistics and reports.
struct host_pool_figures {
  std::uint64_t limit_bytes = 0;
  std::uint64_t created_bytes = 0;  ///< pinned memory held (in use or idle)
  std::uint64_t in_use_bytes = 0;   ///< backing offloaded chunks now
  std::uint64_t peak_in_use_bytes = 0;
  std::uint64_t created_on_demand = 0;  ///< chunks the training path had to wait for
};

class host_pool {
 public:
  /// `limit_source` names what set the limit ("ZEROALLOC_HOST_LIMIT=0.5 of NUMA node 0 ...")
  /// for messages.
  host_pool(device& backing, std::uint64_t limit_bytes, std::string limit_source);
  /// Stops the background creation and releases every chunk. Chunks still acquired must
  /// have been released.
  ~host_pool();
  host_pool(const host_pool&) = delete;
  host_pool& operator=(const host_pool&) = delete;

  /// Creates chunks of `chunk_bytes` on a background thread until `bytes` (at most the
  /// limit) are held, logging progress. Returns at once.
  void start_prefill(std::size_t chunk_bytes, std::uint64_t bytes);
  /// Waits for the background creation to finish (tests).
  void wait_for_prefill();
  /// Stops the background creation and waits for its thread (at exit: it must not outlive
  /// the logger). Chunks made so far stay usable.
  void stop_prefill();

  /// A chunk of exactly `bytes`: an idle one, else one the prefill is about to finish,
  /// else a new one (counted in created_on_demand), after releasing idle chunks of other
  /// sizes if the limit requires. Throws host_memory_exhausted when the limit is reached.
  host_chunk acquire(std::size_t bytes);
  /// Gives a chunk back for reuse. Nothing may still be queued that touches it.
  void release(const host_chunk& chunk);

  [[nodiscard]] host_pool_figures figures() const;
  [[nodiscard]] std::uint64_t limit_bytes() const { return limit_bytes_; }

 private:
  host_chunk create_locked(std::size_t bytes, std::unique_lock<std::mutex>& lock);
  void destroy(const host_chunk& chunk);
  std::uintptr_t take_staging(std::size_t bytes);
  void return_staging(std::uintptr_t address, std::size_t bytes);
  bool free_idle_of_other_sizes(std::size_t bytes, std::unique_lock<std::mutex>& lock);
  [[noreturn]] void throw_exhausted(std::size_t bytes) const;
  void prefill(std::size_t chunk_bytes, std::uint64_t bytes);

  device& device_;
  const std::uint64_t limit_bytes_;
  const std::string limit_source_;
  std::uintptr_t staging_region_ = 0;
  std::size_t staging_region_bytes_ = 0;

  mutable std::mutex mutex_;
  std::condition_variable created_;
  std::map<std::uintptr_t, std::size_t> free_staging_;          // unused staging ranges
  std::map<std::size_t, std::vector<host_chunk>> idle_;          // bytes -> idle chunks
  host_pool_figures figures_;
  std::uint64_t reserved_bytes_ = 0;  // created, or being created by the prefill
  bool stopping_ = false;
  bool prefilling_ = false;
  std::thread prefill_thread_;
};

}  // namespace zeroalloc
