// Cached malloc + free pairs through the C ABI, against the CUDA runtime's own allocators
// in the same run (cudaMallocAsync's pool, cudaMalloc + cudaFree) where a GPU is present.
// Each figure is the median of repetitions (p50), in ns per pair.
//
//   build/bench/caching_allocator_bench --benchmark_repetitions=9
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>

#include "zeroalloc/zeroalloc.h"

namespace {

bool have_gpu() {
  static const bool present = [] {
    int count = 0;
    return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  }();
  return present;
}

void zeroalloc_pair(benchmark::State& state) {
  const auto bytes = static_cast<ssize_t>(state.range(0));
  zeroalloc_free(zeroalloc_malloc(bytes, 0, nullptr), bytes, 0, nullptr);  // fill the cache
  for (auto _ : state) {
    void* pointer = zeroalloc_malloc(bytes, 0, nullptr);
    benchmark::DoNotOptimize(pointer);
    zeroalloc_free(pointer, bytes, 0, nullptr);
  }
  void* last = zeroalloc_malloc(bytes, 0, nullptr);  // the allocator still serves after the run
  if (last == nullptr) {
    state.SkipWithError(zeroalloc_last_error());
  } else {
    zeroalloc_free(last, bytes, 0, nullptr);
  }
  state.SetLabel(have_gpu() ? "cuda" : "sim");
}

void cuda_malloc_async_pair(benchmark::State& state) {
  if (!have_gpu()) {
    state.SkipWithError("no GPU");
    return;
  }
  const auto bytes = static_cast<std::size_t>(state.range(0));
  static cudaStream_t stream = [] {
    cudaStream_t created = nullptr;
    cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking);
    cudaMemPool_t pool = nullptr;
    cudaDeviceGetDefaultMemPool(&pool, 0);
    std::uint64_t keep_everything = UINT64_MAX;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_everything);
    return created;
  }();
  for (auto _ : state) {
    void* pointer = nullptr;
    cudaMallocAsync(&pointer, bytes, stream);
    benchmark::DoNotOptimize(pointer);
    cudaFreeAsync(pointer, stream);
  }
  cudaStreamSynchronize(stream);
}

void cuda_malloc_pair(benchmark::State& state) {
  if (!have_gpu()) {
    state.SkipWithError("no GPU");
    return;
  }
  const auto bytes = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* pointer = nullptr;
    cudaMalloc(&pointer, bytes);
    benchmark::DoNotOptimize(pointer);
    cudaFree(pointer);
  }
}

void sizes(benchmark::internal::Benchmark* bench) {
  for (std::int64_t bytes : {512ll, 64ll << 10, 1ll << 20, 16ll << 20, 256ll << 20})
    bench->Arg(bytes);
}

BENCHMARK(zeroalloc_pair)->Apply(sizes)->Threads(1)->Threads(16)->UseRealTime();
BENCHMARK(cuda_malloc_async_pair)->Apply(sizes)->Threads(1);
BENCHMARK(cuda_malloc_pair)->Arg(2 << 20)->Arg(64 << 20)->Threads(1)->Iterations(200);

}  // namespace

BENCHMARK_MAIN();
