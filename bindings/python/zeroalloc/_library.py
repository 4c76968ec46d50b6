"""Finding and loading libzeroalloc.so, and declaring the C ABI to ctypes."""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

_LIBRARY_NAME = "libzeroalloc.so"


class ZeroallocError(RuntimeError):
    """A zeroalloc call failed; the message is the library's own (zeroalloc_last_error)."""


def _candidates() -> list[Path]:
    found = []
    explicit = os.environ.get("ZEROALLOC_LIBRARY")
    if explicit:
        found.append(Path(explicit))
    here = Path(__file__).resolve().parent
    found.append(here / _LIBRARY_NAME)
    # bindings/python/zeroalloc -> the repository root, then its build tree.
    found.append(here.parents[2] / "build" / _LIBRARY_NAME)
    return found


def preloaded_library() -> Path | None:
    """The libzeroalloc.so in LD_PRELOAD, if this process preloads one: the entry itself when
    it is a path, else (a bare name the dynamic loader found along its search path) the file
    the process has mapped under that name, so that the package uses the preloaded copy and
    never loads a second one (two allocators in one process)."""
    for entry in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        path = Path(entry)
        if not path.name.startswith("libzeroalloc"):
            continue
        mapped = _mapped_file(path.name)
        if mapped is not None:
            return mapped
        if "/" in entry and path.is_file():
            return path
    return None


def _mapped_file(name: str) -> Path | None:
    """The file this process has mapped whose name is `name` (from /proc/self/maps)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6:
                    continue
                mapped = fields[5].strip().removesuffix(" (deleted)")  # replaced since
                if Path(mapped).name == name:
                    return Path(mapped)
    except OSError:
        pass
    return None


def library_path() -> Path:
    """The libzeroalloc.so this package uses: the preloaded one when the process preloads it
    (one library, one allocator per process), else ZEROALLOC_LIBRARY, next to the package,
    or the build tree. Raises ZeroallocError naming where it looked."""
    preloaded = preloaded_library()
    if preloaded is not None:
        return preloaded
    candidates = _candidates()
    if os.environ.get("ZEROALLOC_LIBRARY"):
        explicit = candidates[0]
        if not explicit.is_file():
            raise ZeroallocError(
                f"ZEROALLOC_LIBRARY={explicit} does not exist: point it at libzeroalloc.so "
                "(built by scripts/demo.sh or cmake into build/)")
        return explicit
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ZeroallocError(
        "libzeroalloc.so was not found (looked at " + ", ".join(map(str, candidates)) +
        "): install the package with its library (`pip install .` in a clone of zeroalloc), "
        "build it (scripts/demo.sh builds build/libzeroalloc.so) or set ZEROALLOC_LIBRARY")


class AdamWSettings(ctypes.Structure):
    """zeroalloc_adamw_settings."""

    _fields_ = [("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
                ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double),
                ("step", ctypes.c_int64), ("maximize", ctypes.c_int)]


_loaded: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The loaded library, with every C ABI function declared."""
    global _loaded
    if _loaded is None:
        handle = ctypes.CDLL(str(library_path()))
        c_stream = ctypes.c_void_p
        pointers = ctypes.POINTER(ctypes.c_void_p)
        signatures = {
            "zeroalloc_abi_version": ([], ctypes.c_int),
            "zeroalloc_malloc": ([ctypes.c_ssize_t, ctypes.c_int, c_stream], ctypes.c_void_p),
            "zeroalloc_malloc_class": ([ctypes.c_ssize_t, ctypes.c_int, c_stream, ctypes.c_int],
                                       ctypes.c_void_p),
            "zeroalloc_free": ([ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, c_stream], None),
            "zeroalloc_init": ([ctypes.c_int], None),
            "zeroalloc_empty_cache": ([], None),
            "zeroalloc_set_memory_fraction": ([ctypes.c_double, ctypes.c_int], None),
            "zeroalloc_record_stream": ([ctypes.c_void_p, c_stream], None),
            "zeroalloc_set_thread_class": ([ctypes.c_int], ctypes.c_int),
            "zeroalloc_reset_peak_stats": ([ctypes.c_int], None),
            "zeroalloc_room": ([ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64),
                                ctypes.POINTER(ctypes.c_uint64)], ctypes.c_int),
            "zeroalloc_moved_bytes": ([ctypes.c_int, ctypes.c_int,
                                       ctypes.POINTER(ctypes.c_uint64),
                                       ctypes.POINTER(ctypes.c_uint64)], ctypes.c_int),
            "zeroalloc_stats_json": ([ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t],
                                     ctypes.c_int),
            "zeroalloc_snapshot_json": ([ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t],
                                        ctypes.c_int),
            "zeroalloc_device_count": ([], ctypes.c_int),
            "zeroalloc_report_write": ([ctypes.c_char_p], ctypes.c_int),
            "zeroalloc_report_section": ([ctypes.c_char_p, ctypes.c_char_p], ctypes.c_int),
            "zeroalloc_report_render": ([ctypes.c_char_p, ctypes.c_char_p], ctypes.c_int),
            "zeroalloc_build_info": ([], ctypes.c_char_p),
            "zeroalloc_options_json": ([ctypes.c_char_p, ctypes.c_size_t], ctypes.c_int),
            "zeroalloc_last_error": ([], ctypes.c_char_p),
            "zeroalloc_last_error_code": ([], ctypes.c_int),
            "zeroalloc_free_if_owned": ([ctypes.c_void_p, c_stream, ctypes.c_void_p],
                                        ctypes.c_int),
            "zeroalloc_memory_info": ([ctypes.c_int, ctypes.POINTER(ctypes.c_uint64),
                                       ctypes.POINTER(ctypes.c_uint64)], ctypes.c_int),
            "zeroalloc_forget_stream": ([c_stream], ctypes.c_int),
            "zeroalloc_stream_create": ([ctypes.c_int], c_stream),
            "zeroalloc_stream_destroy": ([ctypes.c_int, c_stream], None),
            "zeroalloc_torch_malloc": ([ctypes.c_ssize_t, ctypes.c_int, c_stream], ctypes.c_void_p),
            "zeroalloc_use_begins": ([ctypes.c_void_p, c_stream], None),
            "zeroalloc_use_in_place": ([ctypes.c_void_p, c_stream], None),
            "zeroalloc_use_ends": ([ctypes.c_void_p, c_stream], None),
            "zeroalloc_use_begins_many": ([pointers, ctypes.c_size_t, c_stream], None),
            "zeroalloc_use_in_place_many": ([pointers, ctypes.c_size_t, c_stream], None),
            "zeroalloc_use_ends_many": ([pointers, ctypes.c_size_t, c_stream], None),
            "zeroalloc_step_boundary": ([], None),
            "zeroalloc_offload": ([ctypes.c_void_p, ctypes.c_int], ctypes.c_int),
            "zeroalloc_fetch": ([ctypes.c_void_p, ctypes.c_int], ctypes.c_int),
            "zeroalloc_residency": ([ctypes.c_void_p], ctypes.c_int),
            "zeroalloc_adamw_on_host": ([pointers, pointers, pointers, pointers,
                                         ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t,
                                         ctypes.POINTER(AdamWSettings), c_stream],
                                        ctypes.c_int),
            "zeroalloc_adamw_on_host_bf16": ([pointers, pointers, pointers, pointers, pointers,
                                              ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t,
                                              ctypes.POINTER(AdamWSettings), c_stream],
                                             ctypes.c_int),
            "zeroalloc_host_adamw_rate": ([ctypes.c_int, ctypes.c_size_t,
                                           ctypes.POINTER(ctypes.c_double)], ctypes.c_int),
            "zeroalloc_pinned_create": ([ctypes.c_int, ctypes.c_size_t,
                                         ctypes.POINTER(ctypes.c_void_p)], ctypes.c_int),
            "zeroalloc_pinned_release": ([ctypes.c_void_p, c_stream], ctypes.c_int),
            "zeroalloc_pinned_bytes": ([ctypes.c_int], ctypes.c_int64),
            "zeroalloc_log": ([ctypes.c_int, ctypes.c_char_p], ctypes.c_int),
            "zeroalloc_group_join": ([ctypes.c_char_p, ctypes.c_int], ctypes.c_int),
            "zeroalloc_group_rank": ([], ctypes.c_int),
            "zeroalloc_group_size": ([], ctypes.c_int),
            "zeroalloc_group_all_gather": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                            c_stream], ctypes.c_int),
            "zeroalloc_group_reduce_scatter": ([ctypes.c_void_p, ctypes.c_void_p,
                                                ctypes.c_size_t, ctypes.c_int, c_stream],
                                               ctypes.c_int),
            "zeroalloc_group_broadcast": ([ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                           c_stream], ctypes.c_int),
            "zeroalloc_group_reduce": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_int, ctypes.c_int, c_stream], ctypes.c_int),
            "zeroalloc_group_abort": ([ctypes.c_char_p], None),
        }
        missing = [name for name in signatures if not hasattr(handle, name)]
        if missing:  # another library, or a zeroalloc older than this package
            raise ZeroallocError(
                f"{library_path()} is not a libzeroalloc.so this package can use: it lacks "
                f"{', '.join(missing[:3])}{' and more' if len(missing) > 3 else ''}. Point "
                "ZEROALLOC_LIBRARY at the libzeroalloc.so built with this package, or, when the "
                "process preloads another, preload that one instead (LD_PRELOAD)")
        for name, (arguments, result) in signatures.items():
            function = getattr(handle, name)
            function.argtypes = arguments
            function.restype = result
        _loaded = handle
    return _loaded


def last_error() -> str:
    return (library().zeroalloc_last_error() or b"").decode(errors="replace")


def read_json(function, *arguments) -> dict:
    """Calls a C ABI function of the (arguments..., buffer, length) -> length-needed protocol
    and parses its JSON. The text can grow between the sizing call and the copy (a counter
    gains a digit, a segment is mapped): retry until it fits."""
    length = function(*arguments, None, 0)
    while length >= 0:
        buffer = ctypes.create_string_buffer(length + 4096)
        needed = function(*arguments, buffer, len(buffer))
        if 0 <= needed < len(buffer):
            return json.loads(buffer.value.decode())
        length = needed
    raise ZeroallocError(last_error())


def function_address(name: str) -> int:
    """The address of a C ABI function, for PyTorch's set_*_fn hooks."""
    return ctypes.cast(getattr(library(), name), ctypes.c_void_p).value
