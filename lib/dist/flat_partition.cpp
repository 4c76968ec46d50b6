#include "dist/flat_partition.hpp"

#include <algorithm>

#include "core/errors.hpp"
#include "core/units.hpp"

namespace zeroalloc {

flat_partition::flat_partition(const std::vector<std::size_t>& item_bytes, int world_size,
                               std::size_t alignment)
    : world_size_(world_size) {
  if (world_size < 1) ZA_THROW(invalid_argument, "a world of ", world_size, " ranks");
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    ZA_THROW(invalid_argument, "alignment ", alignment, " is not a power of two");
  }
  std::size_t end = 0;
  offsets_.reserve(item_bytes.size());
  for (std::size_t bytes : item_bytes) {
    const std::size_t offset = round_up(end, alignment);
    offsets_.push_back(offset);
    end = offset + bytes;
  }
  const auto ranks = static_cast<std::size_t>(world_size);
  shard_bytes_ = round_up((end + ranks - 1) / ranks, alignment);
  for (std::size_t item = 0; item < item_bytes.size(); ++item) {
    std::size_t at = offsets_[item];
    const std::size_t item_end = at + item_bytes[item];
    while (at < item_end) {  // a piece per shard the tensor touches
      const std::size_t rank = at / shard_bytes_;
      const std::size_t shard_end = (rank + 1) * shard_bytes_;
      const std::size_t piece_end = std::min(item_end, shard_end);
      pieces_.push_back({item, static_cast<int>(rank), at - offsets_[item],
                         at - rank * shard_bytes_, piece_end - at});
      at = piece_end;
    }
  }
}

std::vector<partition_piece> flat_partition::pieces_of(int rank) const {
  std::vector<partition_piece> owned;
  for (const partition_piece& piece : pieces_) {
    if (piece.rank == rank) owned.push_back(piece);
  }
  return owned;
}

std::size_t flat_partition::owned_bytes(int rank) const {
  std::size_t bytes = 0;
  for (const partition_piece& piece : pieces_) {
    if (piece.rank == rank) bytes += piece.bytes;
  }
  return bytes;
}

}  // namespace zeroalloc
