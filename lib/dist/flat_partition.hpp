// ZeRO partitions as byte ranges: which rank owns which bytes of a model's tensors.
//
// Note [Flat partitions]: the tensors of one partitioned group (a model's parameters, their
// gradients, one optimizer state of each) are laid out one after another in a flat space,
// each at an aligned offset, and the space, padded to world_size equal shards, is cut into
// one contiguous shard per rank, as DeepSpeed's ZeRO stages 1 and 2 cut their flat buffers.
// Equal shards are what NCCL's reduce-scatter and all-gather take (each rank's part of the
// buffer is the same size), and a tensor may straddle two shards: its pieces are what each
// owner steps. Element-wise optimizers (SGD, Adam, AdamW) step any slice of a tensor as they
// would the whole, so a rank steps exactly its pieces, and an all-gather of the shards gives
// every rank the whole updated tensor. Alignment keeps each piece's start aligned for vector
// loads and for the collectives (NCCL moves 16-byte multiples fastest).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace zeroalloc {

/// A part of a tensor that one rank owns.
struct partition_piece {
  std::size_t item = 0;          ///< the tensor's index in the layout
  int rank = 0;                  ///< its owner
  std::size_t item_offset = 0;   ///< where the piece starts in the tensor, bytes
  std::size_t shard_offset = 0;  ///< ... and in its owner's shard
  std::size_t bytes = 0;
};

/// The flat layout of a group of tensors over `world_size` ranks (Note [Flat partitions]).
class flat_partition {
 public:
  /// Lays out tensors of `item_bytes` (in this order) at offsets aligned to `alignment`
  /// (a power of two) and cuts the space into `world_size` equal shards, each a multiple
  /// of `alignment`. Throws invalid_argument for a world size below 1 or an alignment that
  /// is not a power of two.
  flat_partition(const std::vector<std::size_t>& item_bytes, int world_size,
                 std::size_t alignment = 256);

  [[nodiscard]] int world_size() const { return world_size_; }
  /// Bytes of each rank's shard (all equal).
  [[nodiscard]] std::size_t shard_bytes() const { return shard_bytes_; }
  /// Bytes of the whole padded space: world_size() x shard_bytes().
  [[nodiscard]] std::size_t total_bytes() const { return shard_bytes_ * world_size_; }
  /// Where tensor `item` starts in the flat space.
  [[nodiscard]] std::size_t item_offset(std::size_t item) const { return offsets_.at(item); }
  [[nodiscard]] std::size_t item_count() const { return offsets_.size(); }
  /// Every piece, in the order of the flat space (by item, then by offset in it).
  [[nodiscard]] const std::vector<partition_piece>& pieces() const { return pieces_; }
  /// The pieces rank `rank` owns, in the order of its shard.
  [[nodiscard]] std::vector<partition_piece> pieces_of(int rank) const;
  /// The bytes of tensors (not padding) rank `rank` owns.
  [[nodiscard]] std::size_t owned_bytes(int rank) const;

 private:
  int world_size_ = 1;
  std::size_t shard_bytes_ = 0;
  std::vector<std::size_t> offsets_;
  std::vector<partition_piece> pieces_;
};

}  // namespace zeroalloc
