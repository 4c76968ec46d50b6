// Fault-free migration, over every device: a chunk's bytes survive the trip to the host and
// back at the same address; work queued before a migration is fenced in front of its copy;
// a kernel can write a host-resident chunk; the device memory an eviction frees serves
// other allocations; a freed host-resident allocation returns its host chunk.
#include "tier/migrator.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>

#include "device/sim_device.hpp"
#include "support/attached_listener.hpp"
#include "support/faulty_device.hpp"
#include "support/test_device.hpp"

namespace zeroalloc {
namespace {

using testing::read_back;

constexpr std::size_t kChunkBytes = 8 * MiB;

// An allocator and a host pool over a faulty_device wrapping the test device, for tests
// that inject failures.
// Blocks `stream` until a thread opens it, 200 ms from now, after setting `opened`: work
// queued behind it (a copy that waits for the stream) is still to run until then.
std::thread hold_stream(device& on, stream_handle stream, std::atomic<bool>& opened) {
  auto gate = std::make_shared<std::promise<void>>();
  std::shared_future<void> open = gate->get_future().share();
  on.host_function_async([open] { open.wait(); }, stream);
  return std::thread([gate, &opened] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    opened = true;
    gate->set_value();
  });
}

struct faulty_stack {
  explicit faulty_stack(std::uint64_t host_bytes)
      : device(std::make_unique<testing::faulty_device>(testing::open_test_device(0, 1 * GiB))),
        allocator(*device, settings()),
        pool(*device, host_bytes, "ZEROALLOC_HOST_LIMIT (test)") {}
  static allocator_settings settings() {
    allocator_settings chosen;
    chosen.chunk_bytes = kChunkBytes;
    return chosen;
  }
  std::unique_ptr<testing::faulty_device> device;
  caching_allocator allocator;
  host_pool pool;
};

class MigratorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ZA_OPEN_TEST_DEVICE_OR_SKIP(device_, 0, 1 * GiB);
    allocator_settings settings;
    settings.chunk_bytes = kChunkBytes;
    allocator_ = std::make_unique<caching_allocator>(*device_, settings);
    pool_ = std::make_unique<host_pool>(*device_, 256 * MiB, "ZEROALLOC_HOST_LIMIT=256MiB");
  }
  void TearDown() override {
    if (allocator_) allocator_->empty_cache();  // cached segments give their host chunks back
    if (migrator_) allocator_->paging().detach();
    migrator_.reset();
    allocator_.reset();
    pool_.reset();
  }
  void start(bool verify = false) {
    migrator_ = std::make_unique<migrator>(*allocator_, *pool_, verify);
    allocator_->paging().attach(*migrator_);
  }

  // Random bytes written to `pointer` through the device.
  std::vector<std::uint8_t> write_random(void* pointer, std::size_t bytes, unsigned seed) {
    std::vector<std::uint8_t> pattern(bytes);
    std::mt19937_64 random(seed);
    for (std::size_t i = 0; i < bytes; i += 8) {
      const std::uint64_t word = random();
      std::memcpy(pattern.data() + i, &word, std::min<std::size_t>(8, bytes - i));
    }
    device_->copy_async(pointer, pattern.data(), bytes, nullptr);
    device_->synchronize_stream(nullptr);
    return pattern;
  }

  std::vector<chunk_info> chunks_of(void* pointer) {
    std::vector<chunk_info> chunks;
    EXPECT_TRUE(allocator_->chunks_of_allocation(pointer, chunks));
    return chunks;
  }

  std::unique_ptr<device> device_;
  std::unique_ptr<caching_allocator> allocator_;
  std::unique_ptr<host_pool> pool_;
  std::unique_ptr<migrator> migrator_;
};

TEST_F(MigratorTest, BytesSurviveTheTripToTheHostAndBackAtTheSameAddress) {
  start();
  migrator& engine = *migrator_;
  constexpr std::size_t kBytes = 20 * MiB;  // chunks of 8, 8 and 4 MiB
  void* pointer = allocator_->allocate(kBytes, nullptr, allocation_class::optimizer_state);
  const std::vector<std::uint8_t> written = write_random(pointer, kBytes, 1);
  const std::vector<chunk_info> chunks = chunks_of(pointer);
  ASSERT_EQ(chunks.size(), 3u);
  const std::uint64_t held_before = allocator_->held_bytes();

  for (const chunk_info& chunk : chunks) ASSERT_TRUE(engine.evict_async(chunk.address));
  engine.drain();
  for (const chunk_info& chunk : chunks) EXPECT_EQ(engine.where(chunk.address), residency::host);
  EXPECT_EQ(engine.figures().host_resident_bytes, kBytes);
  // By class too, for the report's per-step residency (Note [Step records]).
  EXPECT_EQ(engine.figures().host_resident_class_bytes,
            (std::array<std::uint64_t, kAllocationClassCount>{0, 0, 0, kBytes}));
  EXPECT_EQ(engine.figures().bytes_to_host, kBytes);
  EXPECT_EQ(read_back(*device_, pointer, kBytes), written) << "bytes changed on the host";
  EXPECT_EQ(allocator_->paging().arena().pooled_bytes(), kBytes) << "device chunks were not freed";
  EXPECT_EQ(allocator_->held_bytes(), held_before);  // pooled, still charged until reused

  for (const chunk_info& chunk : chunks) ASSERT_TRUE(engine.fetch_async(chunk.address));
  engine.drain();
  for (const chunk_info& chunk : chunks) EXPECT_EQ(engine.where(chunk.address), residency::device);
  EXPECT_EQ(read_back(*device_, pointer, kBytes), written) << "bytes changed coming back";
  EXPECT_EQ(engine.figures().host_resident_bytes, 0u);
  EXPECT_EQ(engine.figures().host_resident_class_bytes,
            (std::array<std::uint64_t, kAllocationClassCount>{}));
  EXPECT_EQ(pool_->figures().in_use_bytes, 0u);
  allocator_->deallocate(pointer);
}

// A fetch is committed once its chunk's addresses map the device chunk: if unmapping the
// staging address fails after that, the chunk is on the device with its bytes, the device
// chunk behind it serves nothing else, and the staging address is not used again.
TEST_F(MigratorTest, AFailedUnmapAfterAFetchLosesNoBytesAndSharesNoMemory) {
  faulty_stack stack(256 * MiB);
  testing::faulty_device& device = *stack.device;
  caching_allocator& allocator = stack.allocator;
  host_pool& pool = stack.pool;
  {
    migrator engine(allocator, pool, false);
    testing::attached_listener attached(allocator, engine);
    void* first = allocator.allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
    void* second = allocator.allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
    device.fill_async(first, 0x11, kChunkBytes, nullptr);
    device.fill_async(second, 0x22, kChunkBytes, nullptr);
    device.synchronize_stream(nullptr);
    std::vector<chunk_info> chunks;
    ASSERT_TRUE(allocator.chunks_of_allocation(first, chunks));
    ASSERT_TRUE(allocator.chunks_of_allocation(second, chunks));
    ASSERT_EQ(chunks.size(), 2u);
    const std::uintptr_t a = chunks[0].address;
    const std::uintptr_t b = chunks[1].address;
    ASSERT_TRUE(engine.evict_async(a));
    ASSERT_TRUE(engine.evict_async(b));
    engine.drain();

    device.fail_next_unmap([&](std::uintptr_t address) { return address != a && address != b; });
    ASSERT_TRUE(engine.fetch_async(a));  // not idle: copied through a staging address
    engine.drain();
    EXPECT_EQ(device.failed_unmaps(), 1) << "the staging unmap was not reached";
    EXPECT_EQ(engine.where(a), residency::device);
    EXPECT_EQ(read_back(device, first, kChunkBytes), std::vector<std::uint8_t>(kChunkBytes, 0x11));

    ASSERT_TRUE(engine.fetch_async(b));
    engine.drain();
    EXPECT_EQ(engine.where(b), residency::device);
    device.fill_async(second, 0x33, kChunkBytes, nullptr);
    device.synchronize_stream(nullptr);
    EXPECT_EQ(read_back(device, first, kChunkBytes), std::vector<std::uint8_t>(kChunkBytes, 0x11))
        << "the first chunk's device memory also backs the second";
    EXPECT_EQ(read_back(device, second, kChunkBytes), std::vector<std::uint8_t>(kChunkBytes, 0x33));
    allocator.deallocate(first);
    allocator.deallocate(second);
  }
  allocator.empty_cache();
}

// A fetch that fails after queuing its copy (here the record of its event fails) gives its
// device chunk back only once that copy has run: given back before, the copy could still
// write into memory that by then serves another allocation. The chunk stays on the host with
// its bytes and can still come back. Both ways of fetching are failed: through a staging
// address (a chunk that may be in use) and mapped at once (an idle chunk). Each copy is held
// back, behind a "kernel" on the chunk's stream, until a thread opens it 200 ms later.
TEST_F(MigratorTest, AFetchThatFailsAfterQueuingItsCopyWaitsForItAndKeepsTheChunkOnTheHost) {
  faulty_stack stack(256 * MiB);
  testing::faulty_device& device = *stack.device;
  caching_allocator& allocator = stack.allocator;
  {
    migrator engine(allocator, stack.pool, false);
    testing::attached_listener attached(allocator, engine);
    stream_handle compute = device.create_stream();
    void* first = allocator.allocate(kChunkBytes, compute, allocation_class::optimizer_state);
    void* second = allocator.allocate(kChunkBytes, compute, allocation_class::optimizer_state);
    device.fill_async(first, 0x11, kChunkBytes, compute);
    device.fill_async(second, 0x22, kChunkBytes, compute);
    device.synchronize_stream(compute);
    std::vector<chunk_info> chunks;
    ASSERT_TRUE(allocator.chunks_of_allocation(first, chunks));
    ASSERT_TRUE(allocator.chunks_of_allocation(second, chunks));
    ASSERT_EQ(chunks.size(), 2u);
    const std::uintptr_t a = chunks[0].address;
    const std::uintptr_t b = chunks[1].address;
    ASSERT_TRUE(engine.evict_async(a));
    ASSERT_TRUE(engine.evict_async(b));
    engine.drain();
    const std::vector<std::uint8_t> ones(kChunkBytes, 0x11);
    const std::vector<std::uint8_t> twos(kChunkBytes, 0x22);
    auto hold_compute = [&](std::atomic<bool>& opened) {
      return hold_stream(device, compute, opened);
    };

    std::atomic<bool> opened{false};
    std::thread opener = hold_compute(opened);
    device.fail_record_after_copy([](const void*) { return true; });
    EXPECT_THROW(engine.fetch_async(a), device_error);  // not idle: through a staging address
    EXPECT_TRUE(opened.load())
        << "the failed fetch gave its device chunk back while its copy could still write it";
    opener.join();
    EXPECT_EQ(device.failed_records(), 1) << "the failure was not injected";
    EXPECT_EQ(engine.where(a), residency::host);
    EXPECT_EQ(read_back(device, first, kChunkBytes, compute), ones);

    // The fetch of b copies through a staging address behind `compute` and holds up the
    // copy-in stream, where the idle fetch of a queues its copy next.
    std::atomic<bool> reopened{false};
    opener = hold_compute(reopened);
    ASSERT_TRUE(engine.fetch_async(b));
    std::vector<chunk_info> now;
    ASSERT_TRUE(allocator.chunks_of_allocation(first, now));
    device.fail_record_after_copy([](const void*) { return true; });
    EXPECT_THROW(engine.fetch_async(a, /*chunk_idle=*/true, now.at(0).generation), device_error);
    EXPECT_TRUE(reopened.load())
        << "the failed idle fetch mapped the chunk back while its copy could still run";
    opener.join();
    engine.drain();
    EXPECT_EQ(device.failed_records(), 2);
    EXPECT_EQ(engine.where(a), residency::host);
    EXPECT_EQ(engine.where(b), residency::device);
    EXPECT_EQ(read_back(device, first, kChunkBytes, compute), ones);
    EXPECT_EQ(read_back(device, second, kChunkBytes, compute), twos);

    ASSERT_TRUE(engine.fetch_async(a));
    engine.drain();
    EXPECT_EQ(engine.where(a), residency::device);
    EXPECT_EQ(read_back(device, first, kChunkBytes, compute), ones);
    EXPECT_EQ(stack.pool.figures().in_use_bytes, 0u);
    allocator.deallocate(first);
    allocator.deallocate(second);
    allocator.forget_stream(compute);
    device.destroy_stream(compute);
  }
  allocator.empty_cache();
}

// A move that fails while its copy may still run (its event's record, or the worker's wait
// for the copy) waits for the copy before it gives the memory the copy reads or writes back:
// given back at once, a host slab could be destroyed, or a staging address unmapped, under
// the copy. Each copy is held back behind a "kernel" until a thread opens it 200 ms later.
TEST_F(MigratorTest, AMoveThatFailsWhileItsCopyMayRunWaitsForTheCopy) {
  faulty_stack stack(256 * MiB);
  testing::faulty_device& device = *stack.device;
  caching_allocator& allocator = stack.allocator;
  {
    migrator engine(allocator, stack.pool, false);
    testing::attached_listener attached(allocator, engine);
    stream_handle compute = device.create_stream();
    void* pointer = allocator.allocate(kChunkBytes, compute, allocation_class::optimizer_state);
    device.fill_async(pointer, 0x11, kChunkBytes, compute);
    device.synchronize_stream(compute);
    std::vector<chunk_info> chunks;
    ASSERT_TRUE(allocator.chunks_of_allocation(pointer, chunks));
    const std::uintptr_t a = chunks.at(0).address;
    const std::vector<std::uint8_t> ones(kChunkBytes, 0x11);
    auto hold_compute = [&](std::atomic<bool>& opened) {
      return hold_stream(device, compute, opened);
    };

    std::atomic<bool> opened{false};
    std::thread opener = hold_compute(opened);
    device.fail_record_after_copy([](const void*) { return true; });
    EXPECT_THROW(engine.evict_async(a), device_error);
    EXPECT_TRUE(opened.load()) << "the failed eviction gave its host chunk back under its copy";
    opener.join();
    EXPECT_EQ(engine.where(a), residency::device);

    std::atomic<bool> waited{false};
    opener = hold_compute(waited);
    device.fail_call(testing::device_call::synchronize_event);  // the worker's wait
    ASSERT_TRUE(engine.evict_async(a));
    engine.drain();
    EXPECT_TRUE(waited.load()) << "the worker gave the host chunk back under the copy";
    opener.join();
    EXPECT_EQ(engine.where(a), residency::device);
    EXPECT_EQ(stack.pool.figures().in_use_bytes, 0u);

    ASSERT_TRUE(engine.evict_async(a));
    engine.drain();
    ASSERT_EQ(engine.where(a), residency::host);
    std::atomic<bool> staged{false};
    opener = hold_compute(staged);
    device.fail_call(testing::device_call::synchronize_event);
    ASSERT_TRUE(engine.fetch_async(a));  // not idle: through a staging address
    engine.drain();
    EXPECT_TRUE(staged.load()) << "the worker unmapped the staging address under the copy";
    opener.join();
    EXPECT_EQ(engine.where(a), residency::host);
    EXPECT_EQ(read_back(device, pointer, kChunkBytes, compute), ones);
    ASSERT_TRUE(engine.fetch_async(a));
    engine.drain();
    EXPECT_EQ(engine.where(a), residency::device);
    EXPECT_EQ(read_back(device, pointer, kChunkBytes, compute), ones);
    allocator.deallocate(pointer);
    allocator.forget_stream(compute);
    device.destroy_stream(compute);
  }
  allocator.empty_cache();
}

// An eviction that fails at its remap (in the migrator's worker, after its copy) leaves the
// chunk on the device with its bytes, gives its host memory back and keeps no event: a
// program whose driver fails now and then keeps running, and keeps its memory.
TEST_F(MigratorTest, AnEvictionThatFailsAtItsRemapKeepsTheChunkOnTheDeviceAndLeaksNothing) {
  faulty_stack stack(64 * MiB);
  testing::faulty_device& device = *stack.device;
  caching_allocator& allocator = stack.allocator;
  {
    migrator engine(allocator, stack.pool, false);
    testing::attached_listener attached(allocator, engine);
    void* pointer = allocator.allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
    device.fill_async(pointer, 0x11, kChunkBytes, nullptr);
    device.synchronize_stream(nullptr);
    const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(pointer);
    const std::vector<std::uint8_t> ones(kChunkBytes, 0x11);
    long events_after_first = 0;
    constexpr int kRounds = 40;
    for (int round = 0; round < kRounds; ++round) {
      device.fail_next_unmap([a](std::uintptr_t address) { return address == a; });
      ASSERT_TRUE(engine.evict_async(a));
      engine.drain();
      ASSERT_EQ(engine.where(a), residency::device) << "round " << round;
      if (round == 0) events_after_first = device.events_alive();
    }
    EXPECT_EQ(device.failed_unmaps(), kRounds) << "the failure was not injected";
    EXPECT_EQ(device.events_alive(), events_after_first) << "a failed eviction kept its event";
    EXPECT_EQ(stack.pool.figures().in_use_bytes, 0u) << "a failed eviction kept its host memory";
    EXPECT_EQ(engine.figures().chunks_to_host, 0u);
    EXPECT_EQ(engine.bytes_leaving_device(), 0u);
    EXPECT_EQ(read_back(device, pointer, kChunkBytes), ones);

    ASSERT_TRUE(engine.evict_async(a));  // the driver works again
    engine.drain();
    EXPECT_EQ(engine.where(a), residency::host);
    EXPECT_EQ(read_back(device, pointer, kChunkBytes), ones);
    ASSERT_TRUE(engine.fetch_async(a));
    engine.drain();
    EXPECT_EQ(read_back(device, pointer, kChunkBytes), ones);
    allocator.deallocate(pointer);
  }
  allocator.empty_cache();
}

// Note [A chunk left unmapped] (heap_pinning.cpp): a remap whose new mapping fails, and whose
// old mapping then fails to come back too, leaves the chunk's addresses mapping nothing. The
// error says so, naming the chunk and both failures, instead of leaving a later kernel's
// illegal-address error to explain itself.
TEST_F(MigratorTest, ARemapWhoseRollbackFailsTooSaysTheChunkHasNoMapping) {
  faulty_stack stack(64 * MiB);
  testing::faulty_device& device = *stack.device;
  caching_allocator& allocator = stack.allocator;
  void* pointer = allocator.allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
  const auto address = reinterpret_cast<std::uintptr_t>(pointer);
  chunk_info chunk;
  ASSERT_TRUE(allocator.paging().pin_chunk(address, chunk));
  const host_chunk host = stack.pool.acquire(kChunkBytes);
  device.fail_call(testing::device_call::map, 1, 2);  // the new mapping, then the old one
  try {
    allocator.paging().remap_pinned_chunk(address, host.handle);
    ADD_FAILURE() << "the remap succeeded with every map failing";
  } catch (const device_error& failure) {
    const std::string message = failure.what();
    EXPECT_NE(message.find("has no mapping"), std::string::npos) << message;
    EXPECT_NE(message.find("mapping its old one back failed too (cuMemMap failed"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("restart the process"), std::string::npos) << message;
  }
  device.map(address, chunk.handle);  // the test mends it, so that it can be freed
  allocator.paging().unpin_chunk(address);
  stack.pool.release(host);
  allocator.deallocate(pointer);
  allocator.empty_cache();
}

// With every staging address retired (each one's unmap failed after its fetch), a fetch
// that needs one fails with a message saying so, and gives back the device chunk it took:
// the memory under the limit does not shrink with every attempt.
TEST_F(MigratorTest, AFetchWithNoStagingAddressLeftFailsClearlyAndKeepsNoDeviceMemory) {
  faulty_stack stack(256 * MiB);
  testing::faulty_device& device = *stack.device;
  caching_allocator& allocator = stack.allocator;
  {
    migrator engine(allocator, stack.pool, false);
    testing::attached_listener attached(allocator, engine);
    constexpr int kSlots = 8;  // the migrator's staging addresses
    std::vector<void*> pointers;
    std::vector<std::uintptr_t> chunks;
    for (int i = 0; i <= kSlots; ++i) {
      pointers.push_back(
          allocator.allocate(kChunkBytes, nullptr, allocation_class::optimizer_state));
      device.fill_async(pointers.back(), static_cast<std::uint8_t>(i + 1), kChunkBytes, nullptr);
      std::vector<chunk_info> found;
      ASSERT_TRUE(allocator.chunks_of_allocation(pointers.back(), found));
      chunks.push_back(found.at(0).address);
    }
    device.synchronize_stream(nullptr);
    for (std::uintptr_t chunk : chunks) ASSERT_TRUE(engine.evict_async(chunk));
    engine.drain();
    auto is_chunk = [&](std::uintptr_t address) {
      return std::find(chunks.begin(), chunks.end(), address) != chunks.end();
    };
    for (int i = 0; i < kSlots; ++i) {  // each fetch stands; its staging address retires
      device.fail_next_unmap([&](std::uintptr_t address) { return !is_chunk(address); });
      ASSERT_TRUE(engine.fetch_async(chunks[i]));
      engine.drain();
    }
    ASSERT_EQ(device.failed_unmaps(), kSlots);
    const std::uint64_t held = allocator.held_bytes();
    const std::uint64_t pooled = allocator.paging().arena().pooled_bytes();
    for (int attempt = 0; attempt < 3; ++attempt) {
      try {
        engine.fetch_async(chunks[kSlots]);
        ADD_FAILURE() << "a fetch without a staging address started";
      } catch (const device_error& failure) {
        EXPECT_NE(std::string(failure.what()).find("staging address"), std::string::npos)
            << failure.what();
      }
    }
    EXPECT_EQ(allocator.held_bytes(), held);
    EXPECT_EQ(allocator.paging().arena().pooled_bytes(), pooled)
        << "a failed fetch kept its device chunk";
    EXPECT_EQ(engine.where(chunks[kSlots]), residency::host);
    EXPECT_EQ(read_back(device, pointers[kSlots], kChunkBytes),
              std::vector<std::uint8_t>(kChunkBytes, static_cast<std::uint8_t>(kSlots + 1)));
    for (int i = 0; i < kSlots; ++i) {
      EXPECT_EQ(read_back(device, pointers[i], kChunkBytes),
                std::vector<std::uint8_t>(kChunkBytes, static_cast<std::uint8_t>(i + 1)));
    }
    for (void* pointer : pointers) allocator.deallocate(pointer);
  }
  allocator.empty_cache();
}

TEST_F(MigratorTest, AKernelWritesAHostResidentChunkAndTheWriteComesBack) {
  start();
  migrator& engine = *migrator_;
  void* pointer = allocator_->allocate(kChunkBytes, nullptr, allocation_class::parameter);
  device_->fill_async(pointer, 0x11, kChunkBytes, nullptr);
  const std::uintptr_t chunk = chunks_of(pointer).at(0).address;
  ASSERT_TRUE(engine.evict_async(chunk));
  engine.wait_until_settled(chunk);
  ASSERT_EQ(engine.where(chunk), residency::host);
  device_->fill_async(pointer, 0x7E, kChunkBytes / 2, nullptr);  // device work on host memory
  EXPECT_EQ(read_back(*device_, pointer, 4), std::vector<std::uint8_t>(4, 0x7E));
  ASSERT_TRUE(engine.fetch_async(chunk));
  engine.wait_until_settled(chunk);
  std::vector<std::uint8_t> expected(kChunkBytes, 0x11);
  std::fill_n(expected.begin(), kChunkBytes / 2, 0x7E);
  EXPECT_EQ(read_back(*device_, pointer, kChunkBytes), expected);
  allocator_->deallocate(pointer);
}

TEST_F(MigratorTest, TheCopyWaitsForWorkQueuedBeforeTheEviction) {
  start();
  migrator& engine = *migrator_;
  stream_handle compute = device_->create_stream();
  void* pointer = allocator_->allocate(kChunkBytes, compute, allocation_class::optimizer_state);
  device_->fill_async(pointer, 0x01, kChunkBytes, compute);
  // A slow "kernel", then the write the eviction must not miss; nothing waits on the host.
  device_->host_function_async([] { std::this_thread::sleep_for(std::chrono::milliseconds(300)); },
                               compute);
  device_->fill_async(pointer, 0x5A, kChunkBytes, compute);
  const std::uintptr_t chunk = chunks_of(pointer).at(0).address;
  ASSERT_TRUE(engine.evict_async(chunk));
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_EQ(engine.where(chunk), residency::moving_to_host)
      << "the chunk moved while work queued before the eviction had not run";
  engine.drain();
  EXPECT_EQ(read_back(*device_, pointer, kChunkBytes, compute),
            std::vector<std::uint8_t>(kChunkBytes, 0x5A));
  allocator_->deallocate(pointer);
  allocator_->forget_stream(compute);
  device_->destroy_stream(compute);
}

TEST_F(MigratorTest, DeviceMemoryAnEvictionFreesServesOtherAllocationsWithinTheLimit) {
  allocator_->set_limit(48 * MiB, "ZEROALLOC_MEMORY_LIMIT=48MiB");
  start();
  migrator& engine = *migrator_;
  void* states = allocator_->allocate(32 * MiB, nullptr, allocation_class::optimizer_state);
  const std::vector<std::uint8_t> written = write_random(states, 32 * MiB, 2);
  EXPECT_THROW(allocator_->allocate(32 * MiB, nullptr, allocation_class::other), out_of_memory);
  for (const chunk_info& chunk : chunks_of(states)) ASSERT_TRUE(engine.evict_async(chunk.address));
  engine.drain();
  void* activations = allocator_->allocate(48 * MiB, nullptr, allocation_class::other);
  ASSERT_NE(activations, nullptr);
  EXPECT_LE(allocator_->held_bytes(), 48 * MiB);
  device_->fill_async(activations, 0xEE, 48 * MiB, nullptr);
  EXPECT_EQ(read_back(*device_, states, 32 * MiB), written) << "the offloaded bytes were hit";
  // No device memory left to bring them back: the fetch says no rather than break the limit.
  EXPECT_FALSE(engine.fetch_async(chunks_of(states).at(0).address));
  allocator_->deallocate(activations);
  allocator_->deallocate(states);
}

TEST_F(MigratorTest, AFreedHostResidentAllocationGivesItsHostChunkBack) {
  start();
  migrator& engine = *migrator_;
  void* pointer = allocator_->allocate(16 * MiB, nullptr, allocation_class::gradient);
  for (const chunk_info& chunk : chunks_of(pointer)) ASSERT_TRUE(engine.evict_async(chunk.address));
  engine.drain();
  EXPECT_EQ(pool_->figures().in_use_bytes, 16 * MiB);
  EXPECT_EQ(engine.figures().host_resident_class_bytes[class_index(allocation_class::gradient)],
            16 * MiB);
  allocator_->deallocate(pointer);
  allocator_->empty_cache();
  EXPECT_EQ(pool_->figures().in_use_bytes, 0u);
  EXPECT_EQ(engine.figures().host_resident_bytes, 0u);
  EXPECT_EQ(engine.figures().host_resident_class_bytes,
            (std::array<std::uint64_t, kAllocationClassCount>{}));
}

TEST_F(MigratorTest, AChunkMovingOrMovedCannotBeStartedTwice) {
  start();
  migrator& engine = *migrator_;
  void* pointer = allocator_->allocate(kChunkBytes, nullptr, allocation_class::parameter);
  const std::uintptr_t chunk = chunks_of(pointer).at(0).address;
  ASSERT_TRUE(engine.evict_async(chunk));
  EXPECT_FALSE(engine.evict_async(chunk));
  engine.drain();
  EXPECT_FALSE(engine.evict_async(chunk)) << "it is on the host already";
  EXPECT_FALSE(engine.evict_async(chunk + 4096)) << "not the start of a chunk";
  ASSERT_TRUE(engine.fetch_async(chunk));
  engine.drain();
  EXPECT_FALSE(engine.fetch_async(chunk)) << "it is on the device already";
  allocator_->deallocate(pointer);
}

TEST_F(MigratorTest, ALongRunReusesItsEventsInsteadOfCreatingNewOnes) {
  auto* simulated = dynamic_cast<sim_device*>(device_.get());
  if (simulated == nullptr) GTEST_SKIP() << "skipped: counts events on the simulated device";
  start();
  migrator& engine = *migrator_;
  void* pointer = allocator_->allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
  const std::uintptr_t chunk = chunks_of(pointer).at(0).address;
  for (int round = 0; round < 200; ++round) {
    ASSERT_TRUE(engine.evict_async(chunk));
    engine.drain();
    ASSERT_TRUE(engine.fetch_async(chunk));
    engine.drain();
  }
  EXPECT_LE(simulated->events_alive(), 16u) << "every migration left an event behind";
  allocator_->deallocate(pointer);
}

TEST_F(MigratorTest, VerifyModeChecksEveryMovedChunk) {
  start(/*verify=*/true);
  migrator& engine = *migrator_;
  void* pointer = allocator_->allocate(24 * MiB, nullptr, allocation_class::optimizer_state);
  write_random(pointer, 24 * MiB, 3);
  for (const chunk_info& chunk : chunks_of(pointer)) ASSERT_TRUE(engine.evict_async(chunk.address));
  engine.drain();
  for (const chunk_info& chunk : chunks_of(pointer)) ASSERT_TRUE(engine.fetch_async(chunk.address));
  engine.drain();
  EXPECT_EQ(engine.figures().verified_chunks, 6u);
  allocator_->deallocate(pointer);
}

// ZEROALLOC_VERIFY is there to catch bytes that change while a chunk moves: a copy damaged
// in flight stops the process, with a message that names the chunk and the direction.
TEST_F(MigratorTest, VerifyModeStopsOnAChunkDamagedWhileMoving) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto moved_with_damage = [] {
    faulty_stack stack(64 * MiB);
    testing::faulty_device& device = *stack.device;
    caching_allocator& allocator = stack.allocator;
    migrator engine(allocator, stack.pool, /*verify=*/true);
    testing::attached_listener attached(allocator, engine);
    void* pointer = allocator.allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
    device.fill_async(pointer, 0x11, kChunkBytes, nullptr);
    device.synchronize_stream(nullptr);
    // The chunk is read twice on its way out: for the checksum, then by the move's copy.
    device.damage_copy([pointer](const void* source) { return source == pointer; }, 2);
    engine.evict_async(reinterpret_cast<std::uintptr_t>(pointer));
    engine.drain();
  };
  EXPECT_DEATH(moved_with_damage(),
               "ZEROALLOC_VERIFY: the chunk at 0x[0-9a-f]+ .* changed while "
               "moving to the host");
}

// A listener detaches itself when destroyed (paging_view::detach(listener)): the allocator
// it served calls nothing that is gone (releasing a segment tells the listener of the
// chunks it loses), and a new engine can attach.
TEST_F(MigratorTest, AMigratorDestroyedWhileAttachedLeavesTheAllocatorToTheNextOne) {
  faulty_stack stack(64 * MiB);
  caching_allocator& allocator = stack.allocator;
  {
    migrator first(allocator, stack.pool, /*verify=*/false);
    allocator.paging().attach(first);
    allocator.deallocate(allocator.allocate(kChunkBytes, nullptr, allocation_class::parameter));
  }
  allocator.empty_cache();  // the cached segment goes, and its chunk with it
  migrator second(allocator, stack.pool, /*verify=*/false);
  EXPECT_NO_THROW(allocator.paging().attach(second)) << "the destroyed migrator is still attached";
  void* pointer = allocator.allocate(kChunkBytes, nullptr, allocation_class::parameter);
  ASSERT_NE(pointer, nullptr);
  allocator.deallocate(pointer);
  allocator.empty_cache();
}

// ZEROALLOC_VERIFY must not mistake a user's write for damage: a chunk fetched as idle is
// mapped at once, and a kernel ordered after its arrival (order_after_arrival) may write it
// before the migrator's worker gets to the chunk. The check reads what arrived, in stream
// order; read later, it saw the kernel's bytes and aborted a correct program. On the
// simulated device each chunk's copy is held until the kernel is queued behind it, so that
// the kernel is always ordered after an arrival still on its way. On CUDA nothing is held:
// the read-back of what arrived goes to pageable memory, and CUDA returns from such a copy
// only once it has run, so the fetch itself would wait for the release that follows it.
// There the kernel is queued as soon as the fetch returns, while the worker may still be
// finishing the move.
TEST_F(MigratorTest, VerifyModeChecksWhatArrivedNotWhatAKernelWroteAfterwards) {
  faulty_stack stack(256 * MiB);
  testing::faulty_device& device = *stack.device;
  caching_allocator& allocator = stack.allocator;
  std::vector<chunk_info> chunks;
  void* pointer = allocator.allocate(48 * MiB, nullptr, allocation_class::optimizer_state);
  {
    migrator engine(allocator, stack.pool, /*verify=*/true);
    testing::attached_listener attached(allocator, engine);
    stream_handle stream = device.create_stream();
    device.fill_async(pointer, 0x33, 48 * MiB, nullptr);
    device.synchronize_stream(nullptr);
    ASSERT_TRUE(allocator.chunks_of_allocation(pointer, chunks));
    for (const chunk_info& chunk : chunks) ASSERT_TRUE(engine.evict_async(chunk.address));
    engine.drain();
    std::vector<chunk_info> now_on_host;
    ASSERT_TRUE(allocator.chunks_of_allocation(pointer, now_on_host));
    const bool hold = device.is_simulated();
    for (const chunk_info& chunk : now_on_host) {
      std::promise<void> copy_may_run;
      const void* into = reinterpret_cast<const void*>(chunk.address);
      if (hold) {
        device.hold_copy([into](const void* destination) { return destination == into; },
                         copy_may_run.get_future().share());
      }
      ASSERT_TRUE(engine.fetch_async(chunk.address, /*chunk_idle=*/true, chunk.generation));
      // Not ordered: the move has finished, and the kernel may write at once.
      const bool ordered = engine.order_after_arrival(chunk.address, stream);
      device.fill_async(reinterpret_cast<void*>(chunk.address), 0x5a, chunk.handle.bytes, stream);
      copy_may_run.set_value();
      if (hold) {
        ASSERT_TRUE(ordered) << "a fetch whose copy has not run is still arriving";
      }
      engine.drain();
    }
    device.synchronize_stream(stream);
    EXPECT_EQ(engine.figures().verified_chunks, 2 * chunks.size());
    EXPECT_EQ(read_back(device, pointer, 48 * MiB), std::vector<std::uint8_t>(48 * MiB, 0x5a));
    device.destroy_stream(stream);
  }
  allocator.deallocate(pointer);
  allocator.empty_cache();
}

// Random evictions and fetches racing with "kernels" on several streams. A kernel is a
// delay then a fill of one allocation with a fresh value, enqueued on the allocation's
// stream or on another stream after record_stream; before enqueueing one, the test waits
// for the allocation's migrations to settle (what a use-begins hint does). Every
// allocation must hold its last value at the end, wherever its chunks are.
TEST_F(MigratorTest, RandomMigrationsRacingWithKernelsOnSeveralStreamsKeepEveryByte) {
  start();
  migrator& engine = *migrator_;
  constexpr int kStreams = 3;
  constexpr int kAllocations = 8;
  constexpr int kRounds = 300;
  std::vector<stream_handle> streams;
  for (int i = 0; i < kStreams; ++i) streams.push_back(device_->create_stream());
  std::mt19937 random(7);
  struct tracked {
    void* pointer;
    std::size_t bytes;
    std::uint8_t value;
    stream_handle last_stream;  // where its latest kernel runs
  };
  std::vector<event_handle> events;
  std::vector<tracked> allocations;
  const std::size_t sizes[] = {8 * MiB, 12 * MiB, 16 * MiB, 20 * MiB};
  for (int i = 0; i < kAllocations; ++i) {
    const std::size_t bytes = sizes[i % 4];
    stream_handle stream = streams[i % kStreams];
    void* pointer = allocator_->allocate(bytes, stream, allocation_class::optimizer_state);
    device_->fill_async(pointer, 0, bytes, stream);
    allocations.push_back({pointer, bytes, 0, stream});
  }
  for (int round = 0; round < kRounds; ++round) {
    tracked& chosen = allocations[random() % kAllocations];
    const std::vector<chunk_info> chunks = chunks_of(chosen.pointer);
    switch (random() % 3) {
      case 0: {  // a kernel
        for (const chunk_info& chunk : chunks) engine.wait_until_settled(chunk.address);
        stream_handle stream = streams[random() % kStreams];
        allocator_->record_stream(chosen.pointer, stream);
        if (stream != chosen.last_stream) {           // as a correct program does: kernels on one
          events.push_back(device_->create_event());  // buffer are ordered across streams
          device_->record_event(events.back(), chosen.last_stream);
          device_->stream_wait_event(stream, events.back());
          chosen.last_stream = stream;
        }
        const int delay_us = static_cast<int>(random() % 300);
        device_->host_function_async(
            [delay_us] { std::this_thread::sleep_for(std::chrono::microseconds(delay_us)); },
            stream);
        chosen.value = static_cast<std::uint8_t>(round + 1);
        device_->fill_async(chosen.pointer, chosen.value, chosen.bytes, stream);
        break;
      }
      case 1:
        for (const chunk_info& chunk : chunks) engine.evict_async(chunk.address);
        break;
      default:
        for (const chunk_info& chunk : chunks) engine.fetch_async(chunk.address);
        break;
    }
  }
  engine.drain();
  for (stream_handle stream : streams) device_->synchronize_stream(stream);
  const migration_figures figures = engine.figures();
  EXPECT_GT(figures.chunks_to_host, 20u);
  EXPECT_GT(figures.chunks_to_device, 20u);
  for (const tracked& each : allocations) {
    EXPECT_EQ(read_back(*device_, each.pointer, each.bytes),
              std::vector<std::uint8_t>(each.bytes, each.value));
    allocator_->deallocate(each.pointer);
  }
  for (stream_handle stream : streams) {
    allocator_->forget_stream(stream);
    device_->destroy_stream(stream);
  }
  for (event_handle event : events) device_->destroy_event(event);
}

}  // namespace
}  // namespace zeroalloc
