// The caching allocator's behaviour as a user of the library sees it, over every device:
// memory is distinct and intact, reuse respects streams, the limit holds to the byte,
// running out says why, empty_cache gives memory back, and the statistics add up.
#include "alloc/caching_allocator.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "core/errors.hpp"
#include "support/attached_listener.hpp"
#include "support/faulty_device.hpp"
#include "support/test_device.hpp"

namespace zeroalloc {
namespace {

using testing::read_back;

constexpr std::size_t kSimBytes = 1 * GiB;

class CachingAllocatorTest : public ::testing::Test {
 protected:
  void SetUp() override { ZA_OPEN_TEST_DEVICE_OR_SKIP(device_, 0, kSimBytes); }

  std::unique_ptr<caching_allocator> make_allocator(std::uint64_t limit_bytes = 0,
                                                    std::string source = "the test",
                                                    std::size_t chunk_bytes = 8 * MiB) {
    allocator_settings settings;
    settings.chunk_bytes = chunk_bytes;
    settings.limit_bytes = limit_bytes;
    settings.limit_source = limit_bytes != 0 ? std::move(source) : "";
    return std::make_unique<caching_allocator>(*device_, settings);
  }

  void fill(void* pointer, std::uint8_t value, std::size_t bytes, stream_handle stream = nullptr) {
    device_->fill_async(pointer, value, bytes, stream);
  }
  bool holds(void* pointer, std::uint8_t value, std::size_t bytes, stream_handle stream = nullptr) {
    return read_back(*device_, pointer, bytes, stream) == std::vector<std::uint8_t>(bytes, value);
  }

  std::unique_ptr<device> device_;
};

TEST_F(CachingAllocatorTest, AllocationsAreAlignedDistinctAndUsable) {
  auto allocator = make_allocator();
  std::map<std::uintptr_t, std::size_t> ranges;
  const std::size_t sizes[] = {1, 511, 512, 4096, 100'000, 1 * MiB, 1 * MiB + 1, 7 * MiB, 33 * MiB};
  for (std::size_t bytes : sizes) {
    void* pointer = allocator->allocate(bytes, nullptr, allocation_class::other);
    ASSERT_NE(pointer, nullptr);
    const auto address = reinterpret_cast<std::uintptr_t>(pointer);
    EXPECT_EQ(address % caching_allocator::kAlignment, 0u);
    auto next = ranges.lower_bound(address);
    if (next != ranges.end()) {
      EXPECT_LE(address + bytes, next->first) << "overlaps the next block";
    }
    if (next != ranges.begin()) {
      auto previous = std::prev(next);
      EXPECT_LE(previous->first + previous->second, address) << "overlaps the previous block";
    }
    ranges[address] = bytes;
    fill(pointer, 0x3C, bytes);
    EXPECT_TRUE(holds(pointer, 0x3C, bytes));
    EXPECT_TRUE(allocator->owns(pointer));
  }
  for (auto [address, bytes] : ranges)
    EXPECT_TRUE(allocator->deallocate(reinterpret_cast<void*>(address)));
}

TEST_F(CachingAllocatorTest, ZeroBytesGivesAUniquePointerThatCanBeFreed) {
  auto allocator = make_allocator();
  void* first = allocator->allocate(0, nullptr, allocation_class::other);
  void* second = allocator->allocate(0, nullptr, allocation_class::other);
  EXPECT_NE(first, nullptr);
  EXPECT_NE(first, second);
  EXPECT_TRUE(allocator->deallocate(first));
  EXPECT_TRUE(allocator->deallocate(second));
}

TEST_F(CachingAllocatorTest, ForeignAndDoubleFreesAreRefused) {
  auto allocator = make_allocator();
  int on_the_stack = 0;
  EXPECT_FALSE(allocator->deallocate(&on_the_stack));
  void* pointer = allocator->allocate(4096, nullptr, allocation_class::other);
  EXPECT_TRUE(allocator->deallocate(pointer));
  EXPECT_FALSE(allocator->deallocate(pointer));
  EXPECT_FALSE(allocator->deallocate(static_cast<char*>(pointer) + 512));
  EXPECT_EQ(allocator->stats().total.frees, 1u);
}

TEST_F(CachingAllocatorTest, FreedMemoryIsReusedFromTheCache) {
  auto allocator = make_allocator();
  void* first = allocator->allocate(3 * MiB, nullptr, allocation_class::other);
  allocator->deallocate(first);
  void* second = allocator->allocate(3 * MiB, nullptr, allocation_class::other);
  EXPECT_EQ(first, second);
  EXPECT_EQ(allocator->stats().total.cache_hits, 1u);
  EXPECT_EQ(allocator->stats().total.segments_mapped, 1u);
  allocator->deallocate(second);
}

// The offload engine trusts what it was told about a chunk's uses (the event after its last
// hinted use) only while the chunk's generation stays what it was: a segment made later at
// the same addresses must not start where the released one stood, or the engine would move
// its chunks fenced only by the old segment's long-finished event, while unhinted work on
// the new one may still run.
TEST_F(CachingAllocatorTest, ASegmentMadeWhereAReleasedOneWasHasANewGeneration) {
  auto allocator = make_allocator();
  std::vector<chunk_info> chunks;
  void* first = allocator->allocate(16 * MiB, nullptr, allocation_class::parameter);
  allocator->chunks_of_allocation(first, chunks);
  const std::uint64_t generation_in_use = chunks.at(0).generation;
  allocator->deallocate(first);
  allocator->empty_cache();  // the segment is released, its addresses free
  void* second = allocator->allocate(16 * MiB, nullptr, allocation_class::parameter);
  ASSERT_EQ(second, first) << "the new segment did not take the released one's addresses";
  chunks.clear();
  allocator->chunks_of_allocation(second, chunks);
  EXPECT_NE(chunks.at(0).generation, generation_in_use);
  allocator->deallocate(second);
}

TEST_F(CachingAllocatorTest, BytesStayIntactThroughSplitsAndMerges) {
  auto allocator = make_allocator();
  std::mt19937 random(7);
  struct live_block {
    void* pointer;
    std::size_t bytes;
    std::uint8_t value;
  };
  std::vector<live_block> live;
  for (int round = 0; round < 400; ++round) {
    if (!live.empty() && random() % 3 == 0) {
      const std::size_t victim = random() % live.size();
      ASSERT_TRUE(allocator->deallocate(live[victim].pointer));
      live.erase(live.begin() + static_cast<long>(victim));
      continue;
    }
    const std::size_t bytes =
        random() % 2 == 0 ? 512 + random() % (256 * KiB) : 1 * MiB + random() % (6 * MiB);
    const auto value = static_cast<std::uint8_t>(random());
    void* pointer = allocator->allocate(bytes, nullptr, allocation_class::other);
    fill(pointer, value, bytes);
    live.push_back({pointer, bytes, value});
  }
  for (const live_block& each : live) {
    EXPECT_TRUE(holds(each.pointer, each.value, each.bytes))
        << "block of " << each.bytes << " bytes";
  }
  for (const live_block& each : live) allocator->deallocate(each.pointer);
  EXPECT_EQ(allocator->stats().total.allocated_bytes.current, 0);
}

// Note [Deferred coalescing]: whatever order blocks are freed in, a request that fits the
// merged space is served from it, without new memory.
TEST_F(CachingAllocatorTest, FreedNeighboursMergeWhateverTheOrderOfFrees) {
  for (bool first_freed_first : {true, false}) {
    auto allocator = make_allocator();
    void* a = allocator->allocate(4 * MiB, nullptr, allocation_class::other);  // 20 MiB segment
    void* b = allocator->allocate(4 * MiB, nullptr, allocation_class::other);
    allocator->deallocate(first_freed_first ? a : b);
    allocator->deallocate(first_freed_first ? b : a);
    void* whole = allocator->allocate(18 * MiB, nullptr, allocation_class::other);
    EXPECT_EQ(whole, a);
    EXPECT_EQ(allocator->stats().total.segments_mapped, 1u);
    allocator->deallocate(whole);
  }
}

TEST_F(CachingAllocatorTest, ClassesLiveInSeparateSegments) {
  auto allocator = make_allocator();
  void* parameter = allocator->allocate(4096, nullptr, allocation_class::parameter);
  void* state = allocator->allocate(4096, nullptr, allocation_class::optimizer_state);
  const auto distance =
      reinterpret_cast<std::uintptr_t>(state) > reinterpret_cast<std::uintptr_t>(parameter)
          ? reinterpret_cast<std::uintptr_t>(state) - reinterpret_cast<std::uintptr_t>(parameter)
          : reinterpret_cast<std::uintptr_t>(parameter) - reinterpret_cast<std::uintptr_t>(state);
  EXPECT_GE(distance, 2 * MiB) << "two classes shared a segment";
  EXPECT_EQ(allocator->stats().of(allocation_class::parameter).allocated_bytes.current, 4096);
  EXPECT_EQ(allocator->stats().of(allocation_class::optimizer_state).reserved_bytes.current,
            static_cast<std::int64_t>(2 * MiB));
  allocator->deallocate(parameter);
  allocator->deallocate(state);
}

// Note [Stream-ordered reuse]: the block freed on `first` while `first` still has work
// queued for it must not be written by `second` before that work has run.
TEST_F(CachingAllocatorTest, BlockFreedOnOneStreamIsReusedOnAnotherOnlyAfterItsWork) {
  auto allocator = make_allocator();
  stream_handle first = device_->create_stream();
  stream_handle second = device_->create_stream();
  const std::size_t bytes = 4 * MiB;

  void* pointer = allocator->allocate(bytes, first, allocation_class::other);
  device_->host_function_async([] { std::this_thread::sleep_for(std::chrono::milliseconds(150)); },
                               first);
  fill(pointer, 0xAA, bytes, first);  // the late "kernel" on the first stream
  allocator->deallocate(pointer);     // stream-ordered free: legal at once

  void* reused = allocator->allocate(bytes, second, allocation_class::other);
  EXPECT_EQ(reused, pointer) << "the cached block should be reused across streams";
  fill(reused, 0xBB, bytes, second);
  device_->synchronize_stream(second);
  device_->synchronize_stream(first);
  EXPECT_TRUE(holds(reused, 0xBB, bytes)) << "the second stream wrote before the first finished";

  allocator->deallocate(reused);
  allocator->forget_stream(first);
  allocator->forget_stream(second);
  device_->destroy_stream(first);
  device_->destroy_stream(second);
}

// A block freed while a record_stream stream may still use it stays pending; until then the
// streams the offload engine fences a move of its chunk on must include that stream, and the
// chunk's generation has moved on from the one its use hints were given in.
TEST_F(CachingAllocatorTest, APendingFreeKeepsItsRecordedStreamsInTheChunksStreams) {
  auto allocator = make_allocator();
  stream_handle producer = device_->create_stream();
  stream_handle consumer = device_->create_stream();
  void* pointer = allocator->allocate(16 * MiB, producer, allocation_class::gradient);
  ASSERT_TRUE(allocator->record_stream(pointer, consumer));
  device_->host_function_async([] { std::this_thread::sleep_for(std::chrono::milliseconds(150)); },
                               consumer);
  std::vector<chunk_info> chunks;
  allocator->chunks_of_allocation(pointer, chunks);
  const std::uintptr_t first = chunks.at(0).address;
  const std::uint64_t generation_in_use = chunks.at(0).generation;
  allocator->deallocate(pointer);  // pending: the consumer is still asleep
  chunks.clear();
  allocator->paging().list_chunks(chunks);
  const auto chunk = std::find_if(chunks.begin(), chunks.end(),
                                  [&](const chunk_info& each) { return each.address == first; });
  ASSERT_NE(chunk, chunks.end());
  EXPECT_TRUE(chunk->holds_live_blocks);
  // Hints given while it was in use (their events) do not cover the consumer's work.
  EXPECT_NE(chunk->generation, generation_in_use);
  EXPECT_NE(std::find(chunk->streams.begin(), chunk->streams.end(), consumer), chunk->streams.end())
      << "a move of the chunk would not wait for the consumer's work";
  device_->synchronize_stream(consumer);
  allocator->empty_cache();
  allocator->forget_stream(producer);
  allocator->forget_stream(consumer);
  device_->destroy_stream(producer);
  device_->destroy_stream(consumer);
}

TEST_F(CachingAllocatorTest, RecordStreamKeepsABlockUntilTheOtherStreamIsDone) {
  auto allocator = make_allocator();
  stream_handle producer = device_->create_stream();
  stream_handle consumer = device_->create_stream();
  const std::size_t bytes = 2 * MiB + 512;

  void* pointer = allocator->allocate(bytes, producer, allocation_class::other);
  ASSERT_TRUE(allocator->record_stream(pointer, consumer));
  device_->host_function_async([] { std::this_thread::sleep_for(std::chrono::milliseconds(150)); },
                               consumer);
  fill(pointer, 0xCC, bytes, consumer);  // the consumer still uses it after the free below
  allocator->deallocate(pointer);
  EXPECT_EQ(allocator->stats().total.active_bytes.current,
            allocator->stats().total.allocated_bytes.current +
                static_cast<std::int64_t>(round_up(bytes, 512)));

  void* meanwhile = allocator->allocate(bytes, producer, allocation_class::other);
  EXPECT_NE(meanwhile, pointer) << "handed out while the consumer stream may still use it";
  fill(meanwhile, 0x01, bytes, producer);
  device_->synchronize_stream(consumer);
  EXPECT_TRUE(holds(pointer, 0xCC, bytes, consumer));
  allocator->deallocate(meanwhile);

  void* later = allocator->allocate(bytes, producer, allocation_class::other);
  allocator->deallocate(later);
  EXPECT_EQ(allocator->stats().total.active_bytes.current, 0);
  allocator->forget_stream(producer);
  allocator->forget_stream(consumer);
  device_->destroy_stream(producer);
  device_->destroy_stream(consumer);
}

// Note [Released after every stream] (heap_release.cpp): a block used on a stream the
// allocator never saw (no record_stream) and freed while that work is queued. Under
// ZEROALLOC_ACCESS=any, empty_cache unmaps its segment only after every stream of the device
// ran what it had queued, as cudaFree does under PyTorch's allocator: the late write lands
// in mapped memory instead of faulting.
TEST_F(CachingAllocatorTest, UnderAnyAccessAReleaseWaitsForStreamsTheAllocatorNeverSaw) {
  allocator_settings settings;
  settings.chunk_bytes = 8 * MiB;
  settings.drain_before_release = true;
  caching_allocator allocator(*device_, settings);
  stream_handle unknown = device_->create_stream();
  void* pointer = allocator.allocate(8 * MiB, nullptr, allocation_class::other);
  std::atomic<bool> written{false};
  device_->host_function_async([] { std::this_thread::sleep_for(std::chrono::milliseconds(150)); },
                               unknown);
  fill(pointer, 0x5A, 8 * MiB, unknown);  // still queued when the block is freed
  device_->host_function_async([&written] { written = true; }, unknown);
  allocator.deallocate(pointer);
  allocator.empty_cache();
  EXPECT_TRUE(written.load()) << "the segment was released before the unknown stream's work";
  EXPECT_EQ(allocator.stats().total.reserved_bytes.current, 0) << "nothing was released";
  device_->synchronize_stream(unknown);
  device_->destroy_stream(unknown);
}

TEST_F(CachingAllocatorTest, LimitIsHonouredToTheByte) {
  const std::uint64_t limit = 41 * MiB;  // not a multiple of the granularity on purpose
  auto allocator = make_allocator(limit);
  void* exact = allocator->allocate(40 * MiB, nullptr, allocation_class::other);
  ASSERT_NE(exact, nullptr);
  EXPECT_THROW(allocator->allocate(512, nullptr, allocation_class::other), out_of_memory);
  EXPECT_LE(static_cast<std::uint64_t>(allocator->stats().total.reserved_bytes.peak), limit);
  allocator->deallocate(exact);
  void* small = allocator->allocate(512, nullptr, allocation_class::other);  // cache released, fits
  EXPECT_NE(small, nullptr);
  allocator->deallocate(small);
}

TEST_F(CachingAllocatorTest, OutOfMemoryMessageSaysWhatAndWhichVariable) {
  auto allocator = make_allocator(64 * MiB, "ZEROALLOC_MEMORY_LIMIT=64MiB");
  void* held = allocator->allocate(30 * MiB, nullptr, allocation_class::parameter);
  try {
    allocator->allocate(100 * MiB, nullptr, allocation_class::optimizer_state);
    FAIL() << "an allocation over the limit succeeded";
  } catch (const out_of_memory& failure) {
    const std::string message = failure.what();
    EXPECT_NE(message.find("tried to allocate 100.00 MiB (optimizer_state)"), std::string::npos)
        << message;
    EXPECT_NE(message.find("limit in force: 64.00 MiB, set by ZEROALLOC_MEMORY_LIMIT=64MiB"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("zeroalloc holds 30.00 MiB of which 30.00 MiB is allocated"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("cached but free"), std::string::npos) << message;
  }
  EXPECT_EQ(allocator->stats().total.failures, 1u);
  allocator->deallocate(held);
}

// A request whose segment exceeds the limit fails at once: releasing the cache and asking
// the paging listener (the offload engine, which would move every movable chunk to the
// host) could not make it fit, and would only leave the program slower.
TEST_F(CachingAllocatorTest, ARequestLargerThanTheLimitFailsAtOnceAndKeepsTheCache) {
  auto allocator = make_allocator(64 * MiB);
  struct counting_listener : paging_listener {
    int asked = 0;
    std::uint64_t relieve_pressure(std::size_t) override {
      ++asked;
      return 0;
    }
  } listener;
  allocator->paging().attach(listener);
  const int& asked = listener.asked;
  void* cached = allocator->allocate(16 * MiB, nullptr, allocation_class::other);
  allocator->deallocate(cached);
  EXPECT_THROW(allocator->allocate(100 * MiB, nullptr, allocation_class::optimizer_state),
               out_of_memory);
  EXPECT_EQ(asked, 0) << "the listener was asked to make room that cannot exist";
  EXPECT_EQ(allocator->stats().total.reserved_bytes.current, static_cast<std::int64_t>(16 * MiB))
      << "the cache was released for a request that could never fit";
  void* fits = allocator->allocate(60 * MiB, nullptr, allocation_class::optimizer_state);
  EXPECT_NE(fits, nullptr);  // one that fits under the limit still gets the cache's room
  allocator->deallocate(fits);
  allocator->paging().detach();
}

// Note [Segments at the limit]: blocks of one size, allocated until the allocator refuses,
// reach at least 7/8 of the limit (or every block the limit holds, when that is less),
// whatever the size and the chunk size; and once they are freed, a cache full of that
// size's segments does not keep blocks of another size from doing the same. The refusal
// says how much is cached but free, as the statistics count it.
TEST_F(CachingAllocatorTest, BlocksOfOneSizeFillAtLeastSevenEighthsOfTheLimit) {
  const std::uint64_t limit = 256 * MiB;
  const std::size_t sizes[] = {512 * KiB, 1 * MiB,  2 * MiB,  3 * MiB,   8 * MiB,          12 * MiB,
                               20 * MiB,  24 * MiB, 50 * MiB, 100 * MiB, 8 * MiB + 4 * KiB};
  const std::size_t count = std::size(sizes);
  struct filled {
    std::vector<void*> blocks;
    std::uint64_t bytes = 0;
  };
  // Allocates blocks of `bytes` until refused, each filled with its own value; checks the
  // refusal's figure of cached free memory against the statistics.
  auto fill_until_refused = [&](caching_allocator& allocator, std::size_t bytes) {
    filled result;
    for (;;) {
      try {
        void* pointer = allocator.allocate(bytes, nullptr, allocation_class::other);
        fill(pointer, static_cast<std::uint8_t>(result.blocks.size() + 1), bytes);
        result.blocks.push_back(pointer);
        result.bytes += bytes;
      } catch (const out_of_memory& refusal) {
        const stats_snapshot stats = allocator.stats();
        const std::string cached = format_bytes(static_cast<std::uint64_t>(
            stats.total.reserved_bytes.current - stats.total.allocated_bytes.current));
        EXPECT_NE(std::string(refusal.what()).find(" and " + cached + " is cached but free"),
                  std::string::npos)
            << refusal.what();
        EXPECT_LE(static_cast<std::uint64_t>(stats.total.reserved_bytes.peak), limit);
        return result;
      }
    }
  };
  auto expect_intact_and_free = [&](caching_allocator& allocator, const filled& result,
                                    std::size_t bytes) {
    for (std::size_t i = 0; i < result.blocks.size(); ++i) {
      EXPECT_TRUE(holds(result.blocks[i], static_cast<std::uint8_t>(i + 1), bytes))
          << "block " << i << " of " << format_bytes(bytes);
    }
    for (void* pointer : result.blocks) EXPECT_TRUE(allocator.deallocate(pointer));
  };
  auto least_expected = [&](std::size_t bytes) {
    const std::uint64_t rounded = round_up(bytes, caching_allocator::kAlignment);
    return std::min(limit / 8 * 7, limit / rounded * bytes);
  };
  for (std::size_t chunk_bytes : {64 * MiB, 8 * MiB}) {
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t bytes = sizes[i];
      const std::size_t then_bytes = sizes[(i + 3) % count];
      auto allocator = make_allocator(limit, "the test", chunk_bytes);
      const filled first = fill_until_refused(*allocator, bytes);
      expect_intact_and_free(*allocator, first, bytes);
      const filled then = fill_until_refused(*allocator, then_bytes);
      expect_intact_and_free(*allocator, then, then_bytes);
      std::printf("chunks of %s: %s blocks reach %s; then %s blocks reach %s\n",
                  format_bytes(chunk_bytes).c_str(), format_bytes(bytes).c_str(),
                  format_bytes(first.bytes).c_str(), format_bytes(then_bytes).c_str(),
                  format_bytes(then.bytes).c_str());
      EXPECT_GE(first.bytes, least_expected(bytes))
          << format_bytes(bytes) << " blocks, chunks of " << format_bytes(chunk_bytes);
      // With chunks smaller than the segments, donations of whole chunks may still leave
      // a new segment's tail in a chunk its block uses: 50 MiB blocks after 12 MiB ones
      // reach 200 MiB, 8 MiB + 4 KiB after 24 MiB ones 208 MiB. Held to the default size.
      if (chunk_bytes == allocator_settings{}.chunk_bytes) {
        EXPECT_GE(then.bytes, least_expected(then_bytes))
            << format_bytes(then_bytes) << " blocks after " << format_bytes(bytes)
            << " blocks, chunks of " << format_bytes(chunk_bytes);
      }
    }
  }
}

// Note [Segments at the limit]: with the offload engine (any paging listener) attached, a
// request near the limit that would strand part of a whole free segment exchanges it for one
// of its own size only when no work is queued on it; otherwise the cache hit stands, and the
// program's thread never waits for the device there.
TEST_F(CachingAllocatorTest, NearTheLimitWithAListenerAnAllocationNeverWaitsForQueuedWork) {
  auto allocator = make_allocator(256 * MiB, "the test", 64 * MiB);
  paging_listener quiet;
  testing::attached_listener attached(*allocator, quiet);
  std::vector<void*> blocks;
  for (int i = 0; i < 10; ++i)
    blocks.push_back(allocator->allocate(24 * MiB, nullptr, allocation_class::other));
  for (void* each : blocks) allocator->deallocate(each);  // 240 MiB of free 24 MiB segments
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  device_->host_function_async([released] { released.wait(); }, nullptr);  // the stream is busy
  const std::uint64_t mapped = allocator->stats().total.segments_mapped;
  auto allocation = std::async(std::launch::async, [&] {
    return allocator->allocate(20 * MiB, nullptr, allocation_class::other);  // strands 4 MiB
  });
  const bool returned = allocation.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  release.set_value();
  EXPECT_TRUE(returned) << "the allocation waited for the work queued on its stream";
  void* pointer = allocation.get();
  EXPECT_EQ(allocator->stats().total.segments_mapped, mapped) << "the cache hit did not stand";
  device_->synchronize_stream(nullptr);
  allocator->deallocate(pointer);
}

TEST_F(CachingAllocatorTest, FreeMemoryOfAnotherClassServesARequestWithoutNewMemory) {
  auto allocator = make_allocator(64 * MiB);
  std::vector<void*> activations;
  for (int i = 0; i < 6; ++i)
    activations.push_back(allocator->allocate(10 * MiB, nullptr, allocation_class::other));
  for (void* each : activations) allocator->deallocate(each);  // 60 MiB cached, free
  void* state = allocator->allocate(48 * MiB, nullptr, allocation_class::optimizer_state);
  EXPECT_NE(state, nullptr);
  const stats_snapshot stats = allocator->stats();
  EXPECT_LE(static_cast<std::uint64_t>(stats.total.reserved_bytes.peak), 64 * MiB);
  EXPECT_GE(stats.of(allocation_class::other).segments_donated, 1u);
  EXPECT_EQ(stats.total.failures, 0u);
  allocator->deallocate(state);
}

// Note [Releasing what is needed]: a request that needs new memory under the limit releases
// the cached free segments it needs, largest first, and leaves the rest of the cache.
TEST_F(CachingAllocatorTest, ANewSegmentReleasesOnlyTheCacheItNeeds) {
  auto allocator = make_allocator(128 * MiB);  // 8 MiB chunks
  std::vector<void*> activations;
  for (int i = 0; i < 12; ++i)  // twelve 10 MiB segments: more than donations can gather
    activations.push_back(allocator->allocate(10 * MiB, nullptr, allocation_class::other));
  for (void* each : activations) allocator->deallocate(each);
  ASSERT_EQ(allocator->stats().of(allocation_class::other).reserved_bytes.current,
            static_cast<std::int64_t>(120 * MiB));
  void* state = allocator->allocate(96 * MiB, nullptr, allocation_class::optimizer_state);
  ASSERT_NE(state, nullptr);
  fill(state, 0x5A, 96 * MiB);
  EXPECT_TRUE(holds(state, 0x5A, 96 * MiB));
  const stats_snapshot stats = allocator->stats();
  EXPECT_LE(static_cast<std::uint64_t>(stats.total.reserved_bytes.peak), 128 * MiB);
  EXPECT_EQ(stats.total.failures, 0u);
  EXPECT_GE(stats.of(allocation_class::other).reserved_bytes.current,
            static_cast<std::int64_t>(20 * MiB))
      << "the whole cache was released for a request that needed part of it";
  void* again = allocator->allocate(10 * MiB, nullptr, allocation_class::other);
  EXPECT_EQ(allocator->stats().of(allocation_class::other).cache_hits, 1u)
      << "the kept cache did not serve the next activation";
  allocator->deallocate(again);
  allocator->deallocate(state);
}

// Note [Splitting free runs off a segment]: a run of whole free chunks inside a segment whose
// other blocks are live serves another class; the live blocks keep their bytes.
TEST_F(CachingAllocatorTest, AFreeRunInsideABusySegmentServesAnotherClass) {
  auto allocator = make_allocator(64 * MiB);  // 8 MiB chunks
  allocator->deallocate(allocator->allocate(48 * MiB, nullptr, allocation_class::other));
  void* first = allocator->allocate(16 * MiB, nullptr, allocation_class::other);
  void* middle = allocator->allocate(16 * MiB, nullptr, allocation_class::other);
  void* last = allocator->allocate(16 * MiB, nullptr, allocation_class::other);
  ASSERT_EQ(static_cast<std::uint64_t>(allocator->stats().total.reserved_bytes.current), 48 * MiB)
      << "the three blocks share the 48 MiB segment";
  fill(first, 0x11, 16 * MiB);
  fill(last, 0x33, 16 * MiB);
  allocator->deallocate(middle);
  // 16 MiB of the limit is left: 24 MiB more needs the free middle run.
  void* gradient = allocator->allocate(24 * MiB, nullptr, allocation_class::gradient);
  ASSERT_NE(gradient, nullptr);
  fill(gradient, 0x22, 24 * MiB);
  const stats_snapshot stats = allocator->stats();
  EXPECT_LE(static_cast<std::uint64_t>(stats.total.reserved_bytes.peak), 64 * MiB);
  EXPECT_EQ(stats.of(allocation_class::other).segments_split, 2u)  // before, run, after
      << "the segment was not cut in three";
  EXPECT_EQ(stats.total.failures, 0u);
  EXPECT_TRUE(holds(first, 0x11, 16 * MiB));
  EXPECT_TRUE(holds(last, 0x33, 16 * MiB));
  EXPECT_TRUE(holds(gradient, 0x22, 24 * MiB));
  for (void* pointer : {first, last, gradient}) allocator->deallocate(pointer);
}

// Note [Moving free memory between classes]: reserved memory follows the peak of the sum of
// the classes, not the sum of their peaks.
TEST_F(CachingAllocatorTest, ReservedMemoryFollowsThePeakOfAllClassesTogether) {
  auto allocator = make_allocator();
  for (int step = 0; step < 3; ++step) {
    std::vector<void*> activations;
    for (int i = 0; i < 8; ++i)
      activations.push_back(allocator->allocate(24 * MiB, nullptr, allocation_class::other));
    for (void* each : activations) allocator->deallocate(each);
    std::vector<void*> gradients;
    for (int i = 0; i < 8; ++i)
      gradients.push_back(allocator->allocate(24 * MiB, nullptr, allocation_class::gradient));
    for (void* each : gradients) allocator->deallocate(each);
  }
  const stats_snapshot stats = allocator->stats();
  EXPECT_EQ(stats.total.allocated_bytes.peak, static_cast<std::int64_t>(8 * 24 * MiB));
  EXPECT_EQ(stats.total.reserved_bytes.peak, static_cast<std::int64_t>(8 * 24 * MiB))
      << "the gradients mapped new memory while the activations' memory sat free";
}

TEST_F(CachingAllocatorTest, DonatedMemoryIsWrittenOnlyAfterTheDonorsWorkRan) {
  auto allocator = make_allocator();
  stream_handle first = device_->create_stream();
  stream_handle second = device_->create_stream();
  const std::size_t bytes = 24 * MiB;
  void* activation = allocator->allocate(bytes, first, allocation_class::other);
  device_->host_function_async([] { std::this_thread::sleep_for(std::chrono::milliseconds(150)); },
                               first);
  fill(activation, 0xAA, bytes, first);  // still queued when the memory changes class
  allocator->deallocate(activation);

  void* gradient = allocator->allocate(bytes, second, allocation_class::gradient);
  EXPECT_EQ(allocator->stats().of(allocation_class::other).segments_donated, 1u);
  EXPECT_NE(gradient, activation) << "a new class gets its own addresses";
  fill(gradient, 0xBB, bytes, second);
  device_->synchronize_stream(second);
  device_->synchronize_stream(first);
  EXPECT_TRUE(holds(gradient, 0xBB, bytes))
      << "the gradient stream wrote before the donor's work ran";
  allocator->deallocate(gradient);
  allocator->forget_stream(first);
  allocator->forget_stream(second);
  device_->destroy_stream(first);
  device_->destroy_stream(second);
}

TEST_F(CachingAllocatorTest, EmptyCacheReturnsFreeMemoryToTheDevice) {
  auto allocator = make_allocator();
  const memory_info before = device_->query_memory();
  void* kept = allocator->allocate(4096, nullptr, allocation_class::other);
  void* dropped = allocator->allocate(64 * MiB, nullptr, allocation_class::other);
  allocator->deallocate(dropped);
  EXPECT_EQ(allocator->stats().total.reserved_bytes.current, static_cast<std::int64_t>(66 * MiB));
  allocator->empty_cache();
  EXPECT_EQ(allocator->stats().total.reserved_bytes.current, static_cast<std::int64_t>(2 * MiB));
  if (device_->is_simulated()) {
    EXPECT_EQ(device_->query_memory().free_bytes, before.free_bytes - 2 * MiB);
  }
  allocator->deallocate(kept);
  allocator->empty_cache();
  EXPECT_EQ(allocator->stats().total.reserved_bytes.current, 0);
  if (device_->is_simulated()) {
    EXPECT_EQ(device_->query_memory().free_bytes, before.free_bytes);
  }
}

TEST_F(CachingAllocatorTest, StatisticsAreExactAfterARandomWorkload) {
  auto allocator = make_allocator();
  std::mt19937 random(11);
  struct live_block {
    void* pointer;
    std::int64_t bytes;
    allocation_class cls;
  };
  std::vector<live_block> live;
  std::array<std::int64_t, kAllocationClassCount> allocated{};
  std::array<std::int64_t, kAllocationClassCount> peak{};
  std::int64_t total = 0;
  std::int64_t total_peak = 0;
  std::uint64_t allocations = 0;
  std::uint64_t frees = 0;
  for (int round = 0; round < 3000; ++round) {
    if (!live.empty() && random() % 2 == 0) {
      const std::size_t victim = random() % live.size();
      allocator->deallocate(live[victim].pointer);
      allocated[class_index(live[victim].cls)] -= live[victim].bytes;
      total -= live[victim].bytes;
      ++frees;
      live.erase(live.begin() + static_cast<long>(victim));
      continue;
    }
    const auto cls = static_cast<allocation_class>(random() % kAllocationClassCount);
    const std::size_t bytes =
        random() % 4 == 0 ? 1 * MiB + random() % (3 * MiB) : 1 + random() % (64 * KiB);
    void* pointer = allocator->allocate(bytes, nullptr, cls);
    // Rounded to 512; a large block keeps an unsplittable remainder of up to 1 MiB.
    const std::int64_t charged = allocator->stats().total.allocated_bytes.current - total;
    EXPECT_GE(charged, static_cast<std::int64_t>(round_up(bytes, 512)));
    EXPECT_LE(charged, static_cast<std::int64_t>(round_up(bytes, 512) + (bytes > MiB ? MiB : 0)));
    live.push_back({pointer, charged, cls});
    allocated[class_index(cls)] += charged;
    peak[class_index(cls)] = std::max(peak[class_index(cls)], allocated[class_index(cls)]);
    total += charged;
    total_peak = std::max(total_peak, total);
    ++allocations;
  }
  const stats_snapshot stats = allocator->stats();
  for (allocation_class cls : kAllocationClasses) {
    EXPECT_EQ(stats.classes[class_index(cls)].allocated_bytes.current, allocated[class_index(cls)]);
    EXPECT_EQ(stats.classes[class_index(cls)].allocated_bytes.peak, peak[class_index(cls)]);
  }
  EXPECT_EQ(stats.total.allocated_bytes.current, total);
  EXPECT_EQ(stats.total.allocated_bytes.peak, total_peak);
  EXPECT_EQ(stats.total.allocations, allocations);
  EXPECT_EQ(stats.total.frees, frees);
  EXPECT_EQ(stats.total.active_bytes.current, total);
  EXPECT_EQ(stats.total.active_bytes.peak, total_peak);  // nothing waited for another stream
  EXPECT_GE(stats.total.reserved_bytes.current, total);  // what is cached is never negative
  std::int64_t reserved_by_classes = 0;
  for (const class_figures& each : stats.classes)
    reserved_by_classes += each.reserved_bytes.current;
  EXPECT_EQ(reserved_by_classes, stats.total.reserved_bytes.current);

  allocator->reset_peak_stats();
  EXPECT_EQ(allocator->stats().total.allocated_bytes.peak, total);
  for (const live_block& each : live) allocator->deallocate(each.pointer);
  EXPECT_EQ(allocator->stats().total.allocated_bytes.current, 0);
  EXPECT_EQ(allocator->stats().total.allocated_bytes.peak, total);
}

TEST_F(CachingAllocatorTest, SixteenThreadsOfRandomWorkKeepEveryByte) {
  auto allocator = make_allocator();
  std::atomic<int> corrupted{0};
  const bool simulated = device_->is_simulated();
  std::vector<std::thread> threads;
  for (int thread_index = 0; thread_index < 16; ++thread_index) {
    threads.emplace_back([&, thread_index] {
      std::mt19937 random(static_cast<unsigned>(thread_index));
      stream_handle stream = thread_index % 2 == 0 ? nullptr : device_->create_stream();
      std::vector<std::pair<void*, std::size_t>> live;
      const auto value = static_cast<std::uint8_t>(thread_index + 1);
      for (int round = 0; round < (simulated ? 2000 : 300); ++round) {
        if (!live.empty() && random() % 2 == 0) {
          auto [pointer, bytes] = live.back();
          live.pop_back();
          if (!holds(pointer, value, std::min<std::size_t>(bytes, 4096), stream)) ++corrupted;
          allocator->deallocate(pointer);
          continue;
        }
        const auto cls = static_cast<allocation_class>(random() % kAllocationClassCount);
        const std::size_t bytes =
            random() % 8 == 0 ? 1 * MiB + random() % (2 * MiB) : 1 + random() % (32 * KiB);
        void* pointer = allocator->allocate(bytes, stream, cls);
        fill(pointer, value, bytes, stream);
        live.emplace_back(pointer, bytes);
      }
      for (auto [pointer, bytes] : live) {
        if (!holds(pointer, value, std::min<std::size_t>(bytes, 4096), stream)) ++corrupted;
        allocator->deallocate(pointer);
      }
      if (stream != nullptr) {
        allocator->forget_stream(stream);
        device_->destroy_stream(stream);
      }
    });
  }
  for (auto& each : threads) each.join();
  EXPECT_EQ(corrupted, 0);
  EXPECT_EQ(allocator->stats().total.allocated_bytes.current, 0);
  EXPECT_EQ(allocator->stats().total.allocations, allocator->stats().total.frees);
}

// A CUDA call that fails halfway through the allocator's work surfaces as a device_error and
// leaves the cache as it was or in a state that still adds up: no block is handed out twice
// or lost, no address range is given back twice, and the statistics keep counting what is
// really held. Each test below fails a call at the point where an earlier version changed
// its bookkeeping before the device had done its part.
class AllocatorDeviceFailureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::unique_ptr<device> inner;
    ZA_OPEN_TEST_DEVICE_OR_SKIP(inner, 0, kSimBytes);
    device_ = std::make_unique<testing::faulty_device>(std::move(inner));
    allocator_settings settings;
    settings.chunk_bytes = 8 * MiB;
    allocator_ = std::make_unique<caching_allocator>(*device_, settings);
  }
  void TearDown() override {
    allocator_.reset();
    for (stream_handle stream : streams_) device_->destroy_stream(stream);
  }
  stream_handle new_stream() { return streams_.emplace_back(device_->create_stream()); }
  std::int64_t reserved() const { return allocator_->stats().total.reserved_bytes.current; }
  // A late "kernel" on `stream`: the fences recorded behind it are still pending for a while.
  void keep_busy(stream_handle stream) {
    device_->host_function_async(
        [] { std::this_thread::sleep_for(std::chrono::milliseconds(100)); }, stream);
  }

  std::unique_ptr<testing::faulty_device> device_;
  std::unique_ptr<caching_allocator> allocator_;
  std::vector<stream_handle> streams_;
};

TEST_F(AllocatorDeviceFailureTest, AFailedFenceForAnotherStreamLeavesTheCachedBlockCached) {
  stream_handle first = new_stream();
  stream_handle second = new_stream();
  void* pointer = allocator_->allocate(4 * MiB, first, allocation_class::other);
  allocator_->deallocate(pointer);
  const std::int64_t held = reserved();
  // Taking the block for the second stream fences the first one: that fence fails.
  device_->fail_call(testing::device_call::record_event);
  EXPECT_THROW(allocator_->allocate(4 * MiB, second, allocation_class::other), device_error);
  void* again = allocator_->allocate(4 * MiB, first, allocation_class::other);
  EXPECT_EQ(again, pointer) << "the cached block was lost with the failed fence";
  EXPECT_EQ(reserved(), held) << "new memory was mapped for a request the cache holds";
  allocator_->deallocate(again);
  allocator_->empty_cache();
  EXPECT_EQ(reserved(), 0);
}

TEST_F(AllocatorDeviceFailureTest, AFailedWaitForPendingFreesReleasesNoBlockTwice) {
  stream_handle producer = new_stream();
  stream_handle consumer = new_stream();
  void* first = allocator_->allocate(4 * MiB, producer, allocation_class::other);
  void* second = allocator_->allocate(4 * MiB, producer, allocation_class::other);
  ASSERT_TRUE(allocator_->record_stream(first, consumer));
  ASSERT_TRUE(allocator_->record_stream(second, consumer));
  keep_busy(consumer);
  allocator_->deallocate(first);  // both pending on the consumer's fence
  allocator_->deallocate(second);
  // empty_cache waits for the pending frees: the first wait succeeds, the second fails.
  device_->fail_call(testing::device_call::synchronize_event, 2);
  EXPECT_THROW(allocator_->empty_cache(), device_error);
  allocator_->empty_cache();
  EXPECT_EQ(reserved(), 0) << "a block released twice keeps its segment busy for ever";
  void* a = allocator_->allocate(4 * MiB, producer, allocation_class::other);
  void* b = allocator_->allocate(4 * MiB, producer, allocation_class::other);
  EXPECT_NE(a, b) << "one block handed out twice";
  allocator_->deallocate(a);
  allocator_->deallocate(b);
}

TEST_F(AllocatorDeviceFailureTest, AFailedFenceInEmptyCacheReleasesNothingAndARetryReleasesAll) {
  stream_handle stream = new_stream();
  stream_handle other = new_stream();
  void* first = allocator_->allocate(64 * MiB, stream, allocation_class::other);
  void* second = allocator_->allocate(64 * MiB, other, allocation_class::other);
  allocator_->deallocate(first);
  allocator_->deallocate(second);
  const std::int64_t held = reserved();
  ASSERT_GE(held, static_cast<std::int64_t>(128 * MiB));
  // The free segments' streams are fenced before anything is unmapped: the second fails.
  device_->fail_call(testing::device_call::record_event, 2);
  EXPECT_THROW(allocator_->empty_cache(), device_error);
  EXPECT_EQ(reserved(), held) << "a segment was released though the call failed";
  allocator_->empty_cache();
  EXPECT_EQ(reserved(), 0) << "a segment released twice, or not at all";
  void* a = allocator_->allocate(64 * MiB, stream, allocation_class::other);
  void* b = allocator_->allocate(64 * MiB, stream, allocation_class::other);
  const auto start_a = reinterpret_cast<std::uintptr_t>(a);
  const auto start_b = reinterpret_cast<std::uintptr_t>(b);
  EXPECT_TRUE(start_a + 64 * MiB <= start_b || start_b + 64 * MiB <= start_a)
      << "two segments were placed at the same addresses";
  device_->fill_async(a, 0x11, 64 * MiB, stream);
  device_->fill_async(b, 0x22, 64 * MiB, stream);
  EXPECT_EQ(read_back(*device_, a, 64 * MiB, stream), std::vector<std::uint8_t>(64 * MiB, 0x11));
  allocator_->deallocate(a);
  allocator_->deallocate(b);
}

TEST_F(AllocatorDeviceFailureTest, AFailedUnmapInEmptyCacheKeepsWhatIsStillMappedOutOfUse) {
  void* pointer = allocator_->allocate(64 * MiB, nullptr, allocation_class::other);
  allocator_->deallocate(pointer);
  const auto start = reinterpret_cast<std::uintptr_t>(pointer);
  ASSERT_EQ(reserved(), static_cast<std::int64_t>(64 * MiB));
  // The segment's third chunk (of eight) fails to unmap: the first two are unmapped.
  device_->fail_next_unmap([start](std::uintptr_t address) { return address == start + 16 * MiB; });
  EXPECT_THROW(allocator_->empty_cache(), device_error);
  EXPECT_EQ(reserved(), static_cast<std::int64_t>(48 * MiB))
      << "the chunks still mapped are held, and only they";
  allocator_->empty_cache();  // nothing more to release, and nothing released twice
  EXPECT_EQ(reserved(), static_cast<std::int64_t>(48 * MiB));
  std::vector<void*> taken;
  for (int i = 0; i < 4; ++i) {
    void* next = allocator_->allocate(32 * MiB, nullptr, allocation_class::other);
    const auto at = reinterpret_cast<std::uintptr_t>(next);
    EXPECT_TRUE(at + 32 * MiB <= start + 16 * MiB || at >= start + 64 * MiB)
        << "an allocation was placed over memory still mapped to a released segment";
    device_->fill_async(next, static_cast<std::uint8_t>(i + 1), 32 * MiB, nullptr);
    taken.push_back(next);
  }
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(read_back(*device_, taken[i], 32 * MiB),
              std::vector<std::uint8_t>(32 * MiB, static_cast<std::uint8_t>(i + 1)));
    allocator_->deallocate(taken[i]);
  }
  allocator_->empty_cache();
  EXPECT_EQ(reserved(), static_cast<std::int64_t>(48 * MiB));
}

TEST_F(AllocatorDeviceFailureTest, AFailedUnmapOfDonatedAddressesKeepsThemOutOfUse) {
  stream_handle stream = new_stream();
  void* activation = allocator_->allocate(24 * MiB, stream, allocation_class::other);
  allocator_->deallocate(activation);
  void* gradient = allocator_->allocate(24 * MiB, stream, allocation_class::gradient);
  ASSERT_EQ(allocator_->stats().of(allocation_class::other).segments_donated, 1u);
  device_->fill_async(gradient, 0x77, 24 * MiB, stream);
  // The donor's old addresses are unmapped once its fences pass: the second chunk fails.
  const auto old = reinterpret_cast<std::uintptr_t>(activation);
  device_->fail_next_unmap([old](std::uintptr_t address) { return address == old + 8 * MiB; });
  EXPECT_THROW(allocator_->empty_cache(), device_error);
  EXPECT_NO_THROW(allocator_->empty_cache()) << "the failed range was retried";
  EXPECT_EQ(read_back(*device_, gradient, 24 * MiB, stream),
            std::vector<std::uint8_t>(24 * MiB, 0x77))
      << "the donated chunks lost their bytes in their new segment";
  for (int i = 0; i < 3; ++i) {
    void* next = allocator_->allocate(8 * MiB, stream, allocation_class::other);
    const auto at = reinterpret_cast<std::uintptr_t>(next);
    EXPECT_TRUE(at + 8 * MiB <= old + 8 * MiB || at >= old + 24 * MiB)
        << "an allocation was placed over addresses still mapped to donated chunks";
    allocator_->deallocate(next);
  }
  allocator_->deallocate(gradient);
}

// Two free segments, in two classes: the first one's unmap fails halfway. The other class's
// cache is released all the same, and the first segment's unmapped chunks serve new memory.
TEST_F(AllocatorDeviceFailureTest, AFailedUnmapInOneHeapLeavesTheOtherHeapsReleased) {
  void* activation = allocator_->allocate(64 * MiB, nullptr, allocation_class::other);
  void* gradient = allocator_->allocate(64 * MiB, nullptr, allocation_class::gradient);
  allocator_->deallocate(activation);
  allocator_->deallocate(gradient);
  const auto start = reinterpret_cast<std::uintptr_t>(activation);
  device_->fail_next_unmap([start](std::uintptr_t address) { return address == start + 16 * MiB; });
  EXPECT_THROW(allocator_->empty_cache(), device_error);
  EXPECT_EQ(reserved(), static_cast<std::int64_t>(48 * MiB))
      << "the gradients' free segment was kept because another heap failed";
  EXPECT_EQ(allocator_->stats().of(allocation_class::gradient).reserved_bytes.current, 0);
  allocator_->empty_cache();
  EXPECT_EQ(reserved(), static_cast<std::int64_t>(48 * MiB));
}

// A new segment gathers free memory from other classes, a segment at a time: the second
// donor's fence fails. The first donor already gave its segment up; its memory must not be
// lost with the failed request, or the limit would stay charged for memory nobody holds.
TEST_F(AllocatorDeviceFailureTest, AFailedDonationKeepsTheMemoryDonatedBeforeIt) {
  allocator_->set_limit(32 * MiB, "ZEROALLOC_MEMORY_LIMIT (test)");
  void* first = allocator_->allocate(16 * MiB, nullptr, allocation_class::other);
  void* second = allocator_->allocate(16 * MiB, nullptr, allocation_class::other);
  allocator_->deallocate(first);
  allocator_->deallocate(second);
  device_->fail_call(testing::device_call::record_event, 2);
  EXPECT_THROW(allocator_->allocate(32 * MiB, nullptr, allocation_class::gradient), device_error);
  void* state = allocator_->allocate(32 * MiB, nullptr, allocation_class::gradient);
  ASSERT_NE(state, nullptr);
  device_->fill_async(state, 0x44, 32 * MiB, nullptr);
  EXPECT_EQ(read_back(*device_, state, 32 * MiB), std::vector<std::uint8_t>(32 * MiB, 0x44));
  allocator_->deallocate(state);
}

// A new segment's fourth map fails, and undoing the three before it fails at the second:
// the chunks still mapped stay out of use with their addresses, so later segments are
// placed elsewhere and work.
TEST_F(AllocatorDeviceFailureTest, AFailedUndoOfANewSegmentKeepsItsStillMappedAddressesOutOfUse) {
  device_->fail_call(testing::device_call::map, 4);
  int unmaps = 0;
  device_->fail_next_unmap([&unmaps](std::uintptr_t) { return ++unmaps == 2; });
  EXPECT_THROW(allocator_->allocate(48 * MiB, nullptr, allocation_class::other), device_error);
  EXPECT_EQ(device_->failed_unmaps(), 1);
  EXPECT_EQ(reserved(), 0);
  std::vector<void*> taken;
  for (int i = 0; i < 3; ++i) {
    void* next = allocator_->allocate(16 * MiB, nullptr, allocation_class::other);
    device_->fill_async(next, static_cast<std::uint8_t>(0x60 + i), 16 * MiB, nullptr);
    taken.push_back(next);
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(read_back(*device_, taken[i], 16 * MiB),
              std::vector<std::uint8_t>(16 * MiB, static_cast<std::uint8_t>(0x60 + i)));
    allocator_->deallocate(taken[i]);
  }
  allocator_->empty_cache();
  EXPECT_EQ(reserved(), 0);
}

// A size near the top of size_t fails as out of memory (its segment size wrapped to 0, and
// an unbacked pointer came back).
TEST_F(CachingAllocatorTest, ASizeNearTheTopOfSizeTFailsAsOutOfMemory) {
  auto allocator = make_allocator();
  EXPECT_THROW(allocator->allocate(SIZE_MAX - 1 * MiB + 1, nullptr, allocation_class::other),
               out_of_memory);
  EXPECT_EQ(allocator->stats().total.allocated_bytes.current, 0);
}

TEST(CachingAllocatorMultiDevice, EachDeviceHasItsOwnMemoryAndLimit) {
  std::unique_ptr<device> first;
  std::unique_ptr<device> second;
  ZA_OPEN_TEST_DEVICE_OR_SKIP(first, 0, 256 * MiB);
  ZA_OPEN_TEST_DEVICE_OR_SKIP(second, 1, 256 * MiB);
  allocator_settings settings;
  settings.chunk_bytes = 8 * MiB;
  settings.limit_bytes = 32 * MiB;
  caching_allocator on_first(*first, settings);
  caching_allocator on_second(*second, settings);
  void* a = on_first.allocate(30 * MiB, nullptr, allocation_class::other);
  void* b = on_second.allocate(30 * MiB, nullptr, allocation_class::other);  // its own limit
  EXPECT_TRUE(on_first.owns(a));
  EXPECT_FALSE(on_first.owns(b));
  EXPECT_TRUE(on_second.owns(b));
  EXPECT_FALSE(on_second.deallocate(a));
  EXPECT_TRUE(on_first.deallocate(a));
  EXPECT_TRUE(on_second.deallocate(b));
}

}  // namespace
}  // namespace zeroalloc
