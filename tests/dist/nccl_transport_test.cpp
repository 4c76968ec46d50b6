// The collectives over NCCL on the GPU, one rank (a group of several needs one GPU per rank:
// the two-GPU runs are separate). On the simulated device the suite skips: NCCL needs a GPU.
#include "dist/nccl_transport.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "alloc/caching_allocator.hpp"
#include "support/test_device.hpp"

namespace zeroalloc {
namespace {

using testing::read_back;

class NcclTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ZA_OPEN_TEST_DEVICE_OR_SKIP(device_, 0, 1 * GiB);
    if (device_->is_simulated()) GTEST_SKIP() << "skipped: NCCL needs a GPU";
    allocator_ = std::make_unique<caching_allocator>(*device_, allocator_settings{});
  }
  void TearDown() override {
    for (void* each : allocations_) allocator_->deallocate(each);
  }
  void* buffer(std::size_t bytes, std::uint8_t fill) {
    allocations_.push_back(allocator_->allocate(bytes, nullptr, allocation_class::other));
    device_->fill_async(allocations_.back(), fill, bytes, nullptr);
    return allocations_.back();
  }

  std::unique_ptr<device> device_;
  std::unique_ptr<caching_allocator> allocator_;
  std::vector<void*> allocations_;
};

TEST_F(NcclTransportTest, OneRankGathersScattersBroadcastsAndReducesItsOwnBytes) {
  std::printf("NCCL %s\n", nccl_transport::version().c_str());
  nccl_transport own(*device_, 0, 1, nccl_transport::new_id());
  const std::size_t bytes = 8 * MiB;
  void* gathered = buffer(bytes, 0x5a);
  own.all_gather(gathered, gathered, bytes, nullptr);  // in place
  std::vector<float> values(bytes / 4);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 1000) * 0.5f;
  void* send = buffer(bytes, 0);
  void* receive = buffer(bytes, 0);
  device_->copy_async(send, values.data(), bytes, nullptr);
  own.reduce_scatter(send, receive, values.size(), element_type::float32, nullptr);
  void* broadcast = buffer(bytes, 0x33);
  own.broadcast(broadcast, bytes, 0, nullptr);
  void* reduced = buffer(bytes, 0);
  own.reduce(send, reduced, values.size(), element_type::float32, 0, nullptr);
  device_->synchronize_stream(nullptr);
  EXPECT_EQ(read_back(*device_, gathered, bytes), std::vector<std::uint8_t>(bytes, 0x5a));
  const auto summed = read_back(*device_, receive, bytes);
  EXPECT_EQ(std::memcmp(summed.data(), values.data(), bytes), 0);  // one rank: the sum is itself
  EXPECT_EQ(read_back(*device_, broadcast, bytes), std::vector<std::uint8_t>(bytes, 0x33));
  const auto reduced_bytes = read_back(*device_, reduced, bytes);
  EXPECT_EQ(std::memcmp(reduced_bytes.data(), values.data(), bytes), 0);  // the root's sum
}

// Note [Collectives and failures]: after an abort, every collective of the rank throws with
// the cause, and the communicator goes without hanging.
TEST_F(NcclTransportTest, AnAbortEndsTheRanksLaterCollectivesWithItsCause) {
  nccl_transport own(*device_, 0, 1, nccl_transport::new_id());
  void* data = buffer(1 * MiB, 1);
  own.abort("out of memory while building its shard");
  try {
    own.all_gather(data, data, 1 * MiB, nullptr);
    ADD_FAILURE() << "a collective ran after the abort";
  } catch (const collective_error& failure) {
    EXPECT_NE(std::string(failure.what()).find("rank 0 failed: out of memory while building"),
              std::string::npos)
        << failure.what();
  }
}

}  // namespace
}  // namespace zeroalloc
