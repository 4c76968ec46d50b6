"""zeroalloc: statistics, summaries and allocation classes of libzeroalloc.so.

The PyTorch integration lives in ``zeroalloc.torch``; this module needs no PyTorch.
"""

from zeroalloc._library import ZeroallocError, library, library_path
from zeroalloc._snapshot import dump_snapshot, snapshot
from zeroalloc._stats import (
    CLASSES,
    allocation_class,
    device_count,
    empty_cache,
    memory_stats,
    memory_summary,
    raw_stats,
    reset_peak_memory_stats,
)

__all__ = [
    "CLASSES",
    "ZeroallocError",
    "allocation_class",
    "device_count",
    "dump_snapshot",
    "empty_cache",
    "library",
    "library_path",
    "memory_stats",
    "memory_summary",
    "raw_stats",
    "reset_peak_memory_stats",
    "snapshot",
]
