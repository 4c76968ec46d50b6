#!/usr/bin/env python3
"""What the driver's virtual memory management allows and costs, for the offload engine's
design: can a slice (non-zero offset) or a prefix (smaller size) of a physical allocation be
mapped, for host-located and device-located memory; and how long cuMemMap + cuMemSetAccess
and cuMemUnmap take for a 2 MiB and a 64 MiB allocation of each kind; and what the CPUs' first
touch of host memory mapped this way costs against their second (one read per 4 KiB page, then
a whole pass), the question behind a process's first host step. Driver API via ctypes; needs a
GPU.

    python3 bench/python/vmm_map_probe.py
"""

import ctypes
import json
import statistics
import sys
import time

cuda = ctypes.CDLL("libcuda.so.1")
u64, size_t = ctypes.c_uint64, ctypes.c_size_t


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


LOCATION_DEVICE, LOCATION_HOST_NUMA, LOCATION_HOST = 1, 3, 2
PINNED, READ_WRITE = 1, 3


def call(name, *args):
    result = getattr(cuda, name)(*args)
    return result


def check(name, *args):
    result = call(name, *args)
    if result != 0:
        raise RuntimeError(f"{name} failed with CUresult {result}")


def prop_for(kind: str) -> Prop:
    prop = Prop()
    prop.type = PINNED
    if kind == "device":
        prop.location = Location(LOCATION_DEVICE, 0)
    else:
        prop.location = Location(LOCATION_HOST_NUMA, 0)
    return prop


def create(kind: str, size: int) -> u64:
    handle = u64()
    check("cuMemCreate", ctypes.byref(handle), size_t(size), ctypes.byref(prop_for(kind)),
          ctypes.c_ulonglong(0))
    return handle


def reserve(size: int) -> u64:
    address = u64()
    check("cuMemAddressReserve", ctypes.byref(address), size_t(size), size_t(0), u64(0),
          ctypes.c_ulonglong(0))
    return address


def set_access(address: u64, size: int) -> int:
    desc = AccessDesc(Location(LOCATION_DEVICE, 0), READ_WRITE)
    return call("cuMemSetAccess", address, size_t(size), ctypes.byref(desc), size_t(1))


def try_map(kind: str, handle_size: int, offset: int, size: int) -> str:
    handle = create(kind, handle_size)
    address = reserve(size)
    result = call("cuMemMap", address, size_t(size), size_t(offset), handle,
                  ctypes.c_ulonglong(0))
    if result == 0:
        access = set_access(address, size)
        call("cuMemUnmap", address, size_t(size))
        answer = "yes" if access == 0 else f"maps, cuMemSetAccess fails ({access})"
    else:
        answer = f"no (CUresult {result})"
    call("cuMemAddressFree", address, size_t(size))
    call("cuMemRelease", handle)
    return answer


def time_remap(kind: str, size: int, rounds: int = 20) -> dict:
    handle = create(kind, size)
    address = reserve(size)
    maps, unmaps = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        check("cuMemMap", address, size_t(size), size_t(0), handle, ctypes.c_ulonglong(0))
        if set_access(address, size) != 0:
            raise RuntimeError("cuMemSetAccess failed")
        maps.append(time.perf_counter() - started)
        started = time.perf_counter()
        check("cuMemUnmap", address, size_t(size))
        unmaps.append(time.perf_counter() - started)
    call("cuMemAddressFree", address, size_t(size))
    call("cuMemRelease", handle)
    return {"map_and_access_us": statistics.median(maps) * 1e6,
            "unmap_us": statistics.median(unmaps) * 1e6}


def time_cpu_touch(size: int) -> dict:
    """Host-located memory mapped and opened to the device and the CPUs, as the host tier
    maps its slabs: the CPUs read one byte per 4 KiB page twice, then sum it all twice."""
    import numpy
    handle = create("host", size)
    address = reserve(size)
    check("cuMemMap", address, size_t(size), size_t(0), handle, ctypes.c_ulonglong(0))
    descs = (AccessDesc * 2)(AccessDesc(Location(LOCATION_DEVICE, 0), READ_WRITE),
                             AccessDesc(Location(LOCATION_HOST_NUMA, 0), READ_WRITE))
    check("cuMemSetAccess", address, size_t(size), descs, size_t(2))
    words = numpy.frombuffer((ctypes.c_uint64 * (size // 8)).from_address(address.value),
                             dtype=numpy.uint64)
    timings = {}
    for name, read in (("pages", lambda: int(words[::512].sum())),
                       ("whole", lambda: int(words.sum()))):
        for turn in ("first", "second"):
            started = time.perf_counter()
            read()
            timings[f"{name}_{turn}_s"] = time.perf_counter() - started
    del words
    call("cuMemUnmap", address, size_t(size))
    call("cuMemAddressFree", address, size_t(size))
    call("cuMemRelease", handle)
    return timings


def main() -> int:
    check("cuInit", 0)
    device, context = ctypes.c_int(), ctypes.c_void_p()
    check("cuDeviceGet", ctypes.byref(device), 0)
    check("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
    check("cuCtxSetCurrent", context)
    mib = 1 << 20
    results = {}
    for kind in ("host", "device"):
        results[f"{kind} slice (offset 2 MiB of 4 MiB)"] = try_map(kind, 4 * mib, 2 * mib, 2 * mib)
        results[f"{kind} prefix (first 2 MiB of 4 MiB)"] = try_map(kind, 4 * mib, 0, 2 * mib)
    for kind in ("host", "device"):
        for size in (2 * mib, 64 * mib):
            results[f"{kind} {size // mib} MiB remap"] = time_remap(kind, size)
    results["CPU touch of 4 GiB of host memory"] = time_cpu_touch(4 << 30)
    width = max(len(k) for k in results)
    for key, value in results.items():
        if isinstance(value, dict) and "pages_first_s" in value:
            value = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in value.items())
        elif isinstance(value, dict):
            value = (f"map + set access {value['map_and_access_us']:.0f} us, "
                     f"unmap {value['unmap_us']:.0f} us")
        print(f"{key:<{width}}  {value}")
    print(json.dumps({"bench": "vmm_map_probe", **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
