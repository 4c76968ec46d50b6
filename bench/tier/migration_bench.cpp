// Migration throughput: the migrator moving 64 MiB chunks of live allocations to pinned host
// memory and back, against cudaMemcpyAsync between pinned host memory and device memory, in
// the same run. Prints a table and one JSON line.
//
//   build/bench/migration_bench [--gib 4] [--rounds 5]
//
// Targets (the offload issue): one direction at least 95% of cudaMemcpyAsync, both at once
// at least 90% of it.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "alloc/caching_allocator.hpp"
#include "core/units.hpp"
#include "device/device_registry.hpp"
#include "tier/migrator.hpp"

namespace {

using namespace zeroalloc;
using clock_type = std::chrono::steady_clock;

constexpr std::size_t kChunkBytes = 64 * MiB;

double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

struct copy_figures {
  double host_to_device = 0;
  double device_to_host = 0;
  double both = 0;  // GB/s of both directions together
};

// The same copies the migrator makes (between device chunks mapped at their allocation's
// addresses and pinned host chunks at their staging addresses) with no remapping: what the
// migrator's bookkeeping and remaps cost is the difference.
copy_figures measure_chunk_copies(device& backing, std::size_t bytes, int rounds) {
  allocator_settings settings;
  settings.chunk_bytes = kChunkBytes;
  caching_allocator allocator(backing, settings);
  host_pool pool(backing, 2 * bytes, "the benchmark");
  std::vector<void*> first;
  std::vector<void*> second;
  std::vector<host_chunk> first_host;
  std::vector<host_chunk> second_host;
  for (std::size_t done = 0; done < bytes; done += kChunkBytes) {
    first.push_back(allocator.allocate(kChunkBytes, nullptr, allocation_class::optimizer_state));
    second.push_back(allocator.allocate(kChunkBytes, nullptr, allocation_class::optimizer_state));
    first_host.push_back(pool.acquire(kChunkBytes));
    second_host.push_back(pool.acquire(kChunkBytes));
  }
  stream_handle in = backing.create_stream();
  stream_handle out = backing.create_stream();
  auto run = [&](bool to_device, bool to_host) {
    std::vector<double> rates;
    for (int round = 0; round < rounds; ++round) {
      const auto start = clock_type::now();
      for (std::size_t i = 0; i < first.size(); ++i) {
        if (to_device) {
          backing.copy_async(first[i], reinterpret_cast<void*>(first_host[i].staging_address),
                             kChunkBytes, in);
        }
        if (to_host) {
          backing.copy_async(reinterpret_cast<void*>(second_host[i].staging_address), second[i],
                             kChunkBytes, out);
        }
      }
      backing.synchronize_stream(in);
      backing.synchronize_stream(out);
      const double moved = static_cast<double>(bytes) * ((to_device ? 1 : 0) + (to_host ? 1 : 0));
      rates.push_back(moved / seconds_since(start) / 1e9);
    }
    return median(rates);
  };
  copy_figures result;
  result.host_to_device = run(true, false);
  result.device_to_host = run(false, true);
  result.both = run(true, true);
  backing.destroy_stream(in);
  backing.destroy_stream(out);
  for (std::size_t i = 0; i < first.size(); ++i) {
    pool.release(first_host[i]);
    pool.release(second_host[i]);
    allocator.deallocate(first[i]);
    allocator.deallocate(second[i]);
  }
  allocator.empty_cache();
  return result;
}

// cudaMemcpyAsync in 64 MiB copies between cudaMallocHost and cudaMalloc memory.
copy_figures measure_cuda_memcpy(std::size_t bytes, int rounds) {
  copy_figures result;
  void* host = nullptr;
  void* device = nullptr;
  void* host_2 = nullptr;
  void* device_2 = nullptr;
  if (cudaMallocHost(&host, bytes) != cudaSuccess || cudaMalloc(&device, bytes) != cudaSuccess ||
      cudaMallocHost(&host_2, bytes) != cudaSuccess ||
      cudaMalloc(&device_2, bytes) != cudaSuccess) {
    std::fprintf(stderr, "cudaMemcpyAsync baseline: allocation failed\n");
    return result;
  }
  cudaStream_t in = nullptr;
  cudaStream_t out = nullptr;
  cudaStreamCreateWithFlags(&in, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&out, cudaStreamNonBlocking);
  auto run = [&](bool to_device, bool to_host) {
    std::vector<double> rates;
    for (int round = 0; round < rounds; ++round) {
      cudaDeviceSynchronize();
      const auto start = clock_type::now();
      for (std::size_t offset = 0; offset < bytes; offset += kChunkBytes) {
        if (to_device) {
          cudaMemcpyAsync(static_cast<char*>(device) + offset, static_cast<char*>(host) + offset,
                          kChunkBytes, cudaMemcpyHostToDevice, in);
        }
        if (to_host) {
          cudaMemcpyAsync(static_cast<char*>(host_2) + offset,
                          static_cast<char*>(device_2) + offset, kChunkBytes,
                          cudaMemcpyDeviceToHost, out);
        }
      }
      cudaStreamSynchronize(in);
      cudaStreamSynchronize(out);
      const double moved = static_cast<double>(bytes) * ((to_device ? 1 : 0) + (to_host ? 1 : 0));
      rates.push_back(moved / seconds_since(start) / 1e9);
    }
    return median(rates);
  };
  result.host_to_device = run(true, false);
  result.device_to_host = run(false, true);
  result.both = run(true, true);
  cudaStreamDestroy(in);
  cudaStreamDestroy(out);
  cudaFreeHost(host);
  cudaFreeHost(host_2);
  cudaFree(device);
  cudaFree(device_2);
  return result;
}

struct chunk_set {
  std::vector<void*> allocations;
  std::vector<std::uintptr_t> chunks;
};

chunk_set allocate_chunks(caching_allocator& allocator, std::size_t bytes) {
  chunk_set set;
  for (std::size_t done = 0; done < bytes; done += kChunkBytes) {
    void* pointer = allocator.allocate(kChunkBytes, nullptr, allocation_class::optimizer_state);
    set.allocations.push_back(pointer);
    std::vector<chunk_info> chunks;
    allocator.chunks_of_allocation(pointer, chunks);
    for (const chunk_info& chunk : chunks) set.chunks.push_back(chunk.address);
  }
  return set;
}

copy_figures measure_migrator(device& backing, std::size_t bytes, int rounds) {
  allocator_settings settings;
  settings.chunk_bytes = kChunkBytes;
  caching_allocator allocator(backing, settings);
  host_pool pool(backing, 2 * bytes + kChunkBytes, "the benchmark");
  pool.start_prefill(kChunkBytes, 2 * bytes);
  pool.wait_for_prefill();
  copy_figures result;
  {
    migrator mover(allocator, pool, /*verify=*/false);
    allocator.paging().attach(mover);  // host chunks of unmapped segments go back to the pool
    chunk_set first = allocate_chunks(allocator, bytes);
    chunk_set second = allocate_chunks(allocator, bytes);
    for (void* pointer : first.allocations) backing.fill_async(pointer, 1, kChunkBytes, nullptr);
    for (void* pointer : second.allocations) backing.fill_async(pointer, 2, kChunkBytes, nullptr);
    backing.synchronize_stream(nullptr);
    std::vector<double> out_rates;
    std::vector<double> in_rates;
    std::vector<double> both_rates;
    // How long the requests took to make, before waiting for them: when it is most of a
    // round's time, the requests (their remaps and locks), not the copies, set the rate.
    std::vector<double> out_submit_ms;
    std::vector<double> in_submit_ms;
    std::vector<double> both_submit_ms;
    for (int round = 0; round < rounds; ++round) {
      auto start = clock_type::now();
      for (std::uintptr_t chunk : first.chunks) mover.evict_async(chunk);
      out_submit_ms.push_back(seconds_since(start) * 1e3);
      mover.drain();
      out_rates.push_back(static_cast<double>(bytes) / seconds_since(start) / 1e9);
      start = clock_type::now();
      for (std::uintptr_t chunk : first.chunks) mover.fetch_async(chunk, /*chunk_idle=*/true);
      in_submit_ms.push_back(seconds_since(start) * 1e3);
      mover.drain();
      in_rates.push_back(static_cast<double>(bytes) / seconds_since(start) / 1e9);
      // Both at once: `second` leaves while `first` (sent out again) comes back.
      for (std::uintptr_t chunk : first.chunks) mover.evict_async(chunk);
      mover.drain();
      start = clock_type::now();
      for (std::size_t i = 0; i < first.chunks.size(); ++i) {
        mover.evict_async(second.chunks[i]);
        mover.fetch_async(first.chunks[i], true);
      }
      both_submit_ms.push_back(seconds_since(start) * 1e3);
      mover.drain();
      both_rates.push_back(2.0 * static_cast<double>(bytes) / seconds_since(start) / 1e9);
      for (std::uintptr_t chunk : second.chunks) mover.fetch_async(chunk, true);
      mover.drain();
    }
    const migration_figures counted = mover.figures();
    std::printf("migrator: %llu chunks moved, %.1f us of remapping per chunk\n",
                static_cast<unsigned long long>(counted.chunks_to_host + counted.chunks_to_device),
                static_cast<double>(counted.remap_ns) / 1e3 /
                    static_cast<double>(counted.chunks_to_host + counted.chunks_to_device));
    std::printf("requests made in (median ms): to host %.1f, to device %.1f, both %.1f\n",
                median(out_submit_ms), median(in_submit_ms), median(both_submit_ms));
    result.device_to_host = median(out_rates);
    result.host_to_device = median(in_rates);
    result.both = median(both_rates);
    for (void* pointer : first.allocations) allocator.deallocate(pointer);
    for (void* pointer : second.allocations) allocator.deallocate(pointer);
    allocator.paging().detach();
  }
  allocator.empty_cache();
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  double gib = 4;
  int rounds = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--gib") == 0) gib = std::atof(argv[i + 1]);
    if (std::strcmp(argv[i], "--rounds") == 0) rounds = std::atoi(argv[i + 1]);
  }
  const std::size_t bytes =
      std::max<std::size_t>(1, static_cast<std::size_t>(gib * 1024 / 64)) * kChunkBytes;
  const options parsed = options::from_environment();
  device_registry registry(parsed);
  std::unique_ptr<device> backing = registry.open(0);
  const bool simulated = backing->is_simulated();
  std::printf("migration of %s in 64 MiB chunks on %s, median of %d rounds (GB/s)\n",
              format_bytes(bytes).c_str(), backing->name().c_str(), rounds);
  const copy_figures moved = measure_migrator(*backing, bytes, rounds);
  const copy_figures copies = measure_chunk_copies(*backing, bytes, rounds);
  copy_figures baseline;
  if (!simulated) baseline = measure_cuda_memcpy(bytes, rounds);
  auto ratio = [](double ours, double theirs) { return theirs > 0 ? ours / theirs : 0.0; };
  std::printf("%-16s %10s %16s %7s %14s\n", "direction", "migrator", "cudaMemcpyAsync", "ratio",
              "chunk copies");
  std::printf("%-16s %10.1f %16.1f %7.2f %14.1f\n", "device -> host", moved.device_to_host,
              baseline.device_to_host, ratio(moved.device_to_host, baseline.device_to_host),
              copies.device_to_host);
  std::printf("%-16s %10.1f %16.1f %7.2f %14.1f\n", "host -> device", moved.host_to_device,
              baseline.host_to_device, ratio(moved.host_to_device, baseline.host_to_device),
              copies.host_to_device);
  std::printf("%-16s %10.1f %16.1f %7.2f %14.1f\n", "both at once", moved.both, baseline.both,
              ratio(moved.both, baseline.both), copies.both);
  // Two decimals, as the table shows them.
  auto gbps = [](const copy_figures& figures) {
    auto rounded = [](double value) { return std::round(value * 100) / 100; };
    return nlohmann::ordered_json{{"to_host", rounded(figures.device_to_host)},
                                  {"to_device", rounded(figures.host_to_device)},
                                  {"both", rounded(figures.both)}};
  };
  const nlohmann::ordered_json result = {{"bench", "migration"},
                                         {"device", backing->name()},
                                         {"bytes", bytes},
                                         {"rounds", rounds},
                                         {"migrator_gbps", gbps(moved)},
                                         {"cuda_memcpy_gbps", gbps(baseline)},
                                         {"chunk_copies_gbps", gbps(copies)}};
  std::printf("%s\n", result.dump().c_str());
  return 0;
}
