// The migrator: moves chunks of live allocations between device and host memory without
// changing their addresses (lib/README.md, "The four paths").
//
// Note [Fault-free migration]: a chunk moves device -> host by copying its bytes into a
// pinned host chunk on the out-stream, then remapping its addresses to the host chunk; host
// -> device by mapping a device chunk at a staging address, copying in on the in-stream,
// then remapping. At every moment the chunk's addresses are mapped, so a kernel that
// touches it runs correctly (over PCIe while it is on the host). Ordering:
//   - a copy starts after the work queued so far on every stream the chunk's blocks were
//     used on (events recorded at the request; the copy stream waits on them, the host
//     does not);
//   - the remap happens on the migrator's own thread once the copy's event has completed,
//     so no chunk is remapped while queued work may still touch it through the old backing;
//   - the caller promises that no work is queued on the chunk between the request and the
//     end of the migration (a use-begins hint calls wait_until_settled first), because
//     such writes would land in the backing being left.
// The two copy streams run at once: a fetch overlaps an eviction.
//
// Note [Moves any kernel may see]: the promise above holds only for a program whose every
// use of managed memory is hinted. Any other program may queue a kernel on a chunk at any
// time, on any stream: an EMA of the weights after the optimizer's step, a norm logged, a
// copy on a side stream the allocator never saw. A remap is never atomic (cuMemMap maps
// only an unmapped range), so such a kernel running across it faults, and one queued
// behind the copy's fence writes into the backing being left. With `any_access` (the
// library's default, ZEROALLOC_ACCESS=any) every move is therefore made while nothing can
// touch the chunk:
//   - the device is drained first (device::synchronize_device: every stream of the
//     context, NCCL's and CUDA graphs' included), so no queued kernel runs across the move
//     and the copy reads the last bytes written;
//   - the move then runs to its end before the call returns, on the thread that asked: the
//     thread that allocates or hints is the one that launches the program's kernels
//     (PyTorch's autograd runs the backward on its own thread while the caller waits), so
//     nothing is launched until the chunk maps its new backing;
//   - no chunk is parked, and a fetch is never remapped before its bytes arrive.
// The cost: the device idles for each move's copy and remap instead of overlapping them
// with compute, and the host loses its run-ahead (bench/RESULTS.md measures it). What
// remains outside the rule: a second host thread that launches kernels on managed memory
// while another thread's call moves it (docs/known-limits.md).
// ZEROALLOC_ACCESS=hinted keeps the overlapped moves for programs that touch managed
// memory only through hinted uses.
//
// Note [What a remap costs]: bench/tier/remap_bench on an H200 (CUDA 13, bench/RESULTS.md).
// Mapping host memory costs the driver per 4 KiB page (it maps host memory with small
// pages): on an idle GPU, moving a 64 MiB chunk to its host handle costs 570-780 us
// (cuMemSetAccess 550-750), and back to a device handle 180-220 us (cuMemUnmap of the host
// pages 150-180); a device-to-device remap costs 40-60 us. Neither the host memory's kind
// (HOST or HOST_NUMA), a second mapping of it, nor the size of the address reservation
// changes that. While copies run, each remap takes
// about three times as long (1.1-1.2 ms per 64 MiB, whatever the copies' size) and the
// copies lose 7-10% of their rate; the driver serialises remaps across threads. So a move
// both ways (two remaps of 64 MiB, about 2.3 ms under copies) takes longer than its copies
// (1.3 ms at 100 GB/s), and the migrator's rate is bound by remaps, not by PCIe: about 0.90
// of cudaMemcpyAsync one way to the host, 0.60 both ways at once. Copying with the GPU's
// cores instead of its copy engines (a kernel of 16-byte loads and stores) is no way out:
// such a kernel moves 52.5 GB/s to the host but only 63-68 GB/s both ways, and while a
// kernel reads or writes host memory each remap waits 5.5-16 ms (more, the larger its grid),
// against 0.4-0.9 ms while a kernel copies device memory at up to 1.7 TB/s. So remaps stall
// behind traffic over the link in general, not behind the copy engines; a kernel reaching a
// host-resident chunk (a missed prefetch) slows every remap made meanwhile. The engine's
// bulk traffic therefore avoids remaps: the windowed optimizer step copies host-resident
// states through device scratch and back (tier by copy, not by mapping), and a steady
// training step remaps nothing (bench/RESULTS.md, the Llama runs).
//
// Note [Parked chunks]: mapping host memory costs the driver per 4 KiB page (above): about
// 0.7 ms per 64 MiB chunk on an idle GPU and 1.1-1.6 ms while copies run, serialised across
// threads, against 40 us for device memory and 4 us for a mapping granted no access. Under
// pressure a training step moves the same parameters out and back several times a step (out
// during the forward, back for the backward, out again after it), and those host remaps
// bound it (bench/RESULTS.md: 0.3-0.6 s of remapping a step at 18 GiB on the 1.3B bench). So
// an eviction may park its chunk: the bytes go to a host chunk as always (copied through the
// host chunk's own staging address), but the chunk's addresses then map the placeholder of
// Note [Chunks on disk] (no access: a kernel that touches them faults) instead of the host
// chunk. A fetch maps a device chunk there and copies from the staging address, as for any
// host chunk. The engine parks only chunks whose every use it sees coming (Note [Parameters
// parked] in offload_engine.hpp); a use that must run on the host after all maps the host
// chunk first (map_on_host: one host remap, paid only then).
#pragma once

#include <array>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "alloc/caching_allocator.hpp"
#include "tier/disk_store.hpp"
#include "tier/host_pool.hpp"

namespace zeroalloc {

/// Where a chunk's bytes are.
enum class residency {
  device,
  host,
  moving_to_host,
  moving_to_device,
  disk,              ///< in the disk tier (Note [Chunks on disk])
  moving_to_disk,    ///< from the host to the disk
  moving_from_disk,  ///< from the disk to the host
  unknown
};

/// Counters of the migrator, for statistics and reports.
struct migration_figures {
  std::uint64_t chunks_to_host = 0;
  std::uint64_t chunks_to_device = 0;
  std::uint64_t bytes_to_host = 0;
  std::uint64_t bytes_to_device = 0;
  std::uint64_t host_resident_bytes = 0;  ///< bytes of live chunks on the host now
  /// ... by allocation class (class_index), for reports
  std::array<std::uint64_t, kAllocationClassCount> host_resident_class_bytes{};
  /// bytes_to_host and bytes_to_device by allocation class (class_index)
  std::array<std::uint64_t, kAllocationClassCount> to_host_class_bytes{};
  std::array<std::uint64_t, kAllocationClassCount> to_device_class_bytes{};
  std::uint64_t waits = 0;            ///< wait_until_settled calls that had to wait
  std::uint64_t waited_ns = 0;        ///< time they waited
  std::uint64_t verified_chunks = 0;  ///< ZEROALLOC_VERIFY checks passed
  std::uint64_t remap_ns = 0;         ///< time spent remapping chunks (all threads)
  std::uint64_t chunks_to_disk = 0;   ///< the disk tier (Note [Chunks on disk])
  std::uint64_t chunks_from_disk = 0;
  std::uint64_t bytes_to_disk = 0;
  std::uint64_t bytes_from_disk = 0;
  std::uint64_t disk_resident_bytes = 0;  ///< bytes of live chunks on disk now
  std::uint64_t disk_ns = 0;              ///< time spent moving chunks to and from the disk
  std::uint64_t chunks_parked = 0;        ///< evictions that left the addresses unmapped
                                          ///< (Note [Parked chunks])
  std::uint64_t chunks_unparked = 0;      ///< parked chunks mapped on the host for a use
  std::uint64_t parked_bytes = 0;         ///< bytes of parked chunks now (in host_resident_bytes)
};

/// A paging_listener for the one thing the migrator needs told: a host chunk whose segment
/// the allocator unmapped comes back to the host pool. Attached to the allocator
/// (paging_view::attach) where the migrator works alone; the offload engine, which owns one,
/// passes that on to it.
class migrator : public paging_listener {
 public:
  /// `verify`: checksum every chunk before its copy and after its remap (ZEROALLOC_VERIFY).
  /// `disk`: the disk tier behind the host tier, or nullptr (Note [Chunks on disk]).
  /// `any_access`: any kernel may touch any chunk at any time, so every move drains the
  /// device first and ends before its call returns (Note [Moves any kernel may see]).
  migrator(caching_allocator& allocator, host_pool& pool, bool verify, disk_store* disk = nullptr,
           bool any_access = false);
  /// Finishes every migration in flight and brings host-resident chunks back to the device
  /// where device memory allows (the host pool may be destroyed next). Detach it from the
  /// allocator first.
  ~migrator() override;
  migrator(const migrator&) = delete;
  migrator& operator=(const migrator&) = delete;

  /// Starts moving the chunk mapped at `address` to host memory. Its copy waits for
  /// `after` (events recorded after the chunk's last use) when given, else for everything
  /// queued so far on the streams the chunk's blocks were used on; for both with
  /// `and_chunk_streams`. False when it is not a device-resident chunk of a live segment, or
  /// is moving already. Throws host_memory_exhausted when the host tier is full.
  bool evict_async(std::uintptr_t address, const std::vector<event_handle>* after = nullptr,
                   bool and_chunk_streams = false);
  /// evict_async in two steps, so that a caller can claim under its own lock and do the
  /// rest (which may create pinned host memory, milliseconds) outside it. claim_eviction
  /// pins the chunk and marks it moving to the host (uses that begin now wait for the move);
  /// false as evict_async. Every successful claim must be followed by exactly one
  /// start_claimed_eviction (which gives the claim up if it throws) or cancel_eviction.
  /// With `park`, the chunk's addresses map a placeholder no kernel may touch once its
  /// bytes are on the host, instead of its host chunk (Note [Parked chunks]).
  bool claim_eviction(std::uintptr_t address, chunk_info& claimed);
  void start_claimed_eviction(const chunk_info& claimed, const std::vector<event_handle>* after,
                              bool and_chunk_streams = false, bool park = false);
  void cancel_eviction(std::uintptr_t address);
  /// Starts bringing the chunk back to the device. Its copy waits for the work queued on
  /// the chunk's streams unless `chunk_idle` says that none of it touches the chunk (the
  /// engine knows from hints); an idle chunk is remapped to its device chunk at once and
  /// its bytes arrive behind an event (order_after_arrival). False when it is not on the
  /// host, or no device memory is free within the limit (evict something first).
  /// `chunk_idle` holds only while the chunk's generation is still `idle_generation`.
  /// A fetch that is not idle also waits for `after` when given (events recorded at the
  /// ends of hinted uses, which may have run on streams the allocator does not know).
  bool fetch_async(std::uintptr_t address, bool chunk_idle = false,
                   std::uint64_t idle_generation = 0,
                   const std::vector<event_handle>* after = nullptr);
  /// fetch_async in two steps, as claim_eviction: claim_fetch marks a host-resident chunk
  /// moving to the device (uses that begin now wait for the move), so that a caller can
  /// decide under its own lock whether the chunk is idle and claim it in the same breath;
  /// false when the chunk is not on the host or is moving. Every successful claim must be
  /// followed by exactly one start_claimed_fetch, which gives the claim up when it returns
  /// false or throws.
  /// With `parked_only`, only a parked chunk is claimed (Note [Parked chunks]).
  bool claim_fetch(std::uintptr_t address, bool parked_only = false);
  bool start_claimed_fetch(std::uintptr_t address, bool chunk_idle, std::uint64_t idle_generation,
                           const std::vector<event_handle>* after = nullptr);
  /// Note [Parked chunks]: maps the addresses of the parked chunk at `address` to its host
  /// chunk, so that kernels reach its bytes over PCIe from then on (a host remap: about
  /// 1 ms per 64 MiB). False, with nothing done, when it is not a settled parked chunk.
  bool map_on_host(std::uintptr_t address);
  /// Whether the chunk at `address` is on the host behind a placeholder (parked, settled).
  [[nodiscard]] bool parked(std::uintptr_t address) const;
  /// For a chunk fetched as idle (mapped on the device at once, its bytes still arriving):
  /// makes `stream` wait for the bytes, and returns true. False, with nothing done, for any
  /// other chunk. No host thread waits.
  bool order_after_arrival(std::uintptr_t address, stream_handle stream);
  // The disk tier (Note [Chunks on disk]); each call moves one chunk and returns once it
  // has moved.
  /// Whether the migrator has a disk tier.
  [[nodiscard]] bool has_disk() const { return disk_ != nullptr; }
  /// Marks the host-resident chunk at `address` moving to the disk (uses that begin now wait
  /// for the move); false when there is no disk tier, or it is not on the host, or moving.
  /// Every successful claim must be followed by exactly one start_claimed_spill.
  bool claim_spill(std::uintptr_t address);
  /// Writes the claimed chunk's bytes to the disk, maps its addresses to a placeholder no
  /// kernel may touch and gives its host chunk back to the pool. Throws disk_io_error or
  /// disk_space_exhausted with the chunk still wholly on the host (the claim given up).
  /// Its copy waits for `after` (the ends of the chunk's hinted uses) when given, and for
  /// everything queued on the chunk's streams.
  /// It leaves the disk room kept for restores free (Note [Room kept for restores]).
  void start_claimed_spill(std::uintptr_t address,
                           const std::vector<event_handle>* after = nullptr) {
    spill(address, after, nullptr);
  }
  /// Gives up a claim_spill that will not start.
  void cancel_spill(std::uintptr_t address) { release_claim(address); }
  /// Reads the disk-resident chunk at `address` into a host chunk and maps its addresses
  /// there: afterwards it is host-resident, as after an eviction. False when it is not on
  /// the disk or is moving. Throws host_memory_exhausted (the host tier has no room: make
  /// some, then try again) or disk_io_error, with the chunk still on the disk.
  bool restore(std::uintptr_t address) { return restore_into(address, nullptr); }
  /// Note [Room kept for restores]: with the host tier full, the chunk at `from_disk` comes
  /// back into the host chunk of `claimed` (claimed with claim_spill, the same size), which
  /// goes to the disk first, into the room the disk keeps for this; the room is free again
  /// once `from_disk`'s slot is. True when `from_disk` came back. Throws as a spill or a
  /// restore does; the claim is used up either way.
  bool swap(std::uintptr_t from_disk, std::uintptr_t claimed,
            const std::vector<event_handle>* after = nullptr);
  /// The host-resident chunks, with their bytes and class, for the engine's choice of what
  /// goes to the disk.
  struct host_resident_chunk {
    std::uintptr_t address = 0;
    std::size_t bytes = 0;
    int allocation_class = 0;
  };
  [[nodiscard]] std::vector<host_resident_chunk> host_resident_chunks() const;

  /// Waits until no migration of the chunk at `address` is in flight; returns the
  /// nanoseconds waited (0 when none was).
  std::uint64_t wait_until_settled(std::uintptr_t address);
  /// Waits until every migration in flight has finished.
  void drain();

  /// paging_listener: the host chunk goes back to the pool, and the chunk it held counts as
  /// gone from the host; for a disk-resident chunk (its placeholder), its disk slot is freed.
  void host_chunk_released(physical_handle chunk, std::uintptr_t address) override;

  [[nodiscard]] residency where(std::uintptr_t address) const;
  /// where(), and whether a host-resident chunk is parked, read together.
  [[nodiscard]] residency where(std::uintptr_t address, bool& parked) const;
  /// Bytes of evictions in flight: device memory about to be freed.
  /// Where the host's CPUs reach the bytes of the chunk at `address` (Note [Stepped on the
  /// host] in host_step.hpp): its host copy's address, when the chunk is on the host (mapped
  /// or parked) and not moving and the host pool is open to the CPUs; else 0.
  [[nodiscard]] std::uintptr_t host_address(std::uintptr_t address) const;
  [[nodiscard]] std::uint64_t bytes_leaving_device() const;
  [[nodiscard]] migration_figures figures() const;
  /// Bytes of live chunks on disk now (figures().disk_resident_bytes, without the copy).
  [[nodiscard]] std::uint64_t disk_resident_bytes() const;

 private:
  struct transfer {
    chunk_info chunk;
    bool to_host = true;
    host_chunk host;               // destination (to host) or source (to device)
    physical_handle device_chunk;  // source (to host: the old backing) or destination
    std::uintptr_t staging = 0;    // to device: where device_chunk is mapped for the copy
    event_handle copied = nullptr;
    std::uint64_t checksum = 0;  // ZEROALLOC_VERIFY: of the bytes before the copy
    // ZEROALLOC_VERIFY, a fetch remapped early: the bytes as they arrived, read in stream
    // order before the copy's event (its users may write the chunk from then on).
    std::vector<std::uint64_t> arrived;
    bool remapped_early = false;  // to device, idle: mapped before the copy
    bool park = false;            // to host: map the placeholder (Note [Parked chunks])
    physical_handle placeholder;  // ... the one of its size
    bool committed = false;       // the chunk maps its new backing (Note [Committing a move])
  };

  void fence_behind_chunk_streams(const chunk_info& chunk, stream_handle copy_stream);
  // Events are reused (a recording that a stream waits on is captured at the wait), so a
  // long run creates only as many as are in flight at once.
  event_handle obtain_event();
  /// Note [Moves any kernel may see]: waits until the device has finished its queued work;
  /// if that fails, gives the claim on `address` up through `give_up` and rethrows.
  void drain_before_move(std::uintptr_t address, void (migrator::*give_up)(std::uintptr_t));
  /// Forgets a claim (moving_) made by a move that did not start, and wakes its waiters.
  void release_claim(std::uintptr_t address);
  void return_event(event_handle event);
  std::uint64_t checksum_of(std::uintptr_t address, std::size_t bytes, stream_handle stream);
  void finish(transfer& done);
  void worker();
  std::uintptr_t take_staging_slot();
  /// Keeps a staging address whose unmap failed out of use (it still maps a chunk).
  void retire_staging_slot(std::uintptr_t address, std::size_t bytes);
  void return_staging_slot(std::uintptr_t address);
  /// Waits for what one of its copy streams runs (a failed move's copies), whatever it
  /// fails with.
  void settle(stream_handle stream);
  /// For a fetch whose chunk is mapped on the device for good (finished, or failed after
  /// its remap): its host chunk goes back, and the chunk counts as on the device.
  void forget_host_copy(transfer& fetched);
  /// After a fetch through `slot` failed: unmaps the device chunk there (when `mapped`) and
  /// gives both back; an unmap that fails retires both instead.
  void give_back_staging(std::uintptr_t slot, physical_handle device_chunk, bool mapped);

  /// start_claimed_spill; with `freed`, the spill may take the room kept for restores and
  /// hands its host chunk over there instead of giving it back to the pool (swap()).
  void spill(std::uintptr_t address, const std::vector<event_handle>* after, host_chunk* freed);
  /// restore(); with `into`, the chunk comes back into that host chunk instead of one from
  /// the pool, and the call owns it: used, or given back to the pool.
  bool restore_into(std::uintptr_t address, const host_chunk* into);
  /// Whether `mapped` (what a chunk's addresses map) is where a host-resident chunk's
  /// addresses should point: its host chunk, or with `parked` a placeholder.
  static bool maps_host_copy(const physical_handle& mapped, const host_chunk& host, bool parked);
  /// The placeholder mapped behind disk-resident chunks of `bytes` (Note [Chunks on disk]).
  physical_handle placeholder_for(std::size_t bytes);
  /// Brings every disk-resident chunk back to the host (the destructor's first step).
  void restore_all();

  paging_view paging_;
  device& device_;
  host_pool& pool_;
  const bool verify_;
  disk_store* const disk_;
  const bool any_access_;  // Note [Moves any kernel may see]
  // Note [Two disk lanes]: the disk store reads and writes CPU-addressable memory, and a
  // host chunk is reached through the device, so the bytes pass through a bounce buffer.
  // Writes (spills) and reads (restores) each have a lane of their own: a buffer, a stream
  // for the copies between it and the host chunk, and a lock that lets one move at a time
  // through the lane. So the step's read of the next window's states runs while the chunk
  // spilled for its room is written; with one lane (one move at a time), a 16B model's
  // step waited for its reads and writes in turn (bench/RESULTS.md).
  struct disk_lane {
    std::mutex mutex;
    stream_handle stream = nullptr;
    std::unique_ptr<std::byte, void (*)(void*)> bounce{nullptr, std::free};
    std::size_t bounce_bytes = 0;
    /// The bounce buffer, at least `bytes` long (a failure keeps the old one). Caller
    /// holds mutex.
    std::byte* buffer(std::size_t bytes);
  };
  disk_lane write_lane_;
  disk_lane read_lane_;
  struct chunk_on_disk {
    std::uint64_t slot = 0;  // disk_slot
    std::size_t bytes = 0;
    int allocation_class = 0;
  };
  std::unordered_map<std::uintptr_t, chunk_on_disk> on_disk_;  // under mutex_
  std::size_t largest_spill_bytes_ = 0;  // Note [Room kept for restores]; under mutex_
  std::unordered_map<std::size_t, physical_handle> placeholders_;  // by bytes, under mutex_
  stream_handle out_stream_ = nullptr;
  stream_handle in_stream_ = nullptr;
  std::vector<event_handle> spare_events_;

  std::uintptr_t staging_region_ = 0;
  std::size_t staging_slot_bytes_ = 0;
  std::vector<std::uintptr_t> free_slots_;
  // Staging addresses whose unmap failed, and the bytes they map.
  std::vector<std::pair<std::uintptr_t, std::size_t>> retired_slots_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<transfer> in_flight_;  // in request order; the worker finishes them in order
  std::unordered_map<std::uintptr_t, residency> moving_;       // chunk address -> direction
  std::unordered_map<std::uintptr_t, event_handle> arriving_;  // remapped early: copy event
  struct chunk_on_host {
    host_chunk host;
    int allocation_class = 0;  // the chunk's, for the figures by class
    bool parked = false;       // its addresses map a placeholder (Note [Parked chunks])
  };
  std::unordered_map<std::uintptr_t, chunk_on_host> on_host_;  // chunk address -> its host copy
  // host slice (slab handle, offset) -> chunk address
  std::map<std::pair<std::uint64_t, std::size_t>, std::uintptr_t> host_owner_;
  migration_figures figures_;
  std::uint64_t bytes_leaving_device_ = 0;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace zeroalloc
