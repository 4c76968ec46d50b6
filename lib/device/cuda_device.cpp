#include "device/cuda_device.hpp"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <mutex>
#include <numeric>

#include "core/errors.hpp"
#include "core/host_memory.hpp"
#include "core/units.hpp"
#include "device/cuda_driver.hpp"

namespace zeroalloc {

namespace {

std::string hex(std::uintptr_t value) {
  char text[2 + 2 * sizeof value] = {'0', 'x'};
  char* end = std::to_chars(text + 2, std::end(text), value, 16).ptr;
  return std::string(text, end);
}

// Throws device_error unless `result` is CUDA_SUCCESS. The message names the GPU besides the
// call, since a process often drives several; it is only built on failure.
void check(CUresult result, const char* call, int ordinal) {
  if (result != CUDA_SUCCESS) [[unlikely]] {
    throw_cuda_error(result, detail::concat(call, " on cuda:", ordinal));
  }
}

// As check, for calls on an address range: the range is what one needs to debug them.
void check_range(CUresult result, const char* call, int ordinal, std::uintptr_t address,
                 std::size_t bytes) {
  if (result != CUDA_SUCCESS) [[unlikely]] {
    throw_cuda_error(result, detail::concat(call, " of ", format_bytes(bytes), " at ", hex(address),
                                            " on cuda:", ordinal));
  }
}

CUstream as_stream(stream_handle stream) { return static_cast<CUstream>(stream); }
CUevent as_event(event_handle event) { return static_cast<CUevent>(event); }
CUdeviceptr as_device_pointer(const void* pointer) {
  return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(pointer));
}

// Pinned (the only VMM allocation type) memory on the GPU itself, on its host NUMA node, or
// (host_numa_node < 0) on any host node.
CUmemAllocationProp allocation_properties(memory_location location, int ordinal,
                                          int host_numa_node) {
  CUmemAllocationProp properties{};
  properties.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  if (location == memory_location::host && host_numa_node < 0) {
    properties.location.type = CU_MEM_LOCATION_TYPE_HOST;
    properties.location.id = 0;  // ignored for HOST
  } else if (location == memory_location::host) {
    properties.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    properties.location.id = host_numa_node;
  } else {
    properties.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    properties.location.id = ordinal;
  }
  return properties;
}

// A device attribute the driver may not know (older than the attribute): `fallback` then.
int attribute_or(const cuda_driver& driver, CUdevice_attribute attribute, CUdevice device,
                 int fallback) {
  int value = fallback;
  if (driver.pfn_cuDeviceGetAttribute(&value, attribute, device) != CUDA_SUCCESS) return fallback;
  return value;
}

// The driver calls this on its own thread when the stream reaches the point; it owns the
// function from then on. noexcept: an exception cannot cross the driver's C frames, and
// terminating matches what an escaping exception does on sim_device's stream thread.
void CUDA_CB run_host_function(void* user_data) noexcept {
  const std::unique_ptr<std::function<void()>> function(
      static_cast<std::function<void()>*>(user_data));
  (*function)();
}

}  // namespace

// Note [Current context]
// Most driver calls act on the calling thread's current context: a stream or event is
// created in it, the null stream is its default stream, cuMemGetInfo reports its GPU. This
// device is called from threads it does not own:
// - PyTorch's threads, where this GPU's primary context is normally current already: one
//   cuCtxGetCurrent, nothing else;
// - bare threads that never touched CUDA (the engine's workers, a Python thread freeing a
//   tensor): nothing is current;
// - with several GPUs, a thread working on another GPU: that GPU's context is current.
// In the last two cases the primary context is pushed for the duration of the call and
// popped after, rather than set and left: the CUDA runtime takes its current device from the
// current context, so leaving ours behind would silently move a thread's later work (a
// PyTorch kernel launch, a cudaMalloc) to this GPU. Push and pop only touch the thread's
// context stack, so a call costs at most two more cheap driver calls.
class cuda_device::context_scope {
 public:
  context_scope(const cuda_driver& driver, CUcontext wanted, int ordinal) {
    CUcontext current = nullptr;
    check(driver.pfn_cuCtxGetCurrent(&current), "cuCtxGetCurrent", ordinal);
    if (current == wanted) return;
    check(driver.pfn_cuCtxPushCurrent(wanted), "cuCtxPushCurrent", ordinal);
    pushed_by_ = &driver;
  }
  ~context_scope() {
    if (pushed_by_ == nullptr) return;
    // Cannot fail after a successful push, and a destructor has no one to tell.
    CUcontext popped = nullptr;
    pushed_by_->pfn_cuCtxPopCurrent(&popped);
  }
  context_scope(const context_scope&) = delete;
  context_scope& operator=(const context_scope&) = delete;

 private:
  const cuda_driver* pushed_by_ = nullptr;  // set when there is a context to pop
};

cuda_device::context_scope cuda_device::enter_context() const {
  return context_scope(driver_, primary_context_, ordinal_);
}

cuda_device::cuda_device(int ordinal) : driver_(cuda_driver_table()), ordinal_(ordinal) {
  const int visible = count();
  if (ordinal < 0 || ordinal >= visible) {
    const char* mask = std::getenv("CUDA_VISIBLE_DEVICES");
    ZA_THROW(invalid_argument, "no CUDA device with ordinal ", ordinal, ": this process sees ",
             visible, " GPU(s) (CUDA_VISIBLE_DEVICES=", mask != nullptr ? mask : "unset", ")");
  }
  check(driver_.pfn_cuDeviceGet(&device_, ordinal), "cuDeviceGet", ordinal);
  char gpu_name[256] = {};
  check(driver_.pfn_cuDeviceGetName(gpu_name, static_cast<int>(sizeof gpu_name), device_),
        "cuDeviceGetName", ordinal);
  gpu_name_ = gpu_name;

  int supports_vmm = 0;
  check(driver_.pfn_cuDeviceGetAttribute(
            &supports_vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device_),
        "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)", ordinal);
  if (supports_vmm == 0) {
    throw device_error(
        detail::concat(name(),
                       " does not support CUDA virtual memory management "
                       "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0), "
                       "which zeroalloc needs to map its chunks"),
        CUDA_ERROR_NOT_SUPPORTED);
  }
  // -1 means the system has no NUMA, and then cuMemCreate wants node 0; a driver older than
  // the attribute (CUDA 12.2) cannot create HOST_NUMA memory anyway.
  pinned_numa_node_ = attribute_or(driver_, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, device_, -1);
  host_numa_node_ = std::max(0, pinned_numa_node_);
  host_allocations_supported_ =
      attribute_or(driver_, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                   device_, 0) != 0;

  // Retained only now, so that the checks above cannot leak a reference; the queries below
  // run with the context current (in case the driver wants one) and release it if they throw.
  CUcontext primary = nullptr;
  check(driver_.pfn_cuDevicePrimaryCtxRetain(&primary, device_), "cuDevicePrimaryCtxRetain",
        ordinal);
  primary_context_ = primary;
  try {
    const auto scope = enter_context();
    const CUmemAllocationProp on_device =
        allocation_properties(memory_location::device, ordinal_, host_numa_node_);
    check(driver_.pfn_cuMemGetAllocationGranularity(&granularity_, &on_device,
                                                    CU_MEM_ALLOC_GRANULARITY_MINIMUM),
          "cuMemGetAllocationGranularity", ordinal);
    if (host_allocations_supported_) {
      // One granularity serves both kinds, so that any handle fits any chunk.
      const CUmemAllocationProp on_host =
          allocation_properties(memory_location::host, ordinal_, host_numa_node_);
      std::size_t host_granularity = 0;
      if (driver_.pfn_cuMemGetAllocationGranularity(
              &host_granularity, &on_host, CU_MEM_ALLOC_GRANULARITY_MINIMUM) == CUDA_SUCCESS &&
          host_granularity != 0) {
        granularity_ = std::lcm(granularity_, host_granularity);
      } else {
        host_allocations_supported_ = false;
      }
    }
  } catch (...) {
    driver_.pfn_cuDevicePrimaryCtxRelease(device_);
    throw;
  }
}

cuda_device::~cuda_device() {
  // Fails only when the driver is already shut down (at process exit), and then there is
  // nothing left to release.
  driver_.pfn_cuDevicePrimaryCtxRelease(device_);
}

int cuda_device::count() {
  int devices = 0;
  ZA_CU(cuDeviceGetCount, &devices);
  return devices;
}

std::string cuda_device::name() const {
  return detail::concat(gpu_name_, " (cuda:", ordinal_, ")");
}

memory_info cuda_device::query_memory() const {
  const auto scope = enter_context();
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  check(driver_.pfn_cuMemGetInfo(&free_bytes, &total_bytes), "cuMemGetInfo", ordinal_);
  return {free_bytes, total_bytes};
}

physical_handle cuda_device::create_physical(std::size_t bytes, memory_location location) {
  const bool on_host = location == memory_location::host;
  if (bytes == 0 || bytes % granularity_ != 0) {
    throw device_error(detail::concat(name(), ": create_physical(", bytes,
                                      " bytes) is not a positive multiple of the ",
                                      format_bytes(granularity_), " granularity"),
                       CUDA_ERROR_INVALID_VALUE);
  }
  if (on_host && !host_allocations_supported_) {
    throw device_error(
        detail::concat(name(), ": the driver (CUDA ", driver_.driver_version / 1000, ".",
                       driver_.driver_version % 1000 / 10,
                       ") cannot create pinned host memory for virtual memory mappings "
                       "(cuMemCreate with HOST_NUMA needs CUDA 12.2 or newer and a GPU that "
                       "supports it), so nothing can be offloaded to host memory"),
        CUDA_ERROR_NOT_SUPPORTED);
  }
  const CUmemAllocationProp properties =
      allocation_properties(location, ordinal_, host_on_any_node_ ? -1 : host_numa_node_);
  const auto scope = enter_context();
  CUmemGenericAllocationHandle handle = 0;
  const CUresult result = driver_.pfn_cuMemCreate(&handle, bytes, &properties, 0);
  if (result != CUDA_SUCCESS) [[unlikely]] {
    const std::string where = on_host ? detail::concat(" pinned host memory on NUMA node ",
                                                       host_numa_node_, " for cuda:", ordinal_)
                                      : detail::concat(" device memory on cuda:", ordinal_);
    throw_cuda_error(result, detail::concat("cuMemCreate of ", format_bytes(bytes), where));
  }
  return {handle, bytes, location};
}

void cuda_device::release_physical(physical_handle handle) {
  const auto scope = enter_context();
  check(driver_.pfn_cuMemRelease(handle.value), "cuMemRelease", ordinal_);
}

std::uintptr_t cuda_device::reserve_addresses(std::size_t bytes, std::size_t alignment) {
  const auto scope = enter_context();
  CUdeviceptr address = 0;
  const CUresult result = driver_.pfn_cuMemAddressReserve(&address, bytes, alignment, 0, 0);
  if (result != CUDA_SUCCESS) [[unlikely]] {
    throw_cuda_error(result,
                     detail::concat("cuMemAddressReserve of ", format_bytes(bytes), " aligned to ",
                                    format_bytes(alignment), " on cuda:", ordinal_));
  }
  return static_cast<std::uintptr_t>(address);
}

void cuda_device::free_addresses(std::uintptr_t address, std::size_t bytes) {
  const auto scope = enter_context();
  check_range(driver_.pfn_cuMemAddressFree(address, bytes), "cuMemAddressFree", ordinal_, address,
              bytes);
}

void cuda_device::map(std::uintptr_t address, physical_handle handle) {
  const auto scope = enter_context();
  check_range(driver_.pfn_cuMemMap(address, handle.bytes, handle.offset, handle.value, 0),
              "cuMemMap", ordinal_, address, handle.bytes);
  // A mapping is inaccessible until access is granted. A host-located handle is granted to
  // the GPU too (location DEVICE): that is what lets a kernel read an offloaded chunk. A
  // placeholder (`inaccessible`) is granted nothing: a kernel touching it faults.
  if (handle.inaccessible) return;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = ordinal_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const CUresult granted = driver_.pfn_cuMemSetAccess(address, handle.bytes, &access, 1);
  if (granted != CUDA_SUCCESS) [[unlikely]] {
    // Leave the range as it was (reserved, unmapped), so the caller loses nothing and can
    // release the handle; the unmap's own result would only hide the real error.
    driver_.pfn_cuMemUnmap(address, handle.bytes);
    check_range(granted, "cuMemSetAccess", ordinal_, address, handle.bytes);
  }
}

bool cuda_device::open_to_host(std::uintptr_t address, std::size_t bytes) {
  const auto scope = enter_context();
  // The CPU is a location of its own: host memory mapped through the driver's virtual memory
  // is reached by the CPU only once granted to the host's NUMA node (or the host as a
  // whole, for memory placed on any node).
  CUmemAccessDesc access{};
  access.location.type =
      host_on_any_node_ ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_HOST_NUMA;
  access.location.id = host_on_any_node_ ? 0 : host_numa_node_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return driver_.pfn_cuMemSetAccess(address, bytes, &access, 1) == CUDA_SUCCESS;
}

void* cuda_device::create_pinned(std::size_t bytes) {
  void* address = map_host_pages(bytes, host_on_any_node_ ? -1 : pinned_numa_node_);
  if (address == nullptr) {
    const int code = errno;
    throw device_error(detail::concat("mapping ", format_bytes(bytes),
                                      " of host memory to pin for cuda:", ordinal_,
                                      " failed: the host refused it (", std::strerror(code), ")"),
                       kDeviceOutOfMemoryCode);
  }
  const auto scope = enter_context();
  const CUresult result =
      driver_.pfn_cuMemHostRegister(address, bytes, CU_MEMHOSTREGISTER_PORTABLE);
  if (result != CUDA_SUCCESS) [[unlikely]] {
    unmap_host_pages(address, bytes);
    throw_cuda_error(result, detail::concat("cuMemHostRegister of ", format_bytes(bytes),
                                            " for cuda:", ordinal_));
  }
  return address;
}

void cuda_device::release_pinned(void* address, std::size_t bytes) {
  {
    const auto scope = enter_context();
    check_range(driver_.pfn_cuMemHostUnregister(address), "cuMemHostUnregister", ordinal_,
                reinterpret_cast<std::uintptr_t>(address), bytes);
  }
  unmap_host_pages(address, bytes);
}

void cuda_device::unmap(std::uintptr_t address, std::size_t bytes) {
  const auto scope = enter_context();
  check_range(driver_.pfn_cuMemUnmap(address, bytes), "cuMemUnmap", ordinal_, address, bytes);
}

stream_handle cuda_device::create_stream() {
  const auto scope = enter_context();
  CUstream stream = nullptr;
  check(driver_.pfn_cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate", ordinal_);
  return stream;
}

void cuda_device::destroy_stream(stream_handle stream) {
  if (stream == nullptr) return;
  const auto scope = enter_context();
  check(driver_.pfn_cuStreamDestroy(as_stream(stream)), "cuStreamDestroy", ordinal_);
}

event_handle cuda_device::create_event() {
  const auto scope = enter_context();
  CUevent event = nullptr;
  check(driver_.pfn_cuEventCreate(&event, CU_EVENT_DISABLE_TIMING), "cuEventCreate", ordinal_);
  return event;
}

bool cuda_device::maps_slices() {
  // Asked once, by trying: map the second granule of a two-granule host allocation.
  static std::once_flag asked;
  static bool answer = false;
  std::call_once(asked, [&] {
    physical_handle whole;
    std::uintptr_t address = 0;
    try {
      whole = create_physical(2 * granularity(), memory_location::host);
      address = reserve_addresses(granularity(), granularity());
      physical_handle slice = whole;
      slice.offset = granularity();
      slice.bytes = granularity();
      map(address, slice);
      unmap(address, granularity());
      answer = true;
    } catch (const device_error&) {
      answer = false;
    }
    try {
      if (address != 0) free_addresses(address, granularity());
      if (whole.valid()) release_physical(whole);
    } catch (const device_error&) {  // nothing to lose: the probe's own memory
    }
  });
  return answer;
}

event_handle cuda_device::create_timing_event() {
  const auto scope = enter_context();
  CUevent event = nullptr;
  check(driver_.pfn_cuEventCreate(&event, CU_EVENT_DEFAULT), "cuEventCreate", ordinal_);
  return event;
}

float cuda_device::elapsed_ms(event_handle start, event_handle end) {
  const auto scope = enter_context();
  float milliseconds = 0;
  check(driver_.pfn_cuEventElapsedTime(&milliseconds, as_event(start), as_event(end)),
        "cuEventElapsedTime", ordinal_);
  return milliseconds;
}

void cuda_device::destroy_event(event_handle event) {
  if (event == nullptr) return;
  const auto scope = enter_context();
  check(driver_.pfn_cuEventDestroy(as_event(event)), "cuEventDestroy", ordinal_);
}

void cuda_device::record_event(event_handle event, stream_handle stream) {
  const auto scope = enter_context();
  check(driver_.pfn_cuEventRecord(as_event(event), as_stream(stream)), "cuEventRecord", ordinal_);
}

bool cuda_device::event_completed(event_handle event) {
  const auto scope = enter_context();
  const CUresult result = driver_.pfn_cuEventQuery(as_event(event));
  if (result == CUDA_SUCCESS) return true;  // also for an event never recorded
  if (result == CUDA_ERROR_NOT_READY) return false;
  throw_cuda_error(result, detail::concat("cuEventQuery on cuda:", ordinal_));
}

void cuda_device::synchronize_event(event_handle event) {
  const auto scope = enter_context();
  check(driver_.pfn_cuEventSynchronize(as_event(event)), "cuEventSynchronize", ordinal_);
}

void cuda_device::stream_wait_event(stream_handle stream, event_handle event) {
  const auto scope = enter_context();
  check(driver_.pfn_cuStreamWaitEvent(as_stream(stream), as_event(event), 0), "cuStreamWaitEvent",
        ordinal_);
}

void cuda_device::synchronize_stream(stream_handle stream) {
  const auto scope = enter_context();
  check(driver_.pfn_cuStreamSynchronize(as_stream(stream)), "cuStreamSynchronize", ordinal_);
}

void cuda_device::synchronize_device() {
  const auto scope = enter_context();
  const CUresult result = driver_.pfn_cuCtxSynchronize();
  if (result == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED ||
      result == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED) [[unlikely]] {
    throw_cuda_error(result, detail::concat("cuCtxSynchronize on cuda:", ordinal_,
                                            " (a stream is capturing a CUDA graph: zeroalloc "
                                            "cannot wait for the device to move memory now)"));
  }
  check(result, "cuCtxSynchronize", ordinal_);
}

bool cuda_device::stream_is_capturing(stream_handle stream) {
  const auto scope = enter_context();
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  const CUresult result = driver_.pfn_cuStreamIsCapturing(as_stream(stream), &status);
  // The legacy default stream while another stream captures in global mode.
  if (result == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) return true;
  // A stream the driver does not know (a program's stale handle under LD_PRELOAD): no
  // capture can be seen on it, and the allocation or hint goes on as without one.
  if (result != CUDA_SUCCESS) return false;
  return status != CU_STREAM_CAPTURE_STATUS_NONE;  // active, or invalidated and not yet ended
}

void cuda_device::copy_async(void* destination, const void* source, std::size_t bytes,
                             stream_handle stream) {
  const auto scope = enter_context();
  const CUresult result = driver_.pfn_cuMemcpyAsync(
      as_device_pointer(destination), as_device_pointer(source), bytes, as_stream(stream));
  if (result != CUDA_SUCCESS) [[unlikely]] {
    throw_cuda_error(result,
                     detail::concat("cuMemcpyAsync of ", format_bytes(bytes), " from ",
                                    hex(as_device_pointer(source)), " to ",
                                    hex(as_device_pointer(destination)), " on cuda:", ordinal_));
  }
}

void cuda_device::fill_async(void* destination, std::uint8_t value, std::size_t bytes,
                             stream_handle stream) {
  const auto scope = enter_context();
  check_range(
      driver_.pfn_cuMemsetD8Async(as_device_pointer(destination), value, bytes, as_stream(stream)),
      "cuMemsetD8Async", ordinal_, as_device_pointer(destination), bytes);
}

void cuda_device::host_function_async(std::function<void()> function, stream_handle stream) {
  ZA_REQUIRE(static_cast<bool>(function), "host_function_async needs a function to run");
  auto owned = std::make_unique<std::function<void()>>(std::move(function));
  const auto scope = enter_context();
  check(driver_.pfn_cuLaunchHostFunc(as_stream(stream), run_host_function, owned.get()),
        "cuLaunchHostFunc", ordinal_);
  owned.release();  // run_host_function owns it now
}

void cuda_device::run_current(const std::function<void()>& work) {
  const auto scope = enter_context();
  work();
}

}  // namespace zeroalloc
