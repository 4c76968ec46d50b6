// The host tier's pinned memory: reused, created in the background, and bounded by
// ZEROALLOC_HOST_LIMIT with an error that says so. Over every device.
#include "tier/host_pool.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <iterator>
#include <thread>

#include "device/sim_device.hpp"
#include "support/faulty_device.hpp"
#include "support/test_device.hpp"

namespace zeroalloc {
namespace {

using testing::read_back;

// The ready chunks of `bytes` once there are `count` of them, or after 20 s (0: at once).
std::size_t ready_when(host_pool& pool, std::size_t bytes, std::size_t count) {
  auto ready = [&] {
    const auto counts = pool.ready_chunks();
    const auto found = counts->find(bytes);
    return found == counts->end() ? std::size_t{0} : found->second;
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (ready() < count && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return ready();
}

class HostPoolTest : public ::testing::Test {
 protected:
  void SetUp() override { ZA_OPEN_TEST_DEVICE_OR_SKIP(device_, 0, 1 * GiB); }
  std::unique_ptr<device> device_;
};

TEST_F(HostPoolTest, ChunksAreUsableAtTheirStagingAddressAndReused) {
  host_pool pool(*device_, 64 * MiB, "ZEROALLOC_HOST_LIMIT=64MiB");
  host_chunk chunk = pool.acquire(8 * MiB);
  ASSERT_TRUE(chunk.valid());
  EXPECT_EQ(chunk.handle.location, memory_location::host);
  EXPECT_EQ(chunk.handle.bytes, 8 * MiB);
  auto* staging = reinterpret_cast<void*>(chunk.staging_address);
  device_->fill_async(staging, 0x3C, 8 * MiB, nullptr);
  EXPECT_EQ(read_back(*device_, staging, 8 * MiB), std::vector<std::uint8_t>(8 * MiB, 0x3C));
  EXPECT_EQ(pool.figures().in_use_bytes, 8 * MiB);
  pool.release(chunk);
  EXPECT_EQ(pool.figures().in_use_bytes, 0u);
  const host_chunk again = pool.acquire(8 * MiB);
  EXPECT_EQ(again.handle.value, chunk.handle.value) << "an idle chunk must be reused";
  EXPECT_EQ(again.handle.offset, chunk.handle.offset);
  EXPECT_EQ(pool.figures().created_on_demand, 1u);
  EXPECT_EQ(pool.figures().peak_in_use_bytes, 8 * MiB);
  pool.release(again);
}

TEST_F(HostPoolTest, RunningOutNamesTheLimitAndItsVariable) {
  host_pool pool(*device_, 16 * MiB, "ZEROALLOC_HOST_LIMIT=16MiB");
  const host_chunk first = pool.acquire(8 * MiB);
  const host_chunk second = pool.acquire(8 * MiB);
  try {
    pool.acquire(8 * MiB);
    FAIL() << "a third chunk exceeds the limit";
  } catch (const host_memory_exhausted& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("16.00 MiB"), std::string::npos) << message;
    EXPECT_NE(message.find("ZEROALLOC_HOST_LIMIT"), std::string::npos) << message;
  }
  EXPECT_EQ(pool.figures().created_bytes, 16 * MiB) << "the limit was exceeded";
  pool.release(first);
  pool.release(second);
}

TEST_F(HostPoolTest, PrefillCreatesChunksInTheBackgroundUpToTheLimit) {
  host_pool pool(*device_, 24 * MiB, "ZEROALLOC_HOST_LIMIT=24MiB");
  pool.start_prefill(8 * MiB, 1 * GiB);  // asks for more than the limit allows
  pool.wait_for_prefill();
  EXPECT_EQ(pool.figures().created_bytes, 24 * MiB);
  std::vector<host_chunk> taken;
  for (int i = 0; i < 3; ++i) taken.push_back(pool.acquire(8 * MiB));
  EXPECT_EQ(pool.figures().created_on_demand, 0u) << "the training path waited for creation";
  EXPECT_THROW(pool.acquire(8 * MiB), host_memory_exhausted);
  for (const host_chunk& chunk : taken) pool.release(chunk);
}

// Note [Host budget]: whatever the limit, pinned memory leaves the host room (other
// processes may be pinning theirs): the background creation stops while the host still has
// four reserves available, chunks needed after that are created on demand down to one
// reserve, and a chunk needed beyond it fails with a message naming the memory available,
// not the OOM killer.
TEST_F(HostPoolTest, PinnedMemoryLeavesTheHostItsReserveWhateverTheLimit) {
  if (auto* sim = dynamic_cast<sim_device*>(device_.get())) sim->set_maps_slices(false);
  if (device_->maps_slices()) GTEST_SKIP() << "skipped: this driver slices one large slab";
  host_pool pool(*device_, 64 * MiB, "ZEROALLOC_HOST_LIMIT=64MiB");
  constexpr std::uint64_t kReserve = 1 * GiB;
  // What the host has available at each look, in order: the prefill creates two slabs and
  // stops at the third look; the third chunk is created on demand; the fourth is refused.
  const std::vector<std::uint64_t> available = {4 * kReserve + 16 * MiB, 4 * kReserve + 8 * MiB,
                                                4 * kReserve, kReserve + 8 * MiB, kReserve};
  std::size_t looks = 0;  // under the pool's lock
  pool.set_host_memory_probe([&] { return available[std::min(looks++, available.size() - 1)]; },
                             kReserve);
  pool.start_prefill(8 * MiB, 1 * GiB);
  pool.wait_for_prefill();
  EXPECT_EQ(pool.figures().created_bytes, 16 * MiB) << "the prefill took the host's room";
  std::vector<host_chunk> taken;
  for (int i = 0; i < 3; ++i) taken.push_back(pool.acquire(8 * MiB));
  EXPECT_EQ(pool.figures().created_on_demand, 1u);
  try {
    taken.push_back(pool.acquire(8 * MiB));
    ADD_FAILURE() << "a fourth chunk was pinned into the host's reserve";
  } catch (const host_memory_exhausted& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("of memory available"), std::string::npos) << message;
    EXPECT_NE(message.find("to the rest of the machine"), std::string::npos) << message;
  }
  EXPECT_EQ(pool.figures().created_bytes, 24 * MiB);
  for (const host_chunk& chunk : taken) pool.release(chunk);
}

// Note [Anticipated sizes]: where slabs are whole chunks, sizes the paged classes hold are
// made in the background, by turning prefilled slabs nobody wants into them within the limit.
TEST_F(HostPoolTest, AnticipatedChunkSizesAreCreatedInTheBackgroundWithinTheLimit) {
  if (device_->maps_slices()) GTEST_SKIP() << "skipped: slabs are sliced here, any size fits";
  host_pool pool(*device_, 64 * MiB, "ZEROALLOC_HOST_LIMIT=64MiB");
  pool.start_prefill(16 * MiB, 1 * GiB);
  pool.wait_for_prefill();
  ASSERT_EQ(pool.figures().created_bytes, 64 * MiB);  // four 16 MiB slabs fill the budget
  pool.expect_chunks(16 * MiB, 2);                    // paged chunks: two of 16 MiB, two of 6 MiB
  pool.expect_chunks(6 * MiB, 2);
  auto ready = [&](std::size_t bytes) { return ready_when(pool, bytes, 0); };
  EXPECT_EQ(ready_when(pool, 6 * MiB, 2), 2u);
  EXPECT_EQ(ready(16 * MiB), 3u);  // one surplus slab became two of 6 MiB
  EXPECT_LE(pool.figures().created_bytes, 64 * MiB) << "the limit was exceeded";
  std::vector<host_chunk> taken;
  for (std::size_t bytes : {6 * MiB, 6 * MiB, 16 * MiB, 16 * MiB}) {
    taken.push_back(pool.acquire(bytes));
  }
  EXPECT_EQ(pool.figures().created_on_demand, 0u) << "the training path waited for creation";

  // More wanted than the limit holds: what fits is made, the rest waits, nothing spins
  // past the limit, and the pool still stops.
  pool.expect_chunks(10 * MiB, 8);
  ready_when(pool, 10 * MiB, 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(ready(10 * MiB), 2u);  // the spare 16 MiB slab went: 44 in use + 2 x 10 = 64 MiB
  EXPECT_LE(pool.figures().created_bytes, 64 * MiB);
  for (const host_chunk& chunk : taken) pool.release(chunk);
}

TEST_F(HostPoolTest, FreedSpaceOfAnySizeIsReusedUnderTheLimit) {
  host_pool pool(*device_, 16 * MiB, "ZEROALLOC_HOST_LIMIT=16MiB");
  pool.release(pool.acquire(8 * MiB));
  pool.release(pool.acquire(6 * MiB));
  const host_chunk large = pool.acquire(16 * MiB);  // all of the limit, after both
  EXPECT_EQ(large.handle.bytes, 16 * MiB);
  EXPECT_EQ(pool.figures().created_bytes, 16 * MiB) << "the limit was exceeded";
  pool.release(large);
}

// Note [Host slabs]: chunks of every size come out of what the prefill made, each its own
// bytes, with nothing created on the training path.
TEST_F(HostPoolTest, ChunksOfMixedSizesAreSlicesOfThePrefilledSlabs) {
  if (!device_->maps_slices()) GTEST_SKIP() << "skipped: this driver maps only whole allocations";
  host_pool pool(*device_, 64 * MiB, "ZEROALLOC_HOST_LIMIT=64MiB");
  pool.start_prefill(8 * MiB, 64 * MiB);
  pool.wait_for_prefill();
  std::vector<host_chunk> chunks;
  const std::size_t sizes[] = {6 * MiB, 10 * MiB, 4 * MiB, 20 * MiB, 2 * MiB};
  for (std::size_t i = 0; i < std::size(sizes); ++i) {
    chunks.push_back(pool.acquire(sizes[i]));
    device_->fill_async(reinterpret_cast<void*>(chunks.back().staging_address),
                        static_cast<std::uint8_t>(i + 1), sizes[i], nullptr);
  }
  EXPECT_EQ(pool.figures().created_on_demand, 0u);
  EXPECT_EQ(pool.figures().in_use_bytes, 42 * MiB);
  for (std::size_t i = 0; i < chunks.size(); ++i) {  // no slice overlaps another
    EXPECT_EQ(read_back(*device_, reinterpret_cast<void*>(chunks[i].staging_address), sizes[i]),
              std::vector<std::uint8_t>(sizes[i], static_cast<std::uint8_t>(i + 1)));
  }
  for (const host_chunk& chunk : chunks) pool.release(chunk);
  EXPECT_EQ(pool.figures().in_use_bytes, 0u);
}

// Note [A slab that cannot be destroyed]: a slab whose unmap fails (a failing driver) while
// it is destroyed to make room stays held, retired and counted, and the pool goes on: the
// budget it does not hold is still there, and the background thread survives.
class HostPoolFailureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::unique_ptr<device> inner;
    ZA_OPEN_TEST_DEVICE_OR_SKIP(inner, 0, 1 * GiB);
    // As CUDA drivers do: host slabs are whole chunks, so other sizes need slabs destroyed.
    if (auto* sim = dynamic_cast<sim_device*>(inner.get())) sim->set_maps_slices(false);
    if (inner->maps_slices()) GTEST_SKIP() << "skipped: slabs are sliced here";
    device_ = std::make_unique<testing::faulty_device>(std::move(inner));
  }
  std::unique_ptr<testing::faulty_device> device_;
};

TEST_F(HostPoolFailureTest, ASlabThatFailsToGoKeepsTheRestOfTheBudgetUsable) {
  host_pool pool(*device_, 16 * MiB, "ZEROALLOC_HOST_LIMIT=16MiB");
  pool.release(pool.acquire(8 * MiB));
  const host_chunk held = pool.acquire(8 * MiB);
  const host_chunk other = pool.acquire(8 * MiB);
  pool.release(held);
  pool.release(other);
  ASSERT_EQ(pool.figures().created_bytes, 16 * MiB);
  device_->fail_next_unmap([](std::uintptr_t) { return true; });
  // Room for 16 MiB means destroying both 8 MiB slabs: one of them cannot go.
  EXPECT_THROW(pool.acquire(16 * MiB), host_memory_exhausted);
  EXPECT_EQ(device_->failed_unmaps(), 1);
  EXPECT_EQ(pool.figures().created_bytes, 8 * MiB) << "the slab that failed is still held";
  const host_chunk fits = pool.acquire(8 * MiB);  // the 8 MiB the pool does not hold
  EXPECT_TRUE(fits.valid());
  EXPECT_EQ(pool.figures().created_bytes, 16 * MiB);
  pool.release(fits);
}

TEST_F(HostPoolFailureTest, TheBackgroundThreadSurvivesASlabThatFailsToGo) {
  host_pool pool(*device_, 32 * MiB, "ZEROALLOC_HOST_LIMIT=32MiB");
  pool.start_prefill(16 * MiB, 1 * GiB);
  pool.wait_for_prefill();
  ASSERT_EQ(pool.figures().created_bytes, 32 * MiB);
  device_->fail_next_unmap([](std::uintptr_t) { return true; });
  pool.expect_chunks(6 * MiB, 1);  // a surplus 16 MiB slab must go for it
  EXPECT_EQ(ready_when(pool, 6 * MiB, 1), 1u) << "the other surplus slab should have made room";
  EXPECT_EQ(device_->failed_unmaps(), 1);
  EXPECT_LE(pool.figures().created_bytes, 32 * MiB) << "the limit was exceeded";
}

}  // namespace
}  // namespace zeroalloc
