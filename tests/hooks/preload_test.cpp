// The LD_PRELOAD interposers, seen from an ordinary program linked against the shared CUDA
// runtime and run as `LD_PRELOAD=libzeroalloc.so` (CTest sets it): its cudaMalloc, the
// driver's cuMemAlloc reached through cudaGetDriverEntryPoint and cuGetProcAddress, and
// cudaMemGetInfo are served by zeroalloc. On the simulated device (CI) and on a GPU.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

// The library is preloaded, not linked: reach its C ABI the way a tool would.
std::string stats() {
  using stats_json = int (*)(int, char*, size_t);
  auto function = reinterpret_cast<stats_json>(dlsym(RTLD_DEFAULT, "zeroalloc_stats_json"));
  if (function == nullptr) return "";
  std::vector<char> buffer(static_cast<size_t>(function(0, nullptr, 0)) + 1);
  function(0, buffer.data(), buffer.size());
  return buffer.data();
}

long long total_count(const std::string& key) {
  const std::string text = stats();
  const std::size_t total = text.find("\"total\":");
  const std::size_t at = text.find("\"" + key + "\":", total);
  if (total == std::string::npos || at == std::string::npos) return -1;
  return std::atoll(text.c_str() + at + key.size() + 3);
}

// Calls of `name` that zeroalloc counted and passed through (the "passthrough" object).
long long passthrough(const std::string& name, const char* figure = "calls") {
  const std::string text = stats();
  const std::size_t section = text.find("\"passthrough\":");
  const std::size_t entry = text.find("\"" + name + "\":{", section);
  if (section == std::string::npos || entry == std::string::npos) return -1;
  const std::string key = std::string("\"") + figure + "\":";
  const std::size_t at = text.find(key, entry);
  return std::atoll(text.c_str() + at + key.size());
}

// The file of the shared object that defines `address`.
std::string defining_file(void* address) {
  Dl_info info{};
  return dladdr(address, &info) != 0 && info.dli_fname != nullptr ? info.dli_fname : "";
}

bool simulated() { return stats().find("\"simulated\":true") != std::string::npos; }

void expect_writable(void* pointer, std::size_t bytes) {
  std::vector<unsigned char> pattern(bytes, 0x5A);
  std::vector<unsigned char> back(bytes, 0);
  if (simulated()) {  // simulated device memory is host memory
    std::memcpy(pointer, pattern.data(), bytes);
    std::memcpy(back.data(), pointer, bytes);
  } else {
    ASSERT_EQ(cudaMemcpy(pointer, pattern.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(back.data(), pointer, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  EXPECT_EQ(back, pattern);
}

class PreloadTest : public ::testing::Test {
 protected:
  // A preload that names libzeroalloc but did not bring it in (a wrong path) fails; run by
  // hand without a preload, the suite says "skipped".
  void SetUp() override {
    if (dlsym(RTLD_DEFAULT, "zeroalloc_stats_json") != nullptr) return;
    const char* preload = std::getenv("LD_PRELOAD");
    if (preload != nullptr && std::strstr(preload, "libzeroalloc") != nullptr) {
      FAIL() << "LD_PRELOAD=" << preload << " names libzeroalloc, but the process has no "
             << "zeroalloc_stats_json: the library did not load";
    }
    GTEST_SKIP() << "skipped: run with LD_PRELOAD=libzeroalloc.so";
  }
};

TEST_F(PreloadTest, CudaMallocAndCudaFreeAreServedByZeroalloc) {
  const long long before = total_count("allocations");
  void* pointer = nullptr;
  ASSERT_EQ(cudaMalloc(&pointer, 3 << 20), cudaSuccess);
  ASSERT_NE(pointer, nullptr);
  EXPECT_EQ(total_count("allocations"), before + 1);
  expect_writable(pointer, 3 << 20);
  const long long frees = total_count("frees");
  EXPECT_EQ(cudaFree(pointer), cudaSuccess);
  EXPECT_EQ(total_count("frees"), frees + 1);
}

TEST_F(PreloadTest, ZeroBytesIsSuccessAndANullPointerAsInCuda) {
  void* pointer = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(cudaMalloc(&pointer, 0), cudaSuccess);
  EXPECT_EQ(pointer, nullptr);
}

TEST_F(PreloadTest, StreamOrderedCallsAreServed) {
  const long long before = total_count("allocations");
  void* pointer = nullptr;
  ASSERT_EQ(cudaMallocAsync(&pointer, 1 << 20, nullptr), cudaSuccess);
  EXPECT_EQ(total_count("allocations"), before + 1);
  EXPECT_EQ(cudaFreeAsync(pointer, nullptr), cudaSuccess);
  EXPECT_EQ(total_count("allocations") - total_count("frees"), 0);
}

// CUDA's special stream handles are streams like any other to the program; on the
// simulated device they are its default stream (a fence recorded on them crashed it).
TEST_F(PreloadTest, TheSpecialStreamHandlesAreServed) {
  using empty_cache = void (*)();
  auto release = reinterpret_cast<empty_cache>(dlsym(RTLD_DEFAULT, "zeroalloc_empty_cache"));
  ASSERT_NE(release, nullptr);
  const long long live = total_count("allocations") - total_count("frees");
  for (cudaStream_t special : {cudaStreamPerThread, cudaStreamLegacy}) {
    void* pointer = nullptr;
    const long long before = total_count("allocations");
    ASSERT_EQ(cudaMallocAsync(&pointer, 1 << 20, special), cudaSuccess);
    EXPECT_EQ(total_count("allocations"), before + 1);
    expect_writable(pointer, 1 << 20);
    ASSERT_EQ(cudaFreeAsync(pointer, special), cudaSuccess);
    void* other = nullptr;  // on the legacy stream: the freed block is fenced on `special`
    ASSERT_EQ(cudaMalloc(&other, 1 << 20), cudaSuccess);
    EXPECT_EQ(cudaFree(other), cudaSuccess);
    release();  // fences every free segment's streams
  }
  EXPECT_EQ(total_count("allocations") - total_count("frees"), live);
}

// Results as CUDA gives them: cuMemAlloc of zero bytes is an invalid value (cudaMalloc's is
// a success with a null pointer), and a free of a pointer inside zeroalloc's memory that is
// no live allocation is cudaErrorInvalidValue, answered by zeroalloc (the real cudaFree does
// not know the memory) and leaving the allocation live.
TEST_F(PreloadTest, ResultsFollowCudasForZeroBytesAndBadFrees) {
  using mem_alloc = int (*)(unsigned long long*, std::size_t);
  void* function = nullptr;
  cudaDriverEntryPointQueryResult status{};
  ASSERT_EQ(
      cudaGetDriverEntryPointByVersion("cuMemAlloc", &function, 12000, cudaEnableDefault, &status),
      cudaSuccess);
  unsigned long long address = 1;
  EXPECT_EQ(reinterpret_cast<mem_alloc>(function)(&address, 0), 1);  // CUDA_ERROR_INVALID_VALUE
  void* pointer = nullptr;
  ASSERT_EQ(cudaMalloc(&pointer, 1 << 20), cudaSuccess);
  const long long passed = passthrough("cudaFree_not_owned");
  EXPECT_EQ(cudaFree(static_cast<char*>(pointer) + 4096), cudaErrorInvalidValue);
  EXPECT_EQ(passthrough("cudaFree_not_owned"), passed)
      << "zeroalloc's memory went to the real cudaFree";
  expect_writable(pointer, 1 << 20);
  EXPECT_EQ(cudaFree(pointer), cudaSuccess);
  EXPECT_EQ(cudaFree(pointer), cudaErrorInvalidValue) << "a second free of the same pointer";
}

TEST_F(PreloadTest, MemGetInfoReportsTheZeroallocLimit) {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  EXPECT_EQ(total_bytes, std::size_t{512} << 20);  // ZEROALLOC_MEMORY_LIMIT=512MiB (CTest)
  const std::string text = stats();
  const long long held = std::atoll(text.c_str() + text.find("\"held_bytes\":") + 13);
  EXPECT_EQ(free_bytes, total_bytes - static_cast<std::size_t>(held));
  void* pointer = nullptr;
  ASSERT_EQ(cudaMalloc(&pointer, 64 << 20), cudaSuccess);
  std::size_t free_after = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total_bytes), cudaSuccess);
  EXPECT_LE(free_after, total_bytes - (64 << 20));
  cudaFree(pointer);
}

TEST_F(PreloadTest, RunningOutIsCudaErrorMemoryAllocation) {
  void* pointer = nullptr;
  EXPECT_EQ(cudaMalloc(&pointer, std::size_t{600} << 20), cudaErrorMemoryAllocation);
}

TEST_F(PreloadTest, DriverAllocationThroughCudaGetDriverEntryPointIsServed) {
  using mem_alloc = int (*)(unsigned long long*, std::size_t);
  using mem_free = int (*)(unsigned long long);
  void* alloc_function = nullptr;
  void* free_function = nullptr;
  cudaDriverEntryPointQueryResult status{};
  ASSERT_EQ(cudaGetDriverEntryPointByVersion("cuMemAlloc", &alloc_function, 12000,
                                             cudaEnableDefault, &status),
            cudaSuccess);
  ASSERT_EQ(cudaGetDriverEntryPointByVersion("cuMemFree", &free_function, 12000, cudaEnableDefault,
                                             &status),
            cudaSuccess);
  EXPECT_EQ(status, cudaDriverEntryPointSuccess);
  EXPECT_EQ(alloc_function, dlsym(RTLD_DEFAULT, "cuMemAlloc_v2"));  // zeroalloc's, preloaded first
  const long long before = total_count("allocations");
  unsigned long long address = 0;
  ASSERT_EQ(reinterpret_cast<mem_alloc>(alloc_function)(&address, 1 << 20), 0);
  EXPECT_EQ(total_count("allocations"), before + 1);
  expect_writable(reinterpret_cast<void*>(address), 1 << 20);
  EXPECT_EQ(reinterpret_cast<mem_free>(free_function)(address), 0);
}

TEST_F(PreloadTest, CuGetProcAddressServesThePerThreadStreamVariants) {
  using get_proc_address = int (*)(const char*, void**, int, unsigned long long, int*);
  using alloc_async = int (*)(unsigned long long*, std::size_t, void*);
  using free_async = int (*)(unsigned long long, void*);
  auto lookup = reinterpret_cast<get_proc_address>(dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2"));
  ASSERT_NE(lookup, nullptr);
  void* alloc_function = nullptr;
  void* free_function = nullptr;
  constexpr unsigned long long kPerThreadDefaultStream = 2;
  ASSERT_EQ(lookup("cuMemAllocAsync", &alloc_function, 12000, kPerThreadDefaultStream, nullptr), 0);
  ASSERT_EQ(lookup("cuMemFreeAsync", &free_function, 12000, kPerThreadDefaultStream, nullptr), 0);
  EXPECT_EQ(alloc_function, dlsym(RTLD_DEFAULT, "cuMemAllocAsync_ptsz"));
  const long long before = total_count("allocations");
  unsigned long long address = 0;
  ASSERT_EQ(reinterpret_cast<alloc_async>(alloc_function)(&address, 4096, nullptr), 0);
  EXPECT_EQ(total_count("allocations"), before + 1);
  EXPECT_EQ(reinterpret_cast<free_async>(free_function)(address, nullptr), 0);
}

TEST_F(PreloadTest, DlsymOnTheRuntimesHandleFindsTheHook) {
  // A program that dlopens the runtime and looks cudaMalloc up on its handle (ctypes does).
  const std::string runtime_file = defining_file(reinterpret_cast<void*>(&cudaGetDeviceCount));
  ASSERT_NE(runtime_file.find("libcudart"), std::string::npos) << runtime_file;
  void* runtime = dlopen(runtime_file.c_str(), RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(runtime, nullptr) << dlerror();
  using malloc_function = cudaError_t (*)(void**, std::size_t);
  using free_function = cudaError_t (*)(void*);
  auto found_malloc = reinterpret_cast<malloc_function>(dlsym(runtime, "cudaMalloc"));
  auto found_free = reinterpret_cast<free_function>(dlsym(runtime, "cudaFree"));
  ASSERT_NE(found_malloc, nullptr);
  EXPECT_NE(defining_file(reinterpret_cast<void*>(found_malloc)).find("libzeroalloc"),
            std::string::npos);
  const long long before = total_count("allocations");
  void* pointer = nullptr;
  ASSERT_EQ(found_malloc(&pointer, 1 << 20), cudaSuccess);
  EXPECT_EQ(total_count("allocations"), before + 1);
  expect_writable(pointer, 1 << 20);
  EXPECT_EQ(found_free(pointer), cudaSuccess);
  // Functions zeroalloc does not interpose come from the runtime itself.
  EXPECT_EQ(dlsym(runtime, "cudaGetDeviceCount"), reinterpret_cast<void*>(&cudaGetDeviceCount));
  dlclose(runtime);
}

TEST_F(PreloadTest, DlsymKeepsRtldNextRelativeToItsCaller) {
  // From this program, the next dlsym is libzeroalloc's (preloaded); had zeroalloc's dlsym
  // called glibc's from inside itself, "next" would start after libzeroalloc instead.
  EXPECT_NE(defining_file(dlsym(RTLD_NEXT, "dlsym")).find("libzeroalloc"), std::string::npos);
  EXPECT_NE(dlsym(RTLD_NEXT, "cudaGetDeviceCount"), nullptr);
  // A library that does not define the symbol still has none.
  void* math = dlopen("libm.so.6", RTLD_NOW);
  ASSERT_NE(math, nullptr);
  EXPECT_EQ(dlsym(math, "cudaMalloc"), nullptr);
  EXPECT_EQ(dlsym(math, "zeroalloc_no_such_symbol"), nullptr);
  EXPECT_NE(dlerror(), nullptr);  // and dlerror says why, as glibc's dlsym does
  dlclose(math);
}

TEST_F(PreloadTest, ManagedMemoryAndForeignFreesPassThroughAndAreCounted) {
  const long long calls = passthrough("cudaMallocManaged");
  const long long bytes = passthrough("cudaMallocManaged", "bytes");
  const long long allocations = total_count("allocations");
  void* pointer = nullptr;
  const cudaError_t result = cudaMallocManaged(&pointer, 1 << 20, cudaMemAttachGlobal);
  EXPECT_EQ(passthrough("cudaMallocManaged"), calls + 1);
  EXPECT_EQ(passthrough("cudaMallocManaged", "bytes"), bytes + (1 << 20));
  EXPECT_EQ(total_count("allocations"), allocations) << "managed memory is not zeroalloc's";
  if (result != cudaSuccess) GTEST_SKIP() << "skipped the free: the runtime has no GPU here";
  const long long foreign = passthrough("cudaFree_not_owned");
  EXPECT_EQ(cudaFree(pointer), cudaSuccess);  // reaches the real cudaFree
  EXPECT_EQ(passthrough("cudaFree_not_owned"), foreign + 1);
}

TEST_F(PreloadTest, VmmCallsFetchedThroughCuGetProcAddressAreCountedAndWork) {
  using get_proc_address = int (*)(const char*, void**, int, unsigned long long, int*);
  using address_reserve = int (*)(unsigned long long*, std::size_t, std::size_t, unsigned long long,
                                  unsigned long long);
  using address_free = int (*)(unsigned long long, std::size_t);
  auto lookup = reinterpret_cast<get_proc_address>(dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2"));
  ASSERT_NE(lookup, nullptr);
  void* reserve = nullptr;
  void* release = nullptr;
  if (lookup("cuMemAddressReserve", &reserve, 12000, 0, nullptr) != 0) {
    GTEST_SKIP() << "skipped: no CUDA driver here to pass the call through to";
  }
  ASSERT_EQ(lookup("cuMemAddressFree", &release, 12000, 0, nullptr), 0);
  EXPECT_NE(defining_file(reserve).find("libzeroalloc"), std::string::npos);
  ASSERT_EQ(cudaFree(nullptr), cudaSuccess);  // a context for the driver calls
  const long long calls = passthrough("cuMemAddressReserve");
  unsigned long long address = 0;
  ASSERT_EQ(reinterpret_cast<address_reserve>(reserve)(&address, 64 << 20, 0, 0, 0), 0);
  EXPECT_NE(address, 0u);
  EXPECT_EQ(passthrough("cuMemAddressReserve"), calls + 1);
  EXPECT_EQ(passthrough("cuMemAddressReserve", "bytes") >= (64 << 20), true);
  EXPECT_EQ(reinterpret_cast<address_free>(release)(address, 64 << 20), 0);
  EXPECT_GE(passthrough("cuMemAddressFree"), 1);
}

TEST_F(PreloadTest, DlsymOnTheDriversHandleServesCuMemAlloc) {
  void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (driver == nullptr) GTEST_SKIP() << "skipped: no CUDA driver (libcuda.so.1) here";
  using mem_alloc = int (*)(unsigned long long*, std::size_t);
  using mem_free = int (*)(unsigned long long);
  auto found_alloc = reinterpret_cast<mem_alloc>(dlsym(driver, "cuMemAlloc_v2"));
  auto found_free = reinterpret_cast<mem_free>(dlsym(driver, "cuMemFree_v2"));
  ASSERT_NE(found_alloc, nullptr);
  EXPECT_NE(defining_file(reinterpret_cast<void*>(found_alloc)).find("libzeroalloc"),
            std::string::npos);
  ASSERT_EQ(cudaFree(nullptr), cudaSuccess);
  const long long before = total_count("allocations");
  unsigned long long address = 0;
  ASSERT_EQ(found_alloc(&address, 2 << 20), 0);
  EXPECT_EQ(total_count("allocations"), before + 1);
  expect_writable(reinterpret_cast<void*>(address), 2 << 20);
  EXPECT_EQ(found_free(address), 0);
  dlclose(driver);
}

// cudaFree waits for the device, and programs rely on it: work queued on another stream
// may still use the memory, which the next cudaMalloc could otherwise hand out at once.
TEST_F(PreloadTest, CudaFreeOfServedMemoryWaitsForWorkOnEveryStream) {
  if (simulated()) GTEST_SKIP() << "skipped: the simulated device has no CUDA streams";
  cudaStream_t side = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
  void* pointer = nullptr;
  // Within the suite's 512 MiB limit (ZEROALLOC_MEMORY_LIMIT in tests/CMakeLists.txt).
  constexpr std::size_t kBytes = std::size_t{256} << 20;
  const long long before = total_count("allocations");
  ASSERT_EQ(cudaMalloc(&pointer, kBytes), cudaSuccess);
  ASSERT_EQ(total_count("allocations"), before + 1) << "zeroalloc did not serve it";
  for (int round = 0; round < 256; ++round) {  // about 20 ms of memsets at 3 TB/s
    ASSERT_EQ(cudaMemsetAsync(pointer, round, kBytes, side), cudaSuccess);
  }
  ASSERT_EQ(cudaFree(pointer), cudaSuccess);
  EXPECT_EQ(cudaStreamQuery(side), cudaSuccess)
      << "cudaFree returned while work on the freed memory still ran";
  ASSERT_EQ(cudaStreamSynchronize(side), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(side), cudaSuccess);
}

// Note [Destroyed streams] in hooks/cuda_hooks.cpp: memory freed on a stream the program then
// destroys serves the next allocation, on another stream, once the destroyed stream's work
// has run. Without the interposer, that allocation recorded a fence on the destroyed stream,
// failed, and came back as cudaErrorMemoryAllocation.
TEST_F(PreloadTest, MemoryFreedOnADestroyedStreamServesTheNextAllocation) {
  if (simulated()) GTEST_SKIP() << "skipped: the simulated device has no CUDA streams";
  for (bool driver : {false, true}) {
    SCOPED_TRACE(driver ? "cuStreamDestroy" : "cudaStreamDestroy");
    cudaStream_t side = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
    constexpr std::size_t kBytes = std::size_t{256} << 20;
    void* pointer = nullptr;
    const long long before = total_count("allocations");
    ASSERT_EQ(cudaMallocAsync(&pointer, kBytes, side), cudaSuccess);
    ASSERT_EQ(total_count("allocations"), before + 1) << "zeroalloc did not serve it";
    for (int round = 0; round < 64; ++round) {  // a few ms of memsets
      ASSERT_EQ(cudaMemsetAsync(pointer, round, kBytes, side), cudaSuccess);
    }
    cudaEvent_t last_work = nullptr;
    ASSERT_EQ(cudaEventCreateWithFlags(&last_work, cudaEventDisableTiming), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(last_work, side), cudaSuccess);
    ASSERT_EQ(cudaFreeAsync(pointer, side), cudaSuccess);
    if (driver) {
      using stream_destroy = int (*)(void*);
      void* function = nullptr;
      cudaDriverEntryPointQueryResult found{};
      ASSERT_EQ(cudaGetDriverEntryPointByVersion("cuStreamDestroy", &function, 12000,
                                                 cudaEnableDefault, &found),
                cudaSuccess);
      EXPECT_EQ(function, dlsym(RTLD_DEFAULT, "cuStreamDestroy_v2"));  // zeroalloc's
      ASSERT_EQ(reinterpret_cast<stream_destroy>(function)(side), 0);
    } else {
      ASSERT_EQ(cudaStreamDestroy(side), cudaSuccess);
    }
    EXPECT_EQ(cudaEventQuery(last_work), cudaSuccess)
        << "the stream's memory is cached for reuse while its work still ran";
    void* again = nullptr;
    ASSERT_EQ(cudaMalloc(&again, kBytes), cudaSuccess);
    EXPECT_EQ(again, pointer) << "the cached block should serve it";
    expect_writable(again, 4096);
    EXPECT_EQ(cudaFree(again), cudaSuccess);
    EXPECT_EQ(cudaEventDestroy(last_work), cudaSuccess);
  }
}

// With a malformed variable (a CTest entry of its own sets ZEROALLOC_MEMORY_LIMIT=lots) the
// library does not start, and says so as CUDA would: not initialised, not out of memory.
TEST(PreloadMisconfigured, AllocationsFailAsNotInitialised) {
  const char* limit = std::getenv("ZEROALLOC_MEMORY_LIMIT");
  if (limit == nullptr || std::strcmp(limit, "lots") != 0)
    GTEST_SKIP() << "skipped: needs ZEROALLOC_MEMORY_LIMIT=lots";
  void* pointer = nullptr;
  EXPECT_EQ(cudaMalloc(&pointer, 1 << 20), cudaErrorInitializationError);
  EXPECT_EQ(cudaMallocAsync(&pointer, 1 << 20, nullptr), cudaErrorInitializationError);
}

// With ZEROALLOC_DISABLE=1 (a CTest entry of its own) a preloaded library serves nothing.
TEST(PreloadDisabled, EveryCallGoesToTheRealRuntime) {
  if (std::getenv("ZEROALLOC_DISABLE") == nullptr)
    GTEST_SKIP() << "skipped: needs ZEROALLOC_DISABLE=1";
  void* pointer = nullptr;
  const cudaError_t result = cudaMalloc(&pointer, 1 << 20);
  if (result == cudaSuccess) cudaFree(pointer);  // a GPU served it
  EXPECT_EQ(total_count("allocations"), 0) << "zeroalloc served an allocation while disabled";
}

}  // namespace
