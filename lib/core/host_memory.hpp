// The host's memory, per NUMA node, for the host tier's default budget (Note [Host budget]
// in tier/host_pool.hpp).
#pragma once
#include <cstdint>

namespace zeroalloc {

/// Bytes of memory on host NUMA node `node`, read through libnuma (Note [libnuma at run
/// time]); the whole host's memory where libnuma is missing, NUMA is off or `node` is not
/// a node.
[[nodiscard]] std::uint64_t host_node_bytes(int node);

}  // namespace zeroalloc
