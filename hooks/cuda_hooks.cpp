// LD_PRELOAD interposers: with `LD_PRELOAD=libzeroalloc.so`, the CUDA runtime's and the
// driver's allocation calls are served by zeroalloc, including where programs and libraries
// fetch the driver's entry points through cuGetProcAddress or cudaGetDriverEntryPoint
// (PyTorch reaches cuMem* that way; cuBLAS and NCCL use cuGetProcAddress) or through dlsym
// on a library's handle (ctypes, Numba, JAX load libcuda so).
//
// A hook is a thin shim over the C ABI (zeroalloc/zeroalloc.h) and reaches zeroalloc through
// it alone: zeroalloc_malloc, zeroalloc_free_if_owned, zeroalloc_memory_info,
// zeroalloc_forget_stream and zeroalloc_last_error_code, so that a fix to one of those
// serves the hooks and every other caller at once.
//
// Note [Hook safety]: a hook never throws (everything below the C ABI is caught), never
// logs (but for failed allocations, which zeroalloc_malloc logs at most once every 10 s:
// Note [Failures in the log] in capi.cpp), and does not allocate on the lookup path (string
// compares only). The real functions are found once and cached: from the real lookup when a program
// fetched the hook through cuGetProcAddress, cudaGetDriverEntryPoint or dlsym (the library may have
// been dlopened with RTLD_LOCAL), else with dlsym(RTLD_NEXT). Hooks are inert (they forward every
// call) unless the library was preloaded, and when ZEROALLOC_DISABLE=1: the same libzeroalloc.so
// also serves as PyTorch's pluggable allocator, loaded with dlopen, where it must not touch
// the program's own CUDA calls. Calls not served (the VMM cuMem* family, IPC, managed
// memory, frees of memory zeroalloc does not own) go to the real functions and are counted
// (core/passthrough.hpp).
#include <dlfcn.h>
#include <strings.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/passthrough.hpp"
#include "zeroalloc/zeroalloc.h"

#define ZA_HOOK extern "C" __attribute__((visibility("default")))

// Every interposed symbol: X(name). Served ones are answered by zeroalloc; pass-through ones
// are counted and forwarded.
// One list each, read across.
// clang-format off
#define ZA_SERVED_SYMBOLS(X)                                                                    \
  X(cudaMalloc) X(cudaFree) X(cudaMallocAsync) X(cudaMallocAsync_ptsz) X(cudaFreeAsync)          \
  X(cudaFreeAsync_ptsz) X(cudaMallocFromPoolAsync) X(cudaMallocFromPoolAsync_ptsz)               \
  X(cudaMemGetInfo) X(cuMemAlloc_v2) X(cuMemFree_v2) X(cuMemAllocAsync) X(cuMemAllocAsync_ptsz)  \
  X(cuMemFreeAsync) X(cuMemFreeAsync_ptsz) X(cuMemGetInfo_v2) X(cuGetProcAddress)                \
  X(cuGetProcAddress_v2) X(cudaGetDriverEntryPoint) X(cudaGetDriverEntryPoint_ptsz)              \
  X(cudaGetDriverEntryPointByVersion) X(cudaGetDriverEntryPointByVersion_ptsz)              \
  X(cudaStreamDestroy) X(cuStreamDestroy_v2)
#define ZA_PASSTHROUGH_SYMBOLS(X)                                                               \
  X(cuMemCreate) X(cuMemRelease) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess)                     \
  X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemAllocManaged) X(cudaMallocManaged)           \
  X(cuIpcGetMemHandle) X(cuIpcOpenMemHandle_v2) X(cuIpcCloseMemHandle) X(cudaIpcGetMemHandle)    \
  X(cudaIpcOpenMemHandle) X(cudaIpcCloseMemHandle)
// clang-format on

namespace {

// Result codes, as the runtime (cudaError_t) and the driver (CUresult) define them.
constexpr int kSuccess = 0;
constexpr int kInvalidValue = 1;
constexpr int kOutOfMemory = 2;  // cudaErrorMemoryAllocation and CUDA_ERROR_OUT_OF_MEMORY
constexpr int kUnknown = 999;    // cudaErrorUnknown and CUDA_ERROR_UNKNOWN
constexpr unsigned long long kPerThreadDefaultStream =
    2;  // CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
void* const kLegacyStream = reinterpret_cast<void*>(0x1);     // CU_STREAM_LEGACY
void* const kPerThreadStream = reinterpret_cast<void*>(0x2);  // CU_STREAM_PER_THREAD

using device_pointer = unsigned long long;  // CUdeviceptr
using vmm_handle = unsigned long long;      // CUmemGenericAllocationHandle
struct ipc_handle {                         // CUipcMemHandle and cudaIpcMemHandle_t
  char reserved[64];
};

// The real definition of each interposed symbol, once known.
namespace real_of {
#define ZA_DECLARE_CACHE(name) std::atomic<void*> name{nullptr};
ZA_SERVED_SYMBOLS(ZA_DECLARE_CACHE)
ZA_PASSTHROUGH_SYMBOLS(ZA_DECLARE_CACHE)
#undef ZA_DECLARE_CACHE
}  // namespace real_of

bool interception_active() {
  static const bool active = [] {
    const char* preload = std::getenv("LD_PRELOAD");
    const char* disable = std::getenv("ZEROALLOC_DISABLE");
    // The same words the options table accepts for a boolean, with the spaces around them
    // trimmed as it trims them (no allocation: this runs inside the first intercepted call).
    char word[8] = {};
    if (disable != nullptr) {
      while (std::isspace(static_cast<unsigned char>(*disable))) ++disable;
      std::size_t length = std::strlen(disable);
      while (length > 0 && std::isspace(static_cast<unsigned char>(disable[length - 1]))) --length;
      if (length < sizeof(word)) std::memcpy(word, disable, length);
    }
    const bool disabled = std::strcmp(word, "1") == 0 || strcasecmp(word, "true") == 0 ||
                          strcasecmp(word, "yes") == 0 || strcasecmp(word, "on") == 0;
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

using dlsym_function = void* (*)(void*, const char*);

}  // namespace

// glibc's dlsym, found once; the dlsym trampoline below jumps to it.
extern "C" {
__attribute__((visibility("hidden"))) void* zeroalloc_real_dlsym = nullptr;
}

namespace {

dlsym_function real_dlsym() {
  void* known = __atomic_load_n(&zeroalloc_real_dlsym, __ATOMIC_ACQUIRE);
  if (known == nullptr) {
    // The next dlsym after this library: glibc's (2.34 moved it into libc), or another
    // interposer's, which then sees our lookups as it would see any library's.
    known = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (known == nullptr) known = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    if (known == nullptr) {
      static const char message[] =
          "zeroalloc: glibc's dlsym was not found; LD_PRELOAD=libzeroalloc.so needs glibc\n";
      [[maybe_unused]] const auto written = ::write(2, message, sizeof message - 1);
      std::abort();
    }
    __atomic_store_n(&zeroalloc_real_dlsym, known, __ATOMIC_RELEASE);
  }
  return reinterpret_cast<dlsym_function>(known);
}

// The real definition of `name`: the one a lookup stashed, else the next after this library.
template <typename Function>
Function real(const char* name, std::atomic<void*>& cache) {
  void* found = cache.load(std::memory_order_acquire);
  if (found == nullptr) {
    found = real_dlsym()(RTLD_NEXT, name);
    if (found == nullptr) found = reinterpret_cast<void*>(&missing_function<Function>::call);
    cache.store(found, std::memory_order_release);
  }
  return reinterpret_cast<Function>(found);
}

// The real function behind an interposed symbol.
#define ZA_REAL(type, name) real<type>(#name, real_of::name)

// The real function behind a symbol that is not interposed.
#define ZA_REAL_UNHOOKED(type, name)          \
  ([]() -> type {                             \
    static std::atomic<void*> cache{nullptr}; \
    return real<type>(#name, cache);          \
  }())

// The device the calling thread works on, as the runtime or the driver sees it.
int runtime_current_device() {
  using get_device = int (*)(int*);
  int device = 0;
  if (auto function = ZA_REAL_UNHOOKED(get_device, cudaGetDevice);
      function != nullptr && function(&device) == 0) {
    return device;
  }
  return 0;
}

int driver_current_device() {
  using ctx_get_device = int (*)(int*);
  int device = 0;
  if (auto function = ZA_REAL_UNHOOKED(ctx_get_device, cuCtxGetDevice);
      function != nullptr && function(&device) == 0) {
    return device;
  }
  return runtime_current_device();
}

// The stream a call names: a stream-ordered call of the per-thread default stream ABI (the
// _ptsz variants) means cudaStreamPerThread by NULL. The C ABI takes CUDA's special handles
// as they are (on the simulated device they stand for its default stream).
zeroalloc_stream_t named_stream(void* stream, bool per_thread) {
  return static_cast<zeroalloc_stream_t>(stream == nullptr && per_thread ? kPerThreadStream
                                                                         : stream);
}

// Serves an allocation hook. Fails as CUDA does: out of memory with
// cudaErrorMemoryAllocation (CUDA_ERROR_OUT_OF_MEMORY), a library that could not start (a
// malformed variable) with cudaErrorInitializationError, a bad device with
// cudaErrorInvalidDevice: the numbers agree between the runtime and the driver
// (zeroalloc_last_error_code). `driver` (cuMemAlloc): a zero size is
// CUDA_ERROR_INVALID_VALUE, as cuMemAlloc says; cudaMalloc(0) succeeds with a null pointer,
// and so do the stream-ordered calls here.
int serve_allocation(void** pointer, std::size_t size, int device, zeroalloc_stream_t stream,
                     bool driver = false) {
  if (pointer == nullptr) return kInvalidValue;
  *pointer = nullptr;
  if (size == 0) return driver ? kInvalidValue : kSuccess;
  if (size > static_cast<std::size_t>(SSIZE_MAX)) return kOutOfMemory;
  *pointer = zeroalloc_malloc(static_cast<ssize_t>(size), device, stream);
  if (*pointer != nullptr) return kSuccess;
  const int code = zeroalloc_last_error_code();
  return code != 0 ? code : kOutOfMemory;
}

// Frees `pointer` if zeroalloc owns it (zeroalloc_free_if_owned). A free ordered on no
// stream (cudaFree, cuMemFree) passes `synchronize`, the real cudaDeviceSynchronize or
// cuCtxSynchronize: zeroalloc first waits for the device with it, as those frees do, and
// programs rely on it (work on any stream may still use the memory, which the next
// allocation on the legacy stream would otherwise get at once). A free ordered on a stream
// (cudaFreeAsync, cuMemFreeAsync) passes none, and the block waits for that stream.
// Returns kNotOurs for memory zeroalloc does not own (the real function frees it), else the
// result: success, cudaErrorInvalidValue for a pointer into zeroalloc's memory that is not
// a live allocation (freed twice, or inside one), as CUDA answers; a failing device's
// error as cudaErrorUnknown (the block stays allocated: nothing else may free it).
constexpr int kNotOurs = -1;
int serve_free(void* pointer, zeroalloc_stream_t stream, int (*synchronize)() = nullptr) {
  switch (zeroalloc_free_if_owned(pointer, stream, synchronize)) {
    case ZEROALLOC_FREED:
      return kSuccess;
    case ZEROALLOC_NOT_OWNED:
      return kNotOurs;
    default:
      return zeroalloc_last_error_code() == kInvalidValue ? kInvalidValue : kUnknown;
  }
}

// Note [Destroyed streams]: blocks freed on a stream stay tagged with it, and their next
// use on another stream records a fence on it. Once the program destroys the stream, that
// record fails (the allocation with it), and a new stream that gets the same handle back
// would reuse the blocks without waiting for the old stream's last work. So before the
// real call, zeroalloc_forget_stream makes every allocator that knows the stream wait for
// its work and detach its blocks; a stream zeroalloc never saw costs nothing, and nothing
// is started for it. A failing device's error is left to the real call to report.
void forget_destroyed_stream(void* stream) {
  zeroalloc_forget_stream(static_cast<zeroalloc_stream_t>(stream));
}

// The limit in force and what is left under it (zeroalloc_memory_info); any failure is
// cudaErrorInvalidValue (CUDA_ERROR_INVALID_VALUE).
int serve_memory_info(std::size_t* free_bytes, std::size_t* total_bytes, int device) {
  std::uint64_t free_left = 0;
  std::uint64_t limit = 0;
  if (zeroalloc_memory_info(device, free_bytes != nullptr ? &free_left : nullptr, &limit) != 0) {
    return kInvalidValue;
  }
  if (free_bytes != nullptr) *free_bytes = static_cast<std::size_t>(free_left);
  if (total_bytes != nullptr) *total_bytes = static_cast<std::size_t>(limit);
  return kSuccess;
}

}  // namespace

// ---- CUDA runtime -----------------------------------------------------------------------

ZA_HOOK int cudaMalloc(void** pointer, std::size_t size) {
  if (!interception_active())
    return ZA_REAL(int (*)(void**, std::size_t), cudaMalloc)(pointer, size);
  return serve_allocation(pointer, size, runtime_current_device(), nullptr);
}

ZA_HOOK int cudaFree(void* pointer) {
  // cudaFree(NULL) is the idiom that creates the context: it always reaches the real one.
  if (interception_active() && pointer != nullptr) {
    const int served =
        serve_free(pointer, nullptr, ZA_REAL_UNHOOKED(int (*)(), cudaDeviceSynchronize));
    if (served != kNotOurs) return served;
    zeroalloc::count_passthrough(zeroalloc::passthrough_call::cuda_free_not_owned);
  }
  return ZA_REAL(int (*)(void*), cudaFree)(pointer);
}

ZA_HOOK int cudaMallocAsync(void** pointer, std::size_t size, void* stream) {
  if (!interception_active()) {
    return ZA_REAL(int (*)(void**, std::size_t, void*), cudaMallocAsync)(pointer, size, stream);
  }
  return serve_allocation(pointer, size, runtime_current_device(), named_stream(stream, false));
}

ZA_HOOK int cudaMallocAsync_ptsz(void** pointer, std::size_t size, void* stream) {
  if (!interception_active()) {
    return ZA_REAL(int (*)(void**, std::size_t, void*), cudaMallocAsync_ptsz)(pointer, size,
                                                                              stream);
  }
  return serve_allocation(pointer, size, runtime_current_device(), named_stream(stream, true));
}

ZA_HOOK int cudaMallocFromPoolAsync(void** pointer, std::size_t size, void* pool, void* stream) {
  if (!interception_active()) {
    return ZA_REAL(int (*)(void**, std::size_t, void*, void*), cudaMallocFromPoolAsync)(
        pointer, size, pool, stream);
  }
  return serve_allocation(pointer, size, runtime_current_device(), named_stream(stream, false));
}

ZA_HOOK int cudaMallocFromPoolAsync_ptsz(void** pointer, std::size_t size, void* pool,
                                         void* stream) {
  if (!interception_active()) {
    return ZA_REAL(int (*)(void**, std::size_t, void*, void*), cudaMallocFromPoolAsync_ptsz)(
        pointer, size, pool, stream);
  }
  return serve_allocation(pointer, size, runtime_current_device(), named_stream(stream, true));
}

ZA_HOOK int cudaFreeAsync(void* pointer, void* stream) {
  if (interception_active() && pointer != nullptr) {
    const int served = serve_free(pointer, named_stream(stream, false));
    if (served != kNotOurs) return served;
    zeroalloc::count_passthrough(zeroalloc::passthrough_call::cuda_free_not_owned);
  }
  return ZA_REAL(int (*)(void*, void*), cudaFreeAsync)(pointer, stream);
}

ZA_HOOK int cudaFreeAsync_ptsz(void* pointer, void* stream) {
  if (interception_active() && pointer != nullptr) {
    const int served = serve_free(pointer, named_stream(stream, true));
    if (served != kNotOurs) return served;
    zeroalloc::count_passthrough(zeroalloc::passthrough_call::cuda_free_not_owned);
  }
  return ZA_REAL(int (*)(void*, void*), cudaFreeAsync_ptsz)(pointer, stream);
}

ZA_HOOK int cudaMemGetInfo(std::size_t* free_bytes, std::size_t* total_bytes) {
  if (!interception_active()) {
    return ZA_REAL(int (*)(std::size_t*, std::size_t*), cudaMemGetInfo)(free_bytes, total_bytes);
  }
  return serve_memory_info(free_bytes, total_bytes, runtime_current_device());
}

ZA_HOOK int cudaStreamDestroy(void* stream) {
  if (interception_active()) forget_destroyed_stream(stream);  // Note [Destroyed streams]
  return ZA_REAL(int (*)(void*), cudaStreamDestroy)(stream);
}

// ---- CUDA driver ------------------------------------------------------------------------

ZA_HOOK int cuMemAlloc_v2(device_pointer* pointer, std::size_t size) {
  if (!interception_active())
    return ZA_REAL(int (*)(device_pointer*, std::size_t), cuMemAlloc_v2)(pointer, size);
  return serve_allocation(reinterpret_cast<void**>(pointer), size, driver_current_device(), nullptr,
                          /*driver=*/true);
}

ZA_HOOK int cuMemFree_v2(device_pointer pointer) {
  auto* address = reinterpret_cast<void*>(pointer);
  if (interception_active() && address != nullptr) {
    const int served = serve_free(address, nullptr, ZA_REAL_UNHOOKED(int (*)(), cuCtxSynchronize));
    if (served != kNotOurs) return served;
    zeroalloc::count_passthrough(zeroalloc::passthrough_call::cu_mem_free_not_owned);
  }
  return ZA_REAL(int (*)(device_pointer), cuMemFree_v2)(pointer);
}

ZA_HOOK int cuMemAllocAsync(device_pointer* pointer, std::size_t size, void* stream) {
  if (!interception_active()) {
    return ZA_REAL(int (*)(device_pointer*, std::size_t, void*), cuMemAllocAsync)(pointer, size,
                                                                                  stream);
  }
  return serve_allocation(reinterpret_cast<void**>(pointer), size, driver_current_device(),
                          named_stream(stream, false));
}

ZA_HOOK int cuMemAllocAsync_ptsz(device_pointer* pointer, std::size_t size, void* stream) {
  if (!interception_active()) {
    return ZA_REAL(int (*)(device_pointer*, std::size_t, void*), cuMemAllocAsync_ptsz)(
        pointer, size, stream);
  }
  return serve_allocation(reinterpret_cast<void**>(pointer), size, driver_current_device(),
                          named_stream(stream, true));
}

ZA_HOOK int cuMemFreeAsync(device_pointer pointer, void* stream) {
  auto* address = reinterpret_cast<void*>(pointer);
  if (interception_active() && address != nullptr) {
    const int served = serve_free(address, named_stream(stream, false));
    if (served != kNotOurs) return served;
    zeroalloc::count_passthrough(zeroalloc::passthrough_call::cu_mem_free_not_owned);
  }
  return ZA_REAL(int (*)(device_pointer, void*), cuMemFreeAsync)(pointer, stream);
}

ZA_HOOK int cuMemFreeAsync_ptsz(device_pointer pointer, void* stream) {
  auto* address = reinterpret_cast<void*>(pointer);
  if (interception_active() && address != nullptr) {
    const int served = serve_free(address, named_stream(stream, true));
    if (served != kNotOurs) return served;
    zeroalloc::count_passthrough(zeroalloc::passthrough_call::cu_mem_free_not_owned);
  }
  return ZA_REAL(int (*)(device_pointer, void*), cuMemFreeAsync_ptsz)(pointer, stream);
}

ZA_HOOK int cuMemGetInfo_v2(std::size_t* free_bytes, std::size_t* total_bytes) {
  if (!interception_active()) {
    return ZA_REAL(int (*)(std::size_t*, std::size_t*), cuMemGetInfo_v2)(free_bytes, total_bytes);
  }
  return serve_memory_info(free_bytes, total_bytes, driver_current_device());
}

ZA_HOOK int cuStreamDestroy_v2(void* stream) {
  if (interception_active()) forget_destroyed_stream(stream);  // Note [Destroyed streams]
  return ZA_REAL(int (*)(void*), cuStreamDestroy_v2)(stream);
}

// ---- Calls passed through, counted --------------------------------------------------------

namespace {

// Counts the call and forwards it to the real function.
#define ZA_PASS_THROUGH(type, name, call, bytes, ...)                           \
  do {                                                                          \
    if (interception_active()) {                                                \
      zeroalloc::count_passthrough(zeroalloc::passthrough_call::call, (bytes)); \
    }                                                                           \
    return ZA_REAL(type, name)(__VA_ARGS__);                                    \
  } while (false)

}  // namespace

ZA_HOOK int cuMemCreate(vmm_handle* handle, std::size_t size, const void* properties,
                        unsigned long long flags) {
  ZA_PASS_THROUGH(int (*)(vmm_handle*, std::size_t, const void*, unsigned long long), cuMemCreate,
                  cu_mem_create, size, handle, size, properties, flags);
}

ZA_HOOK int cuMemRelease(vmm_handle handle) {
  ZA_PASS_THROUGH(int (*)(vmm_handle), cuMemRelease, cu_mem_release, 0, handle);
}

ZA_HOOK int cuMemMap(device_pointer address, std::size_t size, std::size_t offset,
                     vmm_handle handle, unsigned long long flags) {
  ZA_PASS_THROUGH(int (*)(device_pointer, std::size_t, std::size_t, vmm_handle, unsigned long long),
                  cuMemMap, cu_mem_map, size, address, size, offset, handle, flags);
}

ZA_HOOK int cuMemUnmap(device_pointer address, std::size_t size) {
  ZA_PASS_THROUGH(int (*)(device_pointer, std::size_t), cuMemUnmap, cu_mem_unmap, size, address,
                  size);
}

ZA_HOOK int cuMemSetAccess(device_pointer address, std::size_t size, const void* descriptors,
                           std::size_t count) {
  ZA_PASS_THROUGH(int (*)(device_pointer, std::size_t, const void*, std::size_t), cuMemSetAccess,
                  cu_mem_set_access, size, address, size, descriptors, count);
}

ZA_HOOK int cuMemAddressReserve(device_pointer* address, std::size_t size, std::size_t alignment,
                                device_pointer wanted, unsigned long long flags) {
  ZA_PASS_THROUGH(
      int (*)(device_pointer*, std::size_t, std::size_t, device_pointer, unsigned long long),
      cuMemAddressReserve, cu_mem_address_reserve, size, address, size, alignment, wanted, flags);
}

ZA_HOOK int cuMemAddressFree(device_pointer address, std::size_t size) {
  ZA_PASS_THROUGH(int (*)(device_pointer, std::size_t), cuMemAddressFree, cu_mem_address_free, size,
                  address, size);
}

ZA_HOOK int cuMemAllocManaged(device_pointer* address, std::size_t size, unsigned int flags) {
  ZA_PASS_THROUGH(int (*)(device_pointer*, std::size_t, unsigned int), cuMemAllocManaged,
                  cu_mem_alloc_managed, size, address, size, flags);
}

ZA_HOOK int cudaMallocManaged(void** address, std::size_t size, unsigned int flags) {
  ZA_PASS_THROUGH(int (*)(void**, std::size_t, unsigned int), cudaMallocManaged,
                  cuda_malloc_managed, size, address, size, flags);
}

ZA_HOOK int cuIpcGetMemHandle(ipc_handle* handle, device_pointer address) {
  ZA_PASS_THROUGH(int (*)(ipc_handle*, device_pointer), cuIpcGetMemHandle, cu_ipc_get_mem_handle, 0,
                  handle, address);
}

ZA_HOOK int cuIpcOpenMemHandle_v2(device_pointer* address, ipc_handle handle, unsigned int flags) {
  ZA_PASS_THROUGH(int (*)(device_pointer*, ipc_handle, unsigned int), cuIpcOpenMemHandle_v2,
                  cu_ipc_open_mem_handle, 0, address, handle, flags);
}

ZA_HOOK int cuIpcCloseMemHandle(device_pointer address) {
  ZA_PASS_THROUGH(int (*)(device_pointer), cuIpcCloseMemHandle, cu_ipc_close_mem_handle, 0,
                  address);
}

ZA_HOOK int cudaIpcGetMemHandle(ipc_handle* handle, void* address) {
  ZA_PASS_THROUGH(int (*)(ipc_handle*, void*), cudaIpcGetMemHandle, cuda_ipc_get_mem_handle, 0,
                  handle, address);
}

ZA_HOOK int cudaIpcOpenMemHandle(void** address, ipc_handle handle, unsigned int flags) {
  ZA_PASS_THROUGH(int (*)(void**, ipc_handle, unsigned int), cudaIpcOpenMemHandle,
                  cuda_ipc_open_mem_handle, 0, address, handle, flags);
}

ZA_HOOK int cudaIpcCloseMemHandle(void* address) {
  ZA_PASS_THROUGH(int (*)(void*), cudaIpcCloseMemHandle, cuda_ipc_close_mem_handle, 0, address);
}

// ---- Entry-point lookups ----------------------------------------------------------------

namespace {

// A symbol zeroalloc interposes: the hook that stands in for it, and where the real
// function is kept.
struct interposed_symbol {
  const char* name;
  void* hook;
  std::atomic<void*>* real;
  bool served;  // answered by zeroalloc; otherwise counted and passed through
};

// The hook for driver symbol `symbol` (a base name, as cuGetProcAddress takes it), in the
// ABI that `cuda_version` and the per-thread-stream flag select; nullptr when zeroalloc
// neither serves nor counts it.
const interposed_symbol* interposed_driver_symbol(const char* symbol, int cuda_version,
                                                  unsigned long long flags);

// Takes the real function a lookup found for `symbol` and gives the caller zeroalloc's hook
// instead. `found` says whether the real lookup succeeded; served symbols are answered
// even when it did not (the simulated device needs no driver).
bool substitute_hook(const char* symbol, void** function, int cuda_version,
                     unsigned long long flags, bool found) {
  if (!interception_active() || symbol == nullptr || function == nullptr) return false;
  const interposed_symbol* hook = interposed_driver_symbol(symbol, cuda_version, flags);
  if (hook == nullptr) return false;
  if (found && *function != nullptr && *function != hook->hook) {
    hook->real->store(*function, std::memory_order_release);
  }
  if (!found && !hook->served) return false;
  *function = hook->hook;
  return true;
}

}  // namespace

ZA_HOOK int cuGetProcAddress_v2(const char* symbol, void** function, int cuda_version,
                                unsigned long long flags, int* symbol_status) {
  const int result =
      ZA_REAL(int (*)(const char*, void**, int, unsigned long long, int*), cuGetProcAddress_v2)(
          symbol, function, cuda_version, flags, symbol_status);
  if (substitute_hook(symbol, function, cuda_version, flags, result == kSuccess)) {
    if (symbol_status != nullptr) *symbol_status = 0;  // CU_GET_PROC_ADDRESS_SUCCESS
    return kSuccess;
  }
  return result;
}

ZA_HOOK int cuGetProcAddress(const char* symbol, void** function, int cuda_version,
                             unsigned long long flags) {
  const int result = ZA_REAL(int (*)(const char*, void**, int, unsigned long long),
                             cuGetProcAddress)(symbol, function, cuda_version, flags);
  if (substitute_hook(symbol, function, cuda_version, flags, result == kSuccess)) return kSuccess;
  return result;
}

// cudaGetDriverEntryPoint's flags mean what cuGetProcAddress's do (cudaEnablePerThreadDefaultStream
// == 2); without a version it looks up the ABI of the runtime it comes with.
namespace {

int runtime_version() {
  using get_version = int (*)(int*);
  int version = 0;
  auto function = ZA_REAL_UNHOOKED(get_version, cudaRuntimeGetVersion);
  return function(&version) == kSuccess && version > 0 ? version : 13000;
}

}  // namespace

ZA_HOOK int cudaGetDriverEntryPoint(const char* symbol, void** function, unsigned long long flags,
                                    int* status) {
  const int result = ZA_REAL(int (*)(const char*, void**, unsigned long long, int*),
                             cudaGetDriverEntryPoint)(symbol, function, flags, status);
  if (substitute_hook(symbol, function, runtime_version(), flags, result == kSuccess)) {
    if (status != nullptr) *status = 0;  // cudaDriverEntryPointSuccess
    return kSuccess;
  }
  return result;
}

ZA_HOOK int cudaGetDriverEntryPoint_ptsz(const char* symbol, void** function,
                                         unsigned long long flags, int* status) {
  const int result = ZA_REAL(int (*)(const char*, void**, unsigned long long, int*),
                             cudaGetDriverEntryPoint_ptsz)(symbol, function, flags, status);
  if (substitute_hook(symbol, function, runtime_version(), flags | kPerThreadDefaultStream,
                      result == kSuccess)) {
    if (status != nullptr) *status = 0;
    return kSuccess;
  }
  return result;
}

ZA_HOOK int cudaGetDriverEntryPointByVersion(const char* symbol, void** function,
                                             unsigned int cuda_version, unsigned long long flags,
                                             int* status) {
  const int result =
      ZA_REAL(int (*)(const char*, void**, unsigned int, unsigned long long, int*),
              cudaGetDriverEntryPointByVersion)(symbol, function, cuda_version, flags, status);
  if (substitute_hook(symbol, function, static_cast<int>(cuda_version), flags,
                      result == kSuccess)) {
    if (status != nullptr) *status = 0;
    return kSuccess;
  }
  return result;
}

ZA_HOOK int cudaGetDriverEntryPointByVersion_ptsz(const char* symbol, void** function,
                                                  unsigned int cuda_version,
                                                  unsigned long long flags, int* status) {
  const int result =
      ZA_REAL(int (*)(const char*, void**, unsigned int, unsigned long long, int*),
              cudaGetDriverEntryPointByVersion_ptsz)(symbol, function, cuda_version, flags, status);
  if (substitute_hook(symbol, function, static_cast<int>(cuda_version),
                      flags | kPerThreadDefaultStream, result == kSuccess)) {
    if (status != nullptr) *status = 0;
    return kSuccess;
  }
  return result;
}

namespace {

// Every interposed symbol by its exported name, for dlsym.
#define ZA_SERVED_ENTRY(name) \
  interposed_symbol{#name, reinterpret_cast<void*>(&::name), &real_of::name, true},
#define ZA_PASSTHROUGH_ENTRY(name) \
  interposed_symbol{#name, reinterpret_cast<void*>(&::name), &real_of::name, false},
const interposed_symbol kInterposed[] = {ZA_SERVED_SYMBOLS(ZA_SERVED_ENTRY)
                                             ZA_PASSTHROUGH_SYMBOLS(ZA_PASSTHROUGH_ENTRY)};
#undef ZA_SERVED_ENTRY
#undef ZA_PASSTHROUGH_ENTRY

const interposed_symbol* by_name(const char* name) {
  for (const interposed_symbol& each : kInterposed) {
    if (std::strcmp(each.name, name) == 0) return &each;
  }
  return nullptr;
}

const interposed_symbol* interposed_driver_symbol(const char* symbol, int cuda_version,
                                                  unsigned long long flags) {
  const bool per_thread = (flags & kPerThreadDefaultStream) != 0;
  // cuMemAlloc, cuMemFree and cuMemGetInfo have had their _v2 ABI since CUDA 3.2; the
  // cuIpcOpenMemHandle we count is the _v2 of CUDA 11.
  struct versioned {
    const char* base;
    int since;
    const char* exported;
    const char* exported_per_thread;
  };
  static constexpr versioned kDriverSymbols[] = {
      {"cuMemAlloc", 3020, "cuMemAlloc_v2", nullptr},
      {"cuMemFree", 3020, "cuMemFree_v2", nullptr},
      {"cuMemGetInfo", 3020, "cuMemGetInfo_v2", nullptr},
      {"cuMemAllocAsync", 0, "cuMemAllocAsync", "cuMemAllocAsync_ptsz"},
      {"cuMemFreeAsync", 0, "cuMemFreeAsync", "cuMemFreeAsync_ptsz"},
      {"cuStreamDestroy", 4000, "cuStreamDestroy_v2", nullptr},
      // Lookups through a fetched cuGetProcAddress stay intercepted.
      {"cuGetProcAddress", 12000, "cuGetProcAddress_v2", nullptr},
      {"cuGetProcAddress", 0, "cuGetProcAddress", nullptr},
      {"cuMemCreate", 0, "cuMemCreate", nullptr},
      {"cuMemRelease", 0, "cuMemRelease", nullptr},
      {"cuMemMap", 0, "cuMemMap", nullptr},
      {"cuMemUnmap", 0, "cuMemUnmap", nullptr},
      {"cuMemSetAccess", 0, "cuMemSetAccess", nullptr},
      {"cuMemAddressReserve", 0, "cuMemAddressReserve", nullptr},
      {"cuMemAddressFree", 0, "cuMemAddressFree", nullptr},
      {"cuMemAllocManaged", 0, "cuMemAllocManaged", nullptr},
      {"cuIpcGetMemHandle", 0, "cuIpcGetMemHandle", nullptr},
      {"cuIpcOpenMemHandle", 11000, "cuIpcOpenMemHandle_v2", nullptr},
      {"cuIpcCloseMemHandle", 0, "cuIpcCloseMemHandle", nullptr},
  };
  for (const versioned& each : kDriverSymbols) {
    if (std::strcmp(each.base, symbol) != 0 || cuda_version < each.since) continue;
    const char* exported = per_thread && each.exported_per_thread != nullptr
                               ? each.exported_per_thread
                               : each.exported;
    return by_name(exported);
  }
  return nullptr;
}

}  // namespace

// ---- dlsym ------------------------------------------------------------------------------
//
// Note [dlsym]: programs that dlopen the runtime or the driver and look functions up on its
// handle (ctypes, Numba, JAX) would bypass the hooks, so a preloaded zeroalloc answers
// dlsym(handle, name) with its hook when `name` is interposed and the handle's library
// defines it. Everything else must reach glibc's dlsym as if zeroalloc were not there: glibc
// resolves RTLD_NEXT (and RTLD_DEFAULT's namespace) relative to its caller, found from the
// return address, so a C++ wrapper that called it would make every RTLD_NEXT lookup of
// every other interposer start after libzeroalloc instead of after that interposer. The
// trampoline below therefore jumps to glibc's dlsym with the caller's return address in
// place. Lookups from inside libzeroalloc (the driver table in device/cuda_driver.cpp) are
// never answered with a hook. x86-64 only, and not in sanitizer builds; elsewhere dlsym is
// not interposed.

namespace {

// Returned by the decision to mean "let glibc answer".
void* const kForward = reinterpret_cast<void*>(~std::uintptr_t{0});

// Where this library is loaded. Not a function-local static: its initialisation guard,
// held while dladdr waits for the loader's lock, would deadlock with a thread inside dlopen
// (holding that lock) whose library constructor calls dlsym. Found when the library loads,
// or by whichever caller comes first (found twice, it is the same).
std::atomic<void*> own_base_address{nullptr};

void* own_base() {
  void* base = own_base_address.load(std::memory_order_acquire);
  if (base == nullptr) {
    Dl_info self{};
    base = dladdr(reinterpret_cast<void*>(&by_name), &self) != 0 ? self.dli_fbase : nullptr;
    own_base_address.store(base, std::memory_order_release);
  }
  return base;
}

__attribute__((constructor)) void remember_own_base() { own_base(); }

bool called_from_zeroalloc(void* caller) {
  void* const base = own_base();
  Dl_info info{};
  return dladdr(caller, &info) != 0 && info.dli_fbase == base;
}

}  // namespace

// What dlsym(handle, name) returns, or kForward when glibc's dlsym should answer as usual.
extern "C" __attribute__((visibility("hidden"))) void* zeroalloc_dlsym_decide(void* handle,
                                                                              const char* name,
                                                                              void* caller) {
  const dlsym_function glibc_dlsym = real_dlsym();  // also sets zeroalloc_real_dlsym
  if (!interception_active() || name == nullptr || handle == RTLD_NEXT || handle == RTLD_DEFAULT) {
    return kForward;  // the global scope finds the preloaded hooks first anyway
  }
  const interposed_symbol* hook = by_name(name);
  if (hook == nullptr || called_from_zeroalloc(caller)) return kForward;
  void* found = glibc_dlsym(handle, name);  // an explicit handle: the caller does not matter
  if (found == nullptr || found == hook->hook) return found;
  hook->real->store(found, std::memory_order_release);
  return hook->hook;
}

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
// Not in sanitizer builds: their runtimes resolve their interceptors with dlsym before any
// instrumented code may run, and would land here. (Those builds are never preloaded.)
// dlsym(handle, name): keeps both arguments, asks zeroalloc_dlsym_decide (passing the
// caller's return address), and either returns its answer or jumps to glibc's dlsym with
// the original arguments and return address (Note [dlsym]).
asm(R"(
    .text
    .globl dlsym
    .type dlsym, @function
    .p2align 4
dlsym:
    .cfi_startproc
    pushq %rdi
    .cfi_adjust_cfa_offset 8
    pushq %rsi
    .cfi_adjust_cfa_offset 8
    movq 16(%rsp), %rdx
    subq $8, %rsp
    .cfi_adjust_cfa_offset 8
    call zeroalloc_dlsym_decide
    addq $8, %rsp
    .cfi_adjust_cfa_offset -8
    popq %rsi
    .cfi_adjust_cfa_offset -8
    popq %rdi
    .cfi_adjust_cfa_offset -8
    cmpq $-1, %rax
    je 1f
    ret
1:
    jmpq *zeroalloc_real_dlsym(%rip)
    .cfi_endproc
    .size dlsym, .-dlsym
)");
#endif
