// A library of the program that allocates device memory in its constructor: under
// LD_PRELOAD, that constructor runs before zeroalloc's own (the program's libraries are
// initialised first), so zeroalloc starts from inside it. See preload_early_test.cpp.
#include <cuda_runtime_api.h>

#include <cstddef>

namespace {

int g_status = -1;
std::size_t g_total_bytes = 0;

__attribute__((constructor)) void allocate_at_load() {
  void* pointer = nullptr;
  g_status = cudaMalloc(&pointer, 1 << 20);
  if (g_status != cudaSuccess) return;
  std::size_t free_bytes = 0;
  cudaMemGetInfo(&free_bytes, &g_total_bytes);
  g_status = cudaFree(pointer);
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int early_caller_status() { return g_status; }
extern "C" __attribute__((visibility("default"))) std::size_t early_caller_total_bytes() {
  return g_total_bytes;
}
