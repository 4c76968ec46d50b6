// Byte sizes: the constants the library uses and a human-readable formatter for messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace zeroalloc {

inline constexpr std::size_t KiB = std::size_t{1} << 10;
inline constexpr std::size_t MiB = std::size_t{1} << 20;
inline constexpr std::size_t GiB = std::size_t{1} << 30;

/// "1.50 GiB", "512 B": for messages and reports, never for parsing.
std::string format_bytes(std::uint64_t bytes);

/// Rounds `value` up to a multiple of `alignment` (a power of two or any positive value).
constexpr std::size_t round_up(std::size_t value, std::size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

}  // namespace zeroalloc
