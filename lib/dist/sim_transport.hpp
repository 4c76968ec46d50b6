// Ranks as threads of one process on the simulated device, where device memory is host
// memory: each collective is a rendezvous of the group's threads, then each rank reads what
// it needs from the others' buffers. Deterministic (a reduction sums ranks in rank order),
// so tests can compare bit for bit with one rank's arithmetic.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "dist/transport.hpp"

namespace zeroalloc {

/// The state the ranks of one simulated group share: make one, then one sim_transport per
/// rank (each used by its own thread).
class sim_group {
 public:
  /// `timeout`: how long a collective waits for every rank to arrive (Note [Collectives and
  /// failures]).
  sim_group(device& backing, int world_size,
            std::chrono::milliseconds timeout = std::chrono::seconds(30));
  [[nodiscard]] int world_size() const { return world_size_; }

 private:
  friend class sim_transport;
  struct posted {
    const void* send = nullptr;
    void* receive = nullptr;
    std::string call;  // the collective and its arguments, as ranks must agree on them
  };
  /// Posts this rank's buffers for collective number `sequence`, named `what`, and waits
  /// until every rank has posted; returns what each posted. Throws collective_error when a
  /// rank aborted, not every rank arrived within the timeout, or the ranks called different
  /// collectives (another kind, size, type or root: the last to arrive compares them).
  std::vector<posted> arrive(int rank, std::uint64_t sequence, const char* what, posted mine);
  /// Waits until every rank is done reading the others' buffers of `sequence`, so that no
  /// rank reuses its buffers while another still reads them.
  void depart(int rank, std::uint64_t sequence, const char* what);
  void abort(int rank, const std::string& why);
  [[noreturn]] void throw_aborted(int rank, const char* what) const;  // mutex_ held

  device& device_;
  const int world_size_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::uint64_t sequence_ = 0;  // the collective under way
  std::vector<posted> posted_;  // this collective's buffers, per rank
  std::vector<bool> arrived_;   // per rank, for this collective
  std::vector<bool> departed_;
  int arrivals_ = 0;
  int departures_ = 0;
  std::optional<std::pair<int, std::string>> aborted_;  // the first rank that failed, and why
};

class sim_transport : public transport {
 public:
  sim_transport(sim_group& group, int rank);
  [[nodiscard]] int rank() const override { return rank_; }
  [[nodiscard]] int world_size() const override { return group_.world_size(); }
  void all_gather(const void* send, void* receive, std::size_t bytes,
                  stream_handle stream) override;
  void reduce_scatter(const void* send, void* receive, std::size_t count, element_type type,
                      stream_handle stream) override;
  void broadcast(void* buffer, std::size_t bytes, int root, stream_handle stream) override;
  void reduce(const void* send, void* receive, std::size_t count, element_type type, int root,
              stream_handle stream) override;
  void abort(const std::string& why) override;

 private:
  sim_group& group_;
  const int rank_;
  std::uint64_t sequence_ = 0;  // this rank's collectives so far
};

}  // namespace zeroalloc
