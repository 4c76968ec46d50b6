#include "core/host_memory.hpp"

#include <dlfcn.h>
#include <numa.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <vector>

namespace zeroalloc {
namespace {

// Note [libnuma at run time]: libnuma is loaded when first needed, as the CUDA driver is,
// not linked: its static archive cannot go into a shared library (it is not
// position-independent), and a wheel that named libnuma.so.1 as a dependency would not load
// on a machine without it. Without libnuma the host counts as one node. The table's types
// come from numa.h, so a changed signature fails to compile.
struct numa_functions {
  decltype(&::numa_available) available = nullptr;
  decltype(&::numa_max_node) max_node = nullptr;
  decltype(&::numa_node_size64) node_size64 = nullptr;

  [[nodiscard]] bool loaded() const {
    return available != nullptr && max_node != nullptr && node_size64 != nullptr;
  }
};

template <typename Function>
void resolve(void* library, const char* name, Function& function) {
  function = reinterpret_cast<Function>(::dlsym(library, name));
}

const numa_functions& numa() {
  static const numa_functions functions = [] {
    numa_functions found;
    void* library = ::dlopen("libnuma.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) return found;  // kept loaded for the process's life otherwise
    resolve(library, "numa_available", found.available);
    resolve(library, "numa_max_node", found.max_node);
    resolve(library, "numa_node_size64", found.node_size64);
    return found;
  }();
  return functions;
}

}  // namespace

std::uint64_t host_memory_bytes() {
  return static_cast<std::uint64_t>(::sysconf(_SC_PHYS_PAGES)) *
         static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
}

std::uint64_t host_node_bytes(int node) {
  const numa_functions& library = numa();
  if (library.loaded() && library.available() >= 0 && node >= 0 && node <= library.max_node()) {
    const long long bytes = library.node_size64(node, nullptr);
    if (bytes > 0) return static_cast<std::uint64_t>(bytes);
  }
  return host_memory_bytes();
}

std::uint64_t host_available_bytes() {
  if (std::FILE* file = std::fopen("/proc/meminfo", "r")) {
    char line[256];
    unsigned long long kib = 0;
    bool found = false;
    while (!found && std::fgets(line, sizeof line, file) != nullptr) {
      found = std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1;
    }
    std::fclose(file);
    if (found) return static_cast<std::uint64_t>(kib) * 1024;
  }
  return static_cast<std::uint64_t>(::sysconf(_SC_AVPHYS_PAGES)) *
         static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
}

std::uint64_t host_reserve_bytes() {
  return std::max<std::uint64_t>(host_memory_bytes() / 16, std::uint64_t{512} << 20);
}

std::size_t host_page_bytes() { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }

void* map_host_pages(std::size_t bytes, int node) {
  void* address =
      ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (address == MAP_FAILED) return nullptr;
  // A forked child (a DataLoader's worker) does not inherit the range: the kernel would copy
  // every pinned page into it at the fork, and the child never uses them.
  (void)::madvise(address, bytes, MADV_DONTFORK);
  // The node preferred for the range's pages (MPOL_PREFERRED), through the system call:
  // libnuma's numa_tonode_memory prints its failures. Placement is best effort (memory on
  // another node is slower for the CPUs, not wrong), so a refusal is ignored.
  if (node >= 0) {
    constexpr int kPreferred = 1;  // MPOL_PREFERRED
    constexpr std::size_t kBits = sizeof(unsigned long) * CHAR_BIT;
    std::vector<unsigned long> mask(static_cast<std::size_t>(node) / kBits + 1, 0);
    mask[static_cast<std::size_t>(node) / kBits] = 1UL << (static_cast<std::size_t>(node) % kBits);
    (void)::syscall(SYS_mbind, address, bytes, kPreferred, mask.data(), mask.size() * kBits + 1, 0);
  }
  return address;
}

void unmap_host_pages(void* address, std::size_t bytes) { ::munmap(address, bytes); }

}  // namespace zeroalloc
