// The reduction of the collectives that do one on the host (the simulated device's
// transports): element-wise sums over ranks, in rank order, so that every run and every
// transport gives the same bits. bfloat16 is summed in float32 and rounded to nearest even
// once, as NCCL does.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "dist/transport.hpp"

namespace zeroalloc {

inline float bf16_to_float(std::uint16_t value) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(value) << 16);
}

inline std::uint16_t float_to_bf16(float value) {  // round to nearest even; NaN stays NaN
  const auto bits = std::bit_cast<std::uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40);
  return static_cast<std::uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/// Elements [first, first + count) of the sum over `inputs` (one per rank, in rank order),
/// written to `out`.
inline void sum_in_rank_order(const std::vector<const void*>& inputs, std::size_t first,
                              std::size_t count, element_type type, void* out) {
  for (std::size_t i = 0; i < count; ++i) {
    const auto value = [&](const void* input) {
      return type == element_type::float32
                 ? static_cast<const float*>(input)[first + i]
                 : bf16_to_float(static_cast<const std::uint16_t*>(input)[first + i]);
    };
    float sum = value(inputs[0]);
    for (std::size_t each = 1; each < inputs.size(); ++each) sum += value(inputs[each]);
    if (type == element_type::float32) {
      static_cast<float*>(out)[i] = sum;
    } else {
      static_cast<std::uint16_t*>(out)[i] = float_to_bf16(sum);
    }
  }
}

}  // namespace zeroalloc
