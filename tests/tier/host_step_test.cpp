// The host step's pieces (Note [Stepped on the host] in lib/tier/host_step.hpp): the AdamW
// update against torch.optim.AdamW's formula computed in double, the workers running every
// task once, and a step spread over threads equal to one on a single thread.
#include "tier/host_step.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <random>
#include <set>
#include <vector>

namespace zeroalloc {
namespace {

std::vector<float> normal_values(std::size_t count, float scale, unsigned seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0F, scale);
  std::vector<float> values(count);
  for (float& value : values) value = normal(generator);
  return values;
}

struct tensors {
  std::vector<float> parameter, gradient, exp_avg, exp_avg_sq;
  explicit tensors(std::size_t count, unsigned seed)
      : parameter(normal_values(count, 1.0F, seed)),
        gradient(normal_values(count, 0.1F, seed + 1)),
        exp_avg(normal_values(count, 0.01F, seed + 2)),
        exp_avg_sq(normal_values(count, 0.03F, seed + 3)) {
    for (float& each : exp_avg_sq) each *= each;
  }
  adamw_span span() {
    return {parameter.data(), gradient.data(), exp_avg.data(), exp_avg_sq.data(), parameter.size()};
  }
};

TEST(HostStep, AdamWMatchesPyTorchsFormulaToFp32Rounding) {
  constexpr std::size_t kCount = 4099;  // not a multiple of any vector width
  for (const bool maximize : {false, true}) {
    tensors t(kCount, 7);
    std::vector<double> p(t.parameter.begin(), t.parameter.end());
    std::vector<double> m(t.exp_avg.begin(), t.exp_avg.end());
    std::vector<double> v(t.exp_avg_sq.begin(), t.exp_avg_sq.end());
    adamw_settings settings{3e-4, 0.9, 0.95, 1e-8, 0.1, 1, maximize};
    for (std::int64_t step = 1; step <= 5; ++step) {
      settings.step = step;
      adamw_update(t.span(), settings);
      const double bias1 = 1.0 - std::pow(settings.beta1, static_cast<double>(step));
      const double bias2 = 1.0 - std::pow(settings.beta2, static_cast<double>(step));
      for (std::size_t i = 0; i < kCount; ++i) {
        const double g = maximize ? -t.gradient[i] : t.gradient[i];
        p[i] *= 1.0 - settings.lr * settings.weight_decay;
        m[i] += (1.0 - settings.beta1) * (g - m[i]);
        v[i] = v[i] * settings.beta2 + (1.0 - settings.beta2) * g * g;
        p[i] -= settings.lr / bias1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bias2) + settings.eps);
      }
    }
    std::size_t changed = 0;
    const std::vector<float> start = tensors(kCount, 7).parameter;
    for (std::size_t i = 0; i < kCount; ++i) {
      // The moments cancel where a gradient opposes them: their error is fp32 rounding of
      // the terms (about 0.01 here), not of the result.
      ASSERT_NEAR(t.parameter[i], p[i], 1e-6 * std::abs(p[i]) + 1e-7) << i;
      ASSERT_NEAR(t.exp_avg[i], m[i], 1e-5 * std::abs(m[i]) + 1e-8) << i;
      ASSERT_NEAR(t.exp_avg_sq[i], v[i], 1e-5 * std::abs(v[i]) + 1e-15) << i;
      changed += t.parameter[i] != start[i] ? 1 : 0;
    }
    EXPECT_GT(changed, kCount * 9 / 10);
    // Maximizing moves each parameter the other way than minimizing (decay aside).
    if (maximize) {
      tensors down(kCount, 7);
      adamw_settings descend = settings;
      descend.maximize = false;
      descend.step = 1;
      descend.weight_decay = 0;
      tensors up(kCount, 7);
      for (tensors* each : {&down, &up}) {  // fresh moments: the gradient alone sets the way
        std::fill(each->exp_avg.begin(), each->exp_avg.end(), 0.0F);
        std::fill(each->exp_avg_sq.begin(), each->exp_avg_sq.end(), 0.0F);
      }
      adamw_settings ascend = descend;
      ascend.maximize = true;
      adamw_update(down.span(), descend);
      adamw_update(up.span(), ascend);
      const std::vector<float> start_values = tensors(kCount, 7).parameter;
      for (std::size_t i = 0; i < kCount; ++i) {
        if (down.parameter[i] == start_values[i]) continue;
        EXPECT_NE(down.parameter[i] < start_values[i], up.parameter[i] < start_values[i]) << i;
      }
    }
  }
}

TEST(HostStep, WorkersRunEveryTaskOnceAndTheSameStepAsOneThread) {
  const std::vector<int> cpus = host_step_cpus(0);
  ASSERT_FALSE(cpus.empty());
  host_workers workers({cpus[0], cpus[0], cpus[0], cpus[0]});  // four threads, one CPU
  EXPECT_EQ(workers.threads(), 4U);
  for (std::size_t tasks : {1U, 3U, 1000U}) {
    std::vector<std::atomic<int>> runs(tasks);
    workers.run(tasks, [&](std::size_t index) { runs[index].fetch_add(1); });
    for (std::size_t i = 0; i < tasks; ++i) ASSERT_EQ(runs[i].load(), 1) << i << " of " << tasks;
  }
  // Three tensors, one spanning several pieces, stepped by the workers and by one thread.
  std::vector<tensors> spread, alone;
  for (std::size_t count : {std::size_t{1} << 20, std::size_t{5}, std::size_t{300000}}) {
    spread.emplace_back(count, static_cast<unsigned>(count));
    alone.emplace_back(count, static_cast<unsigned>(count));
  }
  std::vector<adamw_span> spans;
  for (tensors& each : spread) spans.push_back(each.span());
  const adamw_settings settings{1e-3, 0.9, 0.999, 1e-8, 0.01, 3, false};
  adamw_on_host(workers, spans, settings);
  for (tensors& each : alone) adamw_update(each.span(), settings);
  for (std::size_t k = 0; k < spread.size(); ++k) {
    EXPECT_EQ(spread[k].parameter, alone[k].parameter) << "tensor " << k;
    EXPECT_EQ(spread[k].exp_avg_sq, alone[k].exp_avg_sq) << "tensor " << k;
  }
}

TEST(HostStep, Bf16RoundsToNearestEvenAsPyTorchCasts) {
  EXPECT_EQ(float_to_bf16(1.0F), 0x3F80);
  EXPECT_EQ(bf16_to_float(0x3F80), 1.0F);
  // 1 + 2^-8 lies halfway between 1 and the next bf16 (1 + 2^-7): ties go to even (1).
  EXPECT_EQ(float_to_bf16(1.0F + 0x1p-8F), 0x3F80);
  // Halfway above an odd last bit rounds up to the even one.
  EXPECT_EQ(float_to_bf16(1.0F + 0x1p-7F + 0x1p-8F), 0x3F82);
  EXPECT_EQ(float_to_bf16(1.0F + 0x1p-8F + 0x1p-20F), 0x3F81);  // above halfway: up
  EXPECT_EQ(float_to_bf16(-2.5F), 0xC020);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(INFINITY)), INFINITY);
  EXPECT_EQ(float_to_bf16(3.4e38F), 0x7F80);  // past bf16's largest finite: infinity
}

TEST(HostStep, MasterWeightsStepFromBf16GradientsAndWriteTheirBf16Copies) {
  // The master path is the fp32 update fed the bf16 gradient widened, and its copy is the
  // updated master rounded: the same as stepping with fp32 gradients that hold bf16 values.
  constexpr std::size_t kCount = (std::size_t{1} << 18) + 777;  // several pieces, a ragged end
  tensors fp32(kCount, 11);
  tensors master(kCount, 11);
  std::vector<std::uint16_t> gradient(kCount), copy(kCount, 0);
  for (std::size_t i = 0; i < kCount; ++i) {
    gradient[i] = float_to_bf16(fp32.gradient[i]);
    fp32.gradient[i] = bf16_to_float(gradient[i]);
  }
  adamw_span span = master.span();
  span.gradient = nullptr;
  span.bf16_gradient = gradient.data();
  span.bf16_copy = copy.data();
  const adamw_settings settings{1e-3, 0.9, 0.95, 1e-8, 0.1, 2, false};
  const std::vector<int> cpus = host_step_cpus(0);
  host_workers workers({cpus[0], cpus[0], cpus[0]});
  adamw_on_host(workers, {span}, settings);
  adamw_update(fp32.span(), settings);
  EXPECT_EQ(master.parameter, fp32.parameter);
  EXPECT_EQ(master.exp_avg, fp32.exp_avg);
  EXPECT_EQ(master.exp_avg_sq, fp32.exp_avg_sq);
  std::size_t differs = 0;
  for (std::size_t i = 0; i < kCount; ++i) {
    ASSERT_EQ(copy[i], float_to_bf16(master.parameter[i])) << i;
    differs += bf16_to_float(copy[i]) != master.parameter[i] ? 1 : 0;
  }
  EXPECT_GT(differs, kCount / 2);  // the copy is rounded, the master keeps its fp32 bits
}

TEST(HostStep, CopiesStreamedPastTheCacheHoldWhatOrdinaryStoresWrite) {
  // Note [Copies streamed past the cache]: the same masters, moments and copies, bit for
  // bit, whatever the copies' alignment (a copy starting 1 to 7 values past 16 bytes) and
  // length (a block and a ragged end).
  constexpr std::size_t kCount = 2 * 2048 + 13;
  const adamw_settings settings{1e-3, 0.9, 0.95, 1e-8, 0.1, 3, false};
  const std::vector<int> cpus = host_step_cpus(0);
  host_workers workers({cpus[0], cpus[0]});
  for (std::size_t offset = 0; offset < 8; ++offset) {
    tensors plain(kCount, 21);
    tensors streamed(kCount, 21);
    std::vector<std::uint16_t> gradient(kCount);
    for (std::size_t i = 0; i < kCount; ++i) gradient[i] = float_to_bf16(plain.gradient[i]);
    std::vector<std::uint16_t> plain_copy(kCount + 8, 0), streamed_copy(kCount + 8, 0);
    auto master_span = [&](tensors& t, std::vector<std::uint16_t>& copy) {
      adamw_span span = t.span();
      span.gradient = nullptr;
      span.bf16_gradient = gradient.data();
      span.bf16_copy = copy.data() + offset;
      return span;
    };
    set_streamed_copies(false);
    adamw_on_host(workers, {master_span(plain, plain_copy)}, settings);
    set_streamed_copies(true);
    adamw_on_host(workers, {master_span(streamed, streamed_copy)}, settings);
    set_streamed_copies(false);
    EXPECT_EQ(streamed.parameter, plain.parameter) << offset;
    EXPECT_EQ(streamed.exp_avg, plain.exp_avg) << offset;
    EXPECT_EQ(streamed.exp_avg_sq, plain.exp_avg_sq) << offset;
    EXPECT_EQ(streamed_copy, plain_copy) << offset;  // the values around it untouched too
    EXPECT_NE(plain_copy[offset + kCount / 2], 0) << "nothing was written";
  }
}

TEST(HostStep, CpusOfANodeThatDoesNotExistAreEveryAllowedCpu) {
  const std::vector<int> all = host_step_cpus(-1);
  EXPECT_FALSE(all.empty());
  EXPECT_EQ(host_step_cpus(100000), all);
  const std::set<int> distinct(all.begin(), all.end());
  EXPECT_EQ(distinct.size(), all.size());
}

}  // namespace
}  // namespace zeroalloc
