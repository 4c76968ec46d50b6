// What remapping a chunk costs, call by call, and what it costs while copies run: the
// figures behind the migrator's throughput (Note [Fault-free migration], Note [What a remap
// costs] in tier/migrator.hpp).
//
//   build/bench/remap_bench [--chunks 16] [--reserve-gib N]
//
// First, on an idle GPU, the median time of cuMemUnmap, cuMemMap and cuMemSetAccess when a
// chunk's addresses move from a device handle to a host handle and back: 2 and 64 MiB
// chunks of HOST_NUMA memory, 64 MiB of HOST memory, and 64 MiB of HOST_NUMA memory that is
// also mapped at a second (staging) address, as the migrator's is. --reserve-gib reserves
// that much address space around the chunks (the allocator reserves twice the device's
// memory per heap). Then 64 x 64 MiB device -> host copies (and, "both", as many host ->
// device at once on another stream), in copies of 64 or 4 MiB, alone and while another
// thread remaps 64 MiB chunks back and forth: the copies' GB/s and the time of each remap.
// Last, the same with the copies made by a kernel (tier/copy_kernel.cu) instead of the copy
// engines, at several grid sizes, to the host, both ways, and from device memory to device
// memory: whether a remap waits for the copy engines, for traffic over the link, or for any
// kernel.
#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#if ZEROALLOC_HAVE_COPY_KERNEL
#include "copy_kernel_fatbin.h"
#endif

namespace {

using clock_type = std::chrono::steady_clock;
constexpr std::size_t kMiB = 1 << 20;
std::size_t g_reserve_bytes = 0;  // --reserve-gib: reserve this much address space per set

void check(CUresult result, const char* what) {
  if (result != CUDA_SUCCESS) {
    const char* name = nullptr;
    cuGetErrorName(result, &name);
    std::fprintf(stderr, "%s failed: %s\n", what, name != nullptr ? name : "?");
    std::exit(1);
  }
}

double microseconds(clock_type::time_point start) {
  return std::chrono::duration<double, std::micro>(clock_type::now() - start).count();
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

CUmemAllocationProp properties(CUmemLocationType type, int id) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = type;
  prop.location.id = id;
  return prop;
}

CUmemAccessDesc device_access(int ordinal) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = ordinal;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return access;
}

// A set of chunks whose addresses can move between a device handle and a host handle each.
struct remap_set {
  std::size_t bytes = 0;
  CUdeviceptr base = 0;
  std::vector<CUmemGenericAllocationHandle> on_device;
  std::vector<CUmemGenericAllocationHandle> on_host;
  std::vector<bool> at_host;

  std::size_t reserved = 0;
  CUdeviceptr staging = 0;  // where each host handle is mapped a second time, when staged

  remap_set(std::size_t chunk_bytes, std::size_t count, CUmemLocationType host_type, int numa,
            bool staged = false) {
    bytes = chunk_bytes;
    if (staged) check(cuMemAddressReserve(&staging, bytes * count, 0, 0, 0), "cuMemAddressReserve");
    const CUmemAllocationProp device_prop = properties(CU_MEM_LOCATION_TYPE_DEVICE, 0);
    const CUmemAllocationProp host_prop = properties(host_type, numa);
    reserved = std::max(bytes * count, g_reserve_bytes);
    check(cuMemAddressReserve(&base, reserved, 0, 0, 0), "cuMemAddressReserve");
    const CUmemAccessDesc access = device_access(0);
    for (std::size_t i = 0; i < count; ++i) {
      CUmemGenericAllocationHandle handle = 0;
      check(cuMemCreate(&handle, bytes, &device_prop, 0), "cuMemCreate(device)");
      on_device.push_back(handle);
      check(cuMemCreate(&handle, bytes, &host_prop, 0), "cuMemCreate(host)");
      on_host.push_back(handle);
      if (staging != 0) {
        check(cuMemMap(staging + i * bytes, bytes, 0, handle, 0), "cuMemMap(staging)");
        check(cuMemSetAccess(staging + i * bytes, bytes, &access, 1), "cuMemSetAccess(staging)");
      }
      check(cuMemMap(base + i * bytes, bytes, 0, on_device[i], 0), "cuMemMap");
      check(cuMemSetAccess(base + i * bytes, bytes, &access, 1), "cuMemSetAccess");
      at_host.push_back(false);
    }
  }
  ~remap_set() {
    for (std::size_t i = 0; i < on_device.size(); ++i) {
      cuMemUnmap(base + i * bytes, bytes);
      if (staging != 0) cuMemUnmap(staging + i * bytes, bytes);
      cuMemRelease(on_device[i]);
      cuMemRelease(on_host[i]);
    }
    cuMemAddressFree(base, reserved);
    if (staging != 0) cuMemAddressFree(staging, bytes * on_device.size());
  }

  // Moves chunk i to the other handle; adds each call's microseconds to `times` (unmap,
  // map, set access).
  void flip(std::size_t i, double times[3]) {
    const CUdeviceptr address = base + i * bytes;
    const CUmemAccessDesc access = device_access(0);
    auto start = clock_type::now();
    check(cuMemUnmap(address, bytes), "cuMemUnmap");
    times[0] = microseconds(start);
    start = clock_type::now();
    check(cuMemMap(address, bytes, 0, at_host[i] ? on_device[i] : on_host[i], 0), "cuMemMap");
    times[1] = microseconds(start);
    start = clock_type::now();
    check(cuMemSetAccess(address, bytes, &access, 1), "cuMemSetAccess");
    times[2] = microseconds(start);
    at_host[i] = !at_host[i];
  }
};

void per_call_costs(std::size_t chunk_bytes, std::size_t count, CUmemLocationType host_type,
                    int numa, const char* label, bool staged = false) {
  remap_set set(chunk_bytes, count, host_type, numa, staged);
  std::vector<double> to_host[3];
  std::vector<double> to_device[3];
  for (int round = 0; round < 2; ++round) {
    for (std::size_t i = 0; i < count; ++i) {
      double times[3];
      set.flip(i, times);
      for (int k = 0; k < 3; ++k) to_host[k].push_back(times[k]);
    }
    for (std::size_t i = 0; i < count; ++i) {
      double times[3];
      set.flip(i, times);
      for (int k = 0; k < 3; ++k) to_device[k].push_back(times[k]);
    }
  }
  std::printf(
      "%-10s %6zu MiB | to host: unmap %7.1f map %7.1f access %7.1f | to device: unmap "
      "%7.1f map %7.1f access %7.1f us\n",
      label, chunk_bytes / kMiB, median(to_host[0]), median(to_host[1]), median(to_host[2]),
      median(to_device[0]), median(to_device[1]), median(to_device[2]));
}

// GB/s of `copies` 64 MiB device -> host copies on one stream (each in copies of `piece`;
// with `back_stream`, as many host -> device on it), while `remaps` (when given) flips chunks
// on another thread; and how long each flip took meanwhile.
struct copy_run {
  double gbps = 0;
  int remaps = 0;
  double us_per_remap = 0;  // while the copies ran
};

// The copy kernel and its grid, when copies are made by the GPU's cores.
struct kernel_copier {
  CUfunction function = nullptr;
  unsigned blocks = 0;
  bool on_device = false;  // device memory to device memory: no bytes cross the link

  void copy(CUdeviceptr target, CUdeviceptr source, std::size_t bytes, CUstream stream) const {
    unsigned long long count = bytes / 16;
    void* arguments[] = {&target, &source, &count};
    check(cuLaunchKernel(function, blocks, 1, 1, 512, 1, 1, 0, stream, arguments, nullptr),
          "cuLaunchKernel");
  }
};

copy_run copy_while(remap_set* remaps, int copies, CUdeviceptr source, void* target,
                    CUstream stream, CUstream back_stream, CUcontext context, std::size_t piece,
                    const kernel_copier* kernel = nullptr) {
  std::atomic<bool> done{false};
  std::atomic<int> flipped{0};
  std::thread remapper;
  if (remaps != nullptr) {
    remapper = std::thread([&] {
      cuCtxSetCurrent(context);
      std::size_t i = 0;
      while (!done.load()) {
        double times[3];
        remaps->flip(i % remaps->on_device.size(), times);
        ++i;
        flipped.fetch_add(1);
      }
    });
    while (flipped.load() < 2) std::this_thread::yield();
  }
  CUevent begin = nullptr;
  CUevent end = nullptr;
  check(cuEventCreate(&begin, CU_EVENT_DEFAULT), "cuEventCreate");
  check(cuEventCreate(&end, CU_EVENT_DEFAULT), "cuEventCreate");
  const std::size_t bytes = 64 * kMiB;
  check(cuEventRecord(begin, stream), "cuEventRecord");
  const int flipped_before = flipped.load();
  const auto copies_started = clock_type::now();
  for (int i = 0; i < copies; ++i) {
    const auto host = reinterpret_cast<CUdeviceptr>(target);  // unified addressing
    if (kernel != nullptr) {
      const CUdeviceptr into =
          kernel->on_device ? source + (16 + i % 16) * bytes : host + (i % 16) * bytes;
      kernel->copy(into, source + (i % 16) * bytes, bytes, stream);
      if (back_stream != nullptr) {
        kernel->copy(source + (16 + i % 16) * bytes, host + (16 + i % 16) * bytes, bytes,
                     back_stream);
      }
      continue;
    }
    for (std::size_t offset = 0; offset < bytes; offset += piece) {
      check(cuMemcpyDtoHAsync(static_cast<char*>(target) + (i % 16) * bytes + offset,
                              source + (i % 16) * bytes + offset, piece, stream),
            "cuMemcpyDtoHAsync");
    }
    if (back_stream != nullptr) {  // both directions: the same bytes back, on another stream
      for (std::size_t offset = 0; offset < bytes; offset += piece) {
        check(cuMemcpyHtoDAsync(source + (16 + i % 16) * bytes + offset,
                                static_cast<char*>(target) + (16 + i % 16) * bytes + offset, piece,
                                back_stream),
              "cuMemcpyHtoDAsync");
      }
    }
  }
  if (back_stream != nullptr) {
    CUevent back = nullptr;
    check(cuEventCreate(&back, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    check(cuEventRecord(back, back_stream), "cuEventRecord");
    check(cuStreamWaitEvent(stream, back, 0), "cuStreamWaitEvent");
    cuEventDestroy(back);
  }
  check(cuEventRecord(end, stream), "cuEventRecord");
  check(cuEventSynchronize(end), "cuEventSynchronize");
  const double remap_us = microseconds(copies_started);
  done.store(true);
  if (remapper.joinable()) remapper.join();
  float ms = 0;
  check(cuEventElapsedTime(&ms, begin, end), "cuEventElapsedTime");
  cuEventDestroy(begin);
  cuEventDestroy(end);
  copy_run run;
  run.gbps = static_cast<double>(copies) * static_cast<double>(bytes) / (ms * 1e-3) / 1e9 *
             (back_stream != nullptr ? 2 : 1);
  run.remaps = flipped.load() - flipped_before;
  run.us_per_remap = run.remaps > 0 ? remap_us / run.remaps : 0;
  return run;
}

// Remaps per second when `threads` threads each flip their own 64 MiB chunks of one set
// back and forth on an idle GPU: whether the driver runs remaps of different chunks at once.
double parallel_remaps(remap_set& set, int threads, CUcontext context, int rounds) {
  std::vector<std::thread> workers;
  const std::size_t per_thread = set.on_device.size() / static_cast<std::size_t>(threads);
  const auto start = clock_type::now();
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      cuCtxSetCurrent(context);
      for (int round = 0; round < rounds; ++round) {
        for (std::size_t i = 0; i < per_thread; ++i) {
          double times[3];
          set.flip(static_cast<std::size_t>(t) * per_thread + i, times);
        }
      }
    });
  }
  for (std::thread& worker : workers) worker.join();
  const double seconds = microseconds(start) * 1e-6;
  return static_cast<double>(per_thread * static_cast<std::size_t>(threads) *
                             static_cast<std::size_t>(rounds)) /
         seconds;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t count = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--chunks") == 0) count = std::strtoul(argv[i + 1], nullptr, 10);
    if (std::strcmp(argv[i], "--reserve-gib") == 0) {
      g_reserve_bytes = std::strtoul(argv[i + 1], nullptr, 10) << 30;
    }
  }
  check(cuInit(0), "cuInit");
  CUdevice device = 0;
  check(cuDeviceGet(&device, 0), "cuDeviceGet");
  CUcontext context = nullptr;
  check(cuDevicePrimaryCtxRetain(&context, device), "cuDevicePrimaryCtxRetain");
  check(cuCtxSetCurrent(context), "cuCtxSetCurrent");
  int numa = 0;
  if (cuDeviceGetAttribute(&numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, device) != CUDA_SUCCESS ||
      numa < 0) {
    numa = 0;
  }
  std::printf(
      "per call on an idle GPU, median of %zu chunks x 2 rounds each way (host NUMA "
      "node %d)\n",
      count, numa);
  for (std::size_t mib : {2, 64}) {
    per_call_costs(mib * kMiB, count, CU_MEM_LOCATION_TYPE_HOST_NUMA, numa, "HOST_NUMA");
  }
  per_call_costs(64 * kMiB, count, CU_MEM_LOCATION_TYPE_HOST, 0, "HOST");
  // The migrator's case: each host handle is also mapped at a staging address.
  per_call_costs(64 * kMiB, count, CU_MEM_LOCATION_TYPE_HOST_NUMA, numa, "HOST_NUMA", true);

  {
    remap_set set(64 * kMiB, 16, CU_MEM_LOCATION_TYPE_HOST_NUMA, numa);
    std::printf(
        "\nremaps of 64 MiB chunks at once on an idle GPU (16 chunks, 4 rounds each way)\n");
    const double one = parallel_remaps(set, 1, context, 8);
    for (int threads : {1, 2, 4, 8}) {
      const double rate = threads == 1 ? one : parallel_remaps(set, threads, context, 8);
      std::printf("%d thread(s): %7.0f remaps/s (%.2f x one thread)\n", threads, rate, rate / one);
    }
  }

  CUdeviceptr source = 0;
  void* target = nullptr;
  check(cuMemAlloc(&source, 32 * 64 * kMiB), "cuMemAlloc");
  check(cuMemHostAlloc(&target, 32 * 64 * kMiB, 0), "cuMemHostAlloc");
  CUstream stream = nullptr;
  CUstream back_stream = nullptr;
  check(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  check(cuStreamCreate(&back_stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  copy_while(nullptr, 16, source, target, stream, back_stream, context, 64 * kMiB);  // warm-up
  std::printf(
      "\n64 x 64 MiB copies (device -> host; both: as many host -> device at once), "
      "alone and while another thread remaps chunks\n");
  for (CUstream back : {static_cast<CUstream>(nullptr), back_stream}) {
    const char* direction = back == nullptr ? "to host" : "both";
    for (std::size_t piece_mib : {64, 4}) {
      const std::size_t piece = piece_mib * kMiB;
      const copy_run alone = copy_while(nullptr, 64, source, target, stream, back, context, piece);
      remap_set set(64 * kMiB, count, CU_MEM_LOCATION_TYPE_HOST_NUMA, numa);
      const copy_run remapping = copy_while(&set, 64, source, target, stream, back, context, piece);
      std::printf(
          "%-7s copies of %2zu MiB: alone %6.1f GB/s | while 64 MiB chunks remap: %6.1f GB/s, "
          "%d remaps, %.0f us each\n",
          direction, piece_mib, alone.gbps, remapping.gbps, remapping.remaps,
          remapping.us_per_remap);
    }
  }

#if ZEROALLOC_HAVE_COPY_KERNEL
  CUmodule module = nullptr;
  check(cuModuleLoadData(&module, copy_kernel_fatbin), "cuModuleLoadData(copy kernel)");
  kernel_copier kernel;
  check(cuModuleGetFunction(&kernel.function, module, "zeroalloc_copy_16"), "cuModuleGetFunction");
  int processors = 0;
  check(cuDeviceGetAttribute(&processors, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device),
        "cuDeviceGetAttribute");
  std::printf(
      "\nthe same 64 x 64 MiB copies made by a kernel (blocks of 512 threads; both: one kernel "
      "each way, at once; on device: device memory to device memory), alone and while another "
      "thread remaps chunks\n");
  for (int kind = 0; kind < 3; ++kind) {
    const CUstream back = kind == 1 ? back_stream : nullptr;
    kernel.on_device = kind == 2;
    const char* direction = kind == 0 ? "to host" : kind == 1 ? "both" : "device";
    for (unsigned blocks : {8u, 32u, static_cast<unsigned>(processors)}) {
      kernel.blocks = blocks;
      copy_while(nullptr, 4, source, target, stream, back, context, 64 * kMiB, &kernel);
      const copy_run alone =
          copy_while(nullptr, 64, source, target, stream, back, context, 64 * kMiB, &kernel);
      remap_set set(64 * kMiB, count, CU_MEM_LOCATION_TYPE_HOST_NUMA, numa);
      const copy_run remapping =
          copy_while(&set, 64, source, target, stream, back, context, 64 * kMiB, &kernel);
      std::printf(
          "%-7s kernel, %3u blocks: alone %6.1f GB/s | while 64 MiB chunks remap: %6.1f GB/s, "
          "%d remaps, %.0f us each\n",
          direction, blocks, alone.gbps, remapping.gbps, remapping.remaps, remapping.us_per_remap);
    }
  }
  cuModuleUnload(module);
#else
  std::printf("\ncopies made by a kernel: skipped (built without nvcc)\n");
#endif

  cuStreamDestroy(back_stream);
  cuStreamDestroy(stream);
  cuMemFreeHost(target);
  cuMemFree(source);
  cuDevicePrimaryCtxRelease(device);
  return 0;
}
