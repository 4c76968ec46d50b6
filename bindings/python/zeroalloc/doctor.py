"""python -m zeroalloc doctor: one table of set-up checks with pass / warn / fail and what to
do, like DeepSpeed's ds_report. Exit code 0 only when nothing fails. Works, and says so,
on a machine without a GPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import json
import os
import resource
import sys
from dataclasses import dataclass

PASS, WARN, FAIL = "pass", "warn", "fail"

# CUdevice_attribute values (cuda.h).
_ATTRIBUTE_VMM = 102
_ATTRIBUTE_HOST_NUMA_VMM = 141
_ATTRIBUTE_HOST_NUMA_ID = 134


@dataclass
class Check:
    name: str
    status: str
    finding: str
    action: str = ""


def _version_text(code: int) -> str:
    return f"{code // 1000}.{code % 1000 // 10}"


def _library_checks(checks: list[Check]) -> dict | None:
    from zeroalloc._library import ZeroallocError, library, library_path

    try:
        lib = library()
    except (ZeroallocError, OSError) as failure:
        checks.append(Check("libzeroalloc.so", FAIL, str(failure),
                            "build it (scripts/demo.sh) or set ZEROALLOC_LIBRARY"))
        return None
    build = json.loads(lib.zeroalloc_build_info().decode())
    checks.append(Check("libzeroalloc.so", PASS,
                        f"{library_path()} (version {build['version']}, built for CUDA "
                        f"{_version_text(build['cuda_version'])})"))
    return build


def _option_checks(checks: list[Check]) -> None:
    from zeroalloc._library import library

    lib = library()
    length = lib.zeroalloc_options_json(None, 0)
    buffer = ctypes.create_string_buffer(length + 1)
    lib.zeroalloc_options_json(buffer, length + 1)
    report = json.loads(buffer.value.decode())
    set_options = [option for option in report["options"] if option["value"] is not None]
    if not report["valid"]:
        checks.append(Check("ZEROALLOC_* variables", FAIL, report["error"],
                            "fix or unset the variable; docs/settings.md lists every variable"))
    elif set_options:
        listing = ", ".join(f"{option['name']}={option['value']}" for option in set_options)
        checks.append(Check("ZEROALLOC_* variables", PASS, f"all parse: {listing}"))
    else:
        checks.append(Check("ZEROALLOC_* variables", PASS, "none set: every default applies"))


def _report_paths(options: dict) -> list[str]:
    """The last run's memory reports (ZEROALLOC_REPORT's, each rank's), for the checks that
    repeat what a run said."""
    prefix = (options.get("ZEROALLOC_REPORT") or {}).get("value") or ""
    return sorted(glob.glob(glob.escape(prefix) + ".json")
                  + glob.glob(glob.escape(prefix) + ".rank*.json")) if prefix else []


def _host_step_check(checks: list[Check], options: dict) -> None:
    """The last run's first host step, when it left the new optimizer states to AdamW for
    want of host memory to pin its buffers (Note [States made where the CPUs step them] in
    zeroalloc/torch/_host_step.py): what was missing and the limit that leaves it."""
    for path in _report_paths(options):
        try:
            with open(path) as file:
                section = json.load(file).get("sections", {}).get("host_step") or {}
            short = int(section.get("room_short_bytes", 0))
            limit = section.get("suggested_host_limit")
        except (OSError, ValueError, AttributeError, TypeError):
            continue  # not a report, or not one this version wrote
        if short <= 0:
            continue
        checks.append(Check(
            "host step", WARN,
            f"the last run ({path}) left its first step's new optimizer states to AdamW on "
            f"the device: the host step's pinned buffers were {short / (1 << 30):.1f} GiB "
            "short of host memory, so its second step moved them and ran slow",
            (f"set ZEROALLOC_HOST_LIMIT={limit} if the host tier still holds what the model "
             "puts there, or free host memory") if limit else "free host memory"))
        return


def _recipe_check(checks: list[Check]) -> None:
    """ZEROALLOC_RECIPE, what it sets, and the advice of the last run's report (Note [The
    fast recipe, advised] in zeroalloc/torch/_recipe_advice.py)."""
    from zeroalloc import _recipe
    from zeroalloc._library import library, read_json

    options = {option["name"]: option for option in
               read_json(library().zeroalloc_options_json).get("options", [])}

    def chosen(name: str) -> str | None:
        value = (options.get(name) or {}).get("value")
        return value.strip().lower() if value and value.strip() else None

    if chosen("ZEROALLOC_OFFLOAD") != "host":
        checks.append(Check("recipe", PASS, "exact: nothing is offloaded "
                            "(ZEROALLOC_OFFLOAD is not host)"))
        return
    _host_step_check(checks, options)
    recipe = chosen("ZEROALLOC_RECIPE") or "exact"
    masters = _recipe.master_weights(chosen("ZEROALLOC_MASTER_WEIGHTS"), recipe,
                                     chosen("ZEROALLOC_ZERO_STAGE") or "0")
    host_step = _recipe.host_step(chosen("ZEROALLOC_HOST_STEP"), recipe)
    differences = [what for what, on in (("bf16 weights", masters != "none"),
                                         ("the CPUs' rounding", host_step)) if on]
    finding = (f"{recipe}: master weights {masters}, host step {'on' if host_step else 'off'} "
               + (f"(numbers differ from native: {', '.join(differences)})" if differences
                  else "(native numbers, bit for bit)"))
    paths = _report_paths(options)
    # A choice made since (any of the three variables) is not second-guessed.
    undecided = all(chosen(name) is None for name in
                    ("ZEROALLOC_RECIPE", "ZEROALLOC_MASTER_WEIGHTS", "ZEROALLOC_HOST_STEP"))
    for path in paths if undecided else []:
        try:
            with open(path) as file:
                advice = json.load(file).get("sections", {}).get("recipe")
            said = (f"; the last run ({path}) took {float(advice['measured_step_s']):.2f} s a "
                    f"step, about {float(advice['predicted_step_s']):.2f} s with "
                    f"{advice['advised']}") if advice else ""
        except (OSError, ValueError, AttributeError, KeyError, TypeError):
            continue  # not a report, or not one this version wrote: nothing to repeat
        if said:
            checks.append(Check("recipe", WARN, finding + said,
                                f"set {advice['advised']} to train faster, or "
                                "ZEROALLOC_RECIPE=exact to keep native numbers"))
            return
    checks.append(Check("recipe", PASS, finding))


def _load(names: list[str]) -> ctypes.CDLL | None:
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _driver_checks(checks: list[Check], build: dict | None) -> tuple[ctypes.CDLL | None, int]:
    driver = _load(["libcuda.so.1", "libcuda.so"])
    if driver is None:
        checks.append(Check("CUDA driver", WARN, "libcuda.so.1 not found: no NVIDIA driver",
                            "install the NVIDIA driver to use a GPU; until then zeroalloc runs "
                            "on the simulated device"))
        return None, 0
    result = driver.cuInit(0)
    if result != 0:
        checks.append(Check("CUDA driver", WARN, f"cuInit failed with CUresult {result} "
                            "(no usable GPU, or the driver does not match the kernel module)",
                            "check nvidia-smi; zeroalloc falls back to the simulated device"))
        return None, 0
    version = ctypes.c_int()
    driver.cuDriverGetVersion(ctypes.byref(version))
    built = (build or {}).get("cuda_version", 0)
    if built and version.value < built:
        checks.append(Check("CUDA driver", FAIL,
                            f"supports CUDA {_version_text(version.value)}, the library was "
                            f"built for CUDA {_version_text(built)}",
                            "update the NVIDIA driver (or build zeroalloc with an older CUDA)"))
    else:
        checks.append(Check("CUDA driver", PASS,
                            f"supports CUDA {_version_text(version.value)}"
                            + (f" (library built for {_version_text(built)})" if built else "")))
    count = ctypes.c_int()
    driver.cuDeviceGetCount(ctypes.byref(count))
    return driver, count.value


def _runtime_check(checks: list[Check], build: dict | None) -> None:
    runtime = _load([name for name in ("libcudart.so.13", "libcudart.so",
                                       ctypes.util.find_library("cudart")) if name])
    if runtime is None:
        checks.append(Check("CUDA runtime", WARN, "libcudart not found on the library path",
                            "only needed by CUDA programs; PyTorch ships its own"))
        return
    version = ctypes.c_int()
    runtime.cudaRuntimeGetVersion(ctypes.byref(version))
    built = (build or {}).get("cuda_version", 0)
    major_matches = not built or version.value // 1000 == built // 1000
    checks.append(Check("CUDA runtime", PASS if major_matches else WARN,
                        f"CUDA {_version_text(version.value)}",
                        "" if major_matches else
                        f"the library was built for CUDA {_version_text(built)}: use a runtime "
                        "of the same major version"))


def _gpu_checks(checks: list[Check], driver: ctypes.CDLL | None, count: int) -> None:
    if driver is None or count == 0:
        checks.append(Check("GPUs", WARN, "no GPU visible",
                            "zeroalloc runs on the simulated device (host memory); set "
                            "ZEROALLOC_DEVICE=sim to say so explicitly"))
        return
    for ordinal in range(count):
        device = ctypes.c_int()
        driver.cuDeviceGet(ctypes.byref(device), ordinal)
        name = ctypes.create_string_buffer(256)
        driver.cuDeviceGetName(name, 256, device)

        def attribute(code: int) -> int:
            value = ctypes.c_int(-1)
            driver.cuDeviceGetAttribute(ctypes.byref(value), code, device)
            return value.value

        vmm = attribute(_ATTRIBUTE_VMM) == 1
        host_vmm = attribute(_ATTRIBUTE_HOST_NUMA_VMM) == 1
        bus = ctypes.create_string_buffer(64)
        driver.cuDeviceGetPCIBusId(bus, 64, device)
        numa = _pci_numa_node(bus.value.decode())
        checks.append(Check(f"GPU {ordinal}", PASS if vmm else FAIL,
                            f"{name.value.decode()} at {bus.value.decode()}, NUMA node {numa}; "
                            f"VMM {'yes' if vmm else 'no'}, host-located VMM "
                            f"{'yes' if host_vmm else 'no'}",
                            "" if vmm else "zeroalloc needs virtual memory management "
                            "(cuMemCreate): use a newer GPU or driver"))
        if vmm and not host_vmm:
            checks.append(Check(f"GPU {ordinal} offload", WARN,
                                "host-located VMM memory is not supported",
                                "offload to host memory needs a driver with HOST_NUMA support"))


def _pci_numa_node(bus_id: str) -> str:
    try:
        with open(f"/sys/bus/pci/devices/{bus_id.lower()}/numa_node") as node:
            return node.read().strip()
    except OSError:
        return "unknown"


def _system_checks(checks: list[Check]) -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        checks.append(Check("locked memory (ulimit -l)", PASS, "unlimited"))
    else:
        checks.append(Check("locked memory (ulimit -l)", WARN, f"{soft // 1024} KiB",
                            "pinned host memory may fail to register: run `ulimit -l "
                            "unlimited` (or set memlock in /etc/security/limits.conf)"))
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as setting:
            disabled = int(setting.read().strip())
    except (OSError, ValueError):
        disabled = 0
    io_uring = {0: (PASS, "allowed", ""),
                1: (WARN, "restricted to the io_uring_group", "add the user to that group "
                    "or set kernel.io_uring_disabled=0, for the NVMe tier"),
                2: (FAIL, "disabled by the kernel", "set kernel.io_uring_disabled=0 to use "
                    "the NVMe tier")}
    status, finding, action = io_uring.get(disabled, (WARN, f"setting {disabled}", ""))
    checks.append(Check("io_uring", status, finding, action))
    nodes = sorted(glob.glob("/sys/devices/system/node/node[0-9]*"))
    described = []
    for node in nodes:
        total = ""
        try:
            with open(os.path.join(node, "meminfo")) as meminfo:
                for line in meminfo:
                    if "MemTotal:" in line:
                        total = f" {int(line.split()[-2]) / 2**20:.1f} GiB"
                        break
        except (OSError, ValueError):
            pass
        described.append(os.path.basename(node) + total)
    host_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    checks.append(Check("NUMA", PASS, f"{len(nodes) or 1} node(s)"
                        + (f": {', '.join(described)}" if described else "")
                        + f"; host memory {host_gib:.1f} GiB (the host tier takes any node when "
                        "the GPU's is too small)"))


def _direct_io_problem(directory: str) -> str | None:
    """Writes, reads back and removes one 4 KiB block with O_DIRECT in `directory`; None when
    that works, else what went wrong."""
    import mmap
    import tempfile

    if not os.path.isdir(directory):
        return "does not exist or is not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return "is not writable by this user"
    block = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
    block.write(b"zeroalloc" * 455)
    descriptor, path = tempfile.mkstemp(prefix=".zeroalloc-doctor-", dir=directory)
    os.close(descriptor)
    try:
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_DIRECT)
        except OSError as error:
            return f"refuses O_DIRECT ({error.strerror}): tmpfs and some network file systems do"
        try:
            os.write(descriptor, block)
            back = mmap.mmap(-1, 4096)
            os.lseek(descriptor, 0, os.SEEK_SET)
            os.readv(descriptor, [back])
            if back[:] != block[:]:
                return "an O_DIRECT write did not read back the same bytes"
        except OSError as error:
            return f"O_DIRECT write or read failed ({error.strerror})"
        finally:
            os.close(descriptor)
    finally:
        os.unlink(path)
    return None


def _byte_size(text: str) -> int:
    """A byte size as the library reads one ("200GiB", "80GB", "2m", "1048576"): binary
    units (KiB..TiB and the bare letters) are powers of 1024, KB..TB powers of 1000; 0 when
    empty or not such a size (the library then says what is wrong)."""
    import re

    match = re.fullmatch(r"\s*([0-9]+)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if match is None:
        return 0
    number, unit, suffix = match.groups()
    power = "kmgt".find(unit) + 1 if unit else 0
    base = 1000 if suffix == "b" and unit else 1024
    return int(number) * base ** power


def _direct_io_speed(directory: str, total: int = 256 << 20,
                     block: int = 4 << 20) -> tuple[float, float]:
    """Sequential O_DIRECT write (then fsync) and read of `total` bytes in `block`-sized
    requests in a scratch file of `directory`, removed after: GB/s (1e9 bytes/s) each way,
    what one request at a time gets (the tier keeps many in flight: a floor)."""
    import mmap
    import tempfile
    import time

    buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(block))
    descriptor, path = tempfile.mkstemp(prefix=".zeroalloc-doctor-speed-", dir=directory)
    os.close(descriptor)
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_DIRECT)
        try:
            started = time.perf_counter()
            for _ in range(total // block):
                os.write(descriptor, buffer)
            os.fsync(descriptor)
            written = time.perf_counter() - started
            os.lseek(descriptor, 0, os.SEEK_SET)
            started = time.perf_counter()
            for _ in range(total // block):
                os.readv(descriptor, [buffer])
            read = time.perf_counter() - started
        finally:
            os.close(descriptor)
    finally:
        os.unlink(path)
    return total / written / 1e9, total / read / 1e9


def _file_system_type(directory: str) -> str:
    """The type of the file system `directory` is on, from /proc/mounts (longest match)."""
    path = os.path.realpath(directory)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                point = fields[1]
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        pass
    return kind


def _nvme_checks(checks: list[Check]) -> None:
    setting = os.environ.get("ZEROALLOC_NVME_PATH", "")
    directories = [entry for entry in setting.split(":") if entry]
    if not directories:
        checks.append(Check("NVMe paths", PASS, "ZEROALLOC_NVME_PATH not set: no NVMe tier "
                            "configured"))
        return
    if not os.environ.get("ZEROALLOC_NVME_SIZE"):
        checks.append(Check("NVMe size", FAIL, "ZEROALLOC_NVME_PATH is set but "
                            "ZEROALLOC_NVME_SIZE is not: the library will not start",
                            "set the swap space the tier may take per GPU, e.g. "
                            "ZEROALLOC_NVME_SIZE=200GiB"))
    if (os.environ.get("ZEROALLOC_OFFLOAD") == "host" and
            os.environ.get("ZEROALLOC_ACCESS", "any") != "hinted"):
        checks.append(Check("NVMe access", FAIL, "ZEROALLOC_NVME_PATH is set under "
                            "ZEROALLOC_ACCESS=any: the library will not start (a state on disk "
                            "has nothing readable behind its addresses)",
                            "set ZEROALLOC_ACCESS=hinted if every read of a parameter or "
                            "optimizer state goes through the hooks, or unset "
                            "ZEROALLOC_NVME_PATH"))
    size = _byte_size(os.environ.get("ZEROALLOC_NVME_SIZE", ""))
    share = size // len(directories) if size else 0  # the tier stripes over every directory
    for directory in directories:
        problem = _direct_io_problem(directory)
        if problem is None:
            stats = os.statvfs(directory)
            free = stats.f_bavail * stats.f_frsize
            kind = _file_system_type(directory)
            finding = f"O_DIRECT works on {kind}; {free / 2**30:.1f} GiB free"
            try:
                write_gbps, read_gbps = _direct_io_speed(directory)
                finding += f"; write {write_gbps:.2f} GB/s, read {read_gbps:.2f} GB/s"
            except OSError as error:
                finding += f"; speed not measured ({error.strerror})"
            if share > free:
                checks.append(Check(f"NVMe path {directory}", FAIL, finding +
                                    f"; its share of ZEROALLOC_NVME_SIZE is "
                                    f"{share / 2**30:.1f} GiB",
                                    "free space there, lower ZEROALLOC_NVME_SIZE, or add "
                                    "directories on other drives"))
            elif kind in ("tmpfs", "ramfs"):
                checks.append(Check(f"NVMe path {directory}", WARN, finding,
                                    "this directory is in host memory, not on a drive: "
                                    "offloading there spends RAM the host tier could use"))
            else:
                checks.append(Check(f"NVMe path {directory}", PASS, finding))
        else:
            checks.append(Check(f"NVMe path {directory}", FAIL, f"{directory} {problem}",
                                "point ZEROALLOC_NVME_PATH at directories on local NVMe "
                                "drives (ext4 or xfs), separated by ':'"))


def _nccl_check(checks: list[Check], build: dict | None) -> None:
    nccl = _load(["libnccl.so.2", "libnccl.so"])
    if nccl is None:
        checks.append(Check("NCCL", WARN, "libnccl.so.2 not found",
                            "needed for ZeRO partitions across GPUs"))
        return
    version = ctypes.c_int()
    nccl.ncclGetVersion(ctypes.byref(version))
    code = version.value
    text = f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    checks.append(Check("NCCL", PASS, text))


def _torch_check(checks: list[Check]) -> None:
    try:
        import torch
    except ImportError:
        checks.append(Check("PyTorch", WARN, "not installed",
                            "zeroalloc.torch needs PyTorch; the library works without it"))
        return
    except Exception as failure:  # a broken install (a CUDA library it cannot load, ...)
        checks.append(Check("PyTorch", FAIL, f"installed, but `import torch` fails: {failure}",
                            "repair or reinstall PyTorch; the library works without it"))
        return
    memory = torch.cuda.memory
    missing = [name for name in ("CUDAPluggableAllocator", "change_current_allocator")
               if not hasattr(memory, name)]
    if not hasattr(torch.cuda, "MemPool"):
        missing.append("MemPool")
    checks.append(Check("PyTorch", FAIL if missing else PASS,
                        f"{torch.__version__}, CUDA {torch.version.cuda}"
                        + (f"; missing {', '.join(missing)}" if missing else
                           "; pluggable allocator and MemPool available"),
                        "use PyTorch 2.6 or newer" if missing else ""))


def run_checks() -> list[Check]:
    checks: list[Check] = []
    build = _library_checks(checks)
    if build is not None:
        _option_checks(checks)
        _recipe_check(checks)
    driver, count = _driver_checks(checks, build)
    _runtime_check(checks, build)
    _gpu_checks(checks, driver, count)
    _system_checks(checks)
    _nvme_checks(checks)
    _nccl_check(checks, build)
    _torch_check(checks)
    return checks


def render(checks: list[Check]) -> str:
    widths = [max(len(check.name) for check in checks), 4]
    lines = []
    for check in checks:
        line = f"{check.name:<{widths[0]}}  {check.status.upper():<{widths[1]}}  {check.finding}"
        if check.action:
            line += f"\n{'':<{widths[0] + widths[1] + 4}}-> {check.action}"
        lines.append(line)
    failures = sum(check.status == FAIL for check in checks)
    warnings = sum(check.status == WARN for check in checks)
    lines.append(f"\n{len(checks)} checks: {failures} failed, {warnings} warnings")
    return "\n".join(lines)


def main() -> int:
    checks = run_checks()
    print(render(checks))
    return 1 if any(check.status == FAIL for check in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
