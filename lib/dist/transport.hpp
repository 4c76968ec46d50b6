// The collectives ZeRO partitions need, on device memory, one object per rank.
//
// Note [Collectives and failures]: a collective is a rendezvous of every rank of a group; a
// rank that fails (an exception, a dead process, an NCCL error) would leave the others
// waiting forever inside it. So a rank that fails calls abort() with its reason, which ends
// every rank's collectives in flight and to come with collective_error naming that rank and
// the reason, and a collective whose ranks do not all arrive within the group's timeout ends
// with collective_error naming the ranks missing and the collective: a job ends on every
// rank with the cause, never hangs.
//
// Implementations: sim_transport (ranks as threads of one process, on the simulated device:
// what CI tests the partitioning with). NCCL's, over one communicator per process group, is
// the one for GPUs.
#pragma once

#include <cstddef>
#include <string>

#include "core/errors.hpp"
#include "device/device.hpp"

namespace zeroalloc {

/// A collective could not complete: a rank failed or did not arrive in time. The message
/// names the rank and the cause.
class collective_error : public error {
 public:
  using error::error;
};

/// What reduce_scatter and reduce sum.
enum class element_type { float32, bfloat16 };

[[nodiscard]] constexpr std::size_t element_bytes(element_type type) {
  return type == element_type::float32 ? 4 : 2;
}

class transport {
 public:
  virtual ~transport() = default;
  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual int world_size() const = 0;
  /// Every rank's `bytes` at `send` end up in every rank's `receive` (world_size() x
  /// `bytes`, in rank order), after the work queued on `stream` so far and before the work
  /// queued after. `send` may be this rank's part of `receive` (in place).
  virtual void all_gather(const void* send, void* receive, std::size_t bytes,
                          stream_handle stream) = 0;
  /// The element-wise sum over ranks of `send` (world_size() x `count` elements, in rank
  /// order), cut by rank: this rank's `count` elements of it land in `receive`, in
  /// `stream`'s order. bfloat16 is summed in float32 and rounded to nearest even once.
  virtual void reduce_scatter(const void* send, void* receive, std::size_t count, element_type type,
                              stream_handle stream) = 0;
  /// `root`'s `bytes` at `buffer` end up in every rank's `buffer`, in `stream`'s order.
  virtual void broadcast(void* buffer, std::size_t bytes, int root, stream_handle stream) = 0;
  /// The element-wise sum over ranks of `send` (`count` elements on each rank) into
  /// `root`'s `receive`, in `stream`'s order; the other ranks' `receive` is not touched.
  /// `send` may be `receive` (in place). Summed as reduce_scatter sums.
  virtual void reduce(const void* send, void* receive, std::size_t count, element_type type,
                      int root, stream_handle stream) = 0;
  /// Note [Collectives and failures]: this rank failed for `why`; every rank's collectives
  /// end with collective_error naming it.
  virtual void abort(const std::string& why) = 0;
};

}  // namespace zeroalloc
