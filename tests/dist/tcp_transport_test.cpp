// Note [Collectives through rank 0]: the simulated device's collectives between processes,
// here with ranks as threads (each its own transport and connection, as processes have):
// every byte lands where the collective says, and a failure ends every rank with its cause.

#include "dist/tcp_transport.hpp"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "alloc/caching_allocator.hpp"
#include "core/units.hpp"
#include "device/sim_device.hpp"
#include "dist/reduction.hpp"
#include "support/ports.hpp"

namespace zeroalloc {
namespace {

using namespace std::chrono_literals;

using testing::free_port;

class TcpTransportTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    device_ = std::make_unique<sim_device>(0, 512 * MiB);
    allocator_ = std::make_unique<caching_allocator>(*device_, allocator_settings{});
  }
  void TearDown() override {
    for (void* each : allocations_) allocator_->deallocate(each);
    allocator_.reset();
  }
  void* allocate(std::size_t bytes) {
    std::lock_guard lock(mutex_);
    allocations_.push_back(allocator_->allocate(bytes, nullptr, allocation_class::other));
    return allocations_.back();
  }
  /// Runs `body` as each of `world_size` ranks, each in its own thread with its own
  /// transport; returns each rank's collective_error message ("" when none).
  std::vector<std::string> run(int world_size, std::chrono::milliseconds timeout,
                               const std::function<void(tcp_transport&)>& body) {
    const int port = free_port();
    std::vector<std::string> errors(static_cast<std::size_t>(world_size));
    std::vector<std::thread> threads;
    for (int rank = 0; rank < world_size; ++rank) {
      threads.emplace_back([&, rank] {
        bootstrap_settings settings;
        settings.rank = rank;
        settings.world_size = world_size;
        settings.port = port;
        settings.timeout = 60s;  // joining: whatever the machine's load
        try {
          tcp_transport transport(*device_, settings, timeout);
          body(transport);
        } catch (const collective_error& failure) {
          errors[static_cast<std::size_t>(rank)] = failure.what();
        }
      });
    }
    for (std::thread& each : threads) each.join();
    return errors;
  }

  std::unique_ptr<sim_device> device_;
  std::unique_ptr<caching_allocator> allocator_;
  std::mutex mutex_;
  std::vector<void*> allocations_;
};

TEST_P(TcpTransportTest, EveryByteOfEachCollectiveLandsWhereItShould) {
  const int world = GetParam();
  constexpr std::size_t kCount = 1000;  // elements per rank
  std::vector<std::string> failures(static_cast<std::size_t>(world));
  const std::vector<std::string> errors = run(world, 20s, [&](tcp_transport& transport) {
    const int rank = transport.rank();
    std::string& failed = failures[static_cast<std::size_t>(rank)];
    // all_gather: rank r's bytes are r + 1.
    auto* mine = static_cast<std::uint8_t*>(allocate(kCount));
    auto* all = static_cast<std::uint8_t*>(allocate(kCount * world));
    std::memset(mine, rank + 1, kCount);
    transport.all_gather(mine, all, kCount, nullptr);
    for (int from = 0; from < world; ++from) {
      for (std::size_t i = 0; i < kCount; ++i) {
        if (all[from * kCount + i] != from + 1) failed += "all_gather; ";
      }
    }
    // reduce_scatter, float32: element i of rank r's input is r * 1000 + i.
    auto* send = static_cast<float*>(allocate(kCount * world * sizeof(float)));
    auto* part = static_cast<float*>(allocate(kCount * sizeof(float)));
    for (std::size_t i = 0; i < kCount * world; ++i) send[i] = float(rank * 1000) + float(i);
    transport.reduce_scatter(send, part, kCount, element_type::float32, nullptr);
    for (std::size_t i = 0; i < kCount; ++i) {
      float sum = 0;
      for (int from = 0; from < world; ++from) sum += float(from * 1000) + float(rank * kCount + i);
      if (part[i] != sum) failed += "reduce_scatter float32; ";
    }
    // reduce_scatter, bfloat16: 1.5 from every rank.
    auto* send16 = static_cast<std::uint16_t*>(allocate(kCount * world * 2));
    auto* part16 = static_cast<std::uint16_t*>(allocate(kCount * 2));
    for (std::size_t i = 0; i < kCount * world; ++i) send16[i] = float_to_bf16(1.5f);
    transport.reduce_scatter(send16, part16, kCount, element_type::bfloat16, nullptr);
    for (std::size_t i = 0; i < kCount; ++i) {
      if (bf16_to_float(part16[i]) != 1.5f * float(world)) failed += "reduce_scatter bfloat16; ";
    }
    // reduce to the last rank, in place: element i of rank r's input is r * 1000 + i; the
    // others' buffers stay as they were.
    auto* reduced = static_cast<float*>(allocate(kCount * sizeof(float)));
    for (std::size_t i = 0; i < kCount; ++i) reduced[i] = float(rank * 1000) + float(i);
    transport.reduce(reduced, reduced, kCount, element_type::float32, world - 1, nullptr);
    for (std::size_t i = 0; i < kCount; ++i) {
      float sum = 0;
      for (int from = 0; from < world; ++from) sum += float(from * 1000) + float(i);
      const float expected = rank == world - 1 ? sum : float(rank * 1000) + float(i);
      if (reduced[i] != expected) failed += "reduce; ";
    }
    // broadcast from the last rank.
    auto* buffer = static_cast<std::uint8_t*>(allocate(kCount));
    std::memset(buffer, rank == world - 1 ? 0xab : 0, kCount);
    transport.broadcast(buffer, kCount, world - 1, nullptr);
    for (std::size_t i = 0; i < kCount; ++i) {
      if (buffer[i] != 0xab) failed += "broadcast; ";
    }
  });
  for (int rank = 0; rank < world; ++rank) {
    EXPECT_EQ(errors[static_cast<std::size_t>(rank)], "") << "rank " << rank;
    EXPECT_EQ(failures[static_cast<std::size_t>(rank)].substr(0, 60), "") << "rank " << rank;
  }
}

TEST_P(TcpTransportTest, RanksCallingDifferentCollectivesAllFailNamingBothCalls) {
  const int world = GetParam();
  const std::vector<std::string> errors = run(world, 20s, [&](tcp_transport& transport) {
    auto* send = allocate(4096);
    auto* receive = allocate(4096 * world);
    transport.all_gather(send, receive, transport.rank() == 1 ? 2048 : 4096, nullptr);
  });
  for (int rank = 0; rank < world; ++rank) {
    const std::string& error = errors[static_cast<std::size_t>(rank)];
    EXPECT_NE(error.find("ranks called different collectives (collective 1 of the group): "
                         "rank 0 called all_gather of 4096 bytes, rank 1 all_gather of 2048 bytes"),
              std::string::npos)
        << "rank " << rank << ": " << error;
  }
}

TEST_P(TcpTransportTest, AnAbortEndsTheOtherRanksCollectivesWithItsCause) {
  const int world = GetParam();
  const std::vector<std::string> errors = run(world, 20s, [&](tcp_transport& transport) {
    auto* buffer = allocate(4096);
    transport.broadcast(buffer, 4096, 0, nullptr);  // one that succeeds first
    if (transport.rank() == 1) {
      transport.abort("out of memory while building its shard");
      return;
    }
    transport.broadcast(buffer, 4096, 0, nullptr);
  });
  for (int rank = 0; rank < world; ++rank) {
    if (rank == 1) continue;
    const std::string& error = errors[static_cast<std::size_t>(rank)];
    EXPECT_NE(error.find("rank 1 failed: out of memory while building its shard"),
              std::string::npos)
        << "rank " << rank << ": " << error;
  }
}

TEST_P(TcpTransportTest, ARankThatNeverCallsIsNamedWithinTheTimeout) {
  const int world = GetParam();
  const auto started = std::chrono::steady_clock::now();
  std::atomic<int> finished{0};
  const std::vector<std::string> errors = run(world, 1500ms, [&](tcp_transport& transport) {
    if (transport.rank() == world - 1) {  // joined, then stopped calling collectives
      for (int waited = 0; waited < 600 && finished.load() < world - 1; ++waited) {
        std::this_thread::sleep_for(50ms);
      }
      return;
    }
    auto* buffer = allocate(4096);
    try {
      transport.broadcast(buffer, 4096, 0, nullptr);
    } catch (...) {
      ++finished;
      throw;
    }
    ++finished;
  });
  EXPECT_LT(std::chrono::steady_clock::now() - started, 30s);
  for (int rank = 0; rank + 1 < world; ++rank) {
    const std::string& error = errors[static_cast<std::size_t>(rank)];
    EXPECT_NE(error.find("waited 1500 ms for rank(s) " + std::to_string(world - 1) +
                         ", which never arrived"),
              std::string::npos)
        << "rank " << rank << ": " << error;
  }
}

// Rank 0 gives up on a late rank while another is still sending it a large input: the
// sender's send must not block past its own timeout (the sockets never block; every wait is
// bounded), so every rank ends, none hangs.
TEST_P(TcpTransportTest, ASenderThatRankZeroStoppedReadingEndsWithinItsTimeout) {
  const int world = GetParam() + 1;  // 3 or 5: rank 1 late, the last rank sending 64 MiB
  const auto started = std::chrono::steady_clock::now();
  const std::vector<std::string> errors = run(world, 1000ms, [&](tcp_transport& transport) {
    if (transport.rank() == 1) {
      std::this_thread::sleep_for(1500ms);
      return;
    }
    const std::size_t bytes = transport.rank() == world - 1 ? 64 * MiB : 4096;
    auto* send = allocate(bytes);
    auto* receive = allocate(bytes * world);
    transport.all_gather(send, receive, bytes, nullptr);
  });
  EXPECT_LT(std::chrono::steady_clock::now() - started, 20s) << "a rank hung";
  for (int rank = 0; rank < world; ++rank) {
    if (rank == 1) continue;
    EXPECT_NE(errors[static_cast<std::size_t>(rank)], "") << "rank " << rank << " went on";
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, TcpTransportTest, ::testing::Values(2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "Ranks"; });

TEST(TcpTransport, OneRankGathersItsOwnBytesWithoutAConnection) {
  sim_device device(0, 64 * MiB);
  bootstrap_settings alone;
  tcp_transport transport(device, alone);  // one rank: no connection at all
  EXPECT_EQ(transport.world_size(), 1);
  std::vector<std::uint8_t> bytes(64, 7), all(64);
  transport.all_gather(bytes.data(), all.data(), bytes.size(), nullptr);
  EXPECT_EQ(all, bytes);
}

}  // namespace
}  // namespace zeroalloc
