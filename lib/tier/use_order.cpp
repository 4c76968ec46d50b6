#include "tier/use_order.hpp"

namespace zeroalloc {

void use_order::record(std::uintptr_t address, bool reopened, bool marked) {
  if ((recorded_.insert(address).second || reopened) && recording_.size() < kMostRecordedUses) {
    recording_.push_back(address);
    recording_marks_.push_back(marked);
  }
  // A use nested in an open one recorded no position, so it moves no cursor either: it
  // would jump to the chunk's next recorded use (its backward, say) and stay there.
  if (!reopened) return;
  auto found = positions_.find(address);
  if (found == positions_.end()) return;
  for (std::size_t position : found->second) {
    if (position >= cursor_) {
      cursor_ = position;
      return;
    }
  }
}

void use_order::boundary() {
  learned_ = std::move(recording_);
  marks_ = std::move(recording_marks_);
  recording_.clear();
  recording_marks_.clear();
  recorded_.clear();
  positions_.clear();
  for (std::size_t i = 0; i < learned_.size(); ++i) positions_[learned_[i]].push_back(i);
  next_marked_.assign(learned_.size() + 1, learned_.size());
  for (std::size_t i = learned_.size(); i-- > 0;) {
    next_marked_[i] = marks_[i] ? i : next_marked_[i + 1];
  }
  cursor_ = 0;
}

std::uint64_t use_order::distance(std::uintptr_t address, bool in_use) const {
  auto found = positions_.find(address);
  if (found == positions_.end() || found->second.empty()) return kNever;
  for (std::size_t position : found->second) {
    if (position > cursor_ || (position == cursor_ && in_use)) {
      return position - cursor_;  // 0: the use in progress
    }
  }
  return found->second.front() + learned_.size() - cursor_;  // in the next step
}

}  // namespace zeroalloc
