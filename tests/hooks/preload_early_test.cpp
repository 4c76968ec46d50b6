// zeroalloc started from a constructor of one of the program's libraries (early_caller.cpp),
// before its own constructors ran (Note [Before the library's constructors] in
// lib/core/options.cpp): the allocation is served, with the ZEROALLOC_* variables read.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdlib>
#include <string>
#include <vector>

extern "C" int early_caller_status();
extern "C" std::size_t early_caller_total_bytes();

namespace {

TEST(PreloadEarly, AnAllocationFromALibraryConstructorIsServedWithTheVariablesRead) {
  if (dlsym(RTLD_DEFAULT, "zeroalloc_stats_json") == nullptr) {
    GTEST_SKIP() << "skipped: run with LD_PRELOAD=libzeroalloc.so";
  }
  EXPECT_EQ(early_caller_status(), 0) << "cudaMalloc or cudaFree in the constructor failed";
  // ZEROALLOC_MEMORY_LIMIT=512MiB (CTest): the limit zeroalloc reports, so it served the call.
  EXPECT_EQ(early_caller_total_bytes(), std::size_t{512} << 20);
  using stats_json = int (*)(int, char*, std::size_t);
  auto stats = reinterpret_cast<stats_json>(dlsym(RTLD_DEFAULT, "zeroalloc_stats_json"));
  std::vector<char> buffer(static_cast<std::size_t>(stats(0, nullptr, 0)) + 1);
  stats(0, buffer.data(), buffer.size());
  const std::string text = buffer.data();
  const std::size_t at = text.find("\"allocations\":", text.find("\"total\":"));
  ASSERT_NE(at, std::string::npos);
  EXPECT_GE(std::atoll(text.c_str() + at + 14), 1) << "zeroalloc did not serve the allocation";
}

}  // namespace
