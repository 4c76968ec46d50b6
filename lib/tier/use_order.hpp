// The order in which a training step uses chunks, recorded during one step and learned at
// its boundary: the offload engine's notion of "when is this chunk needed next".
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace zeroalloc {

/// Note [Every use in the order]: a position per use that opens on a chunk with no use open
/// (a chunk's first use of the step, and each later one after its uses all ended), so a
/// layer's forward and backward are two positions. The cursor moves to the chunk's first
/// learned position at or after it on each such use, so the order is walked forward even
/// when a chunk appears several times. Each position carries a mark (the engine marks uses
/// in place: Note [In-place uses in the order] in offload_engine.hpp).
class use_order {
 public:
  static constexpr std::uint64_t kNever = std::numeric_limits<std::uint64_t>::max();
  /// A program that uses chunks without step boundaries (inference under hints) would grow
  /// the recording without end: past this many uses it stops recording until the next one.
  static constexpr std::size_t kMostRecordedUses = std::size_t(1) << 20;

  /// A use opens on `address`; `reopened`: no use was open on it.
  void record(std::uintptr_t address, bool reopened, bool marked = false);
  /// The step ended: what it recorded becomes the learned order, the cursor its start.
  void boundary();

  /// Steps from the cursor to the chunk's next learned position (larger: later; 0: the use
  /// in progress, when `in_use`; a position before the cursor counts in the next step);
  /// kNever when the order does not hold it.
  [[nodiscard]] std::uint64_t distance(std::uintptr_t address, bool in_use) const;

  [[nodiscard]] bool empty() const { return learned_.empty(); }
  [[nodiscard]] std::size_t size() const { return learned_.size(); }
  [[nodiscard]] std::size_t cursor() const { return cursor_; }
  [[nodiscard]] std::uintptr_t at(std::size_t position) const { return learned_[position]; }
  [[nodiscard]] bool marked(std::size_t position) const { return marks_[position]; }
  /// The first marked position at or after `position` (size() when none).
  [[nodiscard]] std::size_t next_marked(std::size_t position) const {
    return position < next_marked_.size() ? next_marked_[position] : learned_.size();
  }

 private:
  std::vector<std::uintptr_t> recording_;
  std::vector<bool> recording_marks_;
  std::unordered_set<std::uintptr_t> recorded_;
  std::vector<std::uintptr_t> learned_;
  std::vector<bool> marks_;
  std::vector<std::size_t> next_marked_;
  std::unordered_map<std::uintptr_t, std::vector<std::size_t>> positions_;
  std::size_t cursor_ = 0;
};

}  // namespace zeroalloc
