// Reserved memory over a repeated training step: the recorded Llama trace of the 1.3B shape
// (24 layers, hidden 2048, batch 4 x 1024 tokens, bf16 autocast, fp32 AdamW), every
// allocation in one class as `zt.install()` alone gives, replayed through the C ABI.
// Every step asks for the same sizes in the same order, so once the first steps have
// filled the cache, reserved memory must stop growing (Note [Deferred coalescing]).
#include <gtest/gtest.h>
#include <zeroalloc/zeroalloc.h>

#include "../../demo/replay.hpp"
#include "../../demo/training_trace.hpp"

namespace zeroalloc::demo {
namespace {

TEST(TraceFragmentation, ReservedStopsGrowingWhenEveryStepRepeats) {
  trace_shape shape;
  shape.layers = 24;
  shape.hidden = 2048;
  shape.intermediate = 5504;
  shape.heads = 16;
  shape.batch = 4;
  shape.sequence_lengths = {1024};
  shape.steps = 6;
  std::vector<trace_event> events = make_training_trace(shape);
  for (trace_event& event : events) event.allocation_class = ZEROALLOC_CLASS_OTHER;

  const replay_result result = replay_through_zeroalloc(events, 0);
  ASSERT_EQ(result.error, "");
  ASSERT_EQ(result.steps.size(), 6u);
  const double gib = 1 << 30;
  for (std::size_t step = 0; step < result.steps.size(); ++step) {
    const allocator_figures& total = result.steps[step].stats.total;
    std::printf("step %zu: peak allocated %.2f GiB, peak reserved %.2f GiB\n", step,
                static_cast<double>(total.allocated_peak_bytes) / gib,
                static_cast<double>(total.reserved_peak_bytes) / gib);
  }
  // Step 1 is the first with optimizer states and the full peak; from there on every step
  // is the same, and so must be what the cache needs for it.
  const std::uint64_t settled = result.steps[1].stats.total.reserved_peak_bytes;
  for (std::size_t step = 2; step < result.steps.size(); ++step) {
    EXPECT_EQ(result.steps[step].stats.total.reserved_peak_bytes, settled) << "step " << step;
  }
  const auto& whole = result.final_stats.total;
  const double ratio = static_cast<double>(whole.reserved_peak_bytes) /
                       static_cast<double>(whole.allocated_peak_bytes);
  std::printf("peak reserved / peak allocated = %.3f\n", ratio);
  EXPECT_LE(ratio, 1.05);
}

}  // namespace
}  // namespace zeroalloc::demo
