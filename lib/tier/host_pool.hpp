// The host tier's memory: pinned host physical memory (host-located VMM allocations on the
// GPU's NUMA node, or any node when the tier is larger than that node), handed out as chunks that
// the migrator maps where an allocation lives.
//
// Note [Host budget]: pinned memory cannot be swapped, so a host that runs out of it does
// not slow down, it kills the process (the OOM killer) or fails every later pinned
// allocation of every program. The pool therefore holds at most ZEROALLOC_HOST_LIMIT bytes
// (default: half of the host's memory), creates them in the background at start-up
// (creating pinned memory costs about 0.25 s per GiB, far too slow for the training path),
// and reuses them forever. Running out is a clear error that names the variable, never a
// host OOM kill. The limit alone cannot promise that: several processes on one host (a
// sweep, jobs started without torchrun) each take their default share, and each process
// grows after its pool is made. So the background creation stops, saying so, once the
// host would have less than a quarter of its memory available. Memory needed beyond that
// is created on demand, down to a reserve of a sixteenth; a chunk needed past the reserve
// fails with host_memory_exhausted, which names the memory available.
//
// Note [Host slabs]: the chunks the engine moves come in many sizes (a segment's last chunk
// is whatever remains of it), so the pool creates large slabs and hands out slices of them,
// first fit, at 2 MiB granularity: any size is served from memory created at start-up. Each
// slab is mapped once at a staging address, where copies reach a slice while it backs no
// allocation. On a driver that maps only whole allocations (device::maps_slices), each slab
// is exactly one chunk and only chunks of the same size reuse it; the CUDA 13 driver on the
// H200 is one (bench/python/vmm_map_probe.py: cuMemMap refuses a non-zero offset and a size
// below the allocation's), so there the prefill makes chunk-sized slabs and other sizes are
// created when first needed (Note [Host chunk sizes] in tier/offload_engine.cpp), unless
// anticipated (Note [Anticipated sizes]).
//
// Note [Anticipated sizes]: on such a driver, the allocator tells the pool about every
// physical chunk the optimizer states' segments gain or lose (expect_chunks), and the
// background thread keeps one slab of each size per such chunk: while it prefills, it makes
// the wanted sizes first; once the budget is spent, it turns free slabs of sizes with more
// slabs than chunks (the prefill's, typically) into wanted ones. Optimizer states are
// allocated a step before pressure first offloads them, so their odd-sized last chunks find
// a slab ready instead of pinned memory created on the training path. Only the states':
// they go to the host first (farthest next use), and slabs for every parameter and gradient
// chunk would take the budget from the chunk-sized slabs the states need at 13B (a third of
// a 100 MiB tensor's chunks is odd-sized). What the limit cannot hold, and other classes'
// odd sizes, are created on demand, as before.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/errors.hpp"
#include "core/free_ranges.hpp"
#include "device/device.hpp"

namespace zeroalloc {

/// Thrown when the host tier would exceed ZEROALLOC_HOST_LIMIT.
class host_memory_exhausted : public error {
 public:
  using error::error;
};

/// A pinned host chunk (a slice of a slab) and the address where it can be reached while it
/// backs no allocation.
struct host_chunk {
  physical_handle handle;  ///< the slab's handle, with the slice's offset and bytes
  std::uintptr_t staging_address = 0;
  [[nodiscard]] bool valid() const { return handle.valid(); }
};

/// Figures of the pool, for statistics and reports.
struct host_pool_figures {
  std::uint64_t limit_bytes = 0;
  std::uint64_t created_bytes = 0;  ///< pinned memory held (in use or idle)
  std::uint64_t in_use_bytes = 0;   ///< backing offloaded chunks now
  std::uint64_t peak_in_use_bytes = 0;
  std::uint64_t created_on_demand = 0;  ///< slabs the training path had to wait for
};

class host_pool {
 public:
  /// `limit_source` names what set the limit ("ZEROALLOC_HOST_LIMIT=0.5 of NUMA node 0 ...")
  /// for messages.
  host_pool(device& backing, std::uint64_t limit_bytes, std::string limit_source);
  /// Stops the background creation and releases every slab. Chunks still acquired must
  /// have been released.
  ~host_pool();
  host_pool(const host_pool&) = delete;
  host_pool& operator=(const host_pool&) = delete;

  /// Creates slabs on a background thread until `bytes` (at most the limit) are held,
  /// logging progress. `chunk_bytes` is the size chunks usually have (the slab size where
  /// slabs cannot be sliced). Returns at once.
  void start_prefill(std::size_t chunk_bytes, std::uint64_t bytes);
  /// Waits for the background creation to finish (tests).
  void wait_for_prefill();
  /// Stops the background creation and waits for its thread (at exit: it must not outlive
  /// the logger). Slabs made so far stay usable.
  void stop_prefill();

  /// A chunk of exactly `bytes` (a multiple of the granularity): a free slice of a slab,
  /// else a slice of a slab the prefill is about to finish, else of a new slab (counted in
  /// created_on_demand), after releasing wholly free slabs if the limit requires. Throws
  /// host_memory_exhausted when the limit is reached.
  host_chunk acquire(std::size_t bytes);
  /// Gives a chunk back for reuse. Nothing may still be queued that touches it.
  void release(const host_chunk& chunk);

  /// Where slabs are whole chunks: `change` chunks of `bytes` (negative: gone) exist in
  /// classes the engine pages; the background thread keeps a slab for each (Note
  /// [Anticipated sizes]). Cheap; no-op where slabs are sliced.
  void expect_chunks(std::size_t bytes, int change);

  /// How many chunks of each size acquire() can hand out without creating pinned memory,
  /// or nullopt when any size fits in free space (slabs are sliced).
  [[nodiscard]] std::optional<std::unordered_map<std::size_t, std::size_t>> ready_chunks() const;

  [[nodiscard]] host_pool_figures figures() const;
  /// True while every slab made so far is open to the host's CPUs at its staging address
  /// (device::open_to_host): the host step reads and writes chunks there (Note [Stepped on
  /// the host] in tier/host_step.hpp).
  [[nodiscard]] bool open_to_host() const { return open_to_host_.load(std::memory_order_acquire); }
  [[nodiscard]] std::uint64_t limit_bytes() const { return limit_bytes_; }
  /// Tests: what the host has available (`available`, host_available_bytes otherwise) and
  /// must keep when pinned memory is created on demand (`reserve` bytes; the background
  /// creation keeps four times that: Note [Host budget]).
  void set_host_memory_probe(std::function<std::uint64_t()> available, std::uint64_t reserve);

 private:
  // Empty when `bytes` more pinned memory leaves the host its reserve (four times it for
  // the background creation); else why not.
  [[nodiscard]] std::string host_room_problem(std::size_t bytes, bool background) const;
  std::atomic<bool> open_to_host_{true};
  struct slab {
    physical_handle handle;              // the whole allocation
    std::uintptr_t staging_address = 0;  // where all of it is mapped
    free_ranges free;                    // free offsets within the slab
    std::size_t free_bytes = 0;
    bool retired = false;  // its destruction failed: held, never used (no free bytes)
  };

  host_chunk take_slice_locked(std::size_t bytes);       // from an existing slab, or invalid
  std::unique_ptr<slab> create_slab(std::size_t bytes);  // no lock held
  void destroy_slab(const slab& gone);                   // no lock held
  /// Destroys each detached slab, with no lock held; true for those destroyed. A failure
  /// is logged, not thrown (Note [A slab that cannot be destroyed]).
  std::vector<bool> destroy_detached(const std::vector<std::unique_ptr<slab>>& victims);
  /// With the lock: the destroyed slabs' bytes leave the budget and their staging
  /// addresses come back; the others return to the pool, retired.
  void settle_destroyed_locked(std::vector<std::unique_ptr<slab>>& victims,
                               const std::vector<bool>& destroyed);
  std::uintptr_t take_staging(std::size_t bytes);
  bool release_free_slabs_locked(std::size_t bytes, std::unique_lock<std::mutex>& lock);
  [[noreturn]] void throw_exhausted(std::size_t bytes) const;
  void prefill(std::size_t slab_bytes, std::uint64_t bytes);
  std::size_t wanted_size_locked() const;  // a size with fewer slabs than chunks, or 0
  // Detaches wholly free slabs of sizes with more slabs than chunks until `bytes` fit
  // under the limit; empty (and nothing detached) when they cannot.
  std::vector<std::unique_ptr<slab>> take_surplus_locked(std::size_t bytes);
  // Detaches wholly free slabs that `may_go` accepts until `bytes` fit under the limit;
  // empty (and nothing detached) when they cannot. The caller accounts for them.
  std::vector<std::unique_ptr<slab>> detach_free_slabs_locked(
      std::size_t bytes, const std::function<bool(const slab&)>& may_go);
  std::size_t new_slab_bytes(std::size_t at_least) const;

  device& device_;
  const std::uint64_t limit_bytes_;
  const std::string limit_source_;
  const bool slices_;  // device::maps_slices()
  std::size_t slab_bytes_ = 0;
  std::uintptr_t staging_region_ = 0;
  std::size_t staging_region_bytes_ = 0;

  mutable std::mutex mutex_;
  std::condition_variable created_;
  std::condition_variable work_;  // the background thread: sizes wanted, slabs freed, stop
  std::unordered_map<std::size_t, std::int64_t> wanted_;    // chunk size -> chunks paged
  std::unordered_map<std::size_t, std::uint64_t> stalled_;  // size -> change_ when it could not
  std::uint64_t change_ = 0;  // counts expect_chunks and release calls
  free_ranges free_staging_;  // unused staging addresses
  std::vector<std::unique_ptr<slab>> slabs_;
  host_pool_figures figures_;
  std::uint64_t reserved_bytes_ = 0;               // created, or being created
  std::function<std::uint64_t()> host_available_;  // under mutex_ (set_host_memory_probe)
  std::uint64_t host_reserve_ = 0;
  bool stopping_ = false;
  bool prefilling_ = false;
  std::thread prefill_thread_;
};

}  // namespace zeroalloc
