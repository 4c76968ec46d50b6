// The host step's AdamW (Note [Stepped on the host] in lib/tier/host_step.hpp) on this
// machine's CPUs: one step over `--millions` million fp32 parameters (parameter, gradient and
// both moments in plain host memory, first touched by the threads that step them), on 1, 2,
// 4 ... threads up to the CPUs of NUMA node `--node` (default 0), and the rate of the host's
// memory it reaches (28 bytes read or written per parameter). No GPU.
//
//   build/bench/host_step_bench [--millions 256] [--node 0] [--rounds 3]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tier/host_step.hpp"

int main(int argc, char** argv) {
  std::size_t millions = 256;
  int node = 0;
  int rounds = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--millions") {
      millions = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (flag == "--node") {
      node = std::atoi(argv[i + 1]);
    } else if (flag == "--rounds") {
      rounds = std::atoi(argv[i + 1]);
    } else {
      std::fprintf(stderr, "unknown flag %s (--millions N, --node N, --rounds N)\n", argv[i]);
      return 2;
    }
  }
  const std::size_t count = millions * 1000 * 1000;
  std::vector<float> parameter(count, 1.0F), gradient(count, 0.01F), exp_avg(count, 0.0F),
      exp_avg_sq(count, 0.0F);
  // Tensors of 64 Mi elements, as a model's large weights.
  std::vector<zeroalloc::adamw_span> spans;
  constexpr std::size_t kTensor = std::size_t{1} << 26;
  for (std::size_t at = 0; at < count; at += kTensor) {
    const std::size_t n = std::min(kTensor, count - at);
    spans.push_back({parameter.data() + at, gradient.data() + at, exp_avg.data() + at,
                     exp_avg_sq.data() + at, n});
  }
  const std::vector<int> cpus = zeroalloc::host_step_cpus(node);
  std::printf("host step: %zu M fp32 parameters (%.2f GB touched a step), CPUs of node %d: %zu\n",
              millions, 28.0 * static_cast<double>(count) / 1e9, node, cpus.size());
  std::printf("%8s %10s %12s %10s\n", "threads", "step s", "params/s", "GB/s");
  std::vector<std::size_t> counts;
  for (std::size_t threads = 1; threads < cpus.size(); threads *= 2) counts.push_back(threads);
  counts.push_back(cpus.size());
  for (std::size_t threads : counts) {
    zeroalloc::host_workers workers(std::vector<int>(cpus.begin(), cpus.begin() + threads));
    zeroalloc::adamw_settings settings;
    std::vector<double> times;
    for (int round = 0; round <= rounds; ++round) {  // round 0 warms the pages
      settings.step = round + 1;
      const auto started = std::chrono::steady_clock::now();
      zeroalloc::adamw_on_host(workers, spans, settings);
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - started;
      if (round > 0) times.push_back(took.count());
    }
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    std::printf("%8zu %10.3f %12.3e %10.1f\n", threads, median, static_cast<double>(count) / median,
                28.0 * static_cast<double>(count) / median / 1e9);
  }
  return 0;
}
