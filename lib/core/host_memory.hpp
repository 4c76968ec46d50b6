// The host's memory, per NUMA node, for the host tier's default budget (Note [Host budget]
// in tier/host_pool.hpp).
#pragma once
#include <cstddef>
#include <cstdint>

namespace zeroalloc {

/// Bytes of memory on the host.
[[nodiscard]] std::uint64_t host_memory_bytes();

/// Bytes of memory on host NUMA node `node`, read through libnuma (Note [libnuma at run
/// time]); the whole host's memory where libnuma is missing, NUMA is off or `node` is not
/// a node.
[[nodiscard]] std::uint64_t host_node_bytes(int node);

/// Bytes the host can still give programs without swapping: MemAvailable of /proc/meminfo
/// (free memory and the page cache that can be dropped), else the free pages.
[[nodiscard]] std::uint64_t host_available_bytes();

/// What pinned memory created on demand must leave to the rest of the machine: a sixteenth
/// of the host's memory, at least 512 MiB (the background creation leaves four times that:
/// Note [Host budget] in tier/host_pool.hpp).
[[nodiscard]] std::uint64_t host_reserve_bytes();

/// The host's page size: what map_host_pages rounds to.
[[nodiscard]] std::size_t host_page_bytes();

/// `bytes` (a multiple of host_page_bytes()) of anonymous host memory that a forked child does
/// not inherit. Its pages, when first touched, go to NUMA node `node` where the host lets
/// them (the mbind system call; anywhere when `node` is negative). nullptr with errno set
/// when the host refuses.
[[nodiscard]] void* map_host_pages(std::size_t bytes, int node);
/// Gives back what map_host_pages returned.
void unmap_host_pages(void* address, std::size_t bytes);

}  // namespace zeroalloc
