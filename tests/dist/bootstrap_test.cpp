// Note [Bootstrap]: the ranks of a job, as threads of this process over the loopback
// interface, get rank 0's id, or all end with one message naming the cause.

#include "dist/bootstrap.hpp"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/errors.hpp"
#include "dist/transport.hpp"
#include "support/ports.hpp"

namespace zeroalloc {
namespace {

using namespace std::chrono_literals;

using testing::free_port;

struct outcome {
  std::string id;
  std::string error;
};

/// Runs `ranks` (each a rank's settings) as threads; rank 0's id is "the id".
std::vector<outcome> run_ranks(const std::vector<bootstrap_settings>& ranks,
                               std::atomic<int>* made = nullptr) {
  std::vector<outcome> outcomes(ranks.size());
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    threads.emplace_back([&, i] {
      try {
        outcomes[i].id = bootstrap_exchange(ranks[i], [&] {
          if (made != nullptr) ++*made;
          return std::string("the id");
        });
      } catch (const collective_error& failure) {
        outcomes[i].error = failure.what();
      }
    });
  }
  for (std::thread& each : threads) each.join();
  return outcomes;
}

std::vector<bootstrap_settings> group(int world_size, std::chrono::milliseconds timeout = 20s) {
  const int port = free_port();
  std::vector<bootstrap_settings> ranks(static_cast<std::size_t>(world_size));
  for (int rank = 0; rank < world_size; ++rank) {
    bootstrap_settings& each = ranks[static_cast<std::size_t>(rank)];
    each.rank = rank;
    each.world_size = world_size;
    each.port = port;
    each.agreement = "ZEROALLOC_ZERO_STAGE=2";
    each.timeout = timeout;
  }
  return ranks;
}

TEST(Bootstrap, EveryRankGetsTheIdRankZeroMadeOnce) {
  for (const int world_size : {2, 4, 8}) {
    std::atomic<int> made{0};
    const std::vector<outcome> outcomes = run_ranks(group(world_size), &made);
    for (std::size_t rank = 0; rank < outcomes.size(); ++rank) {
      EXPECT_EQ(outcomes[rank].error, "") << "rank " << rank << " of " << world_size;
      EXPECT_EQ(outcomes[rank].id, "the id") << "rank " << rank << " of " << world_size;
    }
    EXPECT_EQ(made.load(), 1) << world_size << " ranks";
  }
}

TEST(Bootstrap, RanksThatStartBeforeRankZeroWaitForIt) {
  std::vector<bootstrap_settings> ranks = group(3);
  std::vector<outcome> outcomes(3);
  std::vector<std::thread> threads;
  for (int rank : {1, 2}) {
    threads.emplace_back([&, rank] {
      try {
        outcomes[static_cast<std::size_t>(rank)].id =
            bootstrap_exchange(ranks[static_cast<std::size_t>(rank)], [] { return std::string(); });
      } catch (const collective_error& failure) {
        outcomes[static_cast<std::size_t>(rank)].error = failure.what();
      }
    });
  }
  std::this_thread::sleep_for(300ms);  // rank 0 comes last
  outcomes[0].id = bootstrap_exchange(ranks[0], [] { return std::string("late id"); });
  for (std::thread& each : threads) each.join();
  for (const outcome& each : outcomes) EXPECT_EQ(each.id, "late id") << each.error;
}

TEST(Bootstrap, MixedSettingsEndEveryRankNamingTheRankAndBothSettings) {
  std::vector<bootstrap_settings> ranks = group(4);
  ranks[2].agreement = "ZEROALLOC_ZERO_STAGE=3";
  const auto started = std::chrono::steady_clock::now();
  const std::vector<outcome> outcomes = run_ranks(ranks);
  EXPECT_LT(std::chrono::steady_clock::now() - started, 15s) << "a rank waited for its timeout";
  for (std::size_t rank = 0; rank < outcomes.size(); ++rank) {
    EXPECT_EQ(outcomes[rank].id, "") << "rank " << rank << " went on";
    EXPECT_NE(outcomes[rank].error.find("rank 2 has settings 'ZEROALLOC_ZERO_STAGE=3' where "
                                        "rank 0 has 'ZEROALLOC_ZERO_STAGE=2'"),
              std::string::npos)
        << "rank " << rank << ": " << outcomes[rank].error;
  }
}

TEST(Bootstrap, AMissingRankEndsTheOthersWithinTheTimeoutNamingIt) {
  std::vector<bootstrap_settings> ranks = group(4, 5000ms);
  ranks.pop_back();  // rank 3 never starts
  const auto started = std::chrono::steady_clock::now();
  const std::vector<outcome> outcomes = run_ranks(ranks);
  EXPECT_LT(std::chrono::steady_clock::now() - started, 15s);
  for (std::size_t rank = 0; rank < outcomes.size(); ++rank) {
    EXPECT_NE(outcomes[rank].error.find("rank(s) 3 did not join within 5000 ms"), std::string::npos)
        << "rank " << rank << ": " << outcomes[rank].error;
  }
}

TEST(Bootstrap, WithoutRankZeroTheOthersSayWhereTheyLooked) {
  std::vector<bootstrap_settings> ranks = group(2, 500ms);
  const std::vector<outcome> outcomes = run_ranks({ranks[1]});
  const std::string& error = outcomes[0].error;
  EXPECT_NE(error.find("rank 1 could not reach rank 0 within 500 ms"), std::string::npos) << error;
  EXPECT_NE(error.find("127.0.0.1:" + std::to_string(ranks[1].port)), std::string::npos) << error;
}

TEST(Bootstrap, TwoProcessesWithOneRankAndDisagreeingWorldSizesAreNamed) {
  {
    std::vector<bootstrap_settings> ranks = group(3);
    ranks[2].rank = 1;  // two "rank 1"s
    for (const outcome& each : run_ranks(ranks)) {
      EXPECT_NE(each.error.find("rank 1 joined twice"), std::string::npos) << each.error;
    }
  }
  {
    std::vector<bootstrap_settings> ranks = group(2);
    ranks[1].world_size = 3;
    for (const outcome& each : run_ranks(ranks)) {
      EXPECT_NE(each.error.find("rank 1 says the world has 3 ranks, rank 0 says 2"),
                std::string::npos)
          << each.error;
    }
  }
}

TEST(Bootstrap, AnIdRankZeroCannotMakeIsEveryRanksError) {
  std::vector<bootstrap_settings> ranks = group(3);
  std::vector<outcome> outcomes(3);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 3; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        bootstrap_exchange(ranks[static_cast<std::size_t>(rank)], []() -> std::string {
          throw error("NCCL (libnccl.so.2) could not be loaded");
        });
      } catch (const collective_error& failure) {
        outcomes[static_cast<std::size_t>(rank)].error = failure.what();
      }
    });
  }
  for (std::thread& each : threads) each.join();
  for (const outcome& each : outcomes) {
    EXPECT_NE(each.error.find("rank 0 could not make the group's id: NCCL (libnccl.so.2)"),
              std::string::npos)
        << each.error;
  }
}

class BootstrapEnvironment : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : kVariables) {
      const char* value = std::getenv(name);
      saved_.emplace_back(name,
                          value != nullptr ? std::optional<std::string>(value) : std::nullopt);
    }
    ::setenv("RANK", "1", 1);
    ::setenv("WORLD_SIZE", "4", 1);
    ::setenv("LOCAL_RANK", "1", 1);
    ::setenv("MASTER_ADDR", "10.0.0.7", 1);
    ::setenv("MASTER_PORT", "29500", 1);
  }
  void TearDown() override {
    for (const auto& [name, value] : saved_) {
      if (value) {
        ::setenv(name, value->c_str(), 1);
      } else {
        ::unsetenv(name);
      }
    }
  }
  static std::string error_of(int port = 0) {
    try {
      bootstrap_settings::from_environment("", port);
    } catch (const config_error& failure) {
      return failure.what();
    }
    return "";
  }
  static constexpr const char* kVariables[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                               "MASTER_PORT"};
  std::vector<std::pair<const char*, std::optional<std::string>>> saved_;
};

TEST_F(BootstrapEnvironment, TorchrunsVariablesAreRead) {
  const bootstrap_settings settings = bootstrap_settings::from_environment("stage 2");
  EXPECT_EQ(settings.rank, 1);
  EXPECT_EQ(settings.world_size, 4);
  EXPECT_EQ(settings.local_rank, 1);
  EXPECT_EQ(settings.address, "10.0.0.7");
  EXPECT_EQ(settings.port, 29501) << "MASTER_PORT + 1: torchrun's store holds MASTER_PORT";
  EXPECT_EQ(settings.agreement, "stage 2");
  EXPECT_EQ(bootstrap_settings::from_environment("", 31000).port, 31000);
}

TEST_F(BootstrapEnvironment, AMissingOrMalformedVariableIsNamed) {
  ::setenv("RANK", "one", 1);
  EXPECT_NE(error_of().find("RANK='one' is not a whole number"), std::string::npos) << error_of();
  ::setenv("RANK", "4", 1);
  EXPECT_NE(error_of().find("RANK=4 is not below WORLD_SIZE=4"), std::string::npos) << error_of();
  ::setenv("RANK", "1", 1);
  ::unsetenv("MASTER_ADDR");
  EXPECT_NE(error_of().find("MASTER_ADDR is not set"), std::string::npos) << error_of();
  ::setenv("MASTER_ADDR", "10.0.0.7", 1);
  ::unsetenv("WORLD_SIZE");
  EXPECT_NE(error_of().find("WORLD_SIZE is not set: ZeRO across ranks runs under torchrun"),
            std::string::npos)
      << error_of();
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("MASTER_PORT", "65535", 1);
  EXPECT_NE(error_of().find("MASTER_PORT=65535"), std::string::npos) << error_of();
  ::unsetenv("LOCAL_RANK");  // optional: 0
  ::setenv("MASTER_PORT", "29500", 1);
  EXPECT_EQ(bootstrap_settings::from_environment("").local_rank, 0);
}

}  // namespace
}  // namespace zeroalloc
