// The CUDA driver API as a table of function pointers filled at run time, as NCCL does.
//
// Why a table instead of linking libcuda:
// - libzeroalloc.so must load on machines without an NVIDIA driver (CI runs everything on
//   sim_device), so it cannot have libcuda.so.1 as a link-time dependency.
// - The preload hooks (hooks/) interpose the driver's symbols and cuGetProcAddress so that
//   PyTorch, cuBLAS and NCCL allocate through zeroalloc. The library's own driver calls must
//   reach the real driver, never a hook, or an allocation would recurse into itself. So the
//   table is filled through the real cuGetProcAddress_v2, looked up in libcuda's own dlopen
//   handle (not RTLD_DEFAULT or RTLD_NEXT, where a hook would be found first).
//
// Every entry point is requested by its base name ("cuMemGetInfo", not "cuMemGetInfo_v2") at
// the ABI of CUDA 13.0, the version these headers describe; the driver then returns the newest
// variant (the _v2 one) whose signature matches the PFN_ typedef named in the list below.
// Entry points are the legacy-default-stream variants: a null stream is the legacy default
// stream, as device.hpp promises and as PyTorch's default stream is.
//
// Driver calls go through ZA_CU (or check_cuda), so that every failure becomes a
// device_error whose message names the call and the driver's error name and string.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <string>
#include <string_view>

namespace zeroalloc {

/// The CUDA version whose ABI the table asks for (1000 * major + 10 * minor). A driver older
/// than this is asked for its own version instead: the entry points below kept the same ABI
/// since CUDA 12.0, the first driver that has cuGetProcAddress_v2.
inline constexpr int kCudaAbiVersion = 13000;

// The entry points the library uses: X(base name, CUDA version that introduced the ABI the
// table expects). The version picks the PFN_ typedef of <cudaTypedefs.h>, so the compiler
// checks every call against the exact signature the driver hands back. Add a row here to
// use another entry point.
#define ZA_CUDA_DRIVER_ENTRY_POINTS(X)    \
  X(cuGetErrorName, 6000)                 \
  X(cuGetErrorString, 6000)               \
  X(cuInit, 2000)                         \
  X(cuDriverGetVersion, 2020)             \
  X(cuDeviceGet, 2000)                    \
  X(cuDeviceGetCount, 2000)               \
  X(cuDeviceGetName, 2000)                \
  X(cuDeviceGetAttribute, 2000)           \
  X(cuDeviceTotalMem, 3020)               \
  X(cuDevicePrimaryCtxRetain, 7000)       \
  X(cuDevicePrimaryCtxRelease, 11000)     \
  X(cuCtxGetCurrent, 4000)                \
  X(cuCtxSetCurrent, 4000)                \
  X(cuCtxPushCurrent, 4000)               \
  X(cuCtxPopCurrent, 4000)                \
  X(cuMemGetInfo, 3020)                   \
  X(cuMemCreate, 10020)                   \
  X(cuMemRelease, 10020)                  \
  X(cuMemAddressReserve, 10020)           \
  X(cuMemAddressFree, 10020)              \
  X(cuMemMap, 10020)                      \
  X(cuMemUnmap, 10020)                    \
  X(cuMemSetAccess, 10020)                \
  X(cuMemGetAllocationGranularity, 10020) \
  X(cuMemHostRegister, 6050)              \
  X(cuMemHostUnregister, 4000)            \
  X(cuStreamCreate, 2000)                 \
  X(cuStreamDestroy, 4000)                \
  X(cuStreamSynchronize, 2000)            \
  X(cuStreamIsCapturing, 10000)           \
  X(cuStreamWaitEvent, 3020)              \
  X(cuEventCreate, 2000)                  \
  X(cuEventDestroy, 4000)                 \
  X(cuEventRecord, 2000)                  \
  X(cuEventQuery, 2000)                   \
  X(cuEventSynchronize, 2000)             \
  X(cuEventElapsedTime, 2000)             \
  X(cuMemcpyAsync, 4000)                  \
  X(cuMemsetD8Async, 3020)                \
  X(cuLaunchHostFunc, 10000)              \
  X(cuPointerGetAttribute, 4000)

/// Entry points whose signature changed in a later CUDA (cuCtxSynchronize takes a context
/// from CUDA 13.0): loaded at the version listed, whatever the driver, so that the pointer
/// always has the type its PFN_ names.
#define ZA_CUDA_DRIVER_ENTRY_POINTS_AT_THEIR_VERSION(X) X(cuCtxSynchronize, 2000)

/// The loaded driver. Every pointer is non-null once cuda_driver_table() has returned it.
///
/// The members are named pfn_<base name> rather than after the functions themselves because
/// <cuda.h> #defines many of those names (cuMemGetInfo is a macro for cuMemGetInfo_v2, and
/// cuStreamSynchronize for a _ptsz variant under per-thread default streams).
struct cuda_driver {
#define ZA_CUDA_DECLARE_ENTRY_POINT(name, version) PFN_##name##_v##version pfn_##name = nullptr;
  ZA_CUDA_DRIVER_ENTRY_POINTS(ZA_CUDA_DECLARE_ENTRY_POINT)
  ZA_CUDA_DRIVER_ENTRY_POINTS_AT_THEIR_VERSION(ZA_CUDA_DECLARE_ENTRY_POINT)
#undef ZA_CUDA_DECLARE_ENTRY_POINT

  /// What cuDriverGetVersion reports, e.g. 13000 for a CUDA 13.0 driver (R580).
  int driver_version = 0;
  /// The ABI the entry points were requested at: the smaller of kCudaAbiVersion and
  /// driver_version.
  int requested_version = 0;
};

/// The driver table, loaded and cuInit(0)-ed on the first call; thread-safe, and cheap after
/// the first call. Throws no_driver_error, naming the cause and the way out (install the
/// driver or set ZEROALLOC_DEVICE=sim), when libcuda.so.1 cannot be loaded, is too old, lacks
/// an entry point, or cuInit fails. A failure is remembered: later calls throw the same
/// error without trying again, as the driver would answer the same.
const cuda_driver& cuda_driver_table();

/// "CUDA_ERROR_OUT_OF_MEMORY (out of memory)": the driver's name and string for `result`.
std::string describe_cuda_result(CUresult result);

/// Throws device_error("<call> failed: <name> (<string>)", result). The code is the CUresult
/// itself, so CUDA_ERROR_OUT_OF_MEMORY carries kDeviceOutOfMemoryCode and the allocator can
/// tell running out of memory from a bug.
[[noreturn]] void throw_cuda_error(CUresult result, std::string_view call);

/// Throws as throw_cuda_error unless `result` is CUDA_SUCCESS. Inline so that the success
/// path costs one comparison.
inline void check_cuda(CUresult result, std::string_view call) {
  if (result != CUDA_SUCCESS) [[unlikely]] {
    throw_cuda_error(result, call);
  }
}

}  // namespace zeroalloc

/// Calls a driver entry point through the table and throws device_error on failure, naming
/// it: ZA_CU(cuMemRelease, handle). `name` is the base name of the entry point, which is never
/// macro-expanded here (it is only pasted and stringised).
#define ZA_CU(name, ...) \
  ::zeroalloc::check_cuda(::zeroalloc::cuda_driver_table().pfn_##name(__VA_ARGS__), #name)
