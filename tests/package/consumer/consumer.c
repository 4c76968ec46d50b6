/* Allocates, writes nothing (the memory may be a GPU's), frees, and reads the statistics:
   proof that the installed header and library work together. */
#include <stdio.h>
#include <string.h>
#include <zeroalloc/zeroalloc.h>

int main(void) {
  if (zeroalloc_abi_version() != ZEROALLOC_ABI_VERSION) {
    fprintf(stderr, "header ABI %d, library ABI %d\n", ZEROALLOC_ABI_VERSION,
            zeroalloc_abi_version());
    return 1;
  }
  void* pointer = zeroalloc_malloc(1 << 20, 0, NULL);
  if (pointer == NULL) {
    fprintf(stderr, "zeroalloc_malloc failed: %s\n", zeroalloc_last_error());
    return 1;
  }
  zeroalloc_free(pointer, 1 << 20, 0, NULL);
  char stats[1 << 16];
  const int needed = zeroalloc_stats_json(0, stats, sizeof stats);
  if (needed < 0 || (size_t)needed >= sizeof stats || strstr(stats, "\"allocations\"") == NULL) {
    fprintf(stderr, "zeroalloc_stats_json failed: %s\n", zeroalloc_last_error());
    return 1;
  }
  printf("consumer: allocated and freed 1 MiB through %s\n", zeroalloc_build_info());
  return 0;
}
