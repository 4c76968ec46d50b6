#include "device/cuda_driver.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>

#include "core/errors.hpp"
#include "device/device.hpp"

namespace zeroalloc {

static_assert(CUDA_ERROR_OUT_OF_MEMORY == kDeviceOutOfMemoryCode,
              "device_error codes for CUDA are CUresults; the allocator matches OOM by code");

namespace {

constexpr const char* kDriverLibrary = "libcuda.so.1";
constexpr const char* kWayOut = "install the NVIDIA driver or run with ZEROALLOC_DEVICE=sim";
// cuGetProcAddress_v2 (with the symbolStatus argument) appeared in CUDA 12.0; it is how every
// other entry point is found, so it is the oldest driver the table can use.
constexpr int kOldestUsableDriver = 12000;

using get_proc_address_function = PFN_cuGetProcAddress_v12000;

std::string describe(const cuda_driver& driver, CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (driver.pfn_cuGetErrorName == nullptr ||
      driver.pfn_cuGetErrorName(result, &name) != CUDA_SUCCESS || name == nullptr) {
    return detail::concat("CUresult ", static_cast<int>(result), " (unknown to this driver)");
  }
  if (driver.pfn_cuGetErrorString == nullptr ||
      driver.pfn_cuGetErrorString(result, &text) != CUDA_SUCCESS || text == nullptr) {
    return name;
  }
  return detail::concat(name, " (", text, ")");
}

std::string driver_version_text(int version) {
  return detail::concat(version / 1000, ".", version % 1000 / 10);
}

// Asks the real driver for one entry point; the table must hold only real driver functions,
// so a missing one is an error rather than a null pointer to trip over later.
void* find_entry_point(get_proc_address_function get_proc_address, const char* symbol,
                       int requested_version) {
  void* function = nullptr;
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  const CUresult result = get_proc_address(symbol, &function, requested_version,
                                           CU_GET_PROC_ADDRESS_LEGACY_STREAM, &status);
  if (result != CUDA_SUCCESS || status != CU_GET_PROC_ADDRESS_SUCCESS || function == nullptr) {
    const char* why = status == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                          ? "the driver has it only for a newer CUDA version"
                          : "the driver does not have it";
    ZA_THROW(no_driver_error, "the CUDA driver (", kDriverLibrary, ") lacks ", symbol, " for CUDA ",
             driver_version_text(requested_version), ": ", why,
             " (cuGetProcAddress returned CUresult ", static_cast<int>(result),
             "); update the NVIDIA driver or run with ZEROALLOC_DEVICE=sim");
  }
  return function;
}

cuda_driver load_driver() {
  // RTLD_LOCAL: the driver's symbols stay out of the global scope, where the preload hooks
  // live. The handle is never closed: the driver must outlive every CUDA object, including
  // those destroyed at exit.
  void* library = ::dlopen(kDriverLibrary, RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* reason = ::dlerror();
    ZA_THROW(no_driver_error, "the CUDA driver (", kDriverLibrary,
             ") could not be loaded: ", reason != nullptr ? reason : "unknown dlopen error", "; ",
             kWayOut);
  }
  ::dlerror();  // clear any stale error so that a null result below is explained correctly
  auto get_proc_address =
      reinterpret_cast<get_proc_address_function>(::dlsym(library, "cuGetProcAddress_v2"));
  if (get_proc_address == nullptr) {
    const char* reason = ::dlerror();
    ZA_THROW(no_driver_error, "the CUDA driver (", kDriverLibrary,
             ") is older than CUDA 12.0: it has no cuGetProcAddress_v2 (",
             reason != nullptr ? reason : "symbol not found",
             "); update the NVIDIA driver or run with ZEROALLOC_DEVICE=sim");
  }

  cuda_driver driver;
  // The driver refuses requests for a CUDA version newer than itself, so learn its version
  // first, asking at the oldest version the table supports.
  driver.pfn_cuDriverGetVersion = reinterpret_cast<PFN_cuDriverGetVersion_v2020>(
      find_entry_point(get_proc_address, "cuDriverGetVersion", kOldestUsableDriver));
  if (const CUresult result = driver.pfn_cuDriverGetVersion(&driver.driver_version);
      result != CUDA_SUCCESS) {
    ZA_THROW(no_driver_error, "the CUDA driver (", kDriverLibrary,
             ") did not report its version: cuDriverGetVersion returned CUresult ",
             static_cast<int>(result), "; ", kWayOut);
  }
  driver.requested_version = std::min(kCudaAbiVersion, driver.driver_version);

#define ZA_CUDA_LOAD_ENTRY_POINT(name, version)                  \
  driver.pfn_##name = reinterpret_cast<PFN_##name##_v##version>( \
      find_entry_point(get_proc_address, #name, driver.requested_version));
  ZA_CUDA_DRIVER_ENTRY_POINTS(ZA_CUDA_LOAD_ENTRY_POINT)
#undef ZA_CUDA_LOAD_ENTRY_POINT
#define ZA_CUDA_LOAD_ENTRY_POINT_AT_ITS_VERSION(name, version)   \
  driver.pfn_##name = reinterpret_cast<PFN_##name##_v##version>( \
      find_entry_point(get_proc_address, #name, version));
  ZA_CUDA_DRIVER_ENTRY_POINTS_AT_THEIR_VERSION(ZA_CUDA_LOAD_ENTRY_POINT_AT_ITS_VERSION)
#undef ZA_CUDA_LOAD_ENTRY_POINT_AT_ITS_VERSION

  if (const CUresult result = driver.pfn_cuInit(0); result != CUDA_SUCCESS) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    ZA_THROW(no_driver_error, "the CUDA driver (", kDriverLibrary, ", CUDA ",
             driver_version_text(driver.driver_version),
             ") loaded but could not be initialised: cuInit failed: ", describe(driver, result),
             " (CUDA_VISIBLE_DEVICES=", visible != nullptr ? visible : "unset",
             "); check that nvidia-smi sees a GPU, or run with ZEROALLOC_DEVICE=sim");
  }
  return driver;
}

// The outcome of the one load attempt: the table, or why there is none.
struct load_outcome {
  cuda_driver driver;
  std::string failure;
};

load_outcome load_once() {
  load_outcome outcome;
  try {
    outcome.driver = load_driver();
  } catch (const no_driver_error& failure) {
    outcome.failure = failure.what();
  }
  return outcome;
}

}  // namespace

const cuda_driver& cuda_driver_table() {
  // A function-local static: initialised once, thread-safely, on first use, and a plain
  // "already initialised" check afterwards.
  static const load_outcome outcome = load_once();
  if (!outcome.failure.empty()) [[unlikely]] {
    throw no_driver_error(outcome.failure);
  }
  return outcome.driver;
}

std::string describe_cuda_result(CUresult result) { return describe(cuda_driver_table(), result); }

void throw_cuda_error(CUresult result, std::string_view call) {
  throw device_error(detail::concat(call, " failed: ", describe_cuda_result(result)),
                     static_cast<int>(result));
}

}  // namespace zeroalloc
