// Free parts of a range of addresses (or of offsets into an allocation): a sorted map of
// start -> length whose neighbours are always merged. The heaps keep their unmapped address
// space in one; the host pool its staging addresses and each slab's free slices.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <optional>

namespace zeroalloc {

class free_ranges {
 public:
  /// Adds [start, start + length), merging it with the ranges it touches.
  void give_back(std::uintptr_t start, std::size_t length) {
    auto [inserted, fresh] = ranges_.emplace(start, length);
    (void)fresh;
    auto after = std::next(inserted);
    if (after != ranges_.end() && inserted->first + inserted->second == after->first) {
      inserted->second += after->second;
      ranges_.erase(after);
    }
    if (inserted != ranges_.begin()) {
      auto before = std::prev(inserted);
      if (before->first + before->second == inserted->first) {
        before->second += inserted->second;
        ranges_.erase(inserted);
      }
    }
  }

  /// True when some range holds `length`.
  [[nodiscard]] bool fits(std::size_t length) const { return best(length) != ranges_.end(); }

  /// Takes `length` from the front of the smallest range that holds it; its start, or
  /// nullopt when none does.
  std::optional<std::uintptr_t> take_best_fit(std::size_t length) {
    return take(best(length), length);
  }

  /// Takes `length` from the front of the lowest range that holds it.
  std::optional<std::uintptr_t> take_first_fit(std::size_t length) {
    auto fit = ranges_.begin();
    while (fit != ranges_.end() && fit->second < length) ++fit;
    return take(fit, length);
  }

 private:
  using iterator = std::map<std::uintptr_t, std::size_t>::iterator;
  using const_iterator = std::map<std::uintptr_t, std::size_t>::const_iterator;

  [[nodiscard]] const_iterator best(std::size_t length) const {
    auto fit = ranges_.end();
    for (auto range = ranges_.begin(); range != ranges_.end(); ++range) {
      if (range->second >= length && (fit == ranges_.end() || range->second < fit->second)) {
        fit = range;
      }
    }
    return fit;
  }

  std::optional<std::uintptr_t> take(const_iterator fit, std::size_t length) {
    if (fit == ranges_.end()) return std::nullopt;
    const std::uintptr_t start = fit->first;
    const std::size_t rest = fit->second - length;
    ranges_.erase(fit);
    if (rest != 0) ranges_.emplace(start + length, rest);
    return start;
  }

  std::map<std::uintptr_t, std::size_t> ranges_;
};

}  // namespace zeroalloc
