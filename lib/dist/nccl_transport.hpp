// The collectives over NCCL: one communicator per group, the library loaded at run time.
//
// Note [NCCL at run time]: the library is built against nccl.h alone and loads libnccl.so.2
// the first time a group is made, as it loads libcuda and libnuma: a program that never
// partitions across GPUs runs where NCCL is missing, and one that does gets an error naming
// the library and how to install it.
//
// Note [A watchdog per communicator]: NCCL reports failures asynchronously, and a
// collective whose peer died never completes on the GPU. So each communicator has a thread
// that polls ncclCommGetAsyncError and, for each collective enqueued, an event recorded after
// it: an error, or a collective not complete within the group's timeout, aborts the
// communicator (ncclCommAbort, which also unblocks kernels waiting on peers) and every later
// collective of this rank throws collective_error with the cause (Note [Collectives and
// failures] in transport.hpp), as PyTorch's ProcessGroupNCCL watchdog does.
#pragma once

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "dist/transport.hpp"

struct ncclComm;

namespace zeroalloc {

class nccl_transport : public transport {
 public:
  /// What every rank of a group passes to its constructor: made once, by one rank
  /// (ncclGetUniqueId), and handed to the others (torch.distributed's store, a file, ...).
  using unique_id = std::array<char, 128>;
  /// A new group's id. Throws config_error when NCCL cannot be loaded.
  static unique_id new_id();
  /// NCCL's version, as "2.28.9"; throws config_error when it cannot be loaded.
  static std::string version();

  /// Joins the group `id` as `rank` of `world_size` on `backing` (a GPU; one rank per GPU).
  /// Blocks until every rank has joined. Throws collective_error naming NCCL's reason.
  nccl_transport(device& backing, int rank, int world_size, const unique_id& id,
                 std::chrono::milliseconds timeout = std::chrono::minutes(5));
  /// Destroys the communicator after its collectives complete (aborts it if it failed).
  ~nccl_transport() override;
  nccl_transport(const nccl_transport&) = delete;
  nccl_transport& operator=(const nccl_transport&) = delete;

  [[nodiscard]] int rank() const override { return rank_; }
  [[nodiscard]] int world_size() const override { return world_size_; }
  void all_gather(const void* send, void* receive, std::size_t bytes,
                  stream_handle stream) override;
  void reduce_scatter(const void* send, void* receive, std::size_t count, element_type type,
                      stream_handle stream) override;
  void broadcast(void* buffer, std::size_t bytes, int root, stream_handle stream) override;
  void reduce(const void* send, void* receive, std::size_t count, element_type type, int root,
              stream_handle stream) override;
  void abort(const std::string& why) override;

 private:
  /// Enqueues `call` (an NCCL collective) on `stream`, then the event the watchdog waits
  /// on; throws collective_error when the communicator failed or the call does.
  template <typename Call>
  void enqueue(const char* what, stream_handle stream, Call&& call);
  /// Aborts the communicator with `why` unless it failed already. Caller holds mutex_.
  void fail(const std::string& why);
  void watch();

  device& device_;
  const int rank_;
  const int world_size_;
  const std::chrono::milliseconds timeout_;
  ncclComm* comm_ = nullptr;
  std::mutex mutex_;
  std::condition_variable changed_;
  struct pending {
    std::uint64_t sequence;
    const char* what;
    event_handle done;
    std::chrono::steady_clock::time_point deadline;
  };
  std::deque<pending> pending_;
  std::uint64_t sequence_ = 0;
  std::optional<std::string> failed_;  // why the communicator was aborted
  bool stopping_ = false;
  std::thread watchdog_;
};

}  // namespace zeroalloc
