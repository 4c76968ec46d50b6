// The host step's AdamW (Note [Stepped on the host] in lib/tier/host_step.hpp) on this
// machine's CPUs: one step over `--millions` million fp32 parameters (parameter, gradient and
// both moments in plain host memory, first touched by the threads that step them), on 1, 2,
// 4 ... threads up to the CPUs of NUMA node `--node` (default 0), and the rate of the host's
// memory it reaches (28 bytes read or written per parameter). With `--masters`, the step of
// master weights instead: a bf16 gradient in and a bf16 copy out (also 28 bytes), and the
// same step with its copies streamed past the cache (Note [Copies streamed past the cache]
// in lib/tier/host_step.hpp). Beside each, the same bytes with almost no arithmetic (each state
// plus the gradient, in place, on the same threads): the rate the node's memory gives that access
// pattern. AdamW near it is bound by the host's memory, not by its arithmetic. No GPU.
// With --masters a last column steps split masters: each fp32 master kept as its bf16 copy
// (rounded to nearest, ties away from zero) and the 16 bits that bf16 drops. The copy and
// those bits give back the master exactly. The same arithmetic then reads and writes 26
// bytes a parameter instead of 28, and the host holds 4 bytes a master instead of 6.
//
//   build/bench/host_step_bench [--millions 256] [--node 0] [--rounds 3] [--masters]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tier/host_step.hpp"

namespace {

// The AdamW step's reads and writes with almost none of its arithmetic: every state read,
// one addition, written back where it was; with master weights, the bf16 forms the step
// reads and writes.
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void same_bytes(float* __restrict parameter, const float* __restrict gradient,
                float* __restrict exp_avg, float* __restrict exp_avg_sq, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    exp_avg[i] += gradient[i];
    exp_avg_sq[i] += gradient[i];
    parameter[i] += gradient[i];
  }
}

#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void same_master_bytes(float* __restrict parameter, const std::uint16_t* __restrict gradient,
                       float* __restrict exp_avg, float* __restrict exp_avg_sq,
                       std::uint16_t* __restrict copy, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    const std::uint32_t wide = static_cast<std::uint32_t>(gradient[i]) << 16U;  // bf16 bits
    float g = 0.0F;
    std::memcpy(&g, &wide, sizeof(g));
    exp_avg[i] += g;
    exp_avg_sq[i] += g;
    const float p = parameter[i] + g;
    parameter[i] = p;
    std::uint32_t bits = 0;
    std::memcpy(&bits, &p, sizeof(bits));
    copy[i] = static_cast<std::uint16_t>(bits >> 16U);  // truncated: no rounding's arithmetic
  }
}

// Split masters: `high` is the master rounded to bf16, ties away from zero, and `low` the
// master's low 16 bits. The high half was rounded up exactly when the low half is at least
// 0x8000, so the two give back the master's bits. (Ties to even would make the two tie cases
// meet at one pair.) A NaN master becomes the bf16 NaN PyTorch writes, as rounded() makes it,
// and comes back a NaN (its payload lost).
[[gnu::always_inline]] inline float joined(std::uint16_t high, std::uint16_t low) {
  const std::uint32_t top = static_cast<std::uint32_t>(high) - (low >= 0x8000U ? 1U : 0U);
  const std::uint32_t bits = (top << 16U) | low;
  float value = 0.0F;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

[[gnu::always_inline]] inline void split(float value, std::uint16_t& high, std::uint16_t& low) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  const bool nan = (bits & 0x7FFFFFFFU) > 0x7F800000U;
  low = nan ? 0 : static_cast<std::uint16_t>(bits & 0xFFFFU);
  high = nan ? 0x7FC0 : static_cast<std::uint16_t>((bits >> 16U) + (low >= 0x8000U ? 1U : 0U));
}

// AdamW's scalars, as lib/tier/host_step.cpp computes them (factors_of), held at run time.
struct factors {
  float decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps,
      negative_step_size, gradient_sign;
};

factors factors_at(std::int64_t step) {
  const zeroalloc::adamw_settings s;
  const auto n = static_cast<double>(step);
  return {static_cast<float>(1.0 - s.lr * s.weight_decay),
          static_cast<float>(1.0 - s.beta1),
          static_cast<float>(s.beta2),
          static_cast<float>(1.0 - s.beta2),
          static_cast<float>(std::sqrt(1.0 - std::pow(s.beta2, n))),
          static_cast<float>(s.eps),
          static_cast<float>(-s.lr / (1.0 - std::pow(s.beta1, n))),
          s.maximize ? -1.0F : 1.0F};
}

// The arithmetic of update_element in lib/tier/host_step.cpp, on split masters: 26 bytes a
// parameter (both halves read and written, the bf16 gradient read, both moments).
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void update_split_elements(std::uint16_t* __restrict high, std::uint16_t* __restrict low,
                           const std::uint16_t* __restrict gradient, float* __restrict exp_avg,
                           float* __restrict exp_avg_sq, std::size_t count, factors f) {
  for (std::size_t i = 0; i < count; ++i) {
    const std::uint32_t wide = static_cast<std::uint32_t>(gradient[i]) << 16U;
    float bf16_gradient = 0.0F;
    std::memcpy(&bf16_gradient, &wide, sizeof(bf16_gradient));
    const float g = bf16_gradient * f.gradient_sign;
    const float p = joined(high[i], low[i]) * f.decay;
    const float m = exp_avg[i] + f.one_minus_beta1 * (g - exp_avg[i]);
    const float v = exp_avg_sq[i] * f.beta2 + f.one_minus_beta2 * g * g;
    const float denominator = std::sqrt(v) / f.bias_correction2_sqrt + f.eps;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    split(p + f.negative_step_size * (m / denominator), high[i], low[i]);
  }
}

// Split masters give back every finite master they are given, and their high half is
// PyTorch's bf16 cast but in a tie whose truncated half is even (ties away from zero there).
// Tried on every low half at the edges (0, 0x7FFF, 0x8000, 0x8001, 0xFFFF) and on a spread of
// the others, for a spread of high patterns of both signs and the largest finite one.
bool split_masters_are_exact() {
  std::vector<std::uint32_t> tops;
  for (std::uint32_t top = 0; top < 0x7F80U; top += 7U) tops.push_back(top);
  tops.push_back(0x7F7FU);  // the largest finite: a tie or more rounds up to infinity
  std::vector<std::uint32_t> lows = {0x0000U, 0x7FFFU, 0x8000U, 0x8001U, 0xFFFFU};
  for (std::uint32_t low = 1; low < 0xFFFFU; low += 257U) lows.push_back(low);
  for (const std::uint32_t top : tops) {
    for (const std::uint32_t sign : {0U, 0x8000U}) {
      for (const std::uint32_t low : lows) {
        const std::uint32_t bits = ((top | sign) << 16U) | low;
        float value = 0.0F;
        std::memcpy(&value, &bits, sizeof(value));
        std::uint16_t high = 0, kept = 0;
        split(value, high, kept);
        const float back = joined(high, kept);
        if (std::memcmp(&back, &value, sizeof(value)) != 0) return false;
        const bool tie_kept_by_even = low == 0x8000U && (top & 1U) == 0;
        const std::uint16_t cast = zeroalloc::float_to_bf16(value);
        if (high != (tie_kept_by_even ? cast + 1 : cast)) return false;
      }
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t millions = 256;
  int node = 0;
  int rounds = 3;
  bool masters = false;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--masters") {
      masters = true;
      --i;  // takes no value
    } else if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", argv[i]);
      return 2;
    } else if (flag == "--millions") {
      millions = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (flag == "--node") {
      node = std::atoi(argv[i + 1]);
    } else if (flag == "--rounds") {
      rounds = std::atoi(argv[i + 1]);
    } else {
      std::fprintf(stderr, "unknown flag %s (--millions N, --node N, --rounds N, --masters)\n",
                   argv[i]);
      return 2;
    }
  }
  const std::size_t count = millions * 1000 * 1000;
  std::vector<float> parameter(count, 1.0F), exp_avg(count, 0.0F), exp_avg_sq(count, 0.0F);
  std::vector<float> gradient(masters ? 0 : count, 0.01F);
  std::vector<std::uint16_t> bf16_gradient(masters ? count : 0, zeroalloc::float_to_bf16(0.01F));
  std::vector<std::uint16_t> bf16_copy(masters ? count : 0, 0);
  std::vector<std::uint16_t> low_halves(masters ? count : 0, 0);  // split masters' low bits
  if (masters && !split_masters_are_exact()) {
    std::fprintf(stderr, "split masters do not give back their masters\n");
    return 1;
  }
  // Tensors of 64 Mi elements, as a model's large weights.
  std::vector<zeroalloc::adamw_span> spans;
  constexpr std::size_t kTensor = std::size_t{1} << 26;
  for (std::size_t at = 0; at < count; at += kTensor) {
    const std::size_t n = std::min(kTensor, count - at);
    if (masters) {
      spans.push_back({parameter.data() + at, nullptr, exp_avg.data() + at, exp_avg_sq.data() + at,
                       n, bf16_gradient.data() + at, bf16_copy.data() + at});
    } else {
      spans.push_back({parameter.data() + at, gradient.data() + at, exp_avg.data() + at,
                       exp_avg_sq.data() + at, n});
    }
  }
  constexpr std::size_t kPiece = std::size_t{1} << 18;
  const std::size_t pieces = (count + kPiece - 1) / kPiece;
  const std::vector<int> cpus = zeroalloc::host_step_cpus(node);
  std::printf("host step: %zu M %s parameters (%.2f GB touched a step), CPUs of node %d: %zu\n",
              millions, masters ? "master (bf16 gradient and copy)" : "fp32",
              28.0 * static_cast<double>(count) / 1e9, node, cpus.size());
  std::printf("%8s %10s %12s %10s %14s %12s %14s %16s\n", "threads", "step s", "params/s", "GB/s",
              masters ? "streamed GB/s" : "", "same GB/s", "AdamW/same",
              masters ? "split params/s" : "");
  // The median of `rounds` timed passes of `pass`, after one that warms the pages.
  auto median_of = [&](const std::function<void(int)>& pass) {
    std::vector<double> times;
    for (int round = 0; round <= rounds; ++round) {
      const auto started = std::chrono::steady_clock::now();
      pass(round);
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - started;
      if (round > 0) times.push_back(took.count());
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  };
  auto rate = [&](double seconds) { return 28.0 * static_cast<double>(count) / seconds / 1e9; };
  std::vector<std::size_t> counts;
  for (std::size_t threads = 1; threads < cpus.size(); threads *= 2) counts.push_back(threads);
  counts.push_back(cpus.size());
  for (std::size_t threads : counts) {
    zeroalloc::host_workers workers(std::vector<int>(cpus.begin(), cpus.begin() + threads));
    zeroalloc::adamw_settings settings;
    auto adamw = [&](int round) {
      settings.step = round + 1;
      zeroalloc::adamw_on_host(workers, spans, settings);
    };
    const double median = median_of(adamw);
    std::string streamed;  // Note [Copies streamed past the cache]: the same step, streamed
    if (masters) {
      zeroalloc::set_streamed_copies(true);
      streamed = std::to_string(rate(median_of(adamw)));
      streamed.resize(streamed.find('.') + 2);
      zeroalloc::set_streamed_copies(false);
    }
    const double plain = median_of([&](int) {
      workers.run(pieces, [&](std::size_t index) {
        const std::size_t at = index * kPiece;
        const std::size_t n = std::min(kPiece, count - at);
        if (masters) {
          same_master_bytes(parameter.data() + at, bf16_gradient.data() + at, exp_avg.data() + at,
                            exp_avg_sq.data() + at, bf16_copy.data() + at, n);
        } else {
          same_bytes(parameter.data() + at, gradient.data() + at, exp_avg.data() + at,
                     exp_avg_sq.data() + at, n);
        }
      });
    });
    std::string split_rate;  // the step on split masters, 26 bytes a parameter
    if (masters) {
      const double seconds = median_of([&](int round) {
        workers.run(pieces, [&](std::size_t index) {
          const std::size_t at = index * kPiece;
          update_split_elements(bf16_copy.data() + at, low_halves.data() + at,
                                bf16_gradient.data() + at, exp_avg.data() + at,
                                exp_avg_sq.data() + at, std::min(kPiece, count - at),
                                factors_at(round + 1));
        });
      });
      char text[32];
      std::snprintf(text, sizeof(text), "%.3e", static_cast<double>(count) / seconds);
      split_rate = text;
    }
    std::printf("%8zu %10.3f %12.3e %10.1f %14s %12.1f %13.0f%% %16s\n", threads, median,
                static_cast<double>(count) / median, rate(median), streamed.c_str(), rate(plain),
                100.0 * rate(median) / rate(plain), split_rate.c_str());
  }
  return 0;
}
