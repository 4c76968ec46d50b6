// One GPU through the CUDA driver's virtual memory management (VMM) API: the device that
// makes "stable addresses, movable bytes" real (lib/README.md). Physical handles come from
// cuMemCreate, on the GPU or as pinned host memory on the GPU's NUMA node (HOST_NUMA), and
// either kind is mapped with cuMemMap at addresses reserved with cuMemAddressReserve, with
// read-write access for the GPU, so a kernel can touch an offloaded chunk over PCIe.
//
// Streams and events are the driver's own CUstream / CUevent, so PyTorch's streams pass
// straight through; nullptr is the legacy default stream of this GPU's primary context.
//
// The object holds no mutable state after construction (the driver is thread-safe), so any
// thread may call it at once, including threads that have never touched CUDA: see
// Note [Current context] in cuda_device.cpp. The driver is reached through
// cuda_driver_table(), never through the symbols the preload hooks interpose. Every failure is
// a device_error naming the driver call, the GPU and the driver's error name and string;
// running out of memory carries kDeviceOutOfMemoryCode.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "device/device.hpp"

// The driver's context type, declared here so that this header does not need <cuda.h>.
struct CUctx_st;

namespace zeroalloc {

struct cuda_driver;

class cuda_device final : public device {
 public:
  /// Drives the GPU with this ordinal (as the process sees it, after CUDA_VISIBLE_DEVICES).
  /// Retains its primary context, the one PyTorch and the CUDA runtime use, so that streams,
  /// events and pointers are shared with them. Throws no_driver_error without a usable
  /// driver, invalid_argument for an ordinal the process cannot see, and device_error for a
  /// GPU without virtual memory management.
  explicit cuda_device(int ordinal);
  /// Releases the primary context reference; handles, mappings, streams and events still
  /// alive belong to the caller and are not freed here.
  ~cuda_device() override;
  cuda_device(const cuda_device&) = delete;
  cuda_device& operator=(const cuda_device&) = delete;

  /// How many GPUs this process can see. Throws no_driver_error without a usable driver.
  [[nodiscard]] static int count();

  /// "NVIDIA H200 (cuda:0)".
  [[nodiscard]] std::string name() const override;
  [[nodiscard]] int ordinal() const override { return ordinal_; }
  [[nodiscard]] bool is_simulated() const override { return false; }
  /// The driver's minimum granularity for device allocations (and for host ones, where
  /// supported; the least common multiple of the two), 2 MiB on H200.
  [[nodiscard]] std::size_t granularity() const override { return granularity_; }
  /// cuMemGetInfo: free and total memory of this GPU, counting every process on it.
  [[nodiscard]] memory_info query_memory() const override;

  /// Device-located handles are GPU memory; host-located ones are pinned memory on the
  /// GPU's host NUMA node (node 0 where the system has no NUMA). Needs the driver to support
  /// HOST_NUMA VMM allocations (CUDA 12.2 or newer) for memory_location::host.
  physical_handle create_physical(std::size_t bytes, memory_location location) override;
  void release_physical(physical_handle handle) override;
  std::uintptr_t reserve_addresses(std::size_t bytes, std::size_t alignment) override;
  void free_addresses(std::uintptr_t address, std::size_t bytes) override;
  /// Maps the handle and grants this GPU read-write access; if granting fails the mapping
  /// is undone, so the range is left reserved and unmapped as before the call.
  void map(std::uintptr_t address, physical_handle handle) override;
  bool open_to_host(std::uintptr_t address, std::size_t bytes) override;
  void unmap(std::uintptr_t address, std::size_t bytes) override;
  /// Anonymous pages on the GPU's NUMA node, registered with the driver (cuMemHostRegister,
  /// portable): copies treat them as cudaHostAlloc's.
  void* create_pinned(std::size_t bytes) override;
  void release_pinned(void* address, std::size_t bytes) override;

  /// A non-blocking stream: it does not wait for, or hold up, the legacy default stream.
  stream_handle create_stream() override;
  /// Ignores nullptr (the default stream cannot be destroyed).
  void destroy_stream(stream_handle stream) override;
  /// Events without timing, the cheapest kind to record and query.
  [[nodiscard]] int host_numa_node() const override { return host_numa_node_; }
  void place_host_memory_on_any_node() override { host_on_any_node_ = true; }
  event_handle create_event() override;
  event_handle create_timing_event() override;
  [[nodiscard]] bool maps_slices() override;
  [[nodiscard]] float elapsed_ms(event_handle start, event_handle end) override;
  void destroy_event(event_handle event) override;
  void record_event(event_handle event, stream_handle stream) override;
  [[nodiscard]] bool event_completed(event_handle event) override;
  void synchronize_event(event_handle event) override;
  void stream_wait_event(stream_handle stream, event_handle event) override;
  void synchronize_stream(stream_handle stream) override;
  void synchronize_device() override;
  bool stream_is_capturing(stream_handle stream) override;

  /// Either side may be device memory, a mapped chunk or host memory (unified addressing).
  void copy_async(void* destination, const void* source, std::size_t bytes,
                  stream_handle stream) override;
  void fill_async(void* destination, std::uint8_t value, std::size_t bytes,
                  stream_handle stream) override;
  /// Runs on a driver thread. An exception escaping `function` terminates the process, as
  /// it does on the simulated device's stream thread.
  void host_function_async(std::function<void()> function, stream_handle stream) override;
  void run_current(const std::function<void()>& work) override;

 private:
  class context_scope;

  /// Makes this GPU's primary context current on the calling thread for the scope's
  /// lifetime, and restores what was current after; see Note [Current context].
  [[nodiscard]] context_scope enter_context() const;

  const cuda_driver& driver_;  // loaded first: no driver, no device
  const int ordinal_;
  int device_ = 0;                       // the CUdevice
  CUctx_st* primary_context_ = nullptr;  // retained by the constructor
  std::size_t granularity_ = 0;
  int host_numa_node_ = 0;
  int pinned_numa_node_ = -1;                  // the driver's answer as it is: -1 when it has none
  std::atomic<bool> host_on_any_node_{false};  // CU_MEM_LOCATION_TYPE_HOST instead of HOST_NUMA //
                                               // where memory_location::host handles live
  bool host_allocations_supported_ = false;    // HOST_NUMA VMM allocations work
  std::string gpu_name_;                       // "NVIDIA H200"
};

}  // namespace zeroalloc
