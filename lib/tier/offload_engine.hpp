// The offload engine: decides which chunks live on the device and which on the host, and
// moves them through the migrator ahead of need.
//
// Note [Residency policy]: everything stays on the device while it fits. Under pressure (an
// allocation that would fail, or a fetch that needs room) the engine evicts the idle chunk
// whose next use is farthest away in the access order it learned in the previous step
// (Belady's rule on a recorded order, as DeepSpeed and Colossal-AI's Gemini do), and the
// least recently used one before an order is known. Only parameters, gradients and
// optimizer states are evicted: activations are written and read within a step. A chunk is
// idle when no use-begins hint is open on it.
//
// Note [Prefetch]: each use-begins hint moves the cursor along the learned order; the
// engine then asks its prefetch thread to bring back the host-resident chunks of the next
// ZEROALLOC_PREFETCH_BYTES of that order, evicting farther chunks to make room. The hinting
// (training) thread never waits for that: it waits only when the chunk it is about to use
// is still on the host or moving (a miss), and that time is reported as compute waiting on
// fetches. Without hints the engine still works, from the pressure path alone.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tier/migrator.hpp"

namespace zeroalloc {

struct offload_settings {
  std::uint64_t prefetch_bytes = 512ull << 20;  ///< ZEROALLOC_PREFETCH_BYTES
};

/// The engine's counters, for statistics and reports.
struct offload_figures {
  std::uint64_t uses = 0;           ///< use-begins hints (per chunk)
  std::uint64_t hits = 0;           ///< ... that found the chunk on the device
  std::uint64_t prefetches = 0;     ///< fetches started ahead of need
  std::uint64_t evictions = 0;      ///< evictions the policy chose
  std::uint64_t pressure_evictions = 0;  ///< ... on the allocation-failure path
  std::uint64_t waited_ns = 0;      ///< time use-begins hints waited for a chunk
  std::uint64_t steps = 0;          ///< step boundaries seen
  std::uint64_t learned_order_chunks = 0;  ///< length of the order in use
};

class offload_engine {
 public:
  offload_engine(caching_allocator& allocator, host_pool& pool, bool verify,
                 offload_settings settings);
  ~offload_engine();
  offload_engine(const offload_engine&) = delete;
  offload_engine& operator=(const offload_engine&) = delete;

  // Hints (the Python layer sends them from module and optimizer hooks).
  /// The allocation at `pointer` is about to be used on `stream`: on return its chunks are
  /// on the device, and the chunks the learned order says come next are being fetched.
  void use_begins(const void* pointer, stream_handle stream);
  /// The work enqueued on `stream` so far is the allocation's last use for now: its chunks
  /// may be evicted once that work has run (an event marks the point; no host waits).
  void use_ends(const void* pointer, stream_handle stream);
  /// A training step ended: the order recorded during it becomes the learned order.
  void step_boundary();

  /// The allocator's pressure handler: evicts idle chunks, waiting for them, until
  /// `bytes_needed` of device memory is free or nothing more can go. Returns bytes evicted.
  std::uint64_t relieve_pressure(std::size_t bytes_needed);

  /// Moves every chunk of the allocation at `pointer` (waiting when `wait`). False when
  /// `pointer` is not a live allocation.
  bool evict(const void* pointer, bool wait);
  bool fetch(const void* pointer, bool wait);

  [[nodiscard]] offload_figures figures() const;
  [[nodiscard]] migrator& mover() { return migrator_; }

 private:
  struct chunk_state {
    int open_uses = 0;             // use-begins minus use-ends
    std::uint64_t last_use = 0;    // tick of the last use-begins
    std::size_t bytes = 0;
    int allocation_class = 0;
    event_handle released = nullptr;  // recorded at the last use-ends, on its stream
    bool hinted = false;              // every use so far came with hints
    bool used_on_host = false;        // work ran on it while it was on the host
  };

  std::vector<chunk_info> chunks_of(const void* pointer) const;
  /// Steps from the cursor to the chunk's next use in the learned order (larger: later);
  /// chunks not in the order come last. Caller holds mutex_.
  std::uint64_t next_use_distance(std::uintptr_t address) const;
  /// Picks idle device-resident chunks to evict, farthest next use first, until `bytes`;
  /// never one whose next use comes sooner than `sooner_than`.
  std::vector<std::uintptr_t> choose_victims(std::size_t bytes, std::uint64_t sooner_than);
  /// Starts evicting `victim` behind its last use-ends fence when it has one. Caller holds
  /// mutex_.
  bool start_eviction(std::uintptr_t victim);
  /// Fetches `address`, evicting farther chunks for room when needed; waits when `wait`.
  bool bring_back(std::uintptr_t address, std::size_t bytes, bool wait);
  void prefetch_worker();

  caching_allocator& allocator_;
  device& device_;
  migrator migrator_;
  const offload_settings settings_;

  mutable std::mutex mutex_;
  std::condition_variable wishes_changed_;
  std::unordered_map<std::uintptr_t, chunk_state> chunks_;
  std::vector<std::uintptr_t> recording_;  // first use of each chunk, this step
  std::unordered_map<std::uintptr_t, bool> recorded_;
  std::vector<std::uintptr_t> learned_order_;
  std::unordered_map<std::uintptr_t, std::vector<std::size_t>> positions_;  // in learned_order_
  std::size_t cursor_ = 0;
  std::uint64_t tick_ = 0;
  std::deque<std::uintptr_t> wishes_;  // chunks to prefetch, nearest first
  offload_figures figures_;
  bool stopping_ = false;
  std::thread prefetcher_;
};

}  // namespace zeroalloc
