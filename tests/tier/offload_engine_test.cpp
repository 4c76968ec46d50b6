// The offload engine over every device: allocations that do not fit succeed because idle
// states move to the host; a training loop with hints keeps every byte, learns its order,
// fetches ahead along it and never leaves a chunk on the host for a use (how often the
// fetch was in time is printed: a speed figure, measured by the benchmarks on the GPU).
#include "tier/offload_engine.hpp"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <random>
#include <thread>

#include "core/units.hpp"
#include "device/sim_device.hpp"
#include "support/attached_listener.hpp"
#include "support/test_device.hpp"

namespace zeroalloc {
namespace {

using testing::read_back;

constexpr std::size_t kChunkBytes = 8 * MiB;

class OffloadEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ZA_OPEN_TEST_DEVICE_OR_SKIP(device_, 0, 1 * GiB);
    allocator_settings settings;
    settings.chunk_bytes = kChunkBytes;
    allocator_ = std::make_unique<caching_allocator>(*device_, settings);
    pool_ = std::make_unique<host_pool>(*device_, 512 * MiB, "ZEROALLOC_HOST_LIMIT=512MiB");
  }
  void TearDown() override {
    if (allocator_) {
      allocator_->empty_cache();
      if (engine_) allocator_->paging().detach();
    }
    engine_.reset();
    allocator_.reset();
    pool_.reset();
  }
  void start(std::uint64_t limit_bytes, std::uint64_t prefetch_bytes,
             std::function<void(std::uintptr_t)> between_fetch_attempts = nullptr) {
    allocator_->set_limit(limit_bytes, "ZEROALLOC_MEMORY_LIMIT (test)");
    offload_settings settings;
    settings.prefetch_bytes = prefetch_bytes;
    settings.between_fetch_attempts = std::move(between_fetch_attempts);
    settings.anticipate_state_chunks = anticipate_state_chunks_;
    settings.park_parameters = park_parameters_;
    settings.any_access = any_access_;
    engine_ = std::make_unique<offload_engine>(*allocator_, *pool_, verify_, settings);
    allocator_->paging().attach(*engine_);
  }
  /// As CUDA drivers do, the device maps host chunks only whole (the simulated one is told
  /// to); a pool of four ready chunks. False where the driver maps slices.
  bool start_with_whole_host_chunks() {
    if (auto* sim = dynamic_cast<sim_device*>(device_.get())) sim->set_maps_slices(false);
    if (device_->maps_slices()) return false;
    pool_ = std::make_unique<host_pool>(*device_, 512 * MiB, "ZEROALLOC_HOST_LIMIT=512MiB");
    pool_->start_prefill(kChunkBytes, 4 * kChunkBytes);
    pool_->wait_for_prefill();
    anticipate_state_chunks_ = false;  // the four ready chunks stay as they are
    start(256 * MiB, 0);
    return true;
  }
  /// A new allocator whose chunks are `bytes` long (ZEROALLOC_CHUNK_SIZE); before start().
  void use_chunk_bytes(std::size_t bytes) {
    allocator_settings settings;
    settings.chunk_bytes = bytes;
    allocator_ = std::make_unique<caching_allocator>(*device_, settings);
  }
  /// `count` parameters of `bytes` each (a model's layers), zeroed on `stream`.
  std::vector<void*> zeroed_parameters(int count, std::size_t bytes, stream_handle stream) {
    std::vector<void*> made;
    for (int i = 0; i < count; ++i) {
      made.push_back(allocator_->allocate(bytes, stream, allocation_class::parameter));
      device_->fill_async(made.back(), 0, bytes, stream);
    }
    return made;
  }
  /// The address of the first chunk of the allocation at `pointer`.
  std::uintptr_t first_chunk(void* pointer) {
    std::vector<chunk_info> chunks;
    allocator_->chunks_of_allocation(pointer, chunks);
    return chunks.at(0).address;
  }
  /// Waits until no chunk of the allocation at `pointer` is moving.
  void settle(void* pointer) {
    std::vector<chunk_info> chunks;
    allocator_->chunks_of_allocation(pointer, chunks);
    for (const chunk_info& chunk : chunks) engine_->mover().wait_until_settled(chunk.address);
  }
  /// Where the first chunk of the allocation at `pointer` is.
  residency where_first_chunk(void* pointer) {
    return engine_->mover().where(first_chunk(pointer));
  }
  bool holds(void* pointer, std::uint8_t value, std::size_t bytes) {
    return read_back(*device_, pointer, bytes) == std::vector<std::uint8_t>(bytes, value);
  }
  /// A CUDA graph capture on `stream`, in CUDA's strictest mode (any call that waits for the
  /// device invalidates it). On the simulated device its stand-in refuses such calls too.
  void begin_capture(stream_handle stream) {
    if (auto* sim = dynamic_cast<sim_device*>(device_.get())) return sim->begin_capture(stream);
    ASSERT_EQ(
        cudaStreamBeginCapture(static_cast<cudaStream_t>(stream), cudaStreamCaptureModeGlobal),
        cudaSuccess);
  }
  /// Ends the capture; a failure means something invalidated it.
  void end_capture(stream_handle stream) {
    if (auto* sim = dynamic_cast<sim_device*>(device_.get())) return sim->end_capture(stream);
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(static_cast<cudaStream_t>(stream), &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    EXPECT_EQ(ended, cudaSuccess) << "the capture was invalidated: " << cudaGetErrorString(ended);
  }

  std::unique_ptr<device> device_;
  std::unique_ptr<caching_allocator> allocator_;
  std::unique_ptr<host_pool> pool_;
  std::unique_ptr<offload_engine> engine_;
  bool anticipate_state_chunks_ = true;
  bool park_parameters_ = false;  // ZEROALLOC_PARK_PARAMETERS (on in the library)
  bool verify_ = false;           // ZEROALLOC_VERIFY
  bool any_access_ = false;       // ZEROALLOC_ACCESS=any (the library's default)
};

// Note [Moves any kernel may see] (migrator.hpp): a program that gives no hint at all runs
// its "kernels" (fills and copies, which reach memory through the same addresses) on three
// streams the allocator never saw, writing and reading buffers of every class, while its
// allocations push the others to the host and it asks for evictions and fetches itself.
// Thousands of rounds: every read sees the last value written, and every move's checksum
// holds (ZEROALLOC_VERIFY stops the process otherwise). With the overlapped moves of
// ZEROALLOC_ACCESS=hinted the same program loses writes: the engine copies a chunk behind
// the streams it knows and remaps it while the others still write it.
TEST_F(OffloadEngineTest, UnhintedWorkOnUnknownStreamsKeepsEveryByteWhileChunksMove) {
  any_access_ = true;
  verify_ = true;
  start(64 * MiB, 0);
  offload_engine& engine = *engine_;
  constexpr int kStreams = 3;
  constexpr int kBuffers = 12;  // 96 MiB under a 64 MiB limit
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
  constexpr int kRounds = 600;  // the sanitizers run it 10 to 30 times slower (CI's time)
#else
  constexpr int kRounds = 3000;
#endif
  const allocation_class classes[] = {allocation_class::parameter,
                                      allocation_class::optimizer_state, allocation_class::other};
  std::vector<stream_handle> streams;
  for (int s = 0; s < kStreams; ++s) streams.push_back(device_->create_stream());
  std::vector<void*> buffers;
  std::vector<std::uint8_t> expected(kBuffers);
  for (int i = 0; i < kBuffers; ++i) {
    buffers.push_back(allocator_->allocate(kChunkBytes, nullptr, classes[i % 3]));
    ASSERT_NE(buffers.back(), nullptr);
    expected[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(i + 1);
    device_->fill_async(buffers.back(), expected[static_cast<std::size_t>(i)], kChunkBytes,
                        nullptr);
  }
  device_->synchronize_stream(nullptr);  // the program orders its streams as it would natively
  std::mt19937 random(7);
  int wrong = 0;
  int reads = 0;
  for (int round = 0; round < kRounds && wrong <= 3; ++round) {
    const auto i = static_cast<std::size_t>(random() % kBuffers);
    stream_handle stream = streams[i % kStreams];  // each buffer's work in one stream's order
    switch (random() % 5) {
      case 0:
      case 1:  // a kernel rewrites the buffer
        expected[i] = static_cast<std::uint8_t>(expected[i] % 250 + 1);
        device_->fill_async(buffers[i], expected[i], kChunkBytes, stream);
        break;
      case 2: {  // a kernel reads it
        ++reads;
        if (read_back(*device_, buffers[i], kChunkBytes, stream) !=
            std::vector<std::uint8_t>(kChunkBytes, expected[i])) {
          ADD_FAILURE() << "buffer " << i << " in round " << round << " does not hold "
                        << int(expected[i]);
          ++wrong;
        }
        break;
      }
      case 3: {  // activations come and go: the allocation moves others to the host
        void* scratch = allocator_->allocate(2 * kChunkBytes, stream, allocation_class::other);
        ASSERT_NE(scratch, nullptr) << "round " << round;
        device_->fill_async(scratch, 0xEE, 2 * kChunkBytes, stream);
        allocator_->deallocate(scratch);
        break;
      }
      default:  // the program asks for a move
        if (random() % 2 == 0) {
          engine.evict(buffers[i], /*wait=*/false);
        } else {
          engine.fetch(buffers[i], /*wait=*/false);
        }
    }
  }
  for (stream_handle stream : streams) device_->synchronize_stream(stream);
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    EXPECT_TRUE(read_back(*device_, buffers[i], kChunkBytes) ==
                std::vector<std::uint8_t>(kChunkBytes, expected[i]))
        << "buffer " << i << " at the end";
  }
  const migration_figures moved = engine.mover().figures();
  std::printf(
      "unhinted work under any access: %d reads checked, %llu chunks to the host, "
      "%llu back, %llu verified\n",
      reads, static_cast<unsigned long long>(moved.chunks_to_host),
      static_cast<unsigned long long>(moved.chunks_to_device),
      static_cast<unsigned long long>(moved.verified_chunks));
  // About one move in twenty rounds each way (141 and 135 in 3,000 on the simulated device).
  EXPECT_GT(moved.chunks_to_host, static_cast<std::uint64_t>(kRounds / 30)) << "too few moves";
  EXPECT_GT(moved.chunks_to_device, static_cast<std::uint64_t>(kRounds / 30));
  EXPECT_EQ(moved.chunks_parked, 0u) << "a chunk was parked where any kernel may read it";
  EXPECT_LE(allocator_->held_bytes(), 64 * MiB) << "the device limit was broken";
  for (void* buffer : buffers) allocator_->deallocate(buffer);
  for (stream_handle stream : streams) {
    allocator_->forget_stream(stream);
    device_->destroy_stream(stream);
  }
}

TEST_F(OffloadEngineTest, AnAllocationThatDoesNotFitMovesIdleStatesToTheHost) {
  start(48 * MiB, 0);
  offload_engine& engine = *engine_;
  std::vector<void*> states;
  for (int i = 0; i < 6; ++i) {
    states.push_back(allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state));
    device_->fill_async(states.back(), static_cast<std::uint8_t>(i + 1), kChunkBytes, nullptr);
  }
  void* activations = allocator_->allocate(16 * MiB, nullptr, allocation_class::other);
  ASSERT_NE(activations, nullptr);
  EXPECT_LE(allocator_->held_bytes(), 48 * MiB) << "the device limit was broken";
  EXPECT_GE(engine.figures().pressure_evictions, 2u);
  const std::uint64_t on_host = engine.mover().figures().host_resident_bytes;
  EXPECT_GE(on_host, 16 * MiB);  // at least what the activations needed, and not everything
  EXPECT_LT(on_host, 48 * MiB);
  for (int i = 0; i < 6; ++i) {
    EXPECT_TRUE(holds(states[i], static_cast<std::uint8_t>(i + 1), kChunkBytes)) << i;
  }
  // Activations with a use open are never evicted: with every state on the host, nothing
  // more can go, and the message says how much is offloaded already.
  engine.use_begins(activations, nullptr);
  try {
    allocator_->allocate(48 * MiB, nullptr, allocation_class::other);
    ADD_FAILURE() << "48 MiB of activations fit under a 48 MiB limit beside 16 MiB in use";
  } catch (const out_of_memory& failure) {
    const std::string expected =
        format_bytes(engine.mover().figures().host_resident_bytes) + " is offloaded to host memory";
    EXPECT_NE(std::string(failure.what()).find(expected), std::string::npos) << failure.what();
  }
  engine.use_ends(activations, nullptr);
  allocator_->deallocate(activations);
  for (void* state : states) allocator_->deallocate(state);
}

// Note [Nothing moves while a graph is captured] (caching_allocator.cpp) and Note [Hints
// during a capture]: while a stream captures a CUDA graph, a hint on it moves nothing, and
// an allocation on it that finds no room fails at once, saying why, instead of draining the
// device (which would invalidate the capture). Once the capture has ended, the same
// allocation moves states to the host as usual.
TEST_F(OffloadEngineTest, DuringAGraphCaptureNothingMovesAndAnAllocationWithoutRoomSaysWhy) {
  any_access_ = true;
  start(48 * MiB, 0);
  offload_engine& engine = *engine_;
  stream_handle stream = device_->create_stream();
  std::vector<void*> states;
  for (int i = 0; i < 5; ++i) {
    states.push_back(allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state));
    device_->fill_async(states.back(), static_cast<std::uint8_t>(i + 1), kChunkBytes, nullptr);
  }
  void* captured = allocator_->allocate(kChunkBytes, nullptr, allocation_class::other);
  ASSERT_TRUE(engine.evict(states[0], /*wait=*/true));
  device_->synchronize_device();
  ASSERT_EQ(where_first_chunk(states[0]), residency::host);
  const migration_figures before = engine.mover().figures();

  begin_capture(stream);
  device_->fill_async(captured, 0x77, kChunkBytes, stream);  // a captured kernel
  engine.use_begins(states[0], stream);                      // would fetch: ignored
  EXPECT_EQ(where_first_chunk(states[0]), residency::host);
  engine.use_ends(states[0], stream);
  try {
    allocator_->allocate(16 * MiB, stream, allocation_class::other);
    ADD_FAILURE() << "16 MiB fit beside 48 MiB held under a 48 MiB limit";
  } catch (const out_of_memory& failure) {
    EXPECT_NE(std::string(failure.what()).find("A CUDA graph was being captured"),
              std::string::npos)
        << failure.what();
  }
  end_capture(stream);
  const migration_figures during = engine.mover().figures();
  EXPECT_EQ(during.chunks_to_host, before.chunks_to_host) << "a chunk moved during the capture";
  EXPECT_EQ(during.chunks_to_device, before.chunks_to_device);

  void* activations = allocator_->allocate(16 * MiB, stream, allocation_class::other);
  ASSERT_NE(activations, nullptr);
  EXPECT_GT(engine.mover().figures().chunks_to_host, before.chunks_to_host);
  device_->synchronize_device();
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(
        holds(states[static_cast<std::size_t>(i)], static_cast<std::uint8_t>(i + 1), kChunkBytes))
        << i;
  }
  allocator_->deallocate(activations);
  allocator_->deallocate(captured);
  for (void* state : states) allocator_->deallocate(state);
  allocator_->forget_stream(stream);
  device_->destroy_stream(stream);
}

// Note [Address regions]: optimizer states offloaded to the host stay mapped in their
// segments, so a class may hold far more than the device: three times a small simulated
// device here, with the host tier holding the rest.
TEST(OffloadEngineRegions, StatesBeyondTwiceTheDeviceFitWhenTheHostTierHoldsThem) {
  std::unique_ptr<device> small;
  ZA_OPEN_TEST_DEVICE_OR_SKIP(small, 0, 64 * MiB);
  const std::uint64_t device_bytes = small->query_memory().total_bytes;
  if (device_bytes > 64 * MiB) GTEST_SKIP() << "skipped: needs a device of 64 MiB";
  allocator_settings settings;
  settings.chunk_bytes = kChunkBytes;
  settings.host_tier_bytes = 512 * MiB;
  {
    caching_allocator allocator(*small, settings);
    host_pool pool(*small, 512 * MiB, "ZEROALLOC_HOST_LIMIT=512MiB");
    offload_engine engine(allocator, pool, false, offload_settings{});
    testing::attached_listener attached(allocator, engine);
    std::vector<void*> states;
    for (int i = 0; i < 24; ++i) {  // 192 MiB of states beside a 64 MiB device
      states.push_back(allocator.allocate(kChunkBytes, nullptr, allocation_class::optimizer_state));
      small->fill_async(states.back(), static_cast<std::uint8_t>(i + 1), kChunkBytes, nullptr);
    }
    EXPECT_GE(engine.mover().figures().host_resident_bytes, 128 * MiB);
    for (int i = 0; i < 24; ++i) {
      EXPECT_EQ(read_back(*small, states[i], kChunkBytes),
                std::vector<std::uint8_t>(kChunkBytes, static_cast<std::uint8_t>(i + 1)))
          << i;
    }
    for (void* state : states) allocator.deallocate(state);
    allocator.empty_cache();
  }
}

TEST_F(OffloadEngineTest, AFullHostTierFailsTheAllocationWithAMessageNamingItsLimit) {
  // Two chunks of host memory, six chunks of states: the host fills before the activations
  // find room, and the error says which limit to raise; the states keep their bytes.
  pool_ = std::make_unique<host_pool>(*device_, 2 * kChunkBytes, "ZEROALLOC_HOST_LIMIT=16MiB");
  start(48 * MiB, 0);
  std::vector<void*> states;
  for (int i = 0; i < 6; ++i) {
    states.push_back(allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state));
    device_->fill_async(states.back(), static_cast<std::uint8_t>(i + 1), kChunkBytes, nullptr);
  }
  try {
    allocator_->allocate(32 * MiB, nullptr, allocation_class::other);
    ADD_FAILURE() << "32 MiB fit beside 48 MiB of states under a 48 MiB limit with 16 MiB of "
                     "host memory";
  } catch (const out_of_memory& failure) {
    const std::string message = failure.what();
    EXPECT_NE(message.find("host tier is full"), std::string::npos) << message;
    EXPECT_NE(message.find("ZEROALLOC_HOST_LIMIT"), std::string::npos) << message;
    EXPECT_NE(message.find("ZEROALLOC_MEMORY_LIMIT"), std::string::npos) << message;
  }
  EXPECT_LE(engine_->mover().figures().host_resident_bytes, 2 * kChunkBytes);
  for (int i = 0; i < 6; ++i) {
    EXPECT_TRUE(holds(states[i], static_cast<std::uint8_t>(i + 1), kChunkBytes)) << i;
  }
  for (void* state : states) allocator_->deallocate(state);
}

// Note [Chunks on disk] in migrator.hpp: with the host tier full, host-resident states go to
// the disk tier (swap files under a temporary directory here), the farthest next use first,
// and each comes back, through the host, for its next hinted use, with every byte intact.
class OffloadEngineDiskTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ZA_OPEN_TEST_DEVICE_OR_SKIP(device_, 0, 1 * GiB);
    char pattern[] = "/tmp/offload_disk_test-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    directory_ = pattern;
  }
  void TearDown() override {
    if (allocator_ && engine_) {
      allocator_->empty_cache();
      allocator_->paging().detach();
    }
    engine_.reset();
    allocator_.reset();
    pool_.reset();
    disk_.reset();
    std::filesystem::remove_all(directory_);
  }
  /// A device limit of `limit`, a host tier of `host`, a disk tier of `disk_bytes`; false
  /// (the test skips) where the kernel refuses io_uring.
  bool start(std::uint64_t limit, std::uint64_t host, std::uint64_t disk_bytes,
             std::uint64_t prefetch_bytes = 0, bool parameters_to_disk = false) {
    disk_store_options options;
    options.directories = {directory_.string()};
    options.capacity_bytes = disk_bytes;
    try {
      disk_.emplace(options);
    } catch (const io_uring_unavailable& unavailable) {
      skipped_ = unavailable.what();
      return false;
    }
    allocator_settings settings;
    settings.chunk_bytes = kChunkBytes;
    settings.host_tier_bytes = 1 * GiB;  // the classes' address regions hold the disk's too
    allocator_ = std::make_unique<caching_allocator>(*device_, settings);
    allocator_->set_limit(limit, "ZEROALLOC_MEMORY_LIMIT (test)");
    pool_ = std::make_unique<host_pool>(*device_, host, "ZEROALLOC_HOST_LIMIT (test)");
    offload_settings engine_settings;
    engine_settings.prefetch_bytes = prefetch_bytes;
    engine_settings.parameters_to_disk = parameters_to_disk;
    engine_settings.anticipate_state_chunks = false;
    engine_ =
        std::make_unique<offload_engine>(*allocator_, *pool_, false, engine_settings, &*disk_);
    allocator_->paging().attach(*engine_);
    return true;
  }
  residency where(void* pointer) {
    std::vector<chunk_info> chunks;
    allocator_->chunks_of_allocation(pointer, chunks);
    return engine_->mover().where(chunks.at(0).address);
  }
  /// Chunk-sized optimizer states, state i filled with `first_byte` + i and used once (in
  /// place, or on the device), until `count` are made or the tiers refuse one.
  std::vector<void*> states_filling_the_tiers(int count, std::uint8_t first_byte, bool in_place) {
    std::vector<void*> states;
    for (int i = 0; i < count; ++i) {
      void* state = nullptr;
      try {
        state = allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
      } catch (const out_of_memory&) {
        break;
      }
      device_->fill_async(state, static_cast<std::uint8_t>(first_byte + i), kChunkBytes, nullptr);
      if (in_place) {
        engine_->use_in_place(state, nullptr);
      } else {
        engine_->use_begins(state, nullptr);
      }
      engine_->use_ends(state, nullptr);
      states.push_back(state);
    }
    return states;
  }

  std::unique_ptr<device> device_;
  std::filesystem::path directory_;
  std::optional<disk_store> disk_;
  std::unique_ptr<caching_allocator> allocator_;
  std::unique_ptr<host_pool> pool_;
  std::unique_ptr<offload_engine> engine_;
  std::string skipped_;
};

TEST_F(OffloadEngineDiskTest, StatesBeyondTheHostTierGoToDiskAndComeBackIntactForTheirUse) {
  if (!start(32 * MiB, 32 * MiB, 256 * MiB)) GTEST_SKIP() << "skipped: " << skipped_;
  offload_engine& engine = *engine_;
  std::vector<void*> states;
  for (int i = 0; i < 10; ++i) {  // 80 MiB of states: 32 on the device, 32 on the host
    states.push_back(allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state));
    device_->fill_async(states.back(), static_cast<std::uint8_t>(0x40 + i), kChunkBytes, nullptr);
    engine.use_begins(states.back(), nullptr);  // each written under a hint, as a step does
    engine.use_ends(states.back(), nullptr);
  }
  engine.step_boundary();  // the order is learned: the next uses fetch and evict along it
  const migration_figures spilled = engine.mover().figures();
  EXPECT_GE(spilled.chunks_to_disk, 2u);
  EXPECT_GE(spilled.disk_resident_bytes, 16 * MiB);
  EXPECT_LE(allocator_->held_bytes(), 32 * MiB) << "the device limit was broken";
  EXPECT_LE(pool_->figures().in_use_bytes, 32 * MiB) << "the host limit was broken";
  const auto on_disk = std::count_if(states.begin(), states.end(),
                                     [&](void* state) { return where(state) == residency::disk; });
  EXPECT_GE(on_disk, 2);
  for (int round = 0; round < 2; ++round) {  // each used in turn, as the next steps do
    for (int i = 0; i < 10; ++i) {
      engine.use_begins(states[i], nullptr);
      const residency now = where(states[i]);  // arriving in the stream's order, or there
      EXPECT_TRUE(now == residency::device || now == residency::moving_to_device) << i;
      EXPECT_TRUE(read_back(*device_, states[i], kChunkBytes) ==
                  std::vector<std::uint8_t>(kChunkBytes, static_cast<std::uint8_t>(0x40 + i)))
          << "state " << i << ", round " << round;
      engine.use_ends(states[i], nullptr);
    }
    engine.step_boundary();
  }
  const migration_figures back = engine.mover().figures();
  EXPECT_GE(back.chunks_from_disk, 2u);
  EXPECT_EQ(back.bytes_from_disk % kChunkBytes, 0u);
  for (void* state : states) allocator_->deallocate(state);
  allocator_->empty_cache();  // the segments go, and with them their disk slots
  EXPECT_EQ(engine.mover().figures().disk_resident_bytes, 0u)
      << "released segments still hold disk slots";
  EXPECT_EQ(disk_->figures().used_bytes, 0u);
}

// An optimizer's first step makes its states one window after another, each written once
// (the copy into the optimizer-state class) with no hint: beyond the device and the host
// tier, those made first go to disk for the later ones to fit, and come back intact for
// the next step's hinted uses (Note [States never used yet]).
TEST_F(OffloadEngineDiskTest, StatesNoHintHasReachedYetGoToDiskWhenTheHostTierIsFull) {
  if (!start(32 * MiB, 32 * MiB, 256 * MiB)) GTEST_SKIP() << "skipped: " << skipped_;
  offload_engine& engine = *engine_;
  std::vector<void*> states;
  for (int i = 0; i < 10; ++i) {  // 80 MiB of states: 32 on the device, 32 on the host
    void* state = allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
    ASSERT_NE(state, nullptr) << "state " << i << " found no room";
    device_->fill_async(state, static_cast<std::uint8_t>(0x60 + i), kChunkBytes, nullptr);
    states.push_back(state);
  }
  EXPECT_GE(engine.mover().figures().chunks_to_disk, 2u);
  EXPECT_LE(pool_->figures().in_use_bytes, 32 * MiB) << "the host limit was broken";
  for (int i = 0; i < 10; ++i) {  // the next step: each used in place, under its hint
    engine.use_in_place(states[i], nullptr);
    EXPECT_NE(where(states[i]), residency::disk) << i;
    EXPECT_TRUE(read_back(*device_, states[i], kChunkBytes) ==
                std::vector<std::uint8_t>(kChunkBytes, static_cast<std::uint8_t>(0x60 + i)))
        << "state " << i;
    engine.use_ends(states[i], nullptr);
  }
  for (void* state : states) allocator_->deallocate(state);
}

// ZEROALLOC_NVME_PARAMETERS: parameters that do not fit the device and the host go to disk
// when asked, and come back intact for each hinted use; without it the same model does not
// fit, and the allocation fails.
TEST_F(OffloadEngineDiskTest, HintedParametersGoToDiskOnlyWhenAskedAndComeBackIntact) {
  for (const bool asked : {false, true}) {
    SCOPED_TRACE(asked ? "parameters to disk" : "parameters never to disk");
    TearDown();
    SetUp();
    if (!start(16 * MiB, 32 * MiB, 256 * MiB, 0, /*parameters_to_disk=*/asked)) {
      GTEST_SKIP() << "skipped: " << skipped_;
    }
    offload_engine& engine = *engine_;
    std::vector<void*> layers;
    bool fitted = true;
    for (int i = 0; i < 8; ++i) {  // 64 MiB of parameters: 16 on the device, 32 on the host
      void* layer = nullptr;
      try {
        layer = allocator_->allocate(kChunkBytes, nullptr, allocation_class::parameter);
      } catch (const std::exception&) {
      }
      if (layer == nullptr) {
        fitted = false;
        break;
      }
      device_->fill_async(layer, static_cast<std::uint8_t>(0x20 + i), kChunkBytes, nullptr);
      engine.use_begins(layer, nullptr);  // the forward's hooks hint each layer
      engine.use_ends(layer, nullptr);
      layers.push_back(layer);
    }
    EXPECT_EQ(fitted, asked) << "the parameters fitted " << (fitted ? "" : "not ") << "with "
                             << layers.size() << " of 8 allocated";
    EXPECT_LE(pool_->figures().in_use_bytes, 32 * MiB) << "the host limit was broken";
    if (!asked) {
      EXPECT_EQ(engine.mover().figures().chunks_to_disk, 0u) << "a parameter went to disk";
    } else {
      EXPECT_GE(engine.mover().figures().chunks_to_disk, 2u);
      engine.step_boundary();
      for (int round = 0; round < 2; ++round) {  // forward: each layer under its hint
        for (std::size_t i = 0; i < layers.size(); ++i) {
          engine.use_begins(layers[i], nullptr);
          EXPECT_NE(where(layers[i]), residency::disk) << i;
          EXPECT_TRUE(read_back(*device_, layers[i], kChunkBytes) ==
                      std::vector<std::uint8_t>(kChunkBytes, static_cast<std::uint8_t>(0x20 + i)))
              << "layer " << i << ", round " << round;
          engine.use_ends(layers[i], nullptr);
        }
        engine.step_boundary();
      }
      EXPECT_GE(engine.mover().figures().chunks_from_disk, 2u);
    }
    for (void* layer : layers) allocator_->deallocate(layer);
  }
}

// The windowed step uses host-resident states in place: with the host tier and the disk
// full, a state on disk comes back into the host chunk of one that goes to the disk in its
// place, through the room the disk keeps (Note [Room kept for restores]), step after step.
TEST_F(OffloadEngineDiskTest, StatesUsedInPlaceSwapWithTheHostsWhenHostAndDiskAreFull) {
  if (!start(16 * MiB, 32 * MiB, 32 * MiB)) GTEST_SKIP() << "skipped: " << skipped_;
  offload_engine& engine = *engine_;
  // As many as fit: 16 + 32 + 24 MiB.
  std::vector<void*> states = states_filling_the_tiers(12, 0x40, /*in_place=*/true);
  ASSERT_GE(states.size(), 8u);
  EXPECT_EQ(disk_->figures().used_bytes, 32 * MiB - kChunkBytes) << "the disk is not full";
  const std::uint64_t from_disk_before = engine.mover().figures().chunks_from_disk;
  for (int round = 0; round < 3; ++round) {
    for (std::size_t i = 0; i < states.size(); ++i) {
      ASSERT_NO_THROW(engine.use_in_place(states[i], nullptr)) << "state " << i;
      EXPECT_TRUE(read_back(*device_, states[i], kChunkBytes) ==
                  std::vector<std::uint8_t>(kChunkBytes, static_cast<std::uint8_t>(0x40 + i)))
          << "state " << i << ", round " << round;
      engine.use_ends(states[i], nullptr);
    }
    engine.step_boundary();
  }
  EXPECT_GE(engine.mover().figures().chunks_from_disk - from_disk_before, 3u);
  EXPECT_LE(pool_->figures().in_use_bytes, 32 * MiB) << "the host limit was broken";
  EXPECT_LE(disk_->figures().used_bytes, 32 * MiB - kChunkBytes) << "the kept room stayed used";
  for (void* state : states) allocator_->deallocate(state);
}

// ZEROALLOC_NVME_PARAMETERS sends a parameter's chunk to disk only while its hints describe
// everything in it: a chunk that an unhinted tensor shares (allocated beside a layer after
// the layer's last hinted use) stays in memory, where that tensor's reads find its bytes,
// though its layer is the one needed farthest ahead.
TEST_F(OffloadEngineDiskTest, AParameterChunkSharedWithAnUnhintedTensorStaysOffTheDisk) {
  if (!start(32 * MiB, 32 * MiB, 256 * MiB, 0, /*parameters_to_disk=*/true)) {
    GTEST_SKIP() << "skipped: " << skipped_;
  }
  offload_engine& engine = *engine_;
  constexpr std::size_t kHalf = kChunkBytes / 2;
  constexpr std::size_t kLayer = 2 * kChunkBytes;  // a segment of its own
  auto first_chunk = [&](void* pointer) {
    std::vector<chunk_info> chunks;
    allocator_->chunks_of_allocation(pointer, chunks);
    return chunks.at(0).address;
  };
  auto intact = [&](void* pointer, std::size_t bytes, int value) {
    return read_back(*device_, pointer, bytes) ==
           std::vector<std::uint8_t>(bytes, static_cast<std::uint8_t>(value));
  };
  // Two small layers, each beside a gap (small requests share a 20 MiB segment), and two
  // large ones; a step uses the small ones last, so theirs are the chunks needed farthest
  // ahead once the order is learned.
  std::vector<void*> small, gaps, layers;
  for (int i = 0; i < 2; ++i) {
    small.push_back(allocator_->allocate(kHalf, nullptr, allocation_class::parameter));
    device_->fill_async(small.back(), static_cast<std::uint8_t>(0x30 + i), kHalf, nullptr);
    gaps.push_back(allocator_->allocate(kHalf, nullptr, allocation_class::parameter));
  }
  for (int i = 0; i < 2; ++i) {
    layers.push_back(allocator_->allocate(kLayer, nullptr, allocation_class::parameter));
    device_->fill_async(layers.back(), static_cast<std::uint8_t>(0x20 + i), kLayer, nullptr);
  }
  for (int round = 0; round < 2; ++round) {
    for (auto* group : {&layers, &small}) {
      for (void* layer : *group) {
        engine.use_begins(layer, nullptr);
        engine.use_ends(layer, nullptr);
      }
    }
    engine.step_boundary();
  }
  // After their last hinted use, unhinted tensors in the gaps beside the small layers.
  for (void* gap : gaps) allocator_->deallocate(gap);
  std::vector<void*> unhinted;
  for (int i = 0; i < 2; ++i) {
    unhinted.push_back(allocator_->allocate(kHalf, nullptr, allocation_class::parameter));
    device_->fill_async(unhinted.back(), static_cast<std::uint8_t>(0x70 + i), kHalf, nullptr);
  }
  // Which small layer each lands beside is the allocator's choice: any will do.
  auto beside_a_layer = [&](void* tensor) {
    return std::any_of(small.begin(), small.end(),
                       [&](void* layer) { return first_chunk(layer) == first_chunk(tensor); });
  };
  ASSERT_GT(std::count_if(unhinted.begin(), unhinted.end(), beside_a_layer), 0)
      << "no small layer shares its chunk with a tensor made after it";
  // One more layer, in use: 68 MiB of parameters for 32 of device and 32 of host, so a
  // chunk of the host's goes to disk, a large layer's.
  void* more = allocator_->allocate(kLayer, nullptr, allocation_class::parameter);
  engine.use_begins(more, nullptr);
  device_->fill_async(more, 0x55, kLayer, nullptr);
  engine.mover().drain();
  EXPECT_GE(engine.mover().figures().chunks_to_disk, 1u);
  for (int i = 0; i < 2; ++i) {
    if (!beside_a_layer(unhinted[i])) continue;
    ASSERT_NE(where(unhinted[i]), residency::disk)
        << "tensor " << i << ": a chunk an unhinted tensor shares went to disk";
    EXPECT_TRUE(intact(unhinted[i], kHalf, 0x70 + i)) << "tensor " << i;  // read unhinted
  }
  engine.use_ends(more, nullptr);
  for (std::size_t i = 0; i < layers.size(); ++i) {  // the rest come back for their uses
    engine.use_begins(layers[i], nullptr);
    EXPECT_TRUE(intact(layers[i], kLayer, 0x20 + i)) << "layer " << i;
    engine.use_ends(layers[i], nullptr);
  }
  for (auto* group : {&small, &layers, &unhinted}) {
    for (void* pointer : *group) allocator_->deallocate(pointer);
  }
  allocator_->deallocate(more);
}

// With parameters allowed on disk, what goes first is what is needed farthest ahead: here
// the optimizer states, which no use has reached yet, before the parameters, which the
// forward uses again.
TEST_F(OffloadEngineDiskTest, OptimizerStatesGoToDiskBeforeParameters) {
  if (!start(16 * MiB, 32 * MiB, 256 * MiB, 0, /*parameters_to_disk=*/true)) {
    GTEST_SKIP() << "skipped: " << skipped_;
  }
  offload_engine& engine = *engine_;
  // 64 MiB: 16 on the device, 32 on the host, 16 for the disk. The states, made first, go
  // to the host first (nothing uses them yet); then the parameters fill it, and the last two
  // need two chunks of the host's to go to disk: the states, not the parameters beside them.
  std::vector<void*> states;
  for (int i = 0; i < 2; ++i) {
    states.push_back(allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state));
    device_->fill_async(states.back(), static_cast<std::uint8_t>(0x50 + i), kChunkBytes, nullptr);
  }
  std::vector<void*> layers;
  for (int i = 0; i < 6; ++i) {
    layers.push_back(allocator_->allocate(kChunkBytes, nullptr, allocation_class::parameter));
    device_->fill_async(layers.back(), static_cast<std::uint8_t>(0x20 + i), kChunkBytes, nullptr);
    engine.use_begins(layers.back(), nullptr);  // hinted: each may go to disk
    engine.use_ends(layers.back(), nullptr);
  }
  engine.mover().drain();
  EXPECT_EQ(engine.mover().figures().chunks_to_disk, 2u);
  for (std::size_t i = 0; i < states.size(); ++i) {
    EXPECT_EQ(where(states[i]), residency::disk) << "state " << i;
  }
  for (std::size_t i = 0; i < layers.size(); ++i) {
    EXPECT_NE(where(layers[i]), residency::disk) << "layer " << i << " went before the states";
  }
  for (std::size_t i = 0; i < states.size(); ++i) {
    engine.use_in_place(states[i], nullptr);
    EXPECT_TRUE(read_back(*device_, states[i], kChunkBytes) ==
                std::vector<std::uint8_t>(kChunkBytes, static_cast<std::uint8_t>(0x50 + i)));
    engine.use_ends(states[i], nullptr);
  }
  for (void* pointer : states) allocator_->deallocate(pointer);
  for (void* pointer : layers) allocator_->deallocate(pointer);
}

// Note [In-place uses in the order]: the windowed step uses each state in place, one after
// another, every step. With those uses in the learned order, the chunk that goes to disk to
// make host room is one the step has just used (its next use is a step away), and the
// prefetcher reads the next windows' states from disk ahead of their use: each byte on disk
// is read once a step. Without them (every state's next use "never") the spill picked
// arbitrary chunks, often the next ones needed: a 16B model read 3.5 times its disk-resident
// bytes a step on the H200.
TEST_F(OffloadEngineDiskTest, TheStepReadsEachStateOnDiskOnceAStepAndAheadOfItsUse) {
  if (!start(16 * MiB, 128 * MiB, 512 * MiB, /*prefetch_bytes=*/2 * kChunkBytes)) {
    GTEST_SKIP() << "skipped: " << skipped_;
  }
  offload_engine& engine = *engine_;
  constexpr int kStates = 40;  // 320 MiB: 16 on the device, 128 on the host, the rest on disk
  auto value = [](int step, int state) {
    return static_cast<std::uint8_t>((step * kStates + state) % 251);
  };
  std::vector<void*> states;
  for (int i = 0; i < kStates; ++i) {
    void* state = allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
    ASSERT_NE(state, nullptr) << "state " << i << " found no room";
    device_->fill_async(state, value(0, i), kChunkBytes, nullptr);
    states.push_back(state);
  }
  device_->synchronize_stream(nullptr);
  std::vector<std::uint64_t> read_per_step;
  std::vector<std::uint64_t> on_disk_at_start;
  for (int step = 1; step <= 4; ++step) {
    const migration_figures before = engine.mover().figures();
    on_disk_at_start.push_back(before.disk_resident_bytes);
    // The windowed step: each state where it is, in the optimizer's order, which need not
    // be the order of their addresses (here the reverse).
    for (int i = kStates - 1; i >= 0; --i) {
      engine.use_in_place(states[i], nullptr);
      ASSERT_NE(where(states[i]), residency::disk) << "step " << step << ", state " << i;
      ASSERT_TRUE(read_back(*device_, states[i], kChunkBytes) ==
                  std::vector<std::uint8_t>(kChunkBytes, value(step - 1, i)))
          << "step " << step << ", state " << i << ": not the last bytes written";
      device_->fill_async(states[i], value(step, i), kChunkBytes, nullptr);
      engine.use_ends(states[i], nullptr);
      EXPECT_LE(pool_->figures().in_use_bytes, 128 * MiB) << "the host limit was broken";
    }
    device_->synchronize_stream(nullptr);
    engine.step_boundary();
    read_per_step.push_back(engine.mover().figures().bytes_from_disk - before.bytes_from_disk);
  }
  engine.mover().drain();
  // The first step learns the order, and in the second the headroom for the prefetch
  // window sends the device's states out too. From the third, each chunk on disk is read
  // once, plus at most the chunks the window holds on the host (the one in use, the two
  // read ahead, one on its way to disk): no chunk on the host is done with for the step
  // when its first reads need room, so the farthest goes, and comes back at the step's end.
  // (Spilling in an arbitrary order read 3.5 times the disk's bytes a step on the H200.)
  for (int step = 3; step <= 4; ++step) {
    EXPECT_GE(on_disk_at_start[step - 1], 20 * kChunkBytes);
    EXPECT_LE(read_per_step[step - 1], on_disk_at_start[step - 1] + 4 * kChunkBytes)
        << "step " << step << " read states from disk more than once";
  }
  EXPECT_GT(engine.figures().disk_prefetches, 0u) << "no state was read ahead of its use";
  EXPECT_EQ(engine.figures().prefetches, 0u) << "a state used in place was fetched to the device";
  for (void* state : states) allocator_->deallocate(state);
}

// Random moves between the three tiers (explicit evictions and fetches from another
// thread, spills to disk when the host tier is full, restores for uses) race with
// "kernels" that read and rewrite the states under their hints: every byte survives, and
// every read sees the last value written.
TEST_F(OffloadEngineDiskTest, RandomMovesBetweenTheThreeTiersRacingWithKernelsKeepEveryByte) {
  if (!start(32 * MiB, 32 * MiB, 256 * MiB)) GTEST_SKIP() << "skipped: " << skipped_;
  offload_engine& engine = *engine_;
  stream_handle compute = device_->create_stream();
  constexpr int kStates = 12;  // 96 MiB: 32 on the device, 32 on the host, the rest on disk
  std::vector<void*> states;
  std::vector<std::uint8_t> expected(kStates);
  for (int i = 0; i < kStates; ++i) {
    states.push_back(allocator_->allocate(kChunkBytes, compute, allocation_class::optimizer_state));
    ASSERT_NE(states.back(), nullptr);
    engine.use_begins(states.back(), compute);
    expected[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(i + 1);
    device_->fill_async(states.back(), expected[static_cast<std::size_t>(i)], kChunkBytes, compute);
    engine.use_ends(states.back(), compute);
  }
  std::atomic<bool> done{false};
  std::string mover_failure;
  std::thread mover([&] {
    std::mt19937 random(11);
    try {
      while (!done.load()) {
        void* state = states[random() % kStates];
        try {
          if (random() % 2 == 0) {
            engine.evict(state, /*wait=*/random() % 4 == 0);
          } else {
            engine.fetch(state, /*wait=*/random() % 4 == 0);
          }
        } catch (const host_memory_exhausted&) {
          // An explicit eviction may be refused while every host chunk is busy (moving, or
          // in use): the caller is told, and nothing moves. Only the bytes matter here.
        }
      }
    } catch (const std::exception& failure) {
      mover_failure = failure.what();
    }
  });
  std::mt19937 random(5);
  int wrong = 0;
  for (int round = 0; round < 240; ++round) {
    const auto i = static_cast<std::size_t>(random() % kStates);
    if (random() % 2 == 0) {
      engine.use_in_place(states[i], compute);
    } else {
      engine.use_begins(states[i], compute);
    }
    const std::vector<std::uint8_t> seen = read_back(*device_, states[i], kChunkBytes, compute);
    if (seen != std::vector<std::uint8_t>(kChunkBytes, expected[i])) {
      ADD_FAILURE() << "state " << i << " in round " << round << " does not hold "
                    << int(expected[i]);
      if (++wrong > 3) break;
    }
    expected[i] = static_cast<std::uint8_t>(expected[i] % 250 + 1);
    device_->fill_async(states[i], expected[i], kChunkBytes, compute);
    engine.use_ends(states[i], compute);
    if (round % 40 == 39) engine.step_boundary();
  }
  done = true;
  mover.join();
  EXPECT_EQ(mover_failure, "") << "an eviction or fetch failed";
  device_->synchronize_stream(compute);
  for (std::size_t i = 0; i < states.size(); ++i) {
    engine.use_in_place(states[i], compute);
    EXPECT_TRUE(read_back(*device_, states[i], kChunkBytes, compute) ==
                std::vector<std::uint8_t>(kChunkBytes, expected[i]))
        << "state " << i << " at the end";
    engine.use_ends(states[i], compute);
  }
  const migration_figures moved = engine.mover().figures();
  EXPECT_GT(moved.chunks_to_disk, 0u) << "the disk tier was never used";
  EXPECT_GT(moved.chunks_from_disk, 0u);
  EXPECT_LE(pool_->figures().in_use_bytes, 32 * MiB) << "the host limit was broken";
  for (void* state : states) allocator_->deallocate(state);
  allocator_->forget_stream(compute);
  device_->destroy_stream(compute);
}

// A full disk tier is the host tier's message, as without one, and nothing is lost: the
// states on disk come back intact once the others are freed.
TEST_F(OffloadEngineDiskTest, AFullDiskTierFailsTheAllocationAndLosesNothing) {
  if (!start(48 * MiB, 32 * MiB, 32 * MiB)) GTEST_SKIP() << "skipped: " << skipped_;
  offload_engine& engine = *engine_;
  constexpr std::size_t kStateBytes = 2 * kChunkBytes;  // a segment of its own each
  std::vector<void*> states;
  bool refused = false;
  for (int i = 0; i < 12 && !refused; ++i) {  // 48 + 32 + 24 MiB hold 6 of them
    try {
      states.push_back(
          allocator_->allocate(kStateBytes, nullptr, allocation_class::optimizer_state));
    } catch (const out_of_memory& failure) {
      refused = true;
      EXPECT_NE(std::string(failure.what()).find("ZEROALLOC_HOST_LIMIT"), std::string::npos)
          << failure.what();
      break;
    }
    device_->fill_async(states.back(), static_cast<std::uint8_t>(0x60 + i), kStateBytes, nullptr);
    engine.use_begins(states.back(), nullptr);
    engine.use_ends(states.back(), nullptr);
  }
  EXPECT_TRUE(refused) << "12 states of 16 MiB fit in 48 + 32 + 32 MiB";
  // The disk tier is full but for one chunk's room, kept for bringing chunks back (Note
  // [Room kept for restores]).
  EXPECT_EQ(engine.mover().figures().disk_resident_bytes, 32 * MiB - kChunkBytes);
  EXPECT_EQ(disk_->figures().used_bytes, 32 * MiB - kChunkBytes);
  // The states with a chunk on disk stay; the rest go, and their memory with them.
  auto on_disk = [&](void* pointer) {
    std::vector<chunk_info> chunks;
    allocator_->chunks_of_allocation(pointer, chunks);
    return std::any_of(chunks.begin(), chunks.end(), [&](const chunk_info& chunk) {
      return engine.mover().where(chunk.address) == residency::disk;
    });
  };
  std::vector<std::pair<void*, std::uint8_t>> kept;
  for (std::size_t i = 0; i < states.size(); ++i) {
    if (on_disk(states[i])) {
      kept.emplace_back(states[i], static_cast<std::uint8_t>(0x60 + i));
    } else {
      allocator_->deallocate(states[i]);
    }
  }
  ASSERT_FALSE(kept.empty());
  allocator_->empty_cache();
  for (const auto& [state, value] : kept) {
    engine.use_begins(state, nullptr);
    EXPECT_TRUE(read_back(*device_, state, kStateBytes) ==
                std::vector<std::uint8_t>(kStateBytes, value))
        << "the state filled with " << int{value};
    engine.use_ends(state, nullptr);
  }
  for (const auto& [state, value] : kept) allocator_->deallocate(state);
}

// The largest model a machine trains fills every tier. A chunk on disk needs a host chunk
// to come back to, and the host tier makes room by sending another chunk to the disk: the
// disk tier keeps one chunk's room for that (Note [Room kept for restores]), so states that
// fill the device, the host and the disk still take their turns, step after step, intact.
TEST_F(OffloadEngineDiskTest, StatesFillingEveryTierStillComeBackForTheirUses) {
  if (!start(32 * MiB, 32 * MiB, 32 * MiB)) GTEST_SKIP() << "skipped: " << skipped_;
  offload_engine& engine = *engine_;
  // As many as fit: 96 MiB of tiers, less the room kept.
  std::vector<void*> states = states_filling_the_tiers(12, 0x20, /*in_place=*/false);
  ASSERT_GE(states.size(), 10u) << "the tiers hold 12 chunks less the one kept for restores";
  EXPECT_GE(engine.mover().figures().disk_resident_bytes, 24 * MiB);
  for (int round = 0; round < 3; ++round) {
    for (std::size_t i = 0; i < states.size(); ++i) {
      ASSERT_NO_THROW(engine.use_begins(states[i], nullptr))
          << "state " << i << ", round " << round;
      EXPECT_TRUE(read_back(*device_, states[i], kChunkBytes) ==
                  std::vector<std::uint8_t>(kChunkBytes, static_cast<std::uint8_t>(0x20 + i)))
          << "state " << i << ", round " << round;
      engine.use_ends(states[i], nullptr);
    }
    engine.step_boundary();
  }
  EXPECT_LE(allocator_->held_bytes(), 32 * MiB) << "the device limit was broken";
  EXPECT_LE(pool_->figures().in_use_bytes, 32 * MiB) << "the host limit was broken";
  for (void* state : states) allocator_->deallocate(state);
}

// A chunk whose bytes are on disk maps a placeholder that no access may touch: a copy that
// reads it faults instead of reading wrong bytes (the simulated device: the process dies).
TEST_F(OffloadEngineDiskTest, AReadOfAChunkOnDiskFaultsInsteadOfReadingWrongBytes) {
  if (!device_->is_simulated()) GTEST_SKIP() << "skipped: a fault would end the CUDA context";
  if (!start(32 * MiB, 16 * MiB, 64 * MiB)) GTEST_SKIP() << "skipped: " << skipped_;
  std::vector<void*> states;
  for (int i = 0; i < 8; ++i) {
    states.push_back(allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state));
    engine_->use_begins(states.back(), nullptr);
    engine_->use_ends(states.back(), nullptr);
  }
  void* on_disk = nullptr;
  for (void* state : states) {
    if (where(state) == residency::disk) on_disk = state;
  }
  ASSERT_NE(on_disk, nullptr);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // The child runs the test again, with a directory of its own: it removes it before the
  // read that ends it (the swap files stay open, and the read touches none of them).
  EXPECT_DEATH(
      {
        std::filesystem::remove_all(directory_);
        (void)read_back(*device_, on_disk, kChunkBytes);
      },
      "");
  engine_->use_begins(on_disk, nullptr);  // brought back, it reads again
  EXPECT_EQ(read_back(*device_, on_disk, 4096).size(), 4096u);
  engine_->use_ends(on_disk, nullptr);
  for (void* state : states) allocator_->deallocate(state);
}

// Note [Nothing movable]: when nothing on the device may move (every chunk has a use open),
// the error says so; once the use ends, even memory of class other moves (Note [Idle memory
// of any class]) and the allocation succeeds, with the moved bytes intact.
TEST_F(OffloadEngineTest, WithEveryChunkInUseTheMessageSaysSoAndAnEndedUseLetsItMove) {
  start(32 * MiB, 0);
  offload_engine& engine = *engine_;
  void* activations = allocator_->allocate(16 * MiB, nullptr, allocation_class::other);
  device_->fill_async(activations, 0x5a, 16 * MiB, nullptr);
  void* layer = allocator_->allocate(16 * MiB, nullptr, allocation_class::parameter);
  engine.use_begins(activations, nullptr);
  engine.use_begins(layer, nullptr);
  auto failure_of = [&] {
    try {
      allocator_->deallocate(allocator_->allocate(16 * MiB, nullptr, allocation_class::other));
    } catch (const out_of_memory& failure) {
      return std::string(failure.what());
    }
    return std::string("no failure");
  };
  const std::string message = failure_of();
  EXPECT_NE(message.find("nothing it may move is left on the device"), std::string::npos)
      << message;
  // 32 MiB in use and a 16 MiB segment for the request.
  EXPECT_NE(message.find("needs at least 48.00 MiB of device memory"), std::string::npos)
      << message;
  EXPECT_EQ(engine.mover().figures().bytes_to_host, 0u);
  engine.use_ends(activations, nullptr);
  EXPECT_EQ(failure_of(), "no failure");
  EXPECT_EQ(where_first_chunk(activations), residency::host);
  EXPECT_EQ(where_first_chunk(layer), residency::device);
  EXPECT_TRUE(holds(activations, 0x5a, 16 * MiB));
  engine.use_ends(layer, nullptr);
  allocator_->deallocate(activations);
  allocator_->deallocate(layer);
}

// Note [Landing in a moving chunk]: an allocation that takes free space in a chunk whose
// move to the host has started returns only once the move is over, so that what the
// program writes next is not left behind in the old backing.
TEST_F(OffloadEngineTest, AnAllocationInAChunkBeingMovedWaitsForTheMoveAndKeepsItsBytes) {
  start(256 * MiB, 0);
  offload_engine& engine = *engine_;
  void* kept = allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
  void* freed = allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
  device_->fill_async(kept, 0x11, kChunkBytes, nullptr);
  device_->synchronize_stream(nullptr);
  const std::uintptr_t chunk = first_chunk(freed);
  allocator_->deallocate(freed);  // its chunk now holds free space only
  // The move's copy waits behind 100 ms of other work.
  stream_handle busy = device_->create_stream();
  device_->host_function_async([] { std::this_thread::sleep_for(std::chrono::milliseconds(100)); },
                               busy);
  event_handle later = device_->create_event();
  device_->record_event(later, busy);
  const std::vector<event_handle> after{later};
  ASSERT_TRUE(engine.mover().evict_async(chunk, &after));
  void* landed = allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
  ASSERT_EQ(first_chunk(landed), chunk) << "the allocation did not take the moving chunk";
  EXPECT_NE(engine.mover().where(chunk), residency::moving_to_host)
      << "the allocation returned while its chunk was still moving";
  device_->fill_async(landed, 0x22, kChunkBytes, nullptr);
  engine.mover().drain();
  EXPECT_TRUE(holds(landed, 0x22, kChunkBytes));
  EXPECT_TRUE(holds(kept, 0x11, kChunkBytes));
  allocator_->deallocate(landed);
  allocator_->deallocate(kept);
  device_->destroy_event(later);
  device_->destroy_stream(busy);
}

TEST_F(OffloadEngineTest, ExplicitEvictAndFetchMoveAWholeAllocation) {
  start(256 * MiB, 0);
  offload_engine& engine = *engine_;
  void* pointer = allocator_->allocate(20 * MiB, nullptr, allocation_class::parameter);
  device_->fill_async(pointer, 0x42, 20 * MiB, nullptr);
  ASSERT_TRUE(engine.evict(pointer, /*wait=*/true));
  EXPECT_EQ(engine.mover().figures().host_resident_bytes, 20 * MiB);
  EXPECT_TRUE(holds(pointer, 0x42, 20 * MiB));
  ASSERT_TRUE(engine.fetch(pointer, /*wait=*/true));
  EXPECT_EQ(engine.mover().figures().host_resident_bytes, 0u);
  EXPECT_TRUE(holds(pointer, 0x42, 20 * MiB));
  int not_allocated = 0;
  EXPECT_FALSE(engine.evict(&not_allocated, true));
  allocator_->deallocate(pointer);
}

// Chunks hold several allocations: an explicit eviction of one leaves alone a chunk that
// another allocation is using (a use is open), since work queued after the eviction began
// would write the device copy that the move then discards.
TEST_F(OffloadEngineTest, ExplicitEvictLeavesAChunkSharedWithAnAllocationInUse) {
  start(256 * MiB, 0);
  offload_engine& engine = *engine_;
  void* evicted = allocator_->allocate(2 * MiB, nullptr, allocation_class::optimizer_state);
  void* in_use = allocator_->allocate(2 * MiB, nullptr, allocation_class::optimizer_state);
  std::vector<chunk_info> first, second;
  allocator_->chunks_of_allocation(evicted, first);
  allocator_->chunks_of_allocation(in_use, second);
  ASSERT_EQ(first.at(0).address, second.at(0).address) << "the test needs one shared chunk";
  device_->fill_async(evicted, 0x11, 2 * MiB, nullptr);
  device_->fill_async(in_use, 0x22, 2 * MiB, nullptr);

  engine.use_begins(in_use, nullptr);
  ASSERT_TRUE(engine.evict(evicted, /*wait=*/true));
  EXPECT_EQ(where_first_chunk(evicted), residency::device);
  device_->fill_async(in_use, 0x33, 2 * MiB, nullptr);  // the use's own work
  engine.use_ends(in_use, nullptr);

  ASSERT_TRUE(engine.evict(evicted, /*wait=*/true));  // the use is over: now it moves
  EXPECT_EQ(where_first_chunk(evicted), residency::host);
  EXPECT_TRUE(holds(evicted, 0x11, 2 * MiB));
  EXPECT_TRUE(holds(in_use, 0x33, 2 * MiB));
  allocator_->deallocate(evicted);
  allocator_->deallocate(in_use);
}

// The windowed pattern of an optimizer step that fetches its states instead of reaching
// them where they are: the next window's states are hinted on a side stream (their fetch
// starts) while this window is written on the main stream; then this window's use ends, the
// host waits for it, and its states are evicted without waiting, next to chunks still in
// use. Under a limit that holds a fraction of the states, every write must survive. With
// the prefetcher on, this caught a fetch that marked its chunk "moving" only after the
// remap: a use beginning in between wrote early and the copy-in overwrote it.
TEST_F(OffloadEngineTest, WindowsFetchedAheadAndEvictedBehindKeepEveryWrite) {
  start(64 * MiB, 32 * MiB);  // the prefetcher races the hints, as in training
  offload_engine& engine = *engine_;
  constexpr int kStates = 36;
  constexpr int kWindow = 4;
  constexpr std::size_t kStateBytes = 3 * MiB;
  std::vector<void*> states;
  for (int i = 0; i < kStates; ++i) {
    states.push_back(allocator_->allocate(kStateBytes, nullptr, allocation_class::optimizer_state));
    device_->fill_async(states.back(), 1, kStateBytes, nullptr);
  }
  for (void* state : states) ASSERT_TRUE(engine.evict(state, /*wait=*/true));
  stream_handle side = device_->create_stream();
  event_handle fetched = device_->create_event();
  auto value = [](int round, int index) {
    return static_cast<std::uint8_t>(round * 40 + index + 2);
  };
  for (int round = 0; round < 5; ++round) {
    auto hint = [&](int window, bool begin, stream_handle stream) {
      for (int i = window * kWindow; i < std::min(kStates, (window + 1) * kWindow); ++i) {
        if (begin) {
          engine.use_begins(states[i], stream);
        } else {
          engine.use_ends(states[i], stream);
        }
      }
    };
    const int windows = (kStates + kWindow - 1) / kWindow;
    hint(0, true, side);
    for (int window = 0; window < windows; ++window) {
      if (window + 1 < windows) hint(window + 1, true, side);
      device_->record_event(fetched, side);
      device_->stream_wait_event(nullptr, fetched);
      for (int i = window * kWindow; i < std::min(kStates, (window + 1) * kWindow); ++i) {
        device_->fill_async(states[i], value(round, i), kStateBytes, nullptr);
      }
      hint(window, false, nullptr);
      device_->synchronize_stream(nullptr);
      for (int i = window * kWindow; i < std::min(kStates, (window + 1) * kWindow); ++i) {
        ASSERT_TRUE(engine.evict(states[i], /*wait=*/false));
      }
    }
    device_->synchronize_stream(side);
    for (void* state : states) settle(state);  // a state may span two chunks
    engine.step_boundary();
    for (int i = 0; i < kStates; ++i) {
      // Read as a user must, under a use: the prefetcher may be bringing a chunk back along
      // the learned order (the last window's hints wished for the next chunks) after
      // settle() returned, and an unhinted read raced that copy (3 to 5 runs in 40 with two
      // runs at once, before and after this session's engine changes; 0 in 80 so).
      engine.use_begins(states[i], nullptr);
      ASSERT_TRUE(holds(states[i], value(round, i), kStateBytes))
          << "round " << round << ", state " << i;
      engine.use_ends(states[i], nullptr);
    }
  }
  device_->destroy_event(fetched);
  device_->destroy_stream(side);
  for (void* state : states) allocator_->deallocate(state);
}

// 7 MiB states come in 20 MiB segments, two to a segment with a 6 MiB free tail that no
// 7 MiB request fits. Once the states have gone to the host, the device is held by those
// tails alone: the allocation-failure path must give them up too (they hold nothing), or a
// new state fails with 72 MiB cached and free.
TEST_F(OffloadEngineTest, FreeTailsOfOffloadedSegmentsMakeRoomForANewAllocation) {
  start(64 * MiB, 0);
  constexpr std::size_t kStateBytes = 7 * MiB;
  std::vector<void*> states;
  for (int i = 0; i < 36; ++i) {
    states.push_back(allocator_->allocate(kStateBytes, nullptr, allocation_class::optimizer_state));
    device_->fill_async(states.back(), static_cast<std::uint8_t>(i + 1), kStateBytes, nullptr);
  }
  device_->synchronize_stream(nullptr);
  for (int i = 0; i < 36; ++i) {
    settle(states[i]);
    EXPECT_TRUE(holds(states[i], static_cast<std::uint8_t>(i + 1), kStateBytes)) << "state " << i;
  }
  for (void* state : states) allocator_->deallocate(state);
}

// The policy on a recorded order: after a step that used A, B, C, D in that order, and a
// new step that has used A and B, the chunk needed last is B (next step), then A; C and D,
// needed next, stay. The allocation-failure path evicts in that order.
TEST_F(OffloadEngineTest, PressureEvictsTheChunkWhoseNextUseIsFarthestInTheLearnedOrder) {
  start(256 * MiB, 0);
  offload_engine& engine = *engine_;
  stream_handle stream = nullptr;
  std::vector<void*> layers;  // A, B, C, D: one 8 MiB chunk each
  for (int i = 0; i < 4; ++i) {
    layers.push_back(allocator_->allocate(kChunkBytes, stream, allocation_class::parameter));
  }
  auto use = [&](int i) {
    engine.use_begins(layers[i], stream);
    engine.use_ends(layers[i], stream);
  };
  for (int i = 0; i < 4; ++i) use(i);
  engine.step_boundary();  // learned: A B C D
  device_->synchronize_stream(stream);
  auto on_host = [&](int i) { return where_first_chunk(layers[i]) == residency::host; };
  use(0);
  use(1);  // cursor at B: next uses C (1 away), D (2), A (next step: 3), B itself (4)
  ASSERT_GT(engine.relieve_pressure(kChunkBytes), 0u);
  EXPECT_TRUE(on_host(1)) << "B, just used, is needed last";
  EXPECT_FALSE(on_host(0) || on_host(2) || on_host(3));
  ASSERT_GT(engine.relieve_pressure(kChunkBytes), 0u);
  EXPECT_TRUE(on_host(0)) << "then A, used before B";
  EXPECT_FALSE(on_host(2) || on_host(3)) << "C and D come next: they stay";
  for (void* layer : layers) allocator_->deallocate(layer);
}

TEST_F(OffloadEngineTest, BeforeAnyOrderIsKnownTheLeastRecentlyUsedChunkGoesFirst) {
  start(256 * MiB, 0);
  offload_engine& engine = *engine_;
  std::vector<void*> states;
  for (int i = 0; i < 3; ++i) {
    states.push_back(allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state));
  }
  for (int i : {2, 0, 1}) {  // used last to first: 1, then 0, then 2 is the oldest
    engine.use_begins(states[i], nullptr);
    engine.use_ends(states[i], nullptr);
  }
  device_->synchronize_stream(nullptr);
  ASSERT_GT(engine.relieve_pressure(kChunkBytes), 0u);
  std::vector<chunk_info> chunks;
  allocator_->chunks_of_allocation(states[2], chunks);
  EXPECT_EQ(engine.mover().where(chunks.at(0).address), residency::host);
  for (void* state : states) allocator_->deallocate(state);
}

// With no hint at all, the allocator's order is what the engine knows: the state whose
// memory was least recently allocated or freed goes first (not whichever the chunk list
// happens to name first).
TEST_F(OffloadEngineTest, WithoutHintsTheLeastRecentlyAllocatedOrFreedChunkGoesFirst) {
  start(256 * MiB, 0);
  offload_engine& engine = *engine_;
  constexpr std::size_t kStateBytes = 2 * kChunkBytes;  // a segment of its own, two chunks
  auto allocate = [&] {
    return allocator_->allocate(kStateBytes, nullptr, allocation_class::optimizer_state);
  };
  std::vector<void*> states;
  for (int i = 0; i < 4; ++i) states.push_back(allocate());
  // Reallocated in the order 0, 3, 1: state 2 is the one the program touched longest ago.
  for (int i : {0, 3, 1}) {
    allocator_->deallocate(states[i]);
    states[i] = allocate();
  }
  device_->synchronize_stream(nullptr);
  ASSERT_GT(engine.relieve_pressure(kStateBytes), 0u);
  auto on_host = [&](void* pointer) {
    std::vector<chunk_info> chunks;
    allocator_->chunks_of_allocation(pointer, chunks);
    std::size_t count = 0;
    for (const chunk_info& chunk : chunks) {
      count += engine.mover().where(chunk.address) == residency::host ? 1 : 0;
    }
    return count;
  };
  EXPECT_EQ(on_host(states[2]), 2u);
  for (int i : {0, 1, 3}) EXPECT_EQ(on_host(states[i]), 0u) << i;
  for (void* state : states) allocator_->deallocate(state);
}

// Optimizer states hinted as used in place (Note [Used in place]) stay where they are: the
// one on the host is never fetched, by the hint or by the prefetcher, and is kept out of the
// learned order; while the use is open, pressure cannot move either state.
// Note [Released on every stream]: a chunk whose uses ended on two streams moves only after
// the work of both; the event of the stream whose use ended last covered that one alone.
TEST_F(OffloadEngineTest, AnEvictionWaitsForTheLastUseOnEveryStreamTheChunkWasUsedOn) {
  start(256 * MiB, 0);
  offload_engine& engine = *engine_;
  stream_handle slow = device_->create_stream();
  stream_handle quick = device_->create_stream();
  void* state = allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
  device_->fill_async(state, 0x21, kChunkBytes, nullptr);
  device_->synchronize_stream(nullptr);
  std::atomic<bool> slow_work_done{false};
  engine.use_begins(state, slow);
  device_->host_function_async(
      [&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        slow_work_done = true;
      },
      slow);
  engine.use_ends(state, slow);
  engine.use_begins(state, quick);
  engine.use_ends(state, quick);
  device_->synchronize_stream(quick);
  ASSERT_GE(engine.relieve_pressure(kChunkBytes), kChunkBytes);
  engine.mover().drain();
  EXPECT_TRUE(slow_work_done) << "the chunk moved while the slow stream's work could use it";
  EXPECT_EQ(where_first_chunk(state), residency::host);
  EXPECT_TRUE(holds(state, 0x21, kChunkBytes));
  device_->synchronize_stream(slow);
  allocator_->deallocate(state);
  allocator_->forget_stream(slow);
  allocator_->forget_stream(quick);
  device_->destroy_stream(slow);
  device_->destroy_stream(quick);
}

// A use hinted on a stream the allocator does not know of (no record_stream) is fenced by
// its use-ends event, also once an allocation in the chunk's segment has made the engine
// fence the chunk's own streams: the two together, not one instead of the other.
TEST_F(OffloadEngineTest, AnEvictionWaitsForAHintedUseOnAnUnknownStreamAfterItsSegmentChanged) {
  start(256 * MiB, 0);
  offload_engine& engine = *engine_;
  stream_handle side = device_->create_stream();
  void* state = allocator_->allocate(kChunkBytes / 2, nullptr, allocation_class::optimizer_state);
  device_->fill_async(state, 0x21, kChunkBytes / 2, nullptr);
  device_->synchronize_stream(nullptr);
  std::atomic<bool> side_work_done{false};
  engine.use_begins(state, side);
  device_->host_function_async(
      [&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        side_work_done = true;
      },
      side);
  engine.use_ends(state, side);
  std::vector<chunk_info> before;
  allocator_->chunks_of_allocation(state, before);
  void* neighbour =
      allocator_->allocate(kChunkBytes / 2, nullptr, allocation_class::optimizer_state);
  std::vector<chunk_info> after;
  allocator_->chunks_of_allocation(state, after);
  ASSERT_NE(before.at(0).generation, after.at(0).generation) << "the segment did not change";
  ASSERT_TRUE(engine.evict(state, /*wait=*/true));
  EXPECT_TRUE(side_work_done) << "the chunk moved while the side stream's work could use it";
  EXPECT_EQ(where_first_chunk(state), residency::host);
  EXPECT_TRUE(holds(state, 0x21, kChunkBytes / 2));
  allocator_->deallocate(neighbour);
  allocator_->deallocate(state);
  device_->synchronize_stream(side);
  device_->destroy_stream(side);
}

// A use that never ended (a caller that sends no end for it) is closed by the step
// boundary, but no use-ends fence covers what it queued: the chunk's older use-ends event
// has long completed. An eviction under pressure then waits for the chunk's streams.
TEST_F(OffloadEngineTest, AUseLeftOpenAtTheStepBoundaryIsWaitedForByTheNextEviction) {
  start(256 * MiB, 0);
  offload_engine& engine = *engine_;
  stream_handle compute = device_->create_stream();
  void* state = allocator_->allocate(kChunkBytes, compute, allocation_class::optimizer_state);
  device_->fill_async(state, 0x21, kChunkBytes, compute);
  engine.use_begins(state, compute);
  engine.use_ends(state, compute);
  device_->synchronize_stream(compute);  // that use's end has passed
  std::atomic<bool> open_work_done{false};
  engine.use_begins(state, compute);
  device_->host_function_async(
      [&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        open_work_done = true;
      },
      compute);
  engine.step_boundary();
  ASSERT_GE(engine.relieve_pressure(kChunkBytes), kChunkBytes);
  engine.mover().drain();
  EXPECT_TRUE(open_work_done) << "the chunk moved while the unended use's work could use it";
  EXPECT_EQ(where_first_chunk(state), residency::host);
  EXPECT_TRUE(holds(state, 0x21, kChunkBytes));
  allocator_->deallocate(state);
  allocator_->forget_stream(compute);
  device_->destroy_stream(compute);
}

// Note [Idle at the claim]: a fetch decides whether its chunk is idle (no queued work
// touches it: mapped on the device at once, bytes arriving behind an event) at each
// attempt. Here its first attempt finds no room and evicts; before the second, another
// use works on the chunk where it is, on the host, with a read queued behind a "kernel".
// Decided once before the attempts, the chunk counted as idle: it was mapped on the
// device, whose bytes had not arrived (the copy-in stream was held up), and that read saw
// them. Decided at the claim, the fetch waits for the read.
TEST_F(OffloadEngineTest, AUseBetweenTwoAttemptsOfAFetchMakesTheFetchWaitForIt) {
  constexpr std::size_t kBytes = 2 * kChunkBytes;  // 10 MiB or more: a segment of its own
  stream_handle reader = device_->create_stream();
  stream_handle other = device_->create_stream();
  std::vector<std::uint8_t> seen(kBytes, 0);
  auto gate_reader = std::make_shared<std::promise<void>>();
  auto gate_other = std::make_shared<std::promise<void>>();
  void* state = nullptr;
  void* held_up = nullptr;
  bool hooked = false;
  std::uintptr_t retried = 0;
  start(3 * kBytes, 0, [&](std::uintptr_t address) {
    if (hooked || state == nullptr) return;
    std::vector<chunk_info> chunks;
    allocator_->chunks_of_allocation(state, chunks);
    if (std::none_of(chunks.begin(), chunks.end(),
                     [&](const chunk_info& chunk) { return chunk.address == address; })) {
      return;
    }
    hooked = true;
    retried = address;
    allocator_->set_limit(256 * MiB, "ZEROALLOC_MEMORY_LIMIT (test)");
    // Holds up the copy-in stream: a fetch that waits for `other`.
    std::shared_future<void> open_other = gate_other->get_future().share();
    device_->host_function_async([open_other] { open_other.wait(); }, other);
    EXPECT_TRUE(engine_->mover().fetch_async(first_chunk(held_up)));
    // Another use of the state, on the host, its read behind a slow "kernel".
    engine_->use_in_place(state, reader);
    std::shared_future<void> open_reader = gate_reader->get_future().share();
    device_->host_function_async([open_reader] { open_reader.wait(); }, reader);
    device_->copy_async(seen.data(), state, kBytes, reader);
    engine_->use_ends(state, reader);
  });
  offload_engine& engine = *engine_;
  state = allocator_->allocate(kBytes, reader, allocation_class::optimizer_state);
  void* layer = allocator_->allocate(kBytes, nullptr, allocation_class::parameter);
  held_up = allocator_->allocate(kBytes, other, allocation_class::optimizer_state);
  device_->fill_async(state, 0x11, kBytes, reader);
  device_->fill_async(layer, 0x33, kBytes, nullptr);
  device_->fill_async(held_up, 0x44, kBytes, other);
  for (stream_handle stream : {reader, other, static_cast<stream_handle>(nullptr)}) {
    device_->synchronize_stream(stream);
  }
  for (void* pointer : {state, layer}) {  // hinted, and an order learned
    engine.use_begins(pointer, nullptr);
    engine.use_ends(pointer, nullptr);
  }
  device_->synchronize_stream(nullptr);
  engine.step_boundary();
  ASSERT_TRUE(engine.evict(state, /*wait=*/true));
  ASSERT_TRUE(engine.evict(held_up, /*wait=*/true));
  // Their device chunks serve an activation: no room for the state until the layer goes.
  void* activations = allocator_->allocate(2 * kBytes, nullptr, allocation_class::other);
  ASSERT_EQ(allocator_->paging().arena().pooled_bytes(), 0u);
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    gate_reader->set_value();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    gate_other->set_value();
  });
  engine.use_begins(state, nullptr);  // on the host: fetched now, with a retry
  engine.use_ends(state, nullptr);
  opener.join();
  engine.mover().drain();
  device_->synchronize_stream(reader);
  EXPECT_TRUE(hooked) << "the fetch did not retry: the test set-up is wrong";
  EXPECT_EQ(seen, std::vector<std::uint8_t>(kBytes, 0x11))
      << "a use queued between two attempts of a fetch read the device chunk before its bytes";
  EXPECT_EQ(engine.mover().where(retried), residency::device);
  EXPECT_TRUE(holds(state, 0x11, kBytes));
  EXPECT_TRUE(holds(held_up, 0x44, kBytes));
  for (void* pointer : {state, layer, held_up, activations}) allocator_->deallocate(pointer);
  for (stream_handle stream : {reader, other}) {
    allocator_->forget_stream(stream);
    device_->destroy_stream(stream);
  }
}

TEST_F(OffloadEngineTest, StatesUsedInPlaceStayWhereTheyAreAndArePinnedDuringTheUse) {
  start(256 * MiB, 64 * MiB);
  offload_engine& engine = *engine_;
  stream_handle stream = nullptr;
  void* layer = allocator_->allocate(kChunkBytes, stream, allocation_class::parameter);
  void* away = allocator_->allocate(kChunkBytes, stream, allocation_class::optimizer_state);
  void* here = allocator_->allocate(kChunkBytes, stream, allocation_class::optimizer_state);
  device_->fill_async(away, 0x11, kChunkBytes, stream);
  device_->fill_async(here, 0x22, kChunkBytes, stream);
  ASSERT_TRUE(engine.evict(away, /*wait=*/true));
  auto where = [&](void* pointer) { return where_first_chunk(pointer); };
  std::vector<chunk_info> spanned;  // the chunks the two states span (one or two each)
  allocator_->chunks_of_allocation(away, spanned);
  allocator_->chunks_of_allocation(here, spanned);
  for (int step = 0; step < 3; ++step) {
    engine.use_begins(layer, stream);
    engine.use_ends(layer, stream);
    engine.use_in_place(away, stream);
    engine.use_in_place(here, stream);
    EXPECT_EQ(where(away), residency::host) << "step " << step << ": fetched for its use";
    EXPECT_EQ(engine.figures().chunks_in_use, spanned.size());
    engine.mover().drain();  // the layer's fetch (a miss after the last step's pressure)
    EXPECT_EQ(engine.relieve_pressure(3 * kChunkBytes), kChunkBytes)
        << "only the idle parameter may go";
    EXPECT_EQ(where(here), residency::device) << "moved while in use";
    // The "kernel": one pass that updates both states where they are.
    device_->fill_async(away, static_cast<std::uint8_t>(0x30 + step), kChunkBytes, stream);
    device_->fill_async(here, static_cast<std::uint8_t>(0x40 + step), kChunkBytes, stream);
    engine.use_ends(away, stream);
    engine.use_ends(here, stream);
    EXPECT_EQ(engine.figures().chunks_in_use, 0u);
    engine.step_boundary();
    device_->synchronize_stream(stream);
  }
  engine.mover().drain();
  EXPECT_EQ(where(away), residency::host) << "the prefetcher brought it back";
  // Note [In-place uses in the order]: not in the device's order, never fetched to it.
  EXPECT_EQ(engine.figures().learned_order_chunks, 1u) << "states in the device's order";
  EXPECT_EQ(engine.figures().prefetches, 0u) << "a state used in place was fetched";
  EXPECT_EQ(engine.figures().in_place_uses, 3 * spanned.size());
  // Only the state used where it lies on the host was read over PCIe, each step.
  std::vector<chunk_info> away_chunks;
  allocator_->chunks_of_allocation(away, away_chunks);
  std::uint64_t away_bytes = 0;
  for (const chunk_info& chunk : away_chunks) away_bytes += chunk.handle.bytes;
  EXPECT_EQ(engine.figures().in_place_host_bytes, 3 * away_bytes);
  EXPECT_TRUE(holds(away, 0x32, kChunkBytes));
  EXPECT_TRUE(holds(here, 0x42, kChunkBytes));
  for (void* pointer : {layer, away, here}) allocator_->deallocate(pointer);
}

// Note [Moving a chunk in use]: a use that begins on a host-resident chunk while another
// use is open on it (a use in place, whose caller copies the chunk when it likes, or a use
// on another thread) runs on the host: fetching it then would move the backing from under
// the open use, whose writes would land in host memory being left. Once no other use is
// open, the next use brings it back.
TEST_F(OffloadEngineTest, AUseOfAChunkUsedInPlaceElsewhereLeavesItWhereItIs) {
  start(256 * MiB, 0);
  offload_engine& engine = *engine_;
  stream_handle stream = nullptr;
  stream_handle other = device_->create_stream();
  void* state = allocator_->allocate(kChunkBytes, stream, allocation_class::optimizer_state);
  device_->fill_async(state, 0x11, kChunkBytes, stream);
  ASSERT_TRUE(engine.evict(state, /*wait=*/true));
  engine.use_in_place(state, stream);  // the step updates it where it is
  engine.use_begins(state, other);     // meanwhile another thread reads it
  engine.mover().drain();
  EXPECT_EQ(where_first_chunk(state), residency::host) << "moved under a use in place";
  EXPECT_TRUE(engine.fetch(state, /*wait=*/true));
  EXPECT_EQ(where_first_chunk(state), residency::host) << "an explicit fetch moved it in use";
  device_->fill_async(state, 0x22, kChunkBytes, stream);  // the in-place update
  engine.use_ends(state, other);
  engine.use_ends(state, stream);
  EXPECT_EQ(engine.figures().used_on_host, 1u);
  engine.use_begins(state, stream);  // no other use open: a miss brings it back
  engine.mover().drain();
  EXPECT_EQ(where_first_chunk(state), residency::device);
  engine.use_ends(state, stream);
  device_->synchronize_stream(stream);
  EXPECT_TRUE(holds(state, 0x22, kChunkBytes));
  allocator_->deallocate(state);
  allocator_->forget_stream(other);
  device_->destroy_stream(other);
}

// A hint that names two allocations of one chunk (a layer's weight and bias) opens two
// uses on it, both its own: a miss still brings the chunk back.
TEST_F(OffloadEngineTest, AHintForTwoAllocationsOfOneChunkBringsTheChunkBack) {
  start(256 * MiB, 0);
  offload_engine& engine = *engine_;
  void* weight = allocator_->allocate(4 * MiB, nullptr, allocation_class::parameter);
  void* bias = allocator_->allocate(4 * MiB, nullptr, allocation_class::parameter);
  ASSERT_EQ(first_chunk(weight), first_chunk(bias)) << "the test needs them in one chunk";
  device_->fill_async(bias, 0x31, 4 * MiB, nullptr);
  ASSERT_TRUE(engine.evict(weight, /*wait=*/true));
  ASSERT_EQ(where_first_chunk(bias), residency::host);
  const void* both[] = {weight, bias};
  const std::span<const void* const> layer(both);
  engine.use_begins(layer, nullptr);
  engine.mover().drain();
  EXPECT_EQ(where_first_chunk(bias), residency::device) << "left on the host by its own uses";
  EXPECT_EQ(engine.figures().used_on_host, 0u);
  engine.use_ends(layer, nullptr);
  EXPECT_TRUE(holds(bias, 0x31, 4 * MiB));
  allocator_->deallocate(weight);
  allocator_->deallocate(bias);
}

// Where host chunks come only whole (every CUDA driver measured), an eviction prefers a
// chunk that a ready host chunk of its size can take over one that would have to create
// pinned memory on the training path (Note [Host chunk sizes]), and takes the latter only
// when nothing else is left.
TEST_F(OffloadEngineTest, WithWholeHostChunksVictimsWithAReadyHostChunkGoFirst) {
  if (!start_with_whole_host_chunks()) GTEST_SKIP() << "skipped: this driver maps slices";
  offload_engine& engine = *engine_;
  // An odd-sized state (one 14 MiB segment, one 14 MiB chunk... split 8 + 6 MiB) used first,
  // then a whole-chunk one: by least recent use the odd one's 6 MiB tail would go first.
  void* odd = allocator_->allocate(14 * MiB, nullptr, allocation_class::optimizer_state);
  void* whole = allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
  device_->fill_async(odd, 0x5a, 14 * MiB, nullptr);
  device_->fill_async(whole, 0xa5, kChunkBytes, nullptr);
  std::vector<chunk_info> odd_chunks;
  allocator_->chunks_of_allocation(odd, odd_chunks);
  ASSERT_EQ(odd_chunks.size(), 2u);
  ASSERT_NE(odd_chunks.back().handle.bytes, kChunkBytes);
  for (void* pointer : {odd, whole}) {
    engine.use_begins(pointer, nullptr);
    engine.use_ends(pointer, nullptr);
  }
  device_->synchronize_stream(nullptr);
  auto where = [&](std::uintptr_t address) { return engine.mover().where(address); };
  ASSERT_GT(engine.relieve_pressure(2 * MiB), 0u);
  EXPECT_EQ(where(odd_chunks.front().address), residency::host) << "the least recent whole chunk";
  EXPECT_EQ(where(odd_chunks.back().address), residency::device);
  EXPECT_EQ(pool_->figures().created_on_demand, 0u);
  ASSERT_GT(engine.relieve_pressure(2 * MiB), 0u);
  EXPECT_EQ(where(odd_chunks.back().address), residency::device) << "a whole chunk was left";
  ASSERT_GT(engine.relieve_pressure(2 * MiB), 0u);
  EXPECT_EQ(where(odd_chunks.back().address), residency::host) << "nothing else was left";
  EXPECT_EQ(pool_->figures().created_on_demand, 1u);
  EXPECT_TRUE(holds(odd, 0x5a, 14 * MiB));
  EXPECT_TRUE(holds(whole, 0xa5, kChunkBytes));
  allocator_->deallocate(odd);
  allocator_->deallocate(whole);
}

// The ready-host-chunk preference never overrides the learned order: the chunk needed last
// goes first even when a pinned host chunk has to be created for it.
TEST_F(OffloadEngineTest, WithWholeHostChunksTheFarthestNextUseStillGoesFirst) {
  if (!start_with_whole_host_chunks()) GTEST_SKIP() << "skipped: this driver maps slices";
  offload_engine& engine = *engine_;
  void* odd = allocator_->allocate(14 * MiB, nullptr, allocation_class::optimizer_state);
  void* whole = allocator_->allocate(kChunkBytes, nullptr, allocation_class::parameter);
  std::vector<chunk_info> odd_chunks;
  std::vector<chunk_info> whole_chunks;
  allocator_->chunks_of_allocation(odd, odd_chunks);
  allocator_->chunks_of_allocation(whole, whole_chunks);
  ASSERT_EQ(odd_chunks.size(), 2u);
  auto use = [&](void* pointer) {
    engine.use_begins(pointer, nullptr);
    engine.use_ends(pointer, nullptr);
  };
  use(odd);
  use(whole);
  engine.step_boundary();  // learned: odd (8 MiB, 6 MiB), whole
  use(odd);                // next uses: whole (1 away), odd's first chunk (2), odd's tail (3)
  device_->synchronize_stream(nullptr);
  ASSERT_GT(engine.relieve_pressure(2 * MiB), 0u);
  auto where = [&](std::uintptr_t address) { return engine.mover().where(address); };
  EXPECT_EQ(where(odd_chunks.back().address), residency::host) << "the farthest next use";
  EXPECT_EQ(where(odd_chunks.front().address), residency::device);
  EXPECT_EQ(where(whole_chunks.front().address), residency::device);
  EXPECT_EQ(pool_->figures().created_on_demand, 1u);
  allocator_->deallocate(odd);
  allocator_->deallocate(whole);
}

// Gradients are evicted only on the allocation-failure path and only when nothing else can
// go, free space included, even when they were used longer ago (Note [Residency policy]).
TEST_F(OffloadEngineTest, GradientsAreEvictedLast) {
  start(256 * MiB, 0);
  offload_engine& engine = *engine_;
  void* gradient = allocator_->allocate(kChunkBytes, nullptr, allocation_class::gradient);
  void* state = allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
  for (void* pointer : {gradient, state}) {  // the gradient is the least recently used
    engine.use_begins(pointer, nullptr);
    engine.use_ends(pointer, nullptr);
  }
  device_->synchronize_stream(nullptr);
  auto on_host = [&](void* pointer) { return where_first_chunk(pointer) == residency::host; };
  ASSERT_GT(engine.relieve_pressure(2 * MiB), 0u);
  EXPECT_TRUE(on_host(state));
  EXPECT_FALSE(on_host(gradient));
  // Then the free space of both segments (it holds nothing), and only then the gradient.
  int relieved = 0;
  while (!on_host(gradient)) {
    ASSERT_GT(engine.relieve_pressure(2 * MiB), 0u) << "the gradient never went";
    ASSERT_LT(++relieved, 16);
  }
  EXPECT_GT(relieved, 1) << "the gradient went before the free space";
  allocator_->deallocate(gradient);
  allocator_->deallocate(state);
}

// Note [Idle memory of any class]: memory of class other (a checkpoint loaded onto the
// device, say) goes only when an allocation would otherwise fail, after the states, the
// free space and the gradients, the least recently allocated or freed first; it keeps its
// bytes on the host, and evictions ahead of need never take it.
TEST_F(OffloadEngineTest, IdleMemoryOfClassOtherMovesLastAndKeepsItsBytes) {
  start(256 * MiB, 0);
  offload_engine& engine = *engine_;
  // Loaded first: the least recently allocated or freed of the two.
  void* loaded = allocator_->allocate(16 * MiB, nullptr, allocation_class::other);
  device_->fill_async(loaded, 0x3c, 16 * MiB, nullptr);
  void* recent = allocator_->allocate(16 * MiB, nullptr, allocation_class::other);
  device_->fill_async(recent, 0x4d, 16 * MiB, nullptr);
  void* gradient = allocator_->allocate(kChunkBytes, nullptr, allocation_class::gradient);
  void* state = allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
  for (void* pointer : {gradient, state}) {
    engine.use_begins(pointer, nullptr);
    engine.use_ends(pointer, nullptr);
  }
  device_->synchronize_stream(nullptr);
  auto on_host = [&](void* pointer) { return where_first_chunk(pointer) == residency::host; };
  ASSERT_GT(engine.relieve_pressure(2 * MiB), 0u);
  EXPECT_TRUE(on_host(state));
  EXPECT_FALSE(on_host(loaded));
  int relieved = 0;
  while (!on_host(loaded)) {
    EXPECT_FALSE(on_host(recent)) << "the most recently active memory of class other went first";
    ASSERT_GT(engine.relieve_pressure(2 * MiB), 0u) << "the idle memory of class other never went";
    ASSERT_LT(++relieved, 32);
  }
  EXPECT_TRUE(on_host(gradient)) << "memory of class other went before the gradient";
  EXPECT_TRUE(holds(loaded, 0x3c, 16 * MiB));
  EXPECT_TRUE(holds(recent, 0x4d, 16 * MiB));
  for (void* pointer : {loaded, recent, gradient, state}) allocator_->deallocate(pointer);
}

// Note [Idle classes' cache]: the gradients' cache, held from one step's end to the next
// backward with nothing in it, is what a fetch takes room from, before any live chunk moves.
TEST_F(OffloadEngineTest, AFetchTakesTheCacheOfAClassWithNothingAllocatedBeforeAnythingLive) {
  start(48 * MiB, 0);
  offload_engine& engine = *engine_;
  // Requests of 10 MiB or more get segments of their own size.
  void* layer = allocator_->allocate(16 * MiB, nullptr, allocation_class::parameter);
  void* state = allocator_->allocate(16 * MiB, nullptr, allocation_class::optimizer_state);
  device_->fill_async(layer, 0x11, 16 * MiB, nullptr);
  device_->fill_async(state, 0x22, 16 * MiB, nullptr);
  ASSERT_TRUE(engine.evict(layer, /*wait=*/true));
  void* activations = allocator_->allocate(8 * MiB, nullptr, allocation_class::other);
  void* gradient = allocator_->allocate(16 * MiB, nullptr, allocation_class::gradient);
  allocator_->deallocate(gradient);  // zero_grad: the class keeps its cache, nothing in it
  const std::uint64_t gradients_cache =
      allocator_->stats().of(allocation_class::gradient).reserved_bytes.current;
  ASSERT_EQ(gradients_cache, 16 * MiB);
  EXPECT_EQ(allocator_->paging().idle_cache_bytes(), gradients_cache);

  ASSERT_TRUE(engine.fetch(layer, /*wait=*/true));
  EXPECT_EQ(where_first_chunk(layer), residency::device);
  EXPECT_EQ(where_first_chunk(state), residency::device) << "a live state moved for the fetch";
  EXPECT_EQ(engine.mover().figures().bytes_to_host, 16 * MiB) << "only the layer's eviction";
  EXPECT_EQ(allocator_->stats().of(allocation_class::gradient).reserved_bytes.current, 0);
  EXPECT_LE(allocator_->held_bytes(), 48 * MiB);
  EXPECT_TRUE(holds(layer, 0x11, 16 * MiB));
  EXPECT_TRUE(holds(state, 0x22, 16 * MiB));
  for (void* pointer : {layer, state, activations}) allocator_->deallocate(pointer);
}

// An idle class's cache counts as free room for the prefetch window: the headroom that
// use_ends keeps is not made by moving a hinted, released layer to the host.
TEST_F(OffloadEngineTest, HeadroomCountsTheCacheOfAClassWithNothingAllocatedAsFree) {
  start(48 * MiB, 16 * MiB);
  offload_engine& engine = *engine_;
  void* layer = allocator_->allocate(16 * MiB, nullptr, allocation_class::parameter);
  void* activations = allocator_->allocate(16 * MiB, nullptr, allocation_class::other);
  void* gradient = allocator_->allocate(16 * MiB, nullptr, allocation_class::gradient);
  allocator_->deallocate(gradient);  // 16 MiB of idle cache; nothing else free
  engine.use_begins(layer, nullptr);
  engine.use_ends(layer, nullptr);
  engine.step_boundary();
  engine.use_begins(layer, nullptr);
  engine.use_ends(layer, nullptr);
  device_->synchronize_stream(nullptr);
  engine.use_ends(activations, nullptr);  // asks for headroom with the layer's use over
  engine.mover().drain();
  EXPECT_EQ(where_first_chunk(layer), residency::device)
      << "the layer went to the host while 16 MiB of idle cache made the headroom";
  EXPECT_EQ(engine.figures().evictions, 0u);
  for (void* pointer : {layer, activations}) allocator_->deallocate(pointer);
}

// Evictions that nobody waits for (headroom for the prefetch window) take only chunks whose
// every use was hinted: work on an unhinted chunk may be queued after the move starts,
// which the move would lose (Note [Fault-free migration]). The hinted parameter may go; the
// unhinted state, though its next use is farther, stays.
TEST_F(OffloadEngineTest, HeadroomEvictionsLeaveUnhintedChunksAlone) {
  start(48 * MiB, 32 * MiB);
  offload_engine& engine = *engine_;
  // Requests of 10 MiB or more get segments of their own size: 16 + 16 + 12 MiB held.
  void* layer = allocator_->allocate(16 * MiB, nullptr, allocation_class::parameter);
  void* state = allocator_->allocate(16 * MiB, nullptr, allocation_class::optimizer_state);
  void* activations = allocator_->allocate(12 * MiB, nullptr, allocation_class::other);
  ASSERT_EQ(engine.figures().evictions + engine.figures().pressure_evictions, 0u);
  engine.use_begins(layer, nullptr);
  engine.use_ends(layer, nullptr);
  engine.step_boundary();  // learned: the layer; 4 MiB free, 32 MiB of headroom wanted
  engine.use_begins(layer, nullptr);
  engine.use_ends(layer, nullptr);  // asks for headroom (the layer's use may still be running)
  device_->synchronize_stream(nullptr);
  engine.use_ends(activations, nullptr);  // asks again, the layer's use now over
  engine.mover().drain();
  auto where = [&](void* pointer) { return where_first_chunk(pointer); };
  EXPECT_EQ(where(state), residency::device) << "an unhinted chunk moved behind its user";
  EXPECT_EQ(where(layer), residency::host) << "the hinted, released layer made the headroom";
  for (void* pointer : {layer, state, activations}) allocator_->deallocate(pointer);
}

// Free space in a chunk that went to the host is not where a new allocation should live:
// the allocation that lands there brings the chunk back (ordered before its stream's next
// work), instead of being written over PCIe for as long as it lives.
TEST_F(OffloadEngineTest, AnAllocationInFreeSpaceOnTheHostBringsItBack) {
  start(256 * MiB, 0);
  offload_engine& engine = *engine_;
  void* first = allocator_->allocate(16 * MiB, nullptr, allocation_class::optimizer_state);
  ASSERT_TRUE(engine.evict(first, /*wait=*/true));
  allocator_->deallocate(first);  // its segment stays cached, on the host
  void* second = allocator_->allocate(16 * MiB, nullptr, allocation_class::optimizer_state);
  ASSERT_EQ(second, first) << "the cached segment was not reused";
  device_->fill_async(second, 0x77, 16 * MiB, nullptr);
  device_->synchronize_stream(nullptr);
  engine.mover().drain();
  std::vector<chunk_info> chunks;
  allocator_->chunks_of_allocation(second, chunks);
  for (const chunk_info& chunk : chunks) {
    EXPECT_EQ(engine.mover().where(chunk.address), residency::device) << "left on the host";
  }
  EXPECT_TRUE(holds(second, 0x77, 16 * MiB));
  allocator_->deallocate(second);
}

// Note [Parameters parked]: six hinted layers of parameters under a limit that holds three.
// Used in order, the engine evicts the earlier ones with their addresses unmapped (no host
// remap); each comes back intact for its next hinted use, and the device limit holds.
// Under ZEROALLOC_VERIFY too, whose checksums read a parked chunk's host copy.
class ParkedParametersTest : public OffloadEngineTest, public ::testing::WithParamInterface<bool> {
 protected:
  /// Six layers of one chunk each, filled with 0x30 + i (allocated at once, as a model's
  /// parameters are), then used under hints in order for two steps, under a 24 MiB limit.
  std::vector<void*> hinted_layers() {
    std::vector<void*> layers;
    for (int i = 0; i < 6; ++i) {
      layers.push_back(allocator_->allocate(kChunkBytes, nullptr, allocation_class::parameter));
      device_->fill_async(layers.back(), static_cast<std::uint8_t>(0x30 + i), kChunkBytes, nullptr);
    }
    for (int round = 0; round < 2; ++round) {  // the first learns the order
      for (void* layer : layers) {
        engine_->use_begins(layer, nullptr);
        engine_->use_ends(layer, nullptr);
      }
      engine_->step_boundary();
    }
    device_->synchronize_stream(nullptr);
    engine_->mover().drain();
    return layers;
  }
  bool parked(void* pointer) { return engine_->mover().parked(first_chunk(pointer)); }
  /// Parking on, a 24 MiB limit, and the layers of hinted_layers.
  std::vector<void*> parked_layers_under_limit() {
    park_parameters_ = true;
    start(24 * MiB, 0);
    return hinted_layers();
  }
  /// The index in `layers` of the first parked one, or -1.
  int first_parked(const std::vector<void*>& layers) {
    for (std::size_t i = 0; i < layers.size(); ++i) {
      if (parked(layers[i])) return static_cast<int>(i);
    }
    return -1;
  }
};

TEST_P(ParkedParametersTest, EvictedHintedParametersAreParkedAndComeBackIntactForTheirUse) {
  park_parameters_ = true;
  verify_ = GetParam();
  start(24 * MiB, 0);
  offload_engine& engine = *engine_;
  std::vector<void*> layers = hinted_layers();
  const auto parked_layers =
      std::count_if(layers.begin(), layers.end(), [&](void* layer) { return parked(layer); });
  EXPECT_GE(parked_layers, 3) << "the layers the limit could not hold were not parked";
  const migration_figures away = engine.mover().figures();
  EXPECT_GE(away.chunks_parked, static_cast<std::uint64_t>(parked_layers));
  EXPECT_EQ(away.parked_bytes, static_cast<std::uint64_t>(parked_layers) * kChunkBytes);
  EXPECT_EQ(away.chunks_unparked, 0u);
  const std::uint64_t used_on_host = engine.figures(true).used_on_host;  // the first step's
  for (int round = 0; round < 2; ++round) {  // each used again, in order: fetched for its use
    for (int i = 0; i < 6; ++i) {
      engine.use_begins(layers[i], nullptr);
      EXPECT_NE(where_first_chunk(layers[i]), residency::host) << "layer " << i;
      EXPECT_TRUE(holds(layers[i], static_cast<std::uint8_t>(0x30 + i), kChunkBytes))
          << "layer " << i << ", round " << round;
      engine.use_ends(layers[i], nullptr);
    }
    engine.step_boundary();
  }
  engine.mover().drain();
  EXPECT_LE(allocator_->held_bytes(), 24 * MiB) << "the device limit was broken";
  EXPECT_EQ(engine.figures(true).used_on_host, used_on_host) << "a use ran on the host";
  EXPECT_EQ(engine.mover().figures().chunks_unparked, 0u) << "a host remap was paid";
  if (verify_) {
    EXPECT_GT(engine.mover().figures().verified_chunks, 0u);
  }
  for (void* layer : layers) allocator_->deallocate(layer);
}

INSTANTIATE_TEST_SUITE_P(Verify, ParkedParametersTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Verified" : "Plain"; });

// A use in place (the windowed step, a state_dict copy) of a parked parameter, with the
// device full, runs where it is: its host chunk is mapped first, and the kernels read its
// bytes there.
TEST_F(ParkedParametersTest, AUseInPlaceMapsAParkedParameterOnTheHost) {
  std::vector<void*> layers = parked_layers_under_limit();
  const int index = first_parked(layers);
  ASSERT_GE(index, 0);
  void* parked_layer = layers[index];
  engine_->use_in_place(parked_layer, nullptr);
  EXPECT_EQ(where_first_chunk(parked_layer), residency::host);
  EXPECT_FALSE(parked(parked_layer));
  EXPECT_TRUE(holds(parked_layer, static_cast<std::uint8_t>(0x30 + index), kChunkBytes));
  device_->fill_async(parked_layer, 0x5A, kChunkBytes, nullptr);  // the step writes it there
  engine_->use_ends(parked_layer, nullptr);
  EXPECT_EQ(engine_->mover().figures().chunks_unparked, 1u);
  engine_->use_begins(parked_layer, nullptr);
  EXPECT_TRUE(holds(parked_layer, 0x5A, kChunkBytes)) << "the write on the host was lost";
  engine_->use_ends(parked_layer, nullptr);
  for (void* layer : layers) allocator_->deallocate(layer);
}

// With device memory free within the limit, a use in place of a parked parameter fetches
// it (a device map and a copy, cheaper than mapping the host chunk; its bytes arrive in the
// use's stream order) and runs on the device, evicting nothing for it.
TEST_F(ParkedParametersTest, AUseInPlaceFetchesAParkedParameterWhenTheDeviceHasRoom) {
  std::vector<void*> layers = parked_layers_under_limit();
  std::vector<void*> parked_layers;
  for (void*& layer : layers) {
    if (parked(layer)) {
      parked_layers.push_back(layer);
    } else if (where_first_chunk(layer) == residency::device) {
      allocator_->deallocate(std::exchange(layer, nullptr));  // room
    }
  }
  allocator_->empty_cache();
  ASSERT_FALSE(parked_layers.empty());
  const std::uint64_t evictions = engine_->figures().evictions;
  void* used = parked_layers.front();
  const auto index = std::find(layers.begin(), layers.end(), used) - layers.begin();
  engine_->use_in_place(used, nullptr);
  const residency now = where_first_chunk(used);  // there, or arriving in the stream's order
  EXPECT_TRUE(now == residency::device || now == residency::moving_to_device);
  EXPECT_TRUE(holds(used, static_cast<std::uint8_t>(0x30 + index), kChunkBytes));
  device_->fill_async(used, 0x6B, kChunkBytes, nullptr);
  engine_->use_ends(used, nullptr);
  const offload_figures figures = engine_->figures();
  EXPECT_EQ(figures.in_place_fetches, 1u);
  EXPECT_EQ(figures.evictions, evictions) << "a use in place evicted another chunk";
  EXPECT_EQ(engine_->mover().figures().chunks_unparked, 0u);
  EXPECT_TRUE(holds(used, 0x6B, kChunkBytes));
  for (void* layer : layers) {
    if (layer != nullptr) allocator_->deallocate(layer);
  }
}

// Note [Moving a chunk in use]: the CPUs write a parked parameter at its host copy (the host
// step, behind a use_on_host). A use in place of the same chunk meanwhile (the device's
// step of a neighbour sharing it) finds room on the device, but fetches nothing: it maps
// the host chunk, and the CPUs' writes are what the next use reads.
TEST_F(ParkedParametersTest, AUseInPlaceLeavesAParkedParameterTheCpusWriteWhereItIs) {
  std::vector<void*> layers = parked_layers_under_limit();
  void* used = nullptr;
  for (void*& layer : layers) {
    if (parked(layer) && used == nullptr) {
      used = layer;
    } else if (!parked(layer) && where_first_chunk(layer) == residency::device) {
      allocator_->deallocate(std::exchange(layer, nullptr));  // room for a fetch
    }
  }
  allocator_->empty_cache();
  ASSERT_NE(used, nullptr);
  const void* pointers[] = {used};
  std::vector<offload_engine::host_view> views;
  ASSERT_TRUE(engine_->use_on_host(pointers, nullptr, views));
  ASSERT_EQ(views.size(), 1u);
  engine_->use_in_place(used, nullptr);
  EXPECT_EQ(where_first_chunk(used), residency::host) << "fetched from under the CPUs";
  EXPECT_EQ(engine_->figures().in_place_fetches, 0u);
  std::memset(reinterpret_cast<void*>(views[0].host +
                                      (reinterpret_cast<std::uintptr_t>(used) - views[0].address)),
              0x77, kChunkBytes);  // the CPUs' write, at the host copy
  engine_->use_on_host_ends(pointers, nullptr);
  engine_->use_ends(used, nullptr);
  engine_->use_begins(used, nullptr);
  EXPECT_TRUE(holds(used, 0x77, kChunkBytes)) << "the CPUs' write was lost";
  engine_->use_ends(used, nullptr);
  for (void* layer : layers) {
    if (layer != nullptr) allocator_->deallocate(layer);
  }
}

// Only chunks whose every use the engine sees coming are parked: not a parameter no hint has
// reached, nor one whose segment gained an allocation since its last use, nor an
// optimizer state, nor one the program evicted itself, nor any with the setting off. Those
// stay readable on the host.
TEST_F(ParkedParametersTest, OnlyHintedParametersUntouchedSinceTheirUseAreParked) {
  park_parameters_ = true;
  start(256 * MiB, 0);
  offload_engine& engine = *engine_;
  void* hinted = allocator_->allocate(kChunkBytes, nullptr, allocation_class::parameter);
  engine.use_begins(hinted, nullptr);
  device_->fill_async(hinted, 0x11, kChunkBytes, nullptr);
  engine.use_ends(hinted, nullptr);
  ASSERT_TRUE(engine.evict(hinted, /*wait=*/true));
  EXPECT_EQ(where_first_chunk(hinted), residency::host);
  EXPECT_FALSE(parked(hinted)) << "an eviction the program asked for parked its chunk";
  EXPECT_TRUE(holds(hinted, 0x11, kChunkBytes));
  allocator_->deallocate(hinted);

  // Pressure: a limit of 16 MiB, and three candidates of one chunk each.
  allocator_->set_limit(24 * MiB, "ZEROALLOC_MEMORY_LIMIT (test)");
  void* never_hinted = allocator_->allocate(kChunkBytes, nullptr, allocation_class::parameter);
  device_->fill_async(never_hinted, 0x22, kChunkBytes, nullptr);
  void* state = allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
  engine.use_begins(state, nullptr);
  device_->fill_async(state, 0x33, kChunkBytes, nullptr);
  engine.use_ends(state, nullptr);
  void* touched = allocator_->allocate(kChunkBytes / 2, nullptr, allocation_class::parameter);
  engine.use_begins(touched, nullptr);
  device_->fill_async(touched, 0x44, kChunkBytes / 2, nullptr);
  engine.use_ends(touched, nullptr);
  void* neighbour = allocator_->allocate(kChunkBytes / 4, nullptr, allocation_class::parameter);
  device_->synchronize_stream(nullptr);
  const bool shares = first_chunk(neighbour) == first_chunk(touched);
  // Everything else must go for this one.
  void* activations = allocator_->allocate(24 * MiB, nullptr, allocation_class::other);
  engine.mover().drain();
  for (void* each : {never_hinted, state, touched}) {
    EXPECT_EQ(where_first_chunk(each), residency::host);
    EXPECT_FALSE(parked(each));
  }
  EXPECT_TRUE(holds(never_hinted, 0x22, kChunkBytes));
  EXPECT_TRUE(holds(state, 0x33, kChunkBytes));
  if (shares) {
    EXPECT_TRUE(holds(touched, 0x44, kChunkBytes / 2));
  }
  EXPECT_EQ(engine.mover().figures().chunks_parked, 0u);
  for (void* each : {activations, never_hinted, state, touched, neighbour}) {
    allocator_->deallocate(each);
  }
}

// A program that asks for a parked parameter to move to the host (zeroalloc_offload) reads
// it next: its chunk is mapped there, and kernels reach its bytes.
TEST_F(ParkedParametersTest, AnEvictionAskedForOfAParkedParameterLeavesItReadable) {
  std::vector<void*> layers = parked_layers_under_limit();
  const int index = first_parked(layers);
  ASSERT_GE(index, 0);
  void* parked_layer = layers[index];
  ASSERT_TRUE(engine_->evict(parked_layer, /*wait=*/true));
  EXPECT_EQ(where_first_chunk(parked_layer), residency::host);
  EXPECT_FALSE(parked(parked_layer));
  EXPECT_TRUE(holds(parked_layer, static_cast<std::uint8_t>(0x30 + index), kChunkBytes));
  for (void* layer : layers) allocator_->deallocate(layer);
}

// The setting off (ZEROALLOC_PARK_PARAMETERS=0): hinted parameters go to the host mapped.
TEST_F(ParkedParametersTest, WithTheSettingOffEvictedParametersStayMapped) {
  park_parameters_ = false;
  start(24 * MiB, 0);
  std::vector<void*> layers = hinted_layers();
  int on_host = 0;
  for (int i = 0; i < 6; ++i) {
    if (where_first_chunk(layers[i]) != residency::host) continue;
    ++on_host;
    EXPECT_FALSE(parked(layers[i]));
    EXPECT_TRUE(holds(layers[i], static_cast<std::uint8_t>(0x30 + i), kChunkBytes)) << i;
  }
  EXPECT_GE(on_host, 3);
  EXPECT_EQ(engine_->mover().figures().chunks_parked, 0u);
  for (void* layer : layers) allocator_->deallocate(layer);
}

// A segment released while its chunks are parked gives their host chunks back: nothing
// stays counted on the host, and the pool has the memory again.
TEST_F(ParkedParametersTest, AReleasedSegmentGivesItsParkedChunksHostMemoryBack) {
  std::vector<void*> layers = parked_layers_under_limit();
  ASSERT_GT(engine_->mover().figures().parked_bytes, 0u);
  for (void* layer : layers) allocator_->deallocate(layer);
  allocator_->empty_cache();
  const migration_figures after = engine_->mover().figures();
  EXPECT_EQ(after.parked_bytes, 0u);
  EXPECT_EQ(after.host_resident_bytes, 0u);
  EXPECT_EQ(pool_->figures().in_use_bytes, 0u) << "host chunks of parked chunks leaked";
}

// A read no hint announces faults instead of reading wrong bytes (the simulated device maps
// the placeholder with no access; on CUDA the fault would end the context).
TEST_F(ParkedParametersTest, AnUnhintedReadOfAParkedParameterFaultsInsteadOfReadingWrongBytes) {
  if (!device_->is_simulated()) GTEST_SKIP() << "skipped: a fault would end the CUDA context";
  std::vector<void*> layers = parked_layers_under_limit();
  const int index = first_parked(layers);
  ASSERT_GE(index, 0);
  void* parked_layer = layers[index];
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH((void)read_back(*device_, parked_layer, kChunkBytes), "");
  engine_->use_begins(parked_layer, nullptr);  // hinted, it reads again
  EXPECT_EQ(read_back(*device_, parked_layer, 4096).size(), 4096u);
  engine_->use_ends(parked_layer, nullptr);
  for (void* layer : layers) allocator_->deallocate(layer);
}

// Twenty layers of parameters, 1.7 times what the device may hold, used in order every step
// with hints, on a stream whose "kernels" take 3 ms (the simulated device copies at a few
// GB/s, so a layer's compute covers its fetch and an eviction). From the second step on the
// engine knows the order and fetches ahead.
TEST_F(OffloadEngineTest, AHintedTrainingLoopKeepsEveryByteAndPrefetchesAlongTheOrder) {
  constexpr std::size_t kLayerBytes = 2 * MiB;  // one chunk each (ZEROALLOC_CHUNK_SIZE=2MiB)
  use_chunk_bytes(kLayerBytes);
  start(24 * MiB, 3 * kLayerBytes);
  offload_engine& engine = *engine_;
  stream_handle compute = device_->create_stream();
  constexpr int kLayers = 20;
  constexpr int kSteps = 6;
  const std::vector<void*> layers = zeroed_parameters(kLayers, kLayerBytes, compute);
  offload_figures after_first_steps{};
  for (int step = 0; step < kSteps; ++step) {
    for (int i = 0; i < kLayers; ++i) {
      engine.use_begins(layers[i], compute);
      device_->host_function_async(
          [] { std::this_thread::sleep_for(std::chrono::milliseconds(3)); }, compute);
      device_->fill_async(layers[i], static_cast<std::uint8_t>(step * kLayers + i + 1), kLayerBytes,
                          compute);
      engine.use_ends(layers[i], compute);
    }
    engine.step_boundary();
    if (step == 1) after_first_steps = engine.figures(/*wait_for_device=*/true);
  }
  device_->synchronize_stream(compute);
  engine.mover().drain();
  for (int i = 0; i < kLayers; ++i) {
    EXPECT_TRUE(
        holds(layers[i], static_cast<std::uint8_t>((kSteps - 1) * kLayers + i + 1), kLayerBytes))
        << "layer " << i;
  }
  const offload_figures figures = engine.figures(/*wait_for_device=*/true);
  EXPECT_EQ(figures.learned_order_chunks, static_cast<std::uint64_t>(kLayers));
  EXPECT_LE(allocator_->held_bytes(), 24 * MiB);
  const double uses = static_cast<double>(figures.uses - after_first_steps.uses);
  const double hit_rate = static_cast<double>(figures.hits - after_first_steps.hits) / uses;
  std::printf(
      "steps 3-%d: %.0f uses, prefetch hit rate %.2f (resident %llu, arriving %llu, "
      "left on the host %llu), %llu prefetches, device waited %.1f ms, host waited "
      "%.1f ms\n",
      kSteps, uses, hit_rate,
      static_cast<unsigned long long>(figures.resident - after_first_steps.resident),
      static_cast<unsigned long long>(figures.arriving - after_first_steps.arriving),
      static_cast<unsigned long long>(figures.used_on_host - after_first_steps.used_on_host),
      static_cast<unsigned long long>(figures.prefetches),
      static_cast<double>(figures.device_waited_ns - after_first_steps.device_waited_ns) / 1e6,
      static_cast<double>(figures.waited_ns - after_first_steps.waited_ns) / 1e6);
  // Fetched ahead along the learned order, again and again (how often that was in time is
  // a speed figure: printed here, measured by the benchmarks on the GPU).
  // (Only fetches it started count, not chunks it found on the device: 19-42 in runs here.)
  EXPECT_GE(figures.prefetches, static_cast<std::uint64_t>(kSteps));
  // Every use had its chunk back on the device (ahead of time or fetched for it): none
  // reached it over PCIe.
  EXPECT_EQ(figures.used_on_host - after_first_steps.used_on_host, 0u);
  for (void* layer : layers) allocator_->deallocate(layer);
  allocator_->forget_stream(compute);
  device_->destroy_stream(compute);
}

// Note [Fetched ahead at a miss]: the same loop under ZEROALLOC_ACCESS=any, where no thread
// of the engine's moves anything. A use that misses its chunk brings back the window the
// learned order says comes next, so that most uses after it find theirs on the device;
// every byte is kept, no use reaches its chunk over PCIe, and the limit holds.
TEST_F(OffloadEngineTest, UnderAnyAccessAMissBringsBackTheNextWindowOfTheOrder) {
  constexpr std::size_t kLayerBytes = 2 * MiB;
  use_chunk_bytes(kLayerBytes);
  any_access_ = true;
  start(24 * MiB, 6 * kLayerBytes);
  offload_engine& engine = *engine_;
  stream_handle compute = device_->create_stream();
  constexpr int kLayers = 20;
  constexpr int kSteps = 5;
  const std::vector<void*> layers = zeroed_parameters(kLayers, kLayerBytes, compute);
  offload_figures after_first_steps{};
  for (int step = 0; step < kSteps; ++step) {
    for (int i = 0; i < kLayers; ++i) {
      engine.use_begins(layers[i], compute);
      device_->fill_async(layers[i], static_cast<std::uint8_t>(step * kLayers + i + 1), kLayerBytes,
                          compute);
      engine.use_ends(layers[i], compute);
    }
    engine.step_boundary();
    if (step == 1) after_first_steps = engine.figures(/*wait_for_device=*/true);
  }
  device_->synchronize_stream(compute);
  for (int i = 0; i < kLayers; ++i) {
    EXPECT_TRUE(
        holds(layers[i], static_cast<std::uint8_t>((kSteps - 1) * kLayers + i + 1), kLayerBytes))
        << "layer " << i;
  }
  const offload_figures figures = engine.figures(/*wait_for_device=*/true);
  const double uses = static_cast<double>(figures.uses - after_first_steps.uses);
  const double resident = static_cast<double>(figures.resident - after_first_steps.resident);
  std::printf(
      "steps 3-%d under any access: %.0f uses, %.0f found their chunk on the device, "
      "%llu fetched ahead\n",
      kSteps, uses, resident,
      static_cast<unsigned long long>(figures.prefetches - after_first_steps.prefetches));
  EXPECT_GT(figures.prefetches - after_first_steps.prefetches, 0u);
  // A miss brings back up to six layers: at least half of the uses find theirs resident.
  EXPECT_GE(resident, uses / 2);
  EXPECT_EQ(figures.used_on_host - after_first_steps.used_on_host, 0u);
  EXPECT_LE(allocator_->held_bytes(), 24 * MiB);
  EXPECT_EQ(engine.mover().figures().chunks_parked, 0u);
  for (void* layer : layers) allocator_->deallocate(layer);
  allocator_->forget_stream(compute);
  device_->destroy_stream(compute);
}

// A forward and a backward: twenty layers used in order, then in reverse, 1.7 times what
// the device may hold. The parameters the forward evicted are used again in the backward:
// the order has both uses of each layer, so the backward's layers are fetched ahead too,
// not only found missing when their use begins (Note [Every use in the order]).
TEST_F(OffloadEngineTest, TheBackwardsUsesAreInTheOrderAndItsLayersAreFetchedAhead) {
  constexpr std::size_t kLayerBytes = 2 * MiB;
  use_chunk_bytes(kLayerBytes);
  start(24 * MiB, 3 * kLayerBytes);
  offload_engine& engine = *engine_;
  stream_handle compute = device_->create_stream();
  constexpr int kLayers = 20;
  constexpr int kSteps = 5;
  const std::vector<void*> layers = zeroed_parameters(kLayers, kLayerBytes, compute);
  // The host runs ahead of the device by two layers at most, as a training loop's launch
  // queue and allocations keep it.
  std::vector<event_handle> done = {device_->create_event(), device_->create_event()};
  int uses = 0;
  auto use = [&](int layer, std::uint8_t value) {
    if (uses >= 2) device_->synchronize_event(done[uses % 2]);
    engine.use_begins(layers[layer], compute);
    device_->host_function_async([] { std::this_thread::sleep_for(std::chrono::milliseconds(3)); },
                                 compute);
    device_->fill_async(layers[layer], value, kLayerBytes, compute);
    engine.use_ends(layers[layer], compute);
    device_->record_event(done[uses++ % 2], compute);
  };
  std::uint64_t backward_prefetches = 0;
  std::uint64_t backward_uses_on_host = 0;
  for (int step = 0; step < kSteps; ++step) {
    for (int i = 0; i < kLayers; ++i) use(i, static_cast<std::uint8_t>(step * 2 * kLayers + i + 1));
    const offload_figures before_backward = engine.figures(/*wait_for_device=*/true);
    for (int i = kLayers - 1; i >= 0; --i) {
      use(i, static_cast<std::uint8_t>(step * 2 * kLayers + kLayers + i + 1));
    }
    const offload_figures after_backward = engine.figures(/*wait_for_device=*/true);
    engine.step_boundary();
    if (step >= 2) {  // the order is known
      backward_prefetches += after_backward.prefetches - before_backward.prefetches;
      backward_uses_on_host += after_backward.used_on_host - before_backward.used_on_host;
      std::printf(
          "step %d, backward: %llu prefetches; %llu of %llu uses found their chunk "
          "on the device, %llu arriving\n",
          step,
          static_cast<unsigned long long>(after_backward.prefetches - before_backward.prefetches),
          static_cast<unsigned long long>(after_backward.resident - before_backward.resident),
          static_cast<unsigned long long>(after_backward.uses - before_backward.uses),
          static_cast<unsigned long long>(after_backward.arriving - before_backward.arriving));
    }
  }
  device_->synchronize_stream(compute);
  engine.mover().drain();
  for (int i = 0; i < kLayers; ++i) {
    EXPECT_TRUE(holds(layers[i],
                      static_cast<std::uint8_t>((kSteps - 1) * 2 * kLayers + kLayers + i + 1),
                      kLayerBytes))
        << "layer " << i;
  }
  EXPECT_EQ(engine.figures().learned_order_chunks, static_cast<std::uint64_t>(2 * kLayers))
      << "each layer's forward and backward use";
  // The first layers left the device during the forward: the backward brings them back
  // ahead of their use, every step.
  EXPECT_GE(backward_prefetches, static_cast<std::uint64_t>(kSteps - 2) * 4);
  EXPECT_EQ(backward_uses_on_host, 0u);
  EXPECT_LE(allocator_->held_bytes(), 24 * MiB);
  for (void* layer : layers) allocator_->deallocate(layer);
  for (event_handle event : done) device_->destroy_event(event);
  allocator_->forget_stream(compute);
  device_->destroy_stream(compute);
}

// Belady's MIN (the fewest fetches any policy can make) on `order`, repeated step after
// step, with room for `room` chunks: a use needs every chunk of its group on the device, and
// a miss evicts the chunk, not of that group, whose next use is farthest. Returns the
// fetches of one step once they repeat (the third of five steps; the first fills the room).
std::uint64_t fewest_fetches_per_step(const std::vector<std::vector<int>>& order,
                                      std::size_t room) {
  constexpr int kSteps = 5;
  std::vector<int> uses;    // every chunk's use, step after step
  std::vector<int> groups;  // the group of each use
  for (int step = 0; step < kSteps; ++step) {
    for (std::size_t group = 0; group < order.size(); ++group) {
      for (int chunk : order[group]) {
        uses.push_back(chunk);
        groups.push_back(step * static_cast<int>(order.size()) + static_cast<int>(group));
      }
    }
  }
  auto next_use = [&](int chunk, std::size_t from) {
    for (std::size_t at = from; at < uses.size(); ++at) {
      if (uses[at] == chunk) return at;
    }
    return uses.size();
  };
  std::vector<int> resident;
  std::uint64_t counted = 0;
  const std::size_t per_step = uses.size() / kSteps;
  for (std::size_t at = 0; at < uses.size(); ++at) {
    const int chunk = uses[at];
    if (std::find(resident.begin(), resident.end(), chunk) != resident.end()) continue;
    if (at / per_step == 2) ++counted;
    if (resident.size() == room) {
      const auto& group = order[static_cast<std::size_t>(groups[at]) % order.size()];
      std::size_t farthest = 0;
      std::size_t victim = resident.size();
      for (std::size_t i = 0; i < resident.size(); ++i) {
        if (std::find(group.begin(), group.end(), resident[i]) != group.end()) continue;
        const std::size_t next = next_use(resident[i], at);
        if (victim == resident.size() || next > farthest) {
          farthest = next;
          victim = i;
        }
      }
      resident.erase(resident.begin() + static_cast<std::ptrdiff_t>(victim));
    }
    resident.push_back(chunk);
  }
  return counted;
}

// Planned placement on a recorded order: the step of a small decoder (an embedding, then
// eight layers of attention and MLP parameters, one chunk per tensor; the forward in order,
// the backward in reverse, then AdamW's windows stepping each layer's parameters and two
// states a parameter where they are) under a limit of 64 MiB, with 88 MiB of parameters
// and 176 MiB of states. What the learned order should make of it: the states stay on the
// host for the whole step (used in place, never fetched), the parameters stream, and they
// cost no more fetches than Belady's MIN, the fewest any policy could make on that order,
// with the room the engine leaves: it keeps the prefetch distance free for fetches ahead
// (plan_headroom), so MIN is counted with that much less room. A fetch that evicted a chunk
// needed before it would have to fetch that chunk again, and go past it. Every use finds
// its chunk on the device, and every byte written is kept.
TEST_F(OffloadEngineTest, AStepUnderALimitStreamsItsParametersWithTheFewestFetches) {
  constexpr std::size_t kChunk = 2 * MiB;
  allocator_settings settings;
  settings.chunk_bytes = kChunk;
  allocator_ = std::make_unique<caching_allocator>(*device_, settings);
  constexpr std::size_t kRoom = 32;     // chunks under the limit
  constexpr std::size_t kHeadroom = 6;  // the prefetch distance, kept free
  start(kRoom * kChunk, kHeadroom * kChunk);
  offload_engine& engine = *engine_;
  stream_handle compute = device_->create_stream();
  // Tensors, one chunk each: the embedding's 4, then per layer attention's 2 and the MLP's 3.
  constexpr int kLayers = 8;
  std::vector<void*> parameters;
  std::vector<std::vector<int>> layer_tensors;  // [0]: the embedding, then the layers
  auto add_group = [&](int tensors) {
    layer_tensors.emplace_back();
    for (int i = 0; i < tensors; ++i) {
      layer_tensors.back().push_back(static_cast<int>(parameters.size()));
      parameters.push_back(allocator_->allocate(kChunk, compute, allocation_class::parameter));
    }
  };
  add_group(4);
  for (int layer = 0; layer < kLayers; ++layer) {
    add_group(2);
    add_group(3);
  }
  std::vector<void*> states;  // two a parameter (AdamW's moments)
  for (std::size_t i = 0; i < 2 * parameters.size(); ++i) {
    states.push_back(allocator_->allocate(kChunk, compute, allocation_class::optimizer_state));
  }
  std::vector<std::uint8_t> value(parameters.size() + states.size(), 0);
  auto write = [&](int tensor, void* pointer) {
    value[tensor] = static_cast<std::uint8_t>(value[tensor] % 250 + 1);
    device_->fill_async(pointer, value[tensor], kChunk, compute);
  };
  for (std::size_t i = 0; i < parameters.size(); ++i) write(static_cast<int>(i), parameters[i]);
  for (std::size_t i = 0; i < states.size(); ++i) {
    write(static_cast<int>(parameters.size() + i), states[i]);
  }
  // The device's order: the forward's groups, then the backward's.
  std::vector<std::vector<int>> order;
  for (std::size_t group = 0; group < layer_tensors.size(); ++group) {
    order.push_back(layer_tensors[group]);
  }
  for (std::size_t group = layer_tensors.size(); group-- > 0;)
    order.push_back(layer_tensors[group]);
  // The host runs ahead of the device by two uses at most, as a training loop does.
  std::vector<event_handle> done = {device_->create_event(), device_->create_event()};
  int launched = 0;
  auto use = [&](const std::vector<int>& group) {
    if (launched >= 2) device_->synchronize_event(done[launched % 2]);
    std::vector<const void*> pointers;
    for (int tensor : group) pointers.push_back(parameters[tensor]);
    engine.use_begins(pointers, compute);
    device_->host_function_async([] { std::this_thread::sleep_for(std::chrono::milliseconds(2)); },
                                 compute);
    for (int tensor : group) write(tensor, parameters[tensor]);
    engine.use_ends(pointers, compute);
    device_->record_event(done[launched++ % 2], compute);
  };
  auto step_windows = [&] {  // a layer's window: its parameters and states, where they are
    for (const std::vector<int>& group : layer_tensors) {
      std::vector<const void*> pointers;
      for (int tensor : group) {
        pointers.push_back(parameters[tensor]);
        pointers.push_back(states[2 * tensor]);
        pointers.push_back(states[2 * tensor + 1]);
      }
      engine.use_in_place(pointers, compute);
      for (int tensor : group) {
        write(tensor, parameters[tensor]);
        for (int moment = 0; moment < 2; ++moment) {
          write(static_cast<int>(parameters.size()) + 2 * tensor + moment,
                states[2 * tensor + moment]);
        }
      }
      engine.use_ends(pointers, compute);
    }
  };
  constexpr int kSteps = 7;
  constexpr int kSteady = 3;  // the order is learned in step 0; the last steps are counted
  migration_figures before{};
  offload_figures uses_before{};
  for (int step = 0; step < kSteps; ++step) {
    if (step == kSteps - kSteady) {
      device_->synchronize_stream(compute);
      engine.mover().drain();
      before = engine.mover().figures();
      uses_before = engine.figures(/*wait_for_device=*/true);
    }
    for (const std::vector<int>& group : order) use(group);
    step_windows();
    engine.step_boundary();
  }
  device_->synchronize_stream(compute);
  engine.mover().drain();
  const migration_figures after = engine.mover().figures();
  const offload_figures uses_after = engine.figures(/*wait_for_device=*/true);
  const std::uint64_t fetched =
      (after.to_device_class_bytes[class_index(allocation_class::parameter)] -
       before.to_device_class_bytes[class_index(allocation_class::parameter)]) /
      kChunk / kSteady;
  const std::uint64_t fewest = fewest_fetches_per_step(order, kRoom - kHeadroom);
  std::printf(
      "parameters fetched a step: %llu chunks (Belady's MIN: %llu with the headroom kept free, "
      "%llu with none); states fetched: %llu bytes; uses %llu, left on the host %llu, device "
      "waited %.1f ms\n",
      static_cast<unsigned long long>(fetched), static_cast<unsigned long long>(fewest),
      static_cast<unsigned long long>(fewest_fetches_per_step(order, kRoom)),
      static_cast<unsigned long long>(
          after.to_device_class_bytes[class_index(allocation_class::optimizer_state)] -
          before.to_device_class_bytes[class_index(allocation_class::optimizer_state)]),
      static_cast<unsigned long long>(uses_after.uses - uses_before.uses),
      static_cast<unsigned long long>(uses_after.used_on_host - uses_before.used_on_host),
      static_cast<double>(uses_after.device_waited_ns - uses_before.device_waited_ns) / 1e6);
  ASSERT_GT(fewest, 0u) << "the parameters fit: nothing to plan";
  EXPECT_LE(fetched, fewest) << "fetches a step beyond the fewest the order allows";
  EXPECT_EQ(after.to_device_class_bytes[class_index(allocation_class::optimizer_state)],
            before.to_device_class_bytes[class_index(allocation_class::optimizer_state)])
      << "a state used in place was fetched";
  EXPECT_EQ(uses_after.used_on_host, uses_before.used_on_host)
      << "a use found its parameters on the host";
  for (void* state : states) EXPECT_EQ(where_first_chunk(state), residency::host);
  EXPECT_LE(allocator_->held_bytes(), kRoom * kChunk);
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    EXPECT_TRUE(holds(parameters[i], value[i], kChunk)) << "parameter " << i;
  }
  for (std::size_t i = 0; i < states.size(); ++i) {
    EXPECT_TRUE(holds(states[i], value[parameters.size() + i], kChunk)) << "state " << i;
  }
  for (void* pointer : parameters) allocator_->deallocate(pointer);
  for (void* pointer : states) allocator_->deallocate(pointer);
  for (event_handle event : done) device_->destroy_event(event);
  allocator_->forget_stream(compute);
  device_->destroy_stream(compute);
}

// Note [The host step finishes behind the forward] (bindings/python/zeroalloc/torch/
// _host_step.py): the CPUs may still step states after the step boundary. The boundary ends
// every use left open but theirs: a fetch until then leaves the chunk on the host, where the
// CPUs write it, and the next one after their use ends brings it back with their writes.
TEST_F(OffloadEngineTest, TheCpusUsesOutliveTheStepBoundaryAndKeepTheirChunksOnTheHost) {
  start(256 * MiB, 0);
  offload_engine& engine = *engine_;
  void* state = allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
  device_->fill_async(state, 0x11, kChunkBytes, nullptr);
  ASSERT_TRUE(engine.evict(state, /*wait=*/true));
  const void* pointers[] = {state};
  std::vector<offload_engine::host_view> views;
  engine.use_in_place(state, nullptr);  // a use of the device's that straddles the boundary
  ASSERT_TRUE(engine.use_on_host(pointers, nullptr, views));
  ASSERT_EQ(views.size(), 1u);
  engine.step_boundary();
  EXPECT_EQ(engine.figures().chunks_in_use, 1u) << "the boundary ended the CPUs' use";
  engine.use_ends(state, nullptr);  // ended by the boundary already: ends nothing more
  EXPECT_EQ(engine.figures().chunks_in_use, 1u) << "a stale end ended the CPUs' use";
  ASSERT_TRUE(engine.fetch(state, /*wait=*/true));
  EXPECT_EQ(where_first_chunk(state), residency::host) << "moved from under the CPUs";
  // The CPUs' write, at the chunk's host copy.
  std::memset(reinterpret_cast<void*>(views[0].host +
                                      (reinterpret_cast<std::uintptr_t>(state) - views[0].address)),
              0x5a, kChunkBytes);
  engine.use_on_host_ends(pointers, nullptr);
  EXPECT_EQ(engine.figures().chunks_in_use, 0u);
  ASSERT_TRUE(engine.fetch(state, /*wait=*/true));
  EXPECT_EQ(where_first_chunk(state), residency::device);
  EXPECT_TRUE(holds(state, 0x5a, kChunkBytes));
  // A use of the device's left open at a boundary still ends there.
  engine.use_begins(state, nullptr);
  engine.step_boundary();
  EXPECT_EQ(engine.figures().chunks_in_use, 0u);
  allocator_->deallocate(state);
}

}  // namespace
}  // namespace zeroalloc
