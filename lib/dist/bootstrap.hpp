// The ranks of a job find each other: under torchrun, with only the preloaded library (no
// Python, so no torch.distributed store), rank 0 hands every rank the group's id (NCCL's
// unique id) over a TCP connection.
//
// Note [Bootstrap]: rank 0 listens on MASTER_ADDR's port MASTER_PORT + 1 (torchrun's own
// store holds MASTER_PORT), or another port the caller sets; every other rank connects,
// retrying until rank 0 listens, and says who it is: its rank, the world size, and the
// settings every rank must share (the ZeRO stage, ...), as one string. Rank 0 waits for all
// of them, checks that each rank came once, that all agree on the world size and the
// settings, and answers every rank with the id, or with one message naming the first rank
// that disagreed and how, or the ranks that did not come within the timeout. Every rank
// returns the same id or throws collective_error with the same cause, so a job with mixed
// settings or a missing rank ends on every rank with its reason (Note [Collectives and
// failures] in transport.hpp), never hangs. The id is made once, by rank 0, before it
// listens.
#pragma once

#include <chrono>
#include <functional>
#include <string>

namespace zeroalloc {

struct bootstrap_settings {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string address = "127.0.0.1";  ///< rank 0's host (MASTER_ADDR)
  int port = 0;                       ///< where rank 0 listens
  /// What every rank must share, compared byte for byte (say "ZEROALLOC_ZERO_STAGE=2").
  std::string agreement;
  std::chrono::milliseconds timeout = std::chrono::minutes(5);

  /// torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT;
  /// rank 0 listens at `port`, or at MASTER_PORT + 1 when it is 0. Throws config_error
  /// naming the variable that is missing or malformed.
  static bootstrap_settings from_environment(std::string agreement, int port = 0);
};

/// Note [Bootstrap]: rank 0 calls `make_id` once and every rank returns what it made.
/// Throws collective_error naming the cause (every rank the same) when a rank disagrees,
/// comes twice, or does not come within the timeout; rank 0's listening failures and the
/// others' connection failures name the address and port.
std::string bootstrap_exchange(const bootstrap_settings& settings,
                               const std::function<std::string()>& make_id);

}  // namespace zeroalloc
