// Allocation classes: what kind of data an allocation holds. Each class has its own
// chunks (lib/README.md, "Chunks and their states"), so paging one class never moves another.
#pragma once

#include <array>
#include <cstddef>
#include <string_view>

namespace zeroalloc {

/// Values match zeroalloc_class in the C ABI.
enum class allocation_class : int { other = 0, parameter = 1, gradient = 2, optimizer_state = 3 };

inline constexpr std::size_t kAllocationClassCount = 4;

inline constexpr std::array<allocation_class, kAllocationClassCount> kAllocationClasses = {
    allocation_class::other, allocation_class::parameter, allocation_class::gradient,
    allocation_class::optimizer_state};

/// "other", "parameter", "gradient", "optimizer_state": the names used in stats and reports.
constexpr std::string_view class_name(allocation_class cls) {
  switch (cls) {
    case allocation_class::other:
      return "other";
    case allocation_class::parameter:
      return "parameter";
    case allocation_class::gradient:
      return "gradient";
    case allocation_class::optimizer_state:
      return "optimizer_state";
  }
  return "other";
}

constexpr std::size_t class_index(allocation_class cls) { return static_cast<std::size_t>(cls); }

}  // namespace zeroalloc
