// LD_PRELOAD interposers: with `LD_PRELOAD=libzeroalloc.so`, the CUDA runtime's and the
// driver's allocation calls are served by zeroalloc, including where programs and libraries
// fetch the driver's entry points through cuGetProcAddress or cudaGetDriverEntryPoint
// (PyTorch reaches cuMem* that way; cuBLAS and NCCL use cuGetProcAddress).
//
// Note [Hook safety]: a hook never throws (everything below the C ABI is caught), never
// logs, and does not allocate on the lookup path (string compares only). The real functions
// are found once with dlsym(RTLD_NEXT) and cached. Hooks are inert (they forward every call)
// unless the library was preloaded, and when ZEROALLOC_DISABLE=1: the same libzeroalloc.so
// also serves as PyTorch's pluggable allocator, loaded with dlopen, where it must not touch
// the program's own CUDA calls. Calls not served here (the VMM cuMem* family, IPC, managed
// memory) never reach this file: they go to the real driver directly.
#include <dlfcn.h>
#include <strings.h>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "capi/runtime.hpp"
#include "zeroalloc/zeroalloc.h"

#define ZA_HOOK extern "C" __attribute__((visibility("default")))

namespace {

// Result codes, as the runtime (cudaError_t) and the driver (CUresult) define them.
constexpr int kSuccess = 0;
constexpr int kInvalidValue = 1;
constexpr int kOutOfMemory = 2;  // cudaErrorMemoryAllocation and CUDA_ERROR_OUT_OF_MEMORY
constexpr unsigned long long kPerThreadDefaultStream =
    2;  // CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
void* const kPerThreadStream = reinterpret_cast<void*>(0x2);  // CU_STREAM_PER_THREAD

using device_pointer = unsigned long long;  // CUdeviceptr

bool interception_active() {
  static const bool active = [] {
    const char* preload = std::getenv("LD_PRELOAD");
    const char* disable = std::getenv("ZEROALLOC_DISABLE");
    // The same words the options table accepts for a boolean.
    const bool disabled =
        disable != nullptr && (std::strcmp(disable, "1") == 0 || strcasecmp(disable, "true") == 0 ||
                               strcasecmp(disable, "yes") == 0 || strcasecmp(disable, "on") == 0);
    return preload != nullptr && std::strstr(preload, "libzeroalloc") != nullptr && !disabled;
  }();
  return active;
}

// Stands in for a real function that cannot be found (the library was dlopened, so
// RTLD_NEXT sees only its own dependencies): the call fails with an error code instead of
// jumping to null.
template <typename Function>
struct missing_function;
template <typename... Arguments>
struct missing_function<int (*)(Arguments...)> {
  static int call(Arguments...) { return 999; }  // cudaErrorUnknown, CUDA_ERROR_UNKNOWN
};

// The next definition of `name` after this library (the real runtime or driver function).
template <typename Function>
Function real(const char* name, std::atomic<void*>& cache) {
  void* found = cache.load(std::memory_order_acquire);
  if (found == nullptr) {
    found = dlsym(RTLD_NEXT, name);
    if (found == nullptr) found = reinterpret_cast<void*>(&missing_function<Function>::call);
    cache.store(found, std::memory_order_release);
  }
  return reinterpret_cast<Function>(found);
}

#define ZA_REAL(type, name)                   \
  ([]() -> type {                             \
    static std::atomic<void*> cache{nullptr}; \
    return real<type>(#name, cache);          \
  }())

// The device the calling thread works on, as the runtime or the driver sees it.
int runtime_current_device() {
  using get_device = int (*)(int*);
  int device = 0;
  if (auto function = ZA_REAL(get_device, cudaGetDevice);
      function != nullptr && function(&device) == 0) {
    return device;
  }
  return 0;
}

int driver_current_device() {
  using ctx_get_device = int (*)(int*);
  int device = 0;
  if (auto function = ZA_REAL(ctx_get_device, cuCtxGetDevice);
      function != nullptr && function(&device) == 0) {
    return device;
  }
  return runtime_current_device();
}

// The stream zeroalloc keys blocks by. On the simulated device there is no per-thread
// default stream: its streams are the library's own.
void* served_stream(void* stream, bool per_thread) {
  if (stream != nullptr || !per_thread) return stream;
  try {
    return zeroalloc::runtime::get().simulated() ? nullptr : kPerThreadStream;
  } catch (...) {  // the library could not start: the allocation itself will say why
    return kPerThreadStream;
  }
}

int serve_allocation(void** pointer, std::size_t size, int device, void* stream) {
  if (pointer == nullptr) return kInvalidValue;
  if (size == 0) {  // as cudaMalloc(0): success, and a null pointer
    *pointer = nullptr;
    return kSuccess;
  }
  *pointer =
      zeroalloc_malloc(static_cast<ssize_t>(size), device, static_cast<zeroalloc_stream_t>(stream));
  return *pointer != nullptr ? kSuccess : kOutOfMemory;
}

// Frees `pointer` if zeroalloc owns it. A free ordered on another stream than the block's
// own first records that stream, so the block waits for it (Note [Stream-ordered reuse]).
bool serve_free(void* pointer, void* stream, bool ordered_on_stream) {
  try {
    zeroalloc::runtime& started = zeroalloc::runtime::get();
    zeroalloc::caching_allocator* owner = started.owner_of(pointer);
    if (owner == nullptr) return false;
    if (ordered_on_stream) owner->record_stream(pointer, stream);
    return owner->deallocate(pointer);
  } catch (...) {
    return false;
  }
}

int serve_memory_info(std::size_t* free_bytes, std::size_t* total_bytes, int device) {
  try {
    zeroalloc::caching_allocator& allocator = zeroalloc::runtime::get().allocator(device);
    const std::uint64_t limit = allocator.limit_bytes();
    const std::uint64_t held = allocator.held_bytes();
    if (free_bytes != nullptr) *free_bytes = held < limit ? limit - held : 0;
    if (total_bytes != nullptr) *total_bytes = limit;
    return kSuccess;
  } catch (...) {
    return kInvalidValue;
  }
}

}  // namespace

// ---- CUDA runtime -----------------------------------------------------------------------

ZA_HOOK int cudaMalloc(void** pointer, std::size_t size) {
  if (!interception_active())
    return ZA_REAL(int (*)(void**, std::size_t), cudaMalloc)(pointer, size);
  return serve_allocation(pointer, size, runtime_current_device(), nullptr);
}

ZA_HOOK int cudaFree(void* pointer) {
  // cudaFree(NULL) is the idiom that creates the context: always the real one.
  if (!interception_active() || pointer == nullptr || !serve_free(pointer, nullptr, false)) {
    return ZA_REAL(int (*)(void*), cudaFree)(pointer);
  }
  return kSuccess;
}

ZA_HOOK int cudaMallocAsync(void** pointer, std::size_t size, void* stream) {
  if (!interception_active()) {
    return ZA_REAL(int (*)(void**, std::size_t, void*), cudaMallocAsync)(pointer, size, stream);
  }
  return serve_allocation(pointer, size, runtime_current_device(), served_stream(stream, false));
}

ZA_HOOK int cudaMallocAsync_ptsz(void** pointer, std::size_t size, void* stream) {
  if (!interception_active()) {
    return ZA_REAL(int (*)(void**, std::size_t, void*), cudaMallocAsync_ptsz)(pointer, size,
                                                                              stream);
  }
  return serve_allocation(pointer, size, runtime_current_device(), served_stream(stream, true));
}

ZA_HOOK int cudaMallocFromPoolAsync(void** pointer, std::size_t size, void* pool, void* stream) {
  if (!interception_active()) {
    return ZA_REAL(int (*)(void**, std::size_t, void*, void*), cudaMallocFromPoolAsync)(
        pointer, size, pool, stream);
  }
  return serve_allocation(pointer, size, runtime_current_device(), served_stream(stream, false));
}

ZA_HOOK int cudaMallocFromPoolAsync_ptsz(void** pointer, std::size_t size, void* pool,
                                         void* stream) {
  if (!interception_active()) {
    return ZA_REAL(int (*)(void**, std::size_t, void*, void*), cudaMallocFromPoolAsync_ptsz)(
        pointer, size, pool, stream);
  }
  return serve_allocation(pointer, size, runtime_current_device(), served_stream(stream, true));
}

ZA_HOOK int cudaFreeAsync(void* pointer, void* stream) {
  if (!interception_active() || pointer == nullptr ||
      !serve_free(pointer, served_stream(stream, false), true)) {
    return ZA_REAL(int (*)(void*, void*), cudaFreeAsync)(pointer, stream);
  }
  return kSuccess;
}

ZA_HOOK int cudaFreeAsync_ptsz(void* pointer, void* stream) {
  if (!interception_active() || pointer == nullptr ||
      !serve_free(pointer, served_stream(stream, true), true)) {
    return ZA_REAL(int (*)(void*, void*), cudaFreeAsync_ptsz)(pointer, stream);
  }
  return kSuccess;
}

ZA_HOOK int cudaMemGetInfo(std::size_t* free_bytes, std::size_t* total_bytes) {
  if (!interception_active()) {
    return ZA_REAL(int (*)(std::size_t*, std::size_t*), cudaMemGetInfo)(free_bytes, total_bytes);
  }
  return serve_memory_info(free_bytes, total_bytes, runtime_current_device());
}

// ---- CUDA driver ------------------------------------------------------------------------

ZA_HOOK int cuMemAlloc_v2(device_pointer* pointer, std::size_t size) {
  if (!interception_active())
    return ZA_REAL(int (*)(device_pointer*, std::size_t), cuMemAlloc_v2)(pointer, size);
  return serve_allocation(reinterpret_cast<void**>(pointer), size, driver_current_device(),
                          nullptr);
}

ZA_HOOK int cuMemFree_v2(device_pointer pointer) {
  auto* address = reinterpret_cast<void*>(pointer);
  if (!interception_active() || address == nullptr || !serve_free(address, nullptr, false)) {
    return ZA_REAL(int (*)(device_pointer), cuMemFree_v2)(pointer);
  }
  return kSuccess;
}

ZA_HOOK int cuMemAllocAsync(device_pointer* pointer, std::size_t size, void* stream) {
  if (!interception_active()) {
    return ZA_REAL(int (*)(device_pointer*, std::size_t, void*), cuMemAllocAsync)(pointer, size,
                                                                                  stream);
  }
  return serve_allocation(reinterpret_cast<void**>(pointer), size, driver_current_device(),
                          served_stream(stream, false));
}

ZA_HOOK int cuMemAllocAsync_ptsz(device_pointer* pointer, std::size_t size, void* stream) {
  if (!interception_active()) {
    return ZA_REAL(int (*)(device_pointer*, std::size_t, void*), cuMemAllocAsync_ptsz)(
        pointer, size, stream);
  }
  return serve_allocation(reinterpret_cast<void**>(pointer), size, driver_current_device(),
                          served_stream(stream, true));
}

ZA_HOOK int cuMemFreeAsync(device_pointer pointer, void* stream) {
  auto* address = reinterpret_cast<void*>(pointer);
  if (!interception_active() || address == nullptr ||
      !serve_free(address, served_stream(stream, false), true)) {
    return ZA_REAL(int (*)(device_pointer, void*), cuMemFreeAsync)(pointer, stream);
  }
  return kSuccess;
}

ZA_HOOK int cuMemFreeAsync_ptsz(device_pointer pointer, void* stream) {
  auto* address = reinterpret_cast<void*>(pointer);
  if (!interception_active() || address == nullptr ||
      !serve_free(address, served_stream(stream, true), true)) {
    return ZA_REAL(int (*)(device_pointer, void*), cuMemFreeAsync_ptsz)(pointer, stream);
  }
  return kSuccess;
}

ZA_HOOK int cuMemGetInfo_v2(std::size_t* free_bytes, std::size_t* total_bytes) {
  if (!interception_active()) {
    return ZA_REAL(int (*)(std::size_t*, std::size_t*), cuMemGetInfo_v2)(free_bytes, total_bytes);
  }
  return serve_memory_info(free_bytes, total_bytes, driver_current_device());
}

// ---- Entry-point lookups ----------------------------------------------------------------

namespace {

// The hook that serves driver symbol `symbol` (a base name, as cuGetProcAddress takes it),
// or nullptr when zeroalloc does not serve it.
void* served_driver_symbol(const char* symbol, int cuda_version, unsigned long long flags);

}  // namespace

ZA_HOOK int cuGetProcAddress_v2(const char* symbol, void** function, int cuda_version,
                                unsigned long long flags, int* symbol_status) {
  if (interception_active() && symbol != nullptr && function != nullptr) {
    if (void* served = served_driver_symbol(symbol, cuda_version, flags)) {
      *function = served;
      if (symbol_status != nullptr) *symbol_status = 0;  // CU_GET_PROC_ADDRESS_SUCCESS
      return kSuccess;
    }
  }
  return ZA_REAL(int (*)(const char*, void**, int, unsigned long long, int*), cuGetProcAddress_v2)(
      symbol, function, cuda_version, flags, symbol_status);
}

ZA_HOOK int cuGetProcAddress(const char* symbol, void** function, int cuda_version,
                             unsigned long long flags) {
  if (interception_active() && symbol != nullptr && function != nullptr) {
    if (void* served = served_driver_symbol(symbol, cuda_version, flags)) {
      *function = served;
      return kSuccess;
    }
  }
  return ZA_REAL(int (*)(const char*, void**, int, unsigned long long), cuGetProcAddress)(
      symbol, function, cuda_version, flags);
}

namespace {

// cudaGetDriverEntryPoint's flags mean what cuGetProcAddress's do (cudaEnablePerThreadDefaultStream
// == 2).
int lookup_through_runtime(const char* symbol, void** function, int cuda_version,
                           unsigned long long flags, int* status) {
  if (!interception_active() || symbol == nullptr || function == nullptr) return -1;
  void* served = served_driver_symbol(symbol, cuda_version, flags);
  if (served == nullptr) return -1;
  *function = served;
  if (status != nullptr) *status = 0;  // cudaDriverEntryPointSuccess
  return kSuccess;
}

}  // namespace

ZA_HOOK int cudaGetDriverEntryPoint(const char* symbol, void** function, unsigned long long flags,
                                    int* status) {
  if (lookup_through_runtime(symbol, function, 13000, flags, status) == kSuccess) return kSuccess;
  return ZA_REAL(int (*)(const char*, void**, unsigned long long, int*), cudaGetDriverEntryPoint)(
      symbol, function, flags, status);
}

ZA_HOOK int cudaGetDriverEntryPoint_ptsz(const char* symbol, void** function,
                                         unsigned long long flags, int* status) {
  if (lookup_through_runtime(symbol, function, 13000, flags | kPerThreadDefaultStream, status) ==
      kSuccess) {
    return kSuccess;
  }
  return ZA_REAL(int (*)(const char*, void**, unsigned long long, int*),
                 cudaGetDriverEntryPoint_ptsz)(symbol, function, flags, status);
}

ZA_HOOK int cudaGetDriverEntryPointByVersion(const char* symbol, void** function,
                                             unsigned int cuda_version, unsigned long long flags,
                                             int* status) {
  if (lookup_through_runtime(symbol, function, static_cast<int>(cuda_version), flags, status) ==
      kSuccess) {
    return kSuccess;
  }
  return ZA_REAL(int (*)(const char*, void**, unsigned int, unsigned long long, int*),
                 cudaGetDriverEntryPointByVersion)(symbol, function, cuda_version, flags, status);
}

ZA_HOOK int cudaGetDriverEntryPointByVersion_ptsz(const char* symbol, void** function,
                                                  unsigned int cuda_version,
                                                  unsigned long long flags, int* status) {
  if (lookup_through_runtime(symbol, function, static_cast<int>(cuda_version),
                             flags | kPerThreadDefaultStream, status) == kSuccess) {
    return kSuccess;
  }
  return ZA_REAL(int (*)(const char*, void**, unsigned int, unsigned long long, int*),
                 cudaGetDriverEntryPointByVersion_ptsz)(symbol, function, cuda_version, flags,
                                                        status);
}

namespace {

void* served_driver_symbol(const char* symbol, int cuda_version, unsigned long long flags) {
  const bool per_thread = (flags & kPerThreadDefaultStream) != 0;
  // cuMemAlloc, cuMemFree and cuMemGetInfo have had their _v2 ABI since CUDA 3.2.
  if (std::strcmp(symbol, "cuMemAlloc") == 0 && cuda_version >= 3020) {
    return reinterpret_cast<void*>(&cuMemAlloc_v2);
  }
  if (std::strcmp(symbol, "cuMemFree") == 0 && cuda_version >= 3020) {
    return reinterpret_cast<void*>(&cuMemFree_v2);
  }
  if (std::strcmp(symbol, "cuMemGetInfo") == 0 && cuda_version >= 3020) {
    return reinterpret_cast<void*>(&cuMemGetInfo_v2);
  }
  if (std::strcmp(symbol, "cuMemAllocAsync") == 0) {
    return per_thread ? reinterpret_cast<void*>(&cuMemAllocAsync_ptsz)
                      : reinterpret_cast<void*>(&cuMemAllocAsync);
  }
  if (std::strcmp(symbol, "cuMemFreeAsync") == 0) {
    return per_thread ? reinterpret_cast<void*>(&cuMemFreeAsync_ptsz)
                      : reinterpret_cast<void*>(&cuMemFreeAsync);
  }
  // Lookups through a fetched cuGetProcAddress stay intercepted.
  if (std::strcmp(symbol, "cuGetProcAddress") == 0) {
    return cuda_version >= 12000 ? reinterpret_cast<void*>(&cuGetProcAddress_v2)
                                 : reinterpret_cast<void*>(&cuGetProcAddress);
  }
  return nullptr;
}

}  // namespace
