// The collectives between processes through rank 0 over TCP: what CI runs a job of several
// processes on the simulated device with, as torchrun starts them, and what ranks sharing
// one GPU use (ZEROALLOC_COLLECTIVES=tcp; NCCL takes one GPU per rank), where a GPU job
// otherwise uses NCCL.
//
// Note [Collectives through rank 0]: every rank keeps one TCP connection to rank 0 (made as
// the bootstrap's, Note [Bootstrap]). A collective is a round through rank 0: each rank
// sends what the call is (its kind and sizes, which every rank must agree on) and its bytes;
// rank 0 checks the calls, computes each rank's result (a reduction sums ranks in rank
// order, as sim_transport does: the same bits every run) and sends each its part. A rank
// that fails says so to rank 0 (abort), and rank 0 answers every rank's collective from
// then on with that cause; a rank that does not come within the timeout is named in the
// answer to the others. Slow (every byte twice through one socket), and meant for tests.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "dist/bootstrap.hpp"
#include "dist/sockets.hpp"
#include "dist/transport.hpp"

namespace zeroalloc {

class tcp_transport : public transport {
 public:
  /// Joins the group of `settings` (rank 0 listens at settings.port, the others connect) on
  /// `backing`, the device whose memory the collectives read and write. Blocks until every rank
  /// joined, within settings.timeout; throws collective_error naming the cause otherwise (as
  /// bootstrap_exchange does). Each collective waits `collective_timeout` (default:
  /// settings.timeout) for the others.
  tcp_transport(device& backing, const bootstrap_settings& settings,
                std::optional<std::chrono::milliseconds> collective_timeout = std::nullopt);
  ~tcp_transport() override = default;

  [[nodiscard]] int rank() const override { return settings_.rank; }
  [[nodiscard]] int world_size() const override { return settings_.world_size; }
  void all_gather(const void* send, void* receive, std::size_t bytes,
                  stream_handle stream) override;
  void reduce_scatter(const void* send, void* receive, std::size_t count, element_type type,
                      stream_handle stream) override;
  void broadcast(void* buffer, std::size_t bytes, int root, stream_handle stream) override;
  void reduce(const void* send, void* receive, std::size_t count, element_type type, int root,
              stream_handle stream) override;
  void abort(const std::string& why) override;

 private:
  enum class kind : std::uint32_t { all_gather, reduce_scatter, broadcast, reduce };
  struct call {
    kind what;
    std::uint64_t bytes = 0;  // all_gather, broadcast: bytes; reduce_scatter, reduce: count
    element_type type = element_type::float32;
    int root = 0;
    [[nodiscard]] std::string describe() const;
    bool operator==(const call&) const = default;
  };
  /// `bytes` of device memory at `source`, copied to the host after `stream`'s work so far.
  std::string read_on(stream_handle stream, const void* source, std::size_t bytes);
  /// `bytes` copied to device memory at `destination` in `stream`'s order; returns when done.
  void write_on(stream_handle stream, void* destination, const std::string& bytes);
  /// One round: this rank's call and input; returns this rank's output. Throws
  /// collective_error with the group's cause.
  std::string round(const call& mine, std::string input);
  /// Rank 0's side of a round: every rank's input, then each rank's output.
  std::string serve(const call& mine, std::string input);
  [[noreturn]] void fail_with(const std::string& why);

  device& device_;
  const bootstrap_settings settings_;
  const std::chrono::milliseconds collective_timeout_;
  std::mutex mutex_;  // one collective at a time, in order
  std::uint64_t sequence_ = 0;
  std::optional<std::string> failed_;
  sockets::socket_fd to_rank0_;              // ranks 1..N-1
  std::vector<sockets::socket_fd> to_rank_;  // rank 0: index r for rank r (0 unused)
};

}  // namespace zeroalloc
