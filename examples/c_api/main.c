/* Optimizer states allocated through zeroalloc's C API, one moved to pinned host memory and
 * back by hand, with the bytes moved read from the library. Run with ZEROALLOC_OFFLOAD=host.
 * On a machine without a GPU, zeroalloc serves the simulated device. */
#include <stdint.h>
#include <stdio.h>
#include <zeroalloc/zeroalloc.h>

static const char* where(const void* pointer) {
  static const char* names[] = {"device", "host", "split", "moving", "disk", "host (unmapped)"};
  const int residency = zeroalloc_residency(pointer);
  return residency >= 0 && residency <= 5 ? names[residency] : zeroalloc_last_error();
}

int main(void) {
  const ssize_t bytes = 64 << 20;
  void* states[4];
  for (int i = 0; i < 4; ++i) {
    states[i] = zeroalloc_malloc_class(bytes, 0, NULL, ZEROALLOC_CLASS_OPTIMIZER_STATE);
    if (states[i] == NULL) {
      fprintf(stderr, "allocating state %d failed: %s\n", i, zeroalloc_last_error());
      return 1;
    }
  }
  printf("4 states of 64 MiB allocated; state 0 is on the %s\n", where(states[0]));
  if (zeroalloc_offload(states[0], 1) != 0) {
    fprintf(stderr, "offloading failed: %s\n", zeroalloc_last_error());
    return 1;
  }
  printf("after zeroalloc_offload, state 0 is on the %s (same address %p)\n", where(states[0]),
         states[0]);
  if (zeroalloc_fetch(states[0], 1) != 0) {
    fprintf(stderr, "fetching failed: %s\n", zeroalloc_last_error());
    return 1;
  }
  printf("after zeroalloc_fetch, state 0 is on the %s\n", where(states[0]));
  uint64_t to_host = 0, back = 0;
  zeroalloc_moved_bytes(0, ZEROALLOC_CLASS_OPTIMIZER_STATE, &to_host, &back);
  printf("optimizer states moved: %llu MiB to the host, %llu MiB back\n",
         (unsigned long long)(to_host >> 20), (unsigned long long)(back >> 20));
  for (int i = 0; i < 4; ++i) zeroalloc_free(states[i], bytes, 0, NULL);
  return to_host == (uint64_t)bytes && back == (uint64_t)bytes ? 0 : 1;
}
