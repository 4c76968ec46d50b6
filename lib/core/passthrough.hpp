// Counts of the CUDA calls a preloaded zeroalloc sees but does not serve: the VMM cuMem*
// family, IPC, managed memory, and frees of memory zeroalloc does not own. They go to the
// real runtime or driver unchanged; the counts say how much of a program's memory lives
// outside zeroalloc (PyTorch's expandable segments map their own memory with cuMemCreate,
// for example) and appear under "passthrough" in zeroalloc_stats_json and in reports.
#pragma once

#include <atomic>
#include <cstdint>
#include <iterator>
#include <nlohmann/json_fwd.hpp>
#include <string>

namespace zeroalloc {

/// The calls counted. The order is the order of kPassthroughNames.
enum class passthrough_call : int {
  cu_mem_create,
  cu_mem_release,
  cu_mem_map,
  cu_mem_unmap,
  cu_mem_set_access,
  cu_mem_address_reserve,
  cu_mem_address_free,
  cu_mem_alloc_managed,
  cuda_malloc_managed,
  cu_ipc_get_mem_handle,
  cu_ipc_open_mem_handle,
  cu_ipc_close_mem_handle,
  cuda_ipc_get_mem_handle,
  cuda_ipc_open_mem_handle,
  cuda_ipc_close_mem_handle,
  cuda_free_not_owned,
  cu_mem_free_not_owned,
  count_,
};

/// The name each call has in the statistics (the CUDA function's name).
inline constexpr const char* kPassthroughNames[] = {
    "cuMemCreate",         "cuMemRelease",         "cuMemMap",
    "cuMemUnmap",          "cuMemSetAccess",       "cuMemAddressReserve",
    "cuMemAddressFree",    "cuMemAllocManaged",    "cudaMallocManaged",
    "cuIpcGetMemHandle",   "cuIpcOpenMemHandle",   "cuIpcCloseMemHandle",
    "cudaIpcGetMemHandle", "cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle",
    "cudaFree_not_owned",  "cuMemFree_not_owned",
};
static_assert(std::size(kPassthroughNames) == static_cast<std::size_t>(passthrough_call::count_));

/// Counts one call and the bytes it names (its size argument; 0 where it has none). Lock-free
/// and allocation-free: hooks call it (Note [Hook safety]).
void count_passthrough(passthrough_call call, std::uint64_t bytes = 0) noexcept;

/// {"cuMemCreate":{"calls":N,"bytes":B},...}: every call, in the order above, process-wide.
nlohmann::ordered_json passthrough_figures();

}  // namespace zeroalloc
