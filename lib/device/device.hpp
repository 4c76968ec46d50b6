// The device interface: exactly what the allocator (and later the offload engine) needs
// from a GPU. Two implementations: cuda_device (the CUDA driver's virtual memory
// management API) and sim_device (host memory with the same semantics, for CI).
//
// Streams and events are opaque handles. For cuda_device a stream is the CUstream (the same
// value as a cudaStream_t, so PyTorch's streams pass straight through) and nullptr is the
// legacy default stream. Every call reports failure by throwing device_error (or
// no_driver_error when there is no driver); none blocks on work queued on streams unless its
// name says synchronize.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace zeroalloc {

/// A stream of the device. nullptr is the default stream.
using stream_handle = void*;
/// An event of the device (never nullptr once created).
using event_handle = void*;

/// Where a physical allocation lives.
enum class memory_location {
  device,  ///< the GPU's own memory
  host,    ///< pinned host memory on the GPU's NUMA node, mappable into the GPU's address space
};

/// A physical memory allocation that can be mapped at reserved addresses, or a slice of one:
/// `bytes` from `offset` (the host pool hands out slices of large pinned allocations).
struct physical_handle {
  std::uint64_t value = 0;  ///< CUmemGenericAllocationHandle, or the sim's handle id
  std::size_t bytes = 0;
  memory_location location = memory_location::device;
  std::size_t offset = 0;  ///< where the slice starts in the allocation; 0 for a whole one
  /// map() maps it with no access: a kernel or copy that touches the range faults instead
  /// of reading bytes (the disk tier's placeholder behind a chunk whose bytes are on disk).
  bool inaccessible = false;
  [[nodiscard]] bool valid() const { return value != 0; }
};

/// Free and total memory of a device, as the driver reports it.
struct memory_info {
  std::uint64_t free_bytes = 0;
  std::uint64_t total_bytes = 0;
};

class device {
 public:
  virtual ~device() = default;

  /// "NVIDIA H200 (cuda:0)", "simulated device 1 (8.00 GiB)".
  [[nodiscard]] virtual std::string name() const = 0;
  /// The device ordinal this object drives.
  [[nodiscard]] virtual int ordinal() const = 0;
  /// True for the simulated device: pointers are then plain host addresses.
  [[nodiscard]] virtual bool is_simulated() const = 0;
  /// Granularity of physical allocations and mappings (2 MiB on current GPUs).
  [[nodiscard]] virtual std::size_t granularity() const = 0;
  [[nodiscard]] virtual memory_info query_memory() const = 0;
  /// The host NUMA node nearest the device, where memory_location::host handles live.
  [[nodiscard]] virtual int host_numa_node() const = 0;
  /// From now on, memory_location::host handles come from any host NUMA node, not only the
  /// one nearest the device: for a host tier larger than that node.
  virtual void place_host_memory_on_any_node() = 0;

  // Physical memory. `bytes` is a multiple of granularity().
  virtual physical_handle create_physical(std::size_t bytes, memory_location location) = 0;
  virtual void release_physical(physical_handle handle) = 0;

  // Virtual address space. Reserved ranges are inaccessible until mapped.
  virtual std::uintptr_t reserve_addresses(std::size_t bytes, std::size_t alignment) = 0;
  virtual void free_addresses(std::uintptr_t address, std::size_t bytes) = 0;
  /// Maps `handle` (its `bytes` from `offset`) at `address` (reserved, unmapped) and grants
  /// the device read-write access to it (none when `handle.inaccessible`). The bytes behind
  /// the address are the handle's.
  virtual void map(std::uintptr_t address, physical_handle handle) = 0;
  /// Grants this process's CPUs read-write access to `bytes` at `address`, a mapping of a
  /// host-located handle (Note [Stepped on the host] in tier/host_step.hpp): the host then
  /// reads and writes the bytes the device sees, at that address. False when the driver
  /// refuses (the mapping stays as it was, reachable from the device only).
  virtual bool open_to_host(std::uintptr_t address, std::size_t bytes) = 0;
  /// True when map() takes slices (a non-zero offset, or fewer bytes than the allocation);
  /// older drivers map only whole allocations.
  [[nodiscard]] virtual bool maps_slices() = 0;
  /// Unmaps `bytes` at `address`; the range stays reserved. Work still queued that touches
  /// the range must have completed: unmap does not order itself against streams.
  virtual void unmap(std::uintptr_t address, std::size_t bytes) = 0;

  /// Page-locked host memory of `bytes` (a multiple of the host's page size) at an address of
  /// its own, outside the reserved ranges: the CPUs read and write it there, and copies on
  /// this device's streams reach it at the link's rate, as they reach cudaHostAlloc's memory.
  /// Its pages lie on host_numa_node() where the host lets them (Note [Pinned buffers made
  /// ahead] in tier/pinned_buffers.hpp).
  virtual void* create_pinned(std::size_t bytes) = 0;
  /// Releases what create_pinned returned. Work still queued that touches it must have
  /// completed.
  virtual void release_pinned(void* address, std::size_t bytes) = 0;

  // Streams and events.
  virtual stream_handle create_stream() = 0;
  virtual void destroy_stream(stream_handle stream) = 0;
  virtual event_handle create_event() = 0;
  virtual void destroy_event(event_handle event) = 0;
  /// Marks the point in `stream` after all work enqueued so far.
  virtual void record_event(event_handle event, stream_handle stream) = 0;
  /// True once the work before the last record_event has completed (or never recorded).
  [[nodiscard]] virtual bool event_completed(event_handle event) = 0;
  virtual void synchronize_event(event_handle event) = 0;
  /// An event that also keeps when its recorded point was reached, for elapsed_ms.
  virtual event_handle create_timing_event() = 0;
  /// Milliseconds from the point `start` recorded to the point `end` recorded; both are
  /// timing events whose recordings have completed.
  [[nodiscard]] virtual float elapsed_ms(event_handle start, event_handle end) = 0;
  /// Work enqueued on `stream` after this call waits for the event's recorded point.
  virtual void stream_wait_event(stream_handle stream, event_handle event) = 0;
  virtual void synchronize_stream(stream_handle stream) = 0;
  /// Waits until the work queued so far on every stream of the device has finished: the
  /// program's streams, other libraries' (NCCL's), CUDA graph replays and the library's own
  /// (cuCtxSynchronize). Note [Moves any kernel may see] in tier/migrator.hpp.
  virtual void synchronize_device() = 0;
  /// True while `stream` captures a CUDA graph, or while another stream's capture forbids
  /// using it (the legacy default stream). The device cannot be waited for then: Note
  /// [Nothing moves while a graph is captured] in alloc/caching_allocator.cpp.
  [[nodiscard]] virtual bool stream_is_capturing(stream_handle stream) = 0;

  // Work on streams.
  /// Copies `bytes` between any two device-accessible or host addresses, in stream order.
  virtual void copy_async(void* destination, const void* source, std::size_t bytes,
                          stream_handle stream) = 0;
  /// Sets `bytes` bytes at `destination` to `value`, in stream order.
  virtual void fill_async(void* destination, std::uint8_t value, std::size_t bytes,
                          stream_handle stream) = 0;
  /// Runs `function` on a host thread once the stream reaches this point; the stream waits
  /// for it to return. It must not call back into the device.
  virtual void host_function_async(std::function<void()> function, stream_handle stream) = 0;
  /// Runs `work` on this thread with the device current, for libraries that take it from
  /// the thread (NCCL, the CUDA runtime); the simulated device just runs it.
  virtual void run_current(const std::function<void()>& work) { work(); }
};

/// The result code that device_error carries when memory ran out (CUDA_ERROR_OUT_OF_MEMORY;
/// the simulated device uses it too).
inline constexpr int kDeviceOutOfMemoryCode = 2;

}  // namespace zeroalloc
