// ZeRO's partitioning (lib/dist/flat_partition.hpp) and the collectives it needs, on the
// simulated transport: ranks as threads of this process, their buffers in memory from
// zeroalloc's allocator on the simulated device.
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <exception>
#include <functional>
#include <numeric>
#include <thread>
#include <vector>

#include "alloc/caching_allocator.hpp"
#include "core/units.hpp"
#include "device/sim_device.hpp"
#include "dist/flat_partition.hpp"
#include "dist/sim_transport.hpp"

namespace zeroalloc {
namespace {

TEST(FlatPartitionTest, EveryByteOfEveryTensorHasExactlyOneOwnerInEqualAlignedShards) {
  const std::vector<std::size_t> sizes = {1000, 3, 0, 4096, 12345, 256, 7 * MiB + 5};
  const std::size_t alignment = 256;
  for (int world = 1; world <= 5; ++world) {
    const flat_partition layout(sizes, world, alignment);
    EXPECT_EQ(layout.shard_bytes() % alignment, 0u);
    EXPECT_EQ(layout.total_bytes(), layout.shard_bytes() * world);
    std::vector<std::size_t> covered(sizes.size(), 0);
    std::size_t owned = 0;
    for (std::size_t item = 0; item < sizes.size(); ++item) {
      EXPECT_EQ(layout.item_offset(item) % alignment, 0u) << item;
    }
    for (const partition_piece& piece : layout.pieces()) {
      ASSERT_LT(piece.item, sizes.size());
      // Pieces of a tensor follow each other, from its first byte to its last.
      EXPECT_EQ(piece.item_offset, covered[piece.item]) << "world " << world;
      covered[piece.item] += piece.bytes;
      EXPECT_GT(piece.bytes, 0u);
      // A piece is where the flat layout puts it: in its owner's shard, at its offset there.
      EXPECT_EQ(layout.item_offset(piece.item) + piece.item_offset,
                static_cast<std::size_t>(piece.rank) * layout.shard_bytes() + piece.shard_offset);
      EXPECT_LE(piece.shard_offset + piece.bytes, layout.shard_bytes());
      owned += piece.bytes;
    }
    EXPECT_EQ(covered, sizes) << "world " << world;
    std::size_t by_rank = 0;
    for (int rank = 0; rank < world; ++rank) {
      std::size_t end = 0;
      for (const partition_piece& piece : layout.pieces_of(rank)) {
        EXPECT_EQ(piece.rank, rank);
        EXPECT_GE(piece.shard_offset, end) << "pieces of one shard overlap";
        end = piece.shard_offset + piece.bytes;
      }
      by_rank += layout.owned_bytes(rank);
    }
    EXPECT_EQ(by_rank, owned);
    EXPECT_EQ(owned, std::accumulate(sizes.begin(), sizes.end(), std::size_t{0}));
  }
}

TEST(FlatPartitionTest, AWorldBelowOneOrAnAlignmentNotAPowerOfTwoIsRefused) {
  EXPECT_THROW(flat_partition({16}, 0), invalid_argument);
  EXPECT_THROW(flat_partition({16}, 2, 24), invalid_argument);
}

// A group of ranks, each a thread with its own buffers, on one simulated device.
class CollectiveTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    device_ = std::make_unique<sim_device>(0, 512 * MiB);
    allocator_ = std::make_unique<caching_allocator>(*device_, allocator_settings{});
  }
  void TearDown() override {
    for (void* each : allocations_) allocator_->deallocate(each);
    allocator_.reset();
  }
  void* device_buffer(std::size_t bytes) {
    std::lock_guard lock(mutex_);
    allocations_.push_back(allocator_->allocate(bytes, nullptr, allocation_class::other));
    return allocations_.back();
  }
  template <typename T>
  void upload(void* to, const std::vector<T>& from) {
    device_->copy_async(to, from.data(), from.size() * sizeof(T), nullptr);
    device_->synchronize_stream(nullptr);
  }
  template <typename T>
  std::vector<T> download(const void* from, std::size_t count) {
    std::vector<T> into(count);
    device_->copy_async(into.data(), from, count * sizeof(T), nullptr);
    device_->synchronize_stream(nullptr);
    return into;
  }
  /// Runs `body(transport)` on each rank's thread; rethrows the first failure.
  void on_every_rank(sim_group& group, const std::function<void(transport&)>& body) {
    std::vector<std::exception_ptr> failures(static_cast<std::size_t>(group.world_size()));
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < group.world_size(); ++rank) {
      ranks.emplace_back([&, rank] {
        try {
          sim_transport own(group, rank);
          body(own);
          // A failed assertion returns from the body: end the others' collectives too.
          if (HasFailure()) own.abort("a check failed on this rank");
        } catch (...) {
          failures[static_cast<std::size_t>(rank)] = std::current_exception();
        }
      });
    }
    for (std::thread& each : ranks) each.join();
    for (const std::exception_ptr& failure : failures) {
      if (failure) std::rethrow_exception(failure);
    }
  }

  std::unique_ptr<sim_device> device_;
  std::unique_ptr<caching_allocator> allocator_;
  std::mutex mutex_;
  std::vector<void*> allocations_;
};

TEST_P(CollectiveTest, AllGatherPutsEveryRanksShardOnEveryRankInRankOrder) {
  const int world = GetParam();
  const std::size_t bytes = 3 * MiB + 4096;
  sim_group group(*device_, world);
  on_every_rank(group, [&](transport& own) {
    void* full = device_buffer(bytes * world);
    // In place: this rank's shard already sits at its place in the full buffer.
    std::byte* mine = static_cast<std::byte*>(full) + own.rank() * bytes;
    upload(mine, std::vector<std::uint8_t>(bytes, static_cast<std::uint8_t>(0x10 + own.rank())));
    own.all_gather(mine, full, bytes, nullptr);
    const auto gathered = download<std::uint8_t>(full, bytes * world);
    for (int rank = 0; rank < world; ++rank) {
      for (std::size_t i = 0; i < bytes; i += 4093) {
        ASSERT_EQ(gathered[rank * bytes + i], 0x10 + rank) << "on rank " << own.rank();
      }
    }
  });
}

TEST_P(CollectiveTest, ReduceScatterSumsEachElementOverRanksIntoItsOwner) {
  const int world = GetParam();
  const std::size_t count = 100'003;
  sim_group group(*device_, world);
  auto value = [](int rank, std::size_t i) {
    return static_cast<float>(rank + 1) * 0.5f + static_cast<float>(i % 97) * 0.25f;
  };
  on_every_rank(group, [&](transport& own) {
    std::vector<float> contribution(count * world);
    std::vector<std::uint16_t> contribution16(count * world);
    for (std::size_t i = 0; i < contribution.size(); ++i) {
      contribution[i] = value(own.rank(), i);
      contribution16[i] =
          static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(contribution[i]) >> 16);
    }
    void* send = device_buffer(count * world * 4);
    void* receive = device_buffer(count * 4);
    upload(send, contribution);
    own.reduce_scatter(send, receive, count, element_type::float32, nullptr);
    const auto sums = download<float>(receive, count);
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t at = own.rank() * count + i;
      float expected = value(0, at);
      for (int rank = 1; rank < world; ++rank) expected += value(rank, at);
      ASSERT_EQ(sums[i], expected) << "element " << i << " on rank " << own.rank();
    }
    // bfloat16, summed in float32: these values are exact in bfloat16 and so is their sum.
    upload(send, contribution16);
    own.reduce_scatter(send, receive, count, element_type::bfloat16, nullptr);
    const auto sums16 = download<std::uint16_t>(receive, count);
    for (std::size_t i = 0; i < count; i += 101) {
      const float got = std::bit_cast<float>(static_cast<std::uint32_t>(sums16[i]) << 16);
      ASSERT_EQ(got, sums[i]) << "element " << i << " on rank " << own.rank();
    }
  });
}

// A reduce sums over ranks into the root alone, as a reduce-scatter would sum that rank's
// part, in place or not; the others' buffers keep their bytes.
TEST_P(CollectiveTest, ReduceSumsEachElementOverRanksIntoTheRootAlone) {
  const int world = GetParam();
  const std::size_t count = 50'021;
  sim_group group(*device_, world);
  auto value = [](int rank, std::size_t i) {
    return static_cast<float>(rank + 1) * 0.75f + static_cast<float>(i % 89) * 0.125f;
  };
  on_every_rank(group, [&](transport& own) {
    std::vector<float> mine(count);
    for (std::size_t i = 0; i < count; ++i) mine[i] = value(own.rank(), i);
    void* send = device_buffer(count * 4);
    void* receive = device_buffer(count * 4);
    for (int root = 0; root < world; ++root) {
      upload(send, mine);
      upload(receive, std::vector<float>(count, -1.0f));
      const bool in_place = root % 2 == 1;
      own.reduce(send, in_place ? send : receive, count, element_type::float32, root, nullptr);
      const auto got = download<float>(in_place ? send : receive, count);
      for (std::size_t i = 0; i < count; ++i) {
        float expected = value(0, i);
        for (int rank = 1; rank < world; ++rank) expected += value(rank, i);
        if (own.rank() != root) expected = in_place ? mine[i] : -1.0f;
        ASSERT_EQ(got[i], expected)
            << "element " << i << " on rank " << own.rank() << ", root " << root;
      }
    }
  });
}

TEST_P(CollectiveTest, BroadcastFromEachRootReachesEveryRank) {
  const int world = GetParam();
  sim_group group(*device_, world);
  on_every_rank(group, [&](transport& own) {
    void* buffer = device_buffer(1 * MiB);
    for (int root = 0; root < world; ++root) {
      upload(buffer, std::vector<std::uint8_t>(1 * MiB, static_cast<std::uint8_t>(own.rank())));
      own.broadcast(buffer, 1 * MiB, root, nullptr);
      const auto got = download<std::uint8_t>(buffer, 1 * MiB);
      ASSERT_EQ(got.front(), root);
      ASSERT_EQ(got.back(), root);
    }
  });
}

// ZeRO stage 1 and 2 in miniature: every rank computes gradients of every tensor on its own
// data; a reduce-scatter leaves each owner the summed gradients of its shard; each rank
// steps only its pieces; an all-gather gives every rank every updated tensor. The result is
// one rank's step on the summed gradients, bit for bit.
TEST_P(CollectiveTest, ShardedStepsThenAllGatherEqualOneRanksStepBitForBit) {
  const int world = GetParam();
  const std::vector<std::size_t> elements = {1000, 3, 4096, 12345, 64};
  std::vector<std::size_t> bytes;
  for (std::size_t each : elements) bytes.push_back(each * 4);
  const flat_partition layout(bytes, world);
  const std::size_t total = layout.total_bytes() / 4;
  const float rate = 0.01f;
  auto parameter = [](std::size_t i) { return static_cast<float>(i % 251) * 0.125f - 7.0f; };
  auto gradient = [](int rank, std::size_t i) {
    return static_cast<float>((i * 7 + static_cast<std::size_t>(rank) * 13) % 89) * 0.03125f;
  };
  // One rank's step on the summed gradients (rank order, as the reduce-scatter sums).
  std::vector<float> expected(total);
  for (std::size_t i = 0; i < total; ++i) {
    float sum = gradient(0, i);
    for (int rank = 1; rank < world; ++rank) sum += gradient(rank, i);
    expected[i] = parameter(i) - rate * sum;
  }
  sim_group group(*device_, world);
  on_every_rank(group, [&](transport& own) {
    std::vector<float> host_parameters(total), host_gradients(total);
    for (std::size_t i = 0; i < total; ++i) {
      host_parameters[i] = parameter(i);
      host_gradients[i] = gradient(own.rank(), i);
    }
    void* parameters = device_buffer(total * 4);
    void* gradients = device_buffer(total * 4);
    void* shard = device_buffer(layout.shard_bytes());
    upload(parameters, host_parameters);
    upload(gradients, host_gradients);
    own.reduce_scatter(gradients, shard, layout.shard_bytes() / 4, element_type::float32, nullptr);
    // Step this rank's pieces only (the padding between tensors steps too: harmless).
    auto summed = download<float>(shard, layout.shard_bytes() / 4);
    auto* mine = static_cast<std::byte*>(parameters) + own.rank() * layout.shard_bytes();
    auto values = download<float>(mine, layout.shard_bytes() / 4);
    for (const partition_piece& piece : layout.pieces_of(own.rank())) {
      for (std::size_t at = piece.shard_offset / 4; at < (piece.shard_offset + piece.bytes) / 4;
           ++at) {
        values[at] -= rate * summed[at];
      }
    }
    upload(mine, values);
    own.all_gather(mine, parameters, layout.shard_bytes(), nullptr);
    const auto updated = download<float>(parameters, total);
    for (std::size_t item = 0; item < elements.size(); ++item) {
      const std::size_t first = layout.item_offset(item) / 4;
      for (std::size_t i = first; i < first + elements[item]; ++i) {
        ASSERT_EQ(updated[i], expected[i]) << "tensor " << item << " on rank " << own.rank();
      }
    }
  });
}

// Note [Collectives and failures]: a rank that fails ends the collectives of the others with
// its reason; a rank that never arrives ends them at the timeout, named.
TEST_P(CollectiveTest, ARankThatFailsEndsTheOthersCollectivesWithItsReason) {
  const int world = GetParam();
  sim_group group(*device_, world);
  std::vector<std::string> messages(static_cast<std::size_t>(world));
  on_every_rank(group, [&](transport& own) {
    void* buffer = device_buffer(world * 4096);
    if (own.rank() == world - 1) {
      own.abort("out of memory while building its shard");
      return;
    }
    try {
      own.all_gather(buffer, buffer, 4096, nullptr);
      messages[static_cast<std::size_t>(own.rank())] = "no failure";
    } catch (const collective_error& failure) {
      messages[static_cast<std::size_t>(own.rank())] = failure.what();
    }
  });
  for (int rank = 0; rank + 1 < world; ++rank) {
    const std::string& message = messages[static_cast<std::size_t>(rank)];
    EXPECT_NE(message.find("rank " + std::to_string(world - 1) +
                           " failed: out of memory while building its shard"),
              std::string::npos)
        << message;
  }
}

TEST_P(CollectiveTest, ARankThatNeverArrivesEndsTheOthersAtTheTimeoutNamed) {
  const int world = GetParam();
  sim_group group(*device_, world, std::chrono::milliseconds(200));
  std::vector<std::string> messages(static_cast<std::size_t>(world));
  on_every_rank(group, [&](transport& own) {
    void* buffer = device_buffer(world * 4096);
    if (own.rank() == 1) return;  // it never calls the collective
    try {
      own.all_gather(buffer, buffer, 4096, nullptr);
    } catch (const collective_error& failure) {
      messages[static_cast<std::size_t>(own.rank())] = failure.what();
    }
  });
  for (int rank = 0; rank < world; ++rank) {
    if (rank == 1) continue;
    const std::string& message = messages[static_cast<std::size_t>(rank)];
    EXPECT_NE(
        message.find("the all_gather (collective 1 of the group) waited 200 ms for rank(s) 1,"),
        std::string::npos)
        << message;
  }
}

// Mixed settings across ranks (another size, kind, type or root) end every rank's
// collective with a message naming both calls, instead of reading past a buffer.
TEST_P(CollectiveTest, RanksThatCallDifferentCollectivesAllFailNamingBothCalls) {
  const int world = GetParam();
  sim_group group(*device_, world);
  std::vector<std::string> messages(static_cast<std::size_t>(world));
  on_every_rank(group, [&](transport& own) {
    const std::size_t bytes = own.rank() == 0 ? 4096 : 8192;
    void* buffer = device_buffer(world * 8192);
    try {
      own.all_gather(buffer, buffer, bytes, nullptr);
      messages[static_cast<std::size_t>(own.rank())] = "no failure";
    } catch (const collective_error& failure) {
      messages[static_cast<std::size_t>(own.rank())] = failure.what();
    }
  });
  for (const std::string& message : messages) {
    EXPECT_NE(message.find("ranks called different collectives"), std::string::npos) << message;
    EXPECT_NE(message.find("all_gather of 4096 bytes"), std::string::npos) << message;
    EXPECT_NE(message.find("all_gather of 8192 bytes"), std::string::npos) << message;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, CollectiveTest, ::testing::Values(2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "_ranks"; });

}  // namespace
}  // namespace zeroalloc
