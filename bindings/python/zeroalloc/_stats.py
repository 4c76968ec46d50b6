"""Statistics and summaries, read from zeroalloc_stats_json."""

from __future__ import annotations

import contextlib
import ctypes
from typing import Iterator

from zeroalloc._library import ZeroallocError, last_error, library, read_json

#: Allocation classes, in the order of the C ABI's zeroalloc_class.
CLASSES = ("other", "parameter", "gradient", "optimizer_state")


def device_count() -> int:
    """Devices zeroalloc drives (GPUs, or simulated devices with ZEROALLOC_DEVICE=sim)."""
    count = library().zeroalloc_device_count()
    if count < 0:
        raise ZeroallocError(last_error())
    return count


def raw_stats(device: int = 0) -> dict:
    """The library's statistics of `device`, as zeroalloc_stats_json writes them."""
    return read_json(library().zeroalloc_stats_json, device)


def room(device: int, name: str) -> tuple:
    """(largest cached free block of class `name`, the limit minus every class's allocated
    bytes) on `device`: a request up to the first is served without new memory; one up to
    the second fits under the limit, perhaps after releasing the cache. A cheap read,
    unlike raw_stats."""
    largest, unallocated = ctypes.c_uint64(), ctypes.c_uint64()
    if library().zeroalloc_room(device, CLASSES.index(name), ctypes.byref(largest),
                                ctypes.byref(unallocated)) != 0:
        raise ZeroallocError(last_error())
    return largest.value, unallocated.value


def moved_bytes(device: int, name: str) -> tuple:
    """(bytes of class `name` the offload engine moved to the host, and back) on `device`
    since the process started; (0, 0) without the engine. A cheap read, unlike raw_stats."""
    to_host, to_device = ctypes.c_uint64(), ctypes.c_uint64()
    if library().zeroalloc_moved_bytes(device, CLASSES.index(name), ctypes.byref(to_host),
                                       ctypes.byref(to_device)) != 0:
        raise ZeroallocError(last_error())
    return to_host.value, to_device.value


def memory_stats(device: int = 0) -> dict:
    """Statistics as a flat dict, keyed like torch.cuda.memory_stats where the meaning is the
    same ("allocated_bytes.all.peak", "num_alloc_retries", ...). The pool position holds
    "all" or an allocation class ("allocated_bytes.optimizer_state.current"); figures torch
    has no name for are under "zeroalloc." ("zeroalloc.limit_bytes", ...)."""
    raw = raw_stats(device)
    flat: dict = {}
    groups = {"all": raw["total"], **raw["classes"]}
    for pool, figures in groups.items():
        for gauge in ("allocated_bytes", "reserved_bytes", "active_bytes"):
            flat[f"{gauge}.{pool}.current"] = figures[gauge]["current"]
            flat[f"{gauge}.{pool}.peak"] = figures[gauge]["peak"]
        flat[f"allocation.{pool}.allocated"] = figures["allocations"]
        flat[f"allocation.{pool}.freed"] = figures["frees"]
        flat[f"allocation.{pool}.current"] = figures["allocations"] - figures["frees"]
        segments_gone = figures["segments_unmapped"] + figures["segments_donated"]
        segments_made = figures["segments_mapped"] + figures.get("segments_split", 0)
        flat[f"segment.{pool}.allocated"] = segments_made
        flat[f"segment.{pool}.freed"] = segments_gone
        flat[f"segment.{pool}.current"] = segments_made - segments_gone
        flat[f"zeroalloc.cache_hits.{pool}"] = figures["cache_hits"]
        flat[f"zeroalloc.largest_free_block_bytes.{pool}"] = figures["largest_free_block_bytes"]
        flat[f"zeroalloc.fragmentation_bytes.{pool}"] = figures["fragmentation_bytes"]
    flat["num_alloc_retries"] = raw["total"]["retries"]
    flat["num_ooms"] = raw["total"]["failures"]
    for key in ("limit_bytes", "held_bytes", "pooled_bytes", "limit_source", "device_name",
                "simulated"):
        flat[f"zeroalloc.{key}"] = raw[key]
    for call, figures in raw.get("passthrough", {}).items():
        flat[f"zeroalloc.passthrough.{call}.calls"] = figures["calls"]
        flat[f"zeroalloc.passthrough.{call}.bytes"] = figures["bytes"]
    for key, value in (raw.get("offload") or {}).items():
        flat[f"zeroalloc.offload.{key}"] = value
    return flat


def _format_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{count} B"


def memory_summary(device: int = 0) -> str:
    """A readable table of the statistics of `device` (like torch.cuda.memory_summary)."""
    raw = raw_stats(device)
    limit = _format_bytes(raw["limit_bytes"])
    source = raw["limit_source"] or "the whole device"
    header = [
        f"zeroalloc memory summary, device {raw['device']}: {raw['device_name']}",
        f"limit {limit} ({source}); held {_format_bytes(raw['held_bytes'])}, of which "
        f"{_format_bytes(raw['pooled_bytes'])} idle in the chunk pool",
    ]
    columns = ("class", "allocated", "peak allocated", "reserved", "peak reserved",
               "allocations", "frees", "cache hits", "largest free")
    rows = []
    for name, figures in [*raw["classes"].items(), ("total", raw["total"])]:
        rows.append((
            name,
            _format_bytes(figures["allocated_bytes"]["current"]),
            _format_bytes(figures["allocated_bytes"]["peak"]),
            _format_bytes(figures["reserved_bytes"]["current"]),
            _format_bytes(figures["reserved_bytes"]["peak"]),
            str(figures["allocations"]),
            str(figures["frees"]),
            str(figures["cache_hits"]),
            _format_bytes(figures["largest_free_block_bytes"]),
        ))
    widths = [max(len(column), *(len(row[i]) for row in rows)) for i, column in enumerate(columns)]
    def line(cells):
        return "| " + " | ".join(cell.rjust(width) if i else cell.ljust(width)
                                 for i, (cell, width) in enumerate(zip(cells, widths))) + " |"
    rule = "|" + "|".join("-" * (width + 2) for width in widths) + "|"
    total = raw["total"]
    footer = (f"retries after releasing cache: {total['retries']}; out-of-memory failures: "
              f"{total['failures']}; segments mapped {total['segments_mapped']}, unmapped "
              f"{total['segments_unmapped']}, moved to another class {total['segments_donated']}, "
              f"added by splitting {total.get('segments_split', 0)}")
    passed = [f"{call} {figures['calls']}" + (f" ({_format_bytes(figures['bytes'])})"
                                              if figures["bytes"] else "")
              for call, figures in raw.get("passthrough", {}).items() if figures["calls"]]
    lines = [*header, rule, line(columns), rule, *map(line, rows), rule, footer]
    if passed:
        lines.append("CUDA calls passed through (memory zeroalloc does not manage): " +
                     ", ".join(passed))
    offload = raw.get("offload")
    if offload:
        lines.append(
            f"offload to host memory: {_format_bytes(offload['host_resident_bytes'])} there now "
            f"(at most {_format_bytes(offload['host_peak_in_use_bytes'])} of the "
            f"{_format_bytes(offload['host_limit_bytes'])} host limit); moved "
            f"{_format_bytes(offload['bytes_to_host'])} out, "
            f"{_format_bytes(offload['bytes_to_device'])} back; prefetch hit rate "
            f"{offload['prefetch_hit_rate']:.1%} of {offload['uses']} uses")
    return "\n".join(lines)


def empty_cache() -> None:
    """Returns free cached memory of every device to the driver."""
    library().zeroalloc_empty_cache()


def reset_peak_memory_stats(device: int = 0) -> None:
    library().zeroalloc_reset_peak_stats(device)


@contextlib.contextmanager
def allocation_class(name: str) -> Iterator[None]:
    """Allocations of this thread inside the block belong to class `name` (one of CLASSES),
    so they live in that class's own chunks."""
    if name not in CLASSES:
        raise ValueError(f"allocation class {name!r} does not exist: use one of {CLASSES}")
    lib = library()
    previous = lib.zeroalloc_set_thread_class(CLASSES.index(name))
    try:
        yield
    finally:
        lib.zeroalloc_set_thread_class(previous)
