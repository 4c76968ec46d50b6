// The offload engine: decides which chunks live on the device and which on the host, and
// moves them through the migrator ahead of need.
//
// Note [Residency policy]: everything stays on the device while it fits. Under pressure (an
// allocation that would fail, or a fetch that needs room) the engine evicts the idle chunk
// whose next use is farthest away in the access order it learned in the previous step
// (Belady's rule on a recorded order, as DeepSpeed and Colossal-AI's Gemini do), and the
// least recently used one before an order is known; where no hint says when a chunk was
// used (a program without hints, or chunks never hinted), the one whose segment saw the
// least recent allocation or free (chunk_info::last_activity). Parameters and optimizer states are
// evicted; activations (class other) only as the last resort (Note [Idle memory of any
// class]): they are written and read within a step. Gradients mostly are too, and are freed after
// each step (zero_grad): evicted, they would come back as host-resident free space that the next
// backward writes over PCIe. So they go only when an allocation would otherwise fail and nothing
// else is left. Chunks that hold only free space go on that path too, after those holding something
// and before gradients: a segment's free tail no request fits would otherwise hold the device once
// the segment's blocks are on the host. A chunk is idle when no use hint is open on it.
//
// Note [Used in place]: data that a step reads and writes once, in one streaming pass
// (optimizer states, and in the optimizer's step the parameters too: Note [Parameters
// stepped where they are] in the Python package), is cheapest where it already is: a
// host-resident chunk is reached over
// PCIe, or copied to device scratch and back by the caller, with no remap (a 64 MiB
// host-located map costs about 0.5 ms, 15 times a device one). Such uses are hinted with
// use_in_place: they pin the chunks where they are for the use, and the prefetcher never
// brings them back to the device; pressure moves them to the host, where they stay.
// bench/python/optimizer_step_bench.py measures the choice (RESULTS.md). They are positions
// of the learned order all the same (Note [In-place uses in the order]).
//
// Note [In-place uses in the order]: the engine learns two orders (use_order). The
// device's holds the uses that need their chunk on the device (use_begins): its fetches
// ahead and its evictions follow it. The other holds every use, the windowed step's uses
// in place of host-resident states among them (marked), and serves the disk tier. Which
// host chunk goes to disk for room (farthest next use first) means nothing without the
// uses in place: every state's next use read "never", the chunk sent to disk was an
// arbitrary one, often one the same step needed next, and a 16B model read 3.5 times its
// disk-resident bytes a step (bench/RESULTS.md). And the prefetcher reads from disk the
// states the next uses in place need while the present window is stepped, making host room
// only from chunks needed later than they are (a read ahead that evicts a nearer chunk only
// moves the wait). A use in place is never fetched to the device, and the device's order
// stays what it was before the disk tier: with the uses in place in one shared order, the
// 1.3B bench at 18 GiB lost 1-5% and its prefetch hit rate fell from 0.87 to 0.73.
//
// Note [Every use in the order]: the learned order holds every use of a chunk in the step,
// not only its first: a layer's parameters are used in the forward and again in the
// backward, and with their first use alone the cursor stopped at the forward's last layer,
// so nothing was fetched ahead for the backward (every parameter evicted during the
// forward came back as a miss: a prefetch hit rate of 0.2-0.3 at 13.3 GiB on the 1.3B
// bench). A use-begins hint adds a position for each chunk on which no use is open (a
// chunk that two allocations of one hint share counts once); the cursor moves to the
// chunk's first position at or after it, so the order is walked forward even when a chunk
// appears in it several times.
//
// Note [Prefetch]: each use-begins hint moves the cursor along the learned order; the
// engine then asks its prefetch thread to bring back the host-resident chunks of the next
// ZEROALLOC_PREFETCH_BYTES of that order, evicting farther chunks to make room. The hinting
// (training) thread never waits for that: it waits only when the chunk it is about to use
// is still on the host or moving (a miss), and that time is reported as compute waiting on
// fetches. Without hints the engine still works, from the pressure path alone.
// At the end of each use the engine also keeps that much device memory free (plan_headroom:
// released chunks whose next use lies beyond the window go to the host ahead of need), so a
// fetch ahead finds room without waiting for an eviction, and the step's own allocations
// (activations) find it without an eviction on the allocation path. That room is taken from
// the learned order's: with the window free, a policy can do no better than Belady's MIN
// with the limit less the window, and the engine does as well as that
// (OffloadEngineTest.AStepUnderALimitStreamsItsParametersWithTheFewestFetches: 36 fetches
// of 2 MiB chunks a step where MIN with the whole 64 MiB would make 24). On the 1.3B bench
// the window is 512 MiB of an 18 GiB limit. Keeping free only what the window's fetches
// still need reached 24-26 in that test, but leaves activations no room kept for them:
// not measured on a GPU, not done.
//
// Note [Parameters parked]: an evicted parameter may leave its addresses unmapped (Note
// [Parked chunks] in migrator.hpp: a host remap costs 15-30 times a device one, and under
// pressure the step moves the same parameters several times). Safe only where no kernel
// reads the chunk without the engine bringing it back first, so the engine parks a chunk
// only when (ZEROALLOC_PARK_PARAMETERS, on by default under ZEROALLOC_ACCESS=hinted) it
// holds parameters, every use of it so far was hinted, none is open, and no block of its
// segment was allocated or freed since
// its last use ended (the rule of parameters on disk, Note [Chunks on disk] in
// migrator.cpp): its next use is a hint, which fetches it. Where that use cannot have it on
// the device (no room, another use open), and where an allocation lands in its free space,
// the host chunk is mapped first (reachable_where_it_is). A use in place (the windowed
// step's, a state_dict copy) of a parked chunk fetches it when the device has room within
// the limit, evicting nothing for it (a fetch costs a device map and the copy, less than
// a host map), and maps the host chunk otherwise: the use then runs where the chunk is. A read
// the hints do not cover (a kernel outside the model's forward and backward:
// docs/known-limits.md names them) faults with CUDA's illegal-address error instead of
// reading wrong bytes; so parking is for ZEROALLOC_ACCESS=hinted only (under any, the
// library's default, no chunk is parked), and ZEROALLOC_PARK_PARAMETERS=0 keeps every
// evicted chunk mapped there too, readable over PCIe. The
// model's state_dict copies parked parameters through a use in place (the Python package).
// Evictions the program asks for (zeroalloc_offload) never park.
//
// Note [Tiers that come next]: the engine decides where each chunk lives and the migrator
// moves a chunk between device and pinned host memory at a fixed address. Other sources of
// bytes plug in beside those moves, which stay as they are:
//   - NVMe, behind the host tier (Note [Chunks on disk] in migrator.cpp): a chunk reaches it
//     only from the host, when an eviction finds the host tier full (make_host_room spills
//     the idle host-resident optimizer states used farthest ahead), and comes back to the
//     host before any use or fetch (off_disk), then to the device as any host chunk.
//   - ZeRO partitions: a parameter chunk that another rank owns is resident remotely; its
//     fetch is an all-gather into a device chunk instead of a copy from a host chunk, and the
//     learned order schedules gathers as it schedules fetches (bring_back and the
//     prefetcher's wishes). Evicting it frees the device chunk with no copy out.
// Residency (migrator::where) has a kind for each; the hints and the policy stay.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tier/migrator.hpp"
#include "tier/use_order.hpp"

namespace zeroalloc {

struct offload_settings {
  std::uint64_t prefetch_bytes = 512ull << 20;  ///< ZEROALLOC_PREFETCH_BYTES
  /// Tells the host pool the size of each chunk the optimizer states' segments gain or lose
  /// (chunk_gained, chunk_lost), so that it makes pinned memory of those sizes ahead of need
  /// (Note [Anticipated sizes] in host_pool.hpp). Off in tests that set the pool's ready
  /// chunks themselves.
  bool anticipate_state_chunks = true;
  /// ZEROALLOC_NVME_PARAMETERS: parameters whose every use was hinted, untouched by any
  /// allocation since, may go to disk too (Note [Chunks on disk] in migrator.hpp).
  bool parameters_to_disk = false;
  /// ZEROALLOC_PARK_PARAMETERS: parameters evicted while their uses are all hinted leave
  /// their addresses unmapped (Note [Parameters parked]). Never with any_access.
  bool park_parameters = false;
  /// ZEROALLOC_ACCESS=any: kernels the hints do not announce may touch any chunk at any
  /// time. Every move then drains the device and ends on the thread that asked for it
  /// (Note [Moves any kernel may see] in migrator.hpp); the engine's own threads move
  /// nothing, and what they would do ahead of need is done at a miss (Note [Fetched ahead
  /// at a miss]).
  bool any_access = false;
  /// Tests only: runs on the fetching thread between two attempts of a fetch (after the
  /// first found no room and evictions made some), with the chunk's address, so that a
  /// test can put another thread's use exactly there. Empty in the library.
  std::function<void(std::uintptr_t)> between_fetch_attempts;
};

/// The engine's counters, for statistics and reports.
struct offload_figures {
  std::uint64_t uses = 0;              ///< use-begins hints (per chunk)
  std::uint64_t hits = 0;              ///< ... whose bytes were on the device when the device
                                       ///<     reached the use (the prefetch hit rate's numerator)
  std::uint64_t resident = 0;          ///< ... that found the chunk on the device, in host time
  std::uint64_t arriving = 0;          ///< ... that found it prefetched, bytes still arriving
                                       ///<     (the stream waits for them; the host does not)
  std::uint64_t used_on_host = 0;      ///< ... that left the chunk on the host (no room, or
                                       ///<     another use open on it)
  std::uint64_t device_waited_ns = 0;  ///< time streams waited for fetched bytes
  std::uint64_t prefetches = 0;        ///< fetches started ahead of need
  std::uint64_t disk_prefetches = 0;   ///< chunks read from disk ahead of their in-place use
  std::uint64_t evictions = 0;         ///< evictions the policy chose
  std::uint64_t pressure_evictions = 0;    ///< ... on the allocation-failure path
  std::uint64_t waited_ns = 0;             ///< time use-begins hints (the host) waited for room
  std::uint64_t steps = 0;                 ///< step boundaries seen
  std::uint64_t learned_order_chunks = 0;  ///< positions (uses) in the order in use
  std::uint64_t in_place_uses = 0;         ///< use-in-place hints (per chunk)
  std::uint64_t in_place_host_bytes = 0;   ///< bytes of the chunks those uses found on the
                                           ///< host: the kernels read them over PCIe
  std::uint64_t headroom_searches = 0;     ///< searches for chunks to evict ahead of need
  std::uint64_t headroom_search_ns = 0;    ///< host time those searches took
  std::uint64_t chunks_in_use = 0;         ///< chunks with a use open now
  std::uint64_t in_place_fetches = 0;      ///< parked chunks fetched for a use in place
                                           ///< (Note [Parameters parked])
};

/// The tier of one device's allocator: attach it to the allocator (paging_view::attach) to
/// have allocations that find no room move chunks to the host, and detach it before it is
/// destroyed.
class offload_engine : public paging_listener {
 public:
  /// `disk`: the disk tier behind the host tier, or nullptr (Note [Chunks on disk] in
  /// migrator.hpp).
  offload_engine(caching_allocator& allocator, host_pool& pool, bool verify,
                 offload_settings settings, disk_store* disk = nullptr);
  ~offload_engine() override;
  offload_engine(const offload_engine&) = delete;
  offload_engine& operator=(const offload_engine&) = delete;
  /// Stops and joins the prefetch and read-ahead threads (at exit, where the process-wide
  /// engine is never destroyed: a disk read still under way would outlive the program's
  /// last line). Hints and moves on the calling threads still work. Idempotent.
  void stop_threads();

  // Hints (the Python layer sends them from module and optimizer hooks).
  /// The allocation at `pointer` is about to be used on `stream`: on return its chunks are
  /// on the device, and the chunks the learned order says come next are being fetched.
  /// Each of `pointers` counts as its own use (ended one by one or together); several at
  /// once take the engine's lock once (a module's parameters, a window's states).
  void use_begins(std::span<const void* const> pointers, stream_handle stream);
  void use_begins(const void* pointer, stream_handle stream) { use_begins({&pointer, 1}, stream); }
  /// The allocation at `pointer` is about to be used on `stream` where it is, on the device
  /// or on the host (Note [Used in place]): on return none of its chunks is moving, and none
  /// moves until use_ends; a parked chunk (Note [Parameters parked]) may instead be arriving
  /// on the device in `stream`'s order. Never fetched to the device; a chunk on disk comes to the
  /// host (Note [In-place uses in the order]).
  void use_in_place(std::span<const void* const> pointers, stream_handle stream);
  void use_in_place(const void* pointer, stream_handle stream) {
    use_in_place({&pointer, 1}, stream);
  }
  /// A chunk as the host's CPUs reach it: its device addresses and where its bytes are.
  struct host_view {
    std::uintptr_t address = 0;
    std::size_t bytes = 0;
    std::uintptr_t host = 0;
  };
  /// Note [Stepped on the host] (host_step.hpp): the allocations at `pointers` are about to
  /// be read and written by the host's CPUs. Opens a use of each where it is (nothing moves
  /// until use_ends), waits for the device's work on them (their use-ends fences, their
  /// streams and `stream`), and returns true with `views`, one per chunk, when every chunk
  /// is on the host and open to the CPUs. Else (a chunk on the device or on disk) returns
  /// false with the uses ended and nothing waited for beyond the moves in flight. The caller
  /// ends the uses with use_on_host_ends once the CPUs are done.
  bool use_on_host(std::span<const void* const> pointers, stream_handle stream,
                   std::vector<host_view>& views);
  /// Ends the uses use_on_host opened, once the CPUs are done with the chunks.
  void use_on_host_ends(std::span<const void* const> pointers, stream_handle stream);
  /// The work enqueued on `stream` so far is the allocation's last use for now: its chunks
  /// may be evicted once that work has run (an event marks the point; no host waits).
  void use_ends(std::span<const void* const> pointers, stream_handle stream);
  void use_ends(const void* pointer, stream_handle stream) { use_ends({&pointer, 1}, stream); }
  /// A training step ended: the order recorded during it becomes the learned order. Every
  /// use still open ends, but those of the host's CPUs (use_on_host): a host step may go on
  /// past the boundary (Note [The host step finishes behind the forward] in
  /// bindings/python/zeroalloc/torch/_host_step.py), and its chunks must not move meanwhile.
  void step_boundary();

  // What the allocator tells and asks (paging_listener).
  /// A new allocation lies in chunks on the host (free space of an offloaded chunk); brings
  /// them back, ordered before `stream`'s next work, when the device has room (else they
  /// stay, reached over PCIe).
  void allocated_on_host(const void* pointer, stream_handle stream) override;
  /// Evicts idle chunks, waiting for them, until `bytes_needed` of device memory is free or
  /// nothing more can go. Returns bytes evicted.
  std::uint64_t relieve_pressure(std::size_t bytes_needed) override;
  /// Why this thread's last relieve_pressure that moved nothing more could not (the host
  /// tier's message, naming ZEROALLOC_HOST_LIMIT), or empty; read once.
  std::string pressure_note() override;
  /// The optimizer states' chunk sizes go to the host pool, which makes pinned memory of
  /// those sizes ahead of need (offload_settings::anticipate_state_chunks): pressure sends
  /// them to the host first.
  void chunk_gained(allocation_class cls, std::size_t chunk_bytes) override;
  void chunk_lost(allocation_class cls, std::size_t chunk_bytes) override;
  /// The migrator takes the host chunk back.
  void host_chunk_released(physical_handle chunk, std::uintptr_t address) override;
  /// Note [Nothing movable]: the pressure note when no chunk on the device may move and an
  /// allocation needs `bytes_needed`: what stays, and the smallest limit this point of the
  /// program needs. Caller holds mutex_.
  [[nodiscard]] std::string nothing_movable_note(std::size_t bytes_needed) const;

  /// Moves every chunk of the allocation at `pointer` (waiting when `wait`), except chunks
  /// with a use open (they may hold another allocation in use). False when `pointer` is not
  /// a live allocation.
  bool evict(const void* pointer, bool wait);
  /// Brings every host-resident chunk of the allocation at `pointer` back (waiting when
  /// `wait`), except chunks with a use open (Note [Moving a chunk in use]). False when
  /// `pointer` is not a live allocation.
  bool fetch(const void* pointer, bool wait);

  /// The figures. With `wait_for_device`, after the device-side waits recorded so far have
  /// completed (tests, final reports); without, the waits still running are left out, and
  /// nothing blocks (statistics read during training).
  [[nodiscard]] offload_figures figures(bool wait_for_device = false);
  [[nodiscard]] migrator& mover() { return migrator_; }

 private:
  struct chunk_state {
    int open_uses = 0;           // use-begins minus use-ends
    int cpu_uses = 0;            // of those, use_on_host's (a step boundary keeps them)
    std::uint64_t last_use = 0;  // tick of the last use-begins
    std::size_t bytes = 0;
    int allocation_class = 0;
    // Per stream the chunk's uses ended on, an event recorded at the last of them there
    // (Note [Released on every stream]).
    std::vector<std::pair<stream_handle, event_handle>> released;
    std::uint64_t released_generation = 0;  // the chunk's generation at the last use-ends
    bool hinted = false;                    // every use so far came with hints
    bool used_on_host = false;              // work ran on it while it was on the host
  };

  /// use_begins' work for one chunk, on which it `opened` uses: on the device, arriving in
  /// `stream`'s order, or (no room, or another use open) on the host, marked used there.
  /// True when it was on the device already.
  bool ready_for_use(const chunk_info& chunk, stream_handle stream, int opened);
  std::vector<chunk_info> chunks_of(const void* pointer) const;
  /// The chunks of every allocation in `pointers`, in turn (a chunk twice if two share it).
  std::vector<chunk_info> chunks_of(std::span<const void* const> pointers) const;
  /// Opens a use of the chunk at the current tick. Caller holds mutex_.
  void open_use(const chunk_info& chunk);
  /// Opens a use of each chunk, records the positions of the order (Note [Every use in the
  /// order]) and moves the cursor; then lists what the prefetcher should bring next. True
  /// when it listed something. Caller holds mutex_.
  bool open_and_record(const std::vector<chunk_info>& chunks, bool in_place);
  /// The wishes from the cursors on (Note [Prefetch], Note [In-place uses in the order]):
  /// the reads from disk, and with `device` the fetches to the device too. Caller holds
  /// mutex_.
  void list_wishes(bool device);
  /// Steps from the cursor to the chunk's next use in the learned order (larger: later);
  /// chunks not in the order come last. `on_device`: the next use that needs the chunk on
  /// the device, uses in place left out (device evictions and fetches); else any use (what
  /// goes to disk). Caller holds mutex_.
  std::uint64_t next_use_distance(std::uintptr_t address, bool on_device = true) const;
  /// Picks idle device-resident chunks to evict, farthest next use first, until `bytes`;
  /// never one whose next use comes sooner than `sooner_than`. With `only_released`, only
  /// chunks whose last use has already run on the device (Note [Two timelines]).
  struct victim {
    std::uintptr_t address;
    std::uint64_t generation;
  };
  /// `last_resort` (the allocation-failure path): memory of class other may go too, last
  /// (Note [Idle memory of any class]).
  std::vector<victim> choose_victims(std::size_t bytes, std::uint64_t sooner_than,
                                     bool only_released, bool last_resort = false);
  /// An eviction claimed under mutex_, to start outside it (Note [Evictions outside the
  /// engine's lock]), behind `fences` (the chunk's last use-ends events) when there are any.
  struct planned_eviction {
    chunk_info chunk;
    std::vector<event_handle> fences;  // the chunk's use-ends fences
    bool fence_streams = true;         // also every stream of the chunk (always when none)
    bool park = false;                 // Note [Parameters parked]
  };
  /// The chunk's use-ends events, one per stream its hinted uses ended on. Caller holds
  /// mutex_.
  std::vector<event_handle> use_end_fences(std::uintptr_t address) const;
  /// The eviction of a claimed chunk, with what its copy must wait for: its use-ends fences,
  /// and its streams too when `fence_streams` or unless those fences cover every use since
  /// the last allocation or free in its segment. Caller holds mutex_.
  /// `may_park`: the eviction may park the chunk when the rule of Note [Parameters parked]
  /// allows (not for an eviction the program asked for: it may read the chunk next).
  planned_eviction fenced_eviction(const chunk_info& claimed, bool fence_streams = false,
                                   bool may_park = true) const;
  /// Note [Parameters parked]: makes a chunk about to be used (or allocated in) on the host
  /// reachable there: a parked chunk's host chunk is mapped at its addresses. Returns when
  /// the chunk is on the device, or on the host and mapped. Caller does not hold mutex_.
  void reachable_where_it_is(std::uintptr_t address);
  /// use_in_place's part for a chunk that may be parked: fetched when the device has room
  /// within the limit (no eviction for it; its bytes arrive in `stream`'s order), else
  /// mapped on the host; as reachable_where_it_is otherwise. Caller does not hold mutex_
  /// and has `callers_uses` uses open on it: another use open keeps it where it is (Note
  /// [Moving a chunk in use]).
  void in_place_off_the_placeholder(std::uintptr_t address, stream_handle stream, int callers_uses);
  /// Claims `chosen` and appends it to `into`; false when the migrator would not move it.
  /// Caller holds mutex_.
  bool plan_eviction(const victim& chosen, std::vector<planned_eviction>& into);
  /// Starts the planned evictions in order; returns the addresses started (the first of
  /// `planned`). A full host tier cancels the rest: with a warning (and its message in
  /// `full`, when given), or rethrown when `full_is_an_error`. Caller does not hold mutex_.
  std::vector<std::uintptr_t> launch_evictions(std::vector<planned_eviction>& planned,
                                               bool full_is_an_error = false,
                                               std::string* full = nullptr);
  /// Closes a use of each chunk and records its use-ends fence on `stream`. Caller holds
  /// mutex_.
  /// `cpu`: the uses are use_on_host's. Any other end leaves the CPUs' uses open (one that
  /// began before a step boundary, which ended it already, ends nothing more).
  void end_uses(const std::vector<chunk_info>& chunks, stream_handle stream, bool cpu = false);
  /// Plans evictions of idle chunks needed after the prefetch window until the device has
  /// room for that window (Note [Prefetch]); never waits. Caller holds mutex_.
  std::vector<planned_eviction> plan_headroom();
  /// Note [Fetched ahead at a miss]: the prefetch window's room and fetches, on the
  /// hinting thread, once a miss drained the device (any_access).
  void fetch_ahead_at_a_miss();
  /// Brings a wished chunk back ahead of its use (the prefetcher's step, and a miss's under
  /// any_access); true when a fetch started.
  bool prefetch(std::uintptr_t address, std::size_t bytes);
  /// Fetches `address`, evicting farther chunks for room when needed; waits when `wait`.
  /// `urgent` (a use is waiting) may evict chunks whose last use the device has yet to run.
  /// `ordered_use`: the caller orders its work after the bytes (wait_for_arrival), so an
  /// idle chunk may be mapped before they arrive; a plain fetch() may not. True when the
  /// chunk is on the device or on its way; `fetched`, when given, says whether this call
  /// started the fetch (a chunk found on the device already is no prefetch). A chunk with
  /// more open uses than the caller's own (`callers_uses`) stays where it is: another use
  /// (one in place, or one on another thread) may still queue work on its present backing.
  bool bring_back(std::uintptr_t address, std::size_t bytes, bool wait, bool urgent,
                  bool ordered_use, int callers_uses = 0, bool* fetched = nullptr);
  /// A worker's loop: takes the chunks `queue` lists, nearest first, and runs `act` on
  /// each (outside mutex_), counting those it started in `started_count`, until the engine
  /// stops. A failure is logged with `what`, and the next chunk taken.
  void work_through(std::deque<std::uintptr_t>& queue, std::condition_variable& changed,
                    std::uint64_t offload_figures::*started_count, const char* what,
                    const std::function<bool(std::uintptr_t, std::size_t)>& act);
  void prefetch_worker();
  void read_ahead_worker();
  /// Note [Chunks on disk] in migrator.cpp: moves idle host-resident optimizer states, the
  /// farthest next use first (never `keep`), to the disk until `bytes` of host memory are
  /// free; returns how many chunks went (0: none could, or there is no disk tier). Caller
  /// does not hold mutex_.
  /// `farther_than`: only chunks whose next use is farther than that many positions (a
  /// read ahead of need); 0: any.
  std::uint64_t make_host_room(std::size_t bytes, std::uintptr_t keep,
                               std::uint64_t farther_than = 0);
  /// What may go to the disk (never `keep`), the farthest next use first. Caller holds
  /// mutex_.
  struct disk_candidate {
    std::uintptr_t address;
    std::size_t bytes;
    bool parameter;
    std::uint64_t distance;
  };
  std::vector<disk_candidate> disk_candidates(std::uintptr_t keep, std::uint64_t farther_than);
  /// Note [Room kept for restores] in migrator.cpp: the chunk at `address` comes back from
  /// the disk into the host chunk of one of the same size that goes there. One at a time.
  /// Caller does not hold mutex_.
  bool swap_off_disk(std::uintptr_t address, std::size_t bytes);
  /// The prefetcher's read of an in-place chunk from disk ahead of its use, making host
  /// room only from chunks needed later than it is. True when it came to the host. Caller
  /// does not hold mutex_.
  bool off_disk_ahead(std::uintptr_t address, std::size_t bytes);
  /// Brings the chunk at `address` back from the disk to the host, making room there when
  /// needed; does nothing for a chunk that is not on the disk. Caller does not hold mutex_.
  void off_disk(std::uintptr_t address, std::size_t bytes);
  /// Makes `stream` wait for the chunk's arriving bytes, timing the wait on the device.
  /// False when the chunk is not arriving. Caller does not hold mutex_.
  bool wait_for_arrival(std::uintptr_t address, stream_handle stream, int uses = 1);
  /// Accounts the device-side waits whose events have completed. Caller holds mutex_.
  void collect_waits(bool all);
  event_handle timing_event();  // caller holds mutex_

  caching_allocator& allocator_;
  paging_view paging_;
  device& device_;
  host_pool& pool_;
  migrator migrator_;
  const offload_settings settings_;

  mutable std::mutex mutex_;
  std::mutex swap_mutex_;  // swap_off_disk, one at a time (Note [Room kept for restores])
  std::condition_variable wishes_changed_;
  std::unordered_map<std::uintptr_t, chunk_state> chunks_;
  // Note [In-place uses in the order]: the uses that need their chunk on the device, and
  // every use (those in place marked).
  use_order device_order_;
  use_order every_use_;
  std::size_t window_positions_ = 0;  // how many positions past the cursor the window spans
  std::uint64_t tick_ = 0;
  std::deque<std::uintptr_t> wishes_;  // chunks to fetch to the device, nearest first
  // chunks to read from disk to the host, nearest first (Note [In-place uses in the order])
  std::deque<std::uintptr_t> reads_;
  std::condition_variable reads_changed_;
  offload_figures figures_;
  // Per thread (each allocation's failure is its own): set by relieve_pressure when the
  // host tier was full, cleared when it moved something.
  std::unordered_map<std::thread::id, std::string> pressure_notes_;
  struct timed_wait {
    event_handle before;
    event_handle after;
    int uses = 1;  // the uses it stands for (hits, when it was one)
  };
  std::deque<timed_wait> pending_waits_;
  std::vector<event_handle> spare_timing_events_;
  bool stopping_ = false;
  std::thread prefetcher_;
  std::thread reader_;  // read_ahead_worker
};

}  // namespace zeroalloc
