// What the offload engine's use hints cost the thread that sends them: a module hook sends a
// use-begins and a use-ends for its parameters every forward, so this is per-module host
// time on the training path. The parameters are those of a Llama-style decoder layer
// (hidden 2048, intermediate 5504, fp32), 24 layers in one parameter class, nothing
// offloaded (the steady state). Runs on the device ZEROALLOC_DEVICE names (default: sim).
//
//   build/bench/hint_bench [--benchmark_repetitions=5]
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "zeroalloc/zeroalloc.h"

namespace {

constexpr std::size_t kHidden = 2048;
constexpr std::size_t kIntermediate = 5504;
constexpr int kLayers = 24;

struct model {
  std::vector<std::vector<void*>> layers;  // each layer's nine parameters

  model() {
    const std::size_t sizes[] = {kHidden * kHidden,
                                 kHidden * kHidden,
                                 kHidden * kHidden,
                                 kHidden * kHidden,
                                 kHidden * kIntermediate,
                                 kHidden * kIntermediate,
                                 kHidden * kIntermediate,
                                 kHidden,
                                 kHidden};
    for (int layer = 0; layer < kLayers; ++layer) {
      std::vector<void*>& parameters = layers.emplace_back();
      for (std::size_t elements : sizes) {
        void* pointer = zeroalloc_malloc_class(static_cast<ssize_t>(elements * 4), 0, nullptr,
                                               ZEROALLOC_CLASS_PARAMETER);
        if (pointer == nullptr) {
          std::fprintf(stderr, "hint_bench: allocating a parameter failed: %s\n",
                       zeroalloc_last_error());
          std::exit(1);
        }
        parameters.push_back(pointer);
      }
    }
  }
};

model& the_model() {
  static model built;
  return built;
}

// One module per parameter, one call per pointer: what leaf-module hooks sent.
void BM_HintsOneCallPerTensor(benchmark::State& state) {
  model& built = the_model();
  for (auto _ : state) {
    for (const std::vector<void*>& layer : built.layers) {
      for (void* parameter : layer) zeroalloc_use_begins(parameter, nullptr);
      for (void* parameter : layer) zeroalloc_use_ends(parameter, nullptr);
    }
  }
  state.counters["us_per_layer"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * kLayers,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  zeroalloc_step_boundary();
}

// One call per layer for its nine parameters: what a hint group sends.
void BM_HintsOneCallPerLayer(benchmark::State& state) {
  model& built = the_model();
  for (auto _ : state) {
    for (const std::vector<void*>& layer : built.layers) {
      zeroalloc_use_begins_many(const_cast<const void* const*>(layer.data()), layer.size(),
                                nullptr);
      zeroalloc_use_ends_many(const_cast<const void* const*>(layer.data()), layer.size(), nullptr);
    }
  }
  state.counters["us_per_layer"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * kLayers,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  zeroalloc_step_boundary();
}

BENCHMARK(BM_HintsOneCallPerTensor)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_HintsOneCallPerLayer)->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) {
  // Defaults for a run with nothing set; the caller's settings win.
  setenv("ZEROALLOC_DEVICE", "sim", 0);
  setenv("ZEROALLOC_SIM_MEMORY", "8GiB", 0);
  setenv("ZEROALLOC_OFFLOAD", "host", 0);
  setenv("ZEROALLOC_HOST_LIMIT", "64MiB", 0);  // a small prefill: no thread competing
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  the_model();  // allocated before any timing
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
