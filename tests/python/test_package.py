"""The Python package over the C ABI: statistics under PyTorch's key names, the summary
table, allocation classes, and clear errors. Needs no PyTorch; runs on whatever device the
library picks (CI sets ZEROALLOC_DEVICE=sim). The test never sets ZEROALLOC_* in its own
environment: pytest runs other files' subprocesses from the same process."""

import ctypes
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "python"
sys.path.insert(0, str(PACKAGE))

import zeroalloc  # noqa: E402

MiB = 1 << 20

if not (ROOT / "build" / "libzeroalloc.so").exists() and "ZEROALLOC_LIBRARY" not in os.environ:
    pytest.skip("skipped: build/libzeroalloc.so is not built", allow_module_level=True)


def run_python(code: str, **environment) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(PACKAGE), **environment}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_memory_stats_use_torch_key_names_and_count_exactly():
    lib = zeroalloc.library()
    before = zeroalloc.memory_stats()
    pointer = lib.zeroalloc_malloc(3 * MiB, 0, None)
    assert pointer, zeroalloc._library.last_error()
    during = zeroalloc.memory_stats()
    assert during["allocated_bytes.all.current"] - before["allocated_bytes.all.current"] == 3 * MiB
    assert during["allocated_bytes.all.peak"] >= during["allocated_bytes.all.current"]
    assert during["allocation.all.allocated"] == before["allocation.all.allocated"] + 1
    assert during["reserved_bytes.other.current"] >= 3 * MiB
    assert isinstance(during["zeroalloc.simulated"], bool)
    lib.zeroalloc_free(pointer, 3 * MiB, 0, None)
    after = zeroalloc.memory_stats()
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert after["allocation.all.freed"] == before["allocation.all.freed"] + 1
    assert {"num_alloc_retries", "num_ooms", "segment.all.current"} <= after.keys()


def test_allocation_class_routes_this_threads_allocations_and_restores():
    lib = zeroalloc.library()
    with zeroalloc.allocation_class("optimizer_state"):
        pointer = lib.zeroalloc_malloc(2 * MiB, 0, None)
    outside = lib.zeroalloc_malloc(4096, 0, None)
    stats = zeroalloc.memory_stats()
    assert stats["allocated_bytes.optimizer_state.current"] == 2 * MiB
    assert stats["allocated_bytes.other.current"] >= 4096
    lib.zeroalloc_free(pointer, 0, 0, None)
    lib.zeroalloc_free(outside, 0, 0, None)
    with pytest.raises(ValueError, match="allocation class 'activations' does not exist"):
        with zeroalloc.allocation_class("activations"):
            pass


def test_summary_is_a_table_of_every_class():
    lib = zeroalloc.library()
    with zeroalloc.allocation_class("parameter"):
        pointer = lib.zeroalloc_malloc(5 * MiB, 0, None)
    summary = zeroalloc.memory_summary()
    for name in ("other", "parameter", "gradient", "optimizer_state", "total"):
        assert f"| {name}" in summary
    assert zeroalloc.raw_stats()["device_name"] in summary
    assert "5.00 MiB" in summary
    lib.zeroalloc_free(pointer, 0, 0, None)


def test_bad_device_raises_the_librarys_message():
    with pytest.raises(zeroalloc.ZeroallocError, match="device 7 does not exist"):
        zeroalloc.raw_stats(7)


def test_malformed_variable_is_named_when_the_library_is_used():
    result = run_python("import zeroalloc; zeroalloc.memory_stats()",
                        ZEROALLOC_MEMORY_LIMIT="plenty")
    assert result.returncode != 0
    assert "ZEROALLOC_MEMORY_LIMIT='plenty' is not valid" in result.stderr


def test_missing_library_says_where_it_looked():
    result = run_python("import zeroalloc; zeroalloc.library()",
                        ZEROALLOC_LIBRARY="/nonexistent/libzeroalloc.so")
    assert result.returncode != 0
    assert "ZEROALLOC_LIBRARY=/nonexistent/libzeroalloc.so does not exist" in result.stderr


def test_a_library_that_is_not_zeroalloc_is_named_not_a_traceback():
    libm = "/lib/x86_64-linux-gnu/libm.so.6"
    if not Path(libm).exists():
        pytest.skip(f"skipped: {libm} is not here")
    result = run_python("import zeroalloc; zeroalloc.library()", ZEROALLOC_LIBRARY=libm)
    assert result.returncode != 0
    assert f"{libm} is not a libzeroalloc.so this package can use" in result.stderr
    doctor = run_python("import sys, zeroalloc.doctor as d; sys.exit(d.main())",
                        ZEROALLOC_LIBRARY=libm)
    assert "is not a libzeroalloc.so this package can use" in doctor.stdout + doctor.stderr
    assert "AttributeError" not in doctor.stderr


def test_command_line_summary_runs():
    result = run_python("import runpy; runpy.run_module('zeroalloc', run_name='__main__')")
    assert result.returncode == 2  # no command: usage
    result = subprocess.run([sys.executable, "-m", "zeroalloc", "summary"],
                            env={**os.environ, "PYTHONPATH": str(PACKAGE)},
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "zeroalloc memory summary, device 0" in result.stdout


def test_snapshot_has_pytorchs_shape_and_accounts_for_every_byte(tmp_path):
    import pickle

    lib = zeroalloc.library()
    with zeroalloc.allocation_class("gradient"):
        pointer = lib.zeroalloc_malloc(3 * MiB + 100, 0, None)
    data = zeroalloc.snapshot()
    assert set(data) >= {"segments", "device_traces"}
    assert len(data["device_traces"]) >= 1
    ours = [segment for segment in data["segments"]
            if any(block["address"] == pointer for block in segment["blocks"])]
    assert len(ours) == 1
    segment = ours[0]
    assert segment["allocation_class"] == "gradient"
    assert {"device", "address", "total_size", "allocated_size", "stream", "segment_type",
            "blocks", "frames"} <= segment.keys()
    block = next(block for block in segment["blocks"] if block["address"] == pointer)
    assert block["state"] == "active_allocated"
    assert block["requested_size"] == 3 * MiB + 100
    assert block["size"] >= block["requested_size"]
    for each in data["segments"]:  # torch.cuda._memory_viz.segsum relies on this
        assert sum(block["size"] for block in each["blocks"]) == each["total_size"]
        offset = each["address"]
        for piece in each["blocks"]:
            assert piece["address"] == offset
            offset += piece["size"]
    path = tmp_path / "snapshot.pickle"
    zeroalloc.dump_snapshot(path)
    with open(path, "rb") as saved:
        assert pickle.load(saved)["segments"]
    lib.zeroalloc_free(pointer, 0, 0, None)
    freed = zeroalloc.snapshot()
    states = [block["state"] for segment in freed["segments"] for block in segment["blocks"]
              if block["address"] == pointer]
    assert states in ([], ["inactive"])


def test_unwritable_snapshot_path_is_named():
    with pytest.raises(zeroalloc.ZeroallocError,
                       match="cannot write the memory snapshot to /nonexistent/dir/s.pickle"):
        zeroalloc.dump_snapshot("/nonexistent/dir/s.pickle")


def test_doctor_prints_every_check_and_passes_on_a_working_setup():
    result = subprocess.run([sys.executable, "-m", "zeroalloc", "doctor"],
                            env={**os.environ, "PYTHONPATH": str(PACKAGE)},
                            capture_output=True, text=True)
    for row in ("libzeroalloc.so", "ZEROALLOC_* variables", "CUDA driver", "CUDA runtime",
                "GPU", "locked memory (ulimit -l)", "io_uring", "NUMA", "NCCL", "PyTorch"):
        assert row in result.stdout, result.stdout
    failed = [line for line in result.stdout.splitlines() if "  FAIL  " in line]
    assert (result.returncode == 0) == (not failed), result.stdout
    # What this test runs with is a working set-up: the library loads, the variables parse,
    # and whatever a machine lacks (a driver, a GPU) is a warning, not a failure.
    for row in ("libzeroalloc.so", "ZEROALLOC_* variables", "CUDA runtime"):
        line = next(line for line in result.stdout.splitlines() if line.startswith(row))
        assert "  PASS  " in line, result.stdout
    assert not failed and result.returncode == 0, result.stdout


def test_doctor_names_the_recipe_and_repeats_the_last_runs_advice(tmp_path):
    """Note [The fast recipe, advised]: a run told that the fast recipe would help left it
    in its report; doctor, run with the same ZEROALLOC_REPORT, says so with what to set."""
    def recipe_line(**environment):
        result = subprocess.run([sys.executable, "-m", "zeroalloc", "doctor"],
                                env={**os.environ, "PYTHONPATH": str(PACKAGE),
                                     "ZEROALLOC_OFFLOAD": "host", **environment},
                                capture_output=True, text=True)
        lines = result.stdout.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("recipe "))
        return " ".join(lines[at:at + 2])

    assert "PASS  exact: master weights none, host step off (native numbers, bit for bit)" in (
        recipe_line())
    assert "fast: master weights bf16, host step on (numbers differ from native: bf16 " \
           "weights, the CPUs' rounding)" in recipe_line(ZEROALLOC_RECIPE="fast")
    assert "host step off (numbers differ from native: bf16 weights)" in recipe_line(
        ZEROALLOC_RECIPE="fast", ZEROALLOC_HOST_STEP="0")
    # Under a ZeRO stage the fast recipe leaves master weights out, and doctor says so.
    assert "fast: master weights none, host step on (numbers differ from native: the CPUs' " \
           "rounding)" in recipe_line(ZEROALLOC_RECIPE="fast", ZEROALLOC_ZERO_STAGE="2")
    (tmp_path / "run.rank0.json").write_text(json.dumps({"sections": {"recipe": {
        "advised": "ZEROALLOC_RECIPE=fast", "measured_step_s": 1.9,
        "predicted_step_s": 0.52}}}))
    line = recipe_line(ZEROALLOC_REPORT=str(tmp_path / "run"))
    assert "WARN" in line and "took 1.90 s a step, about 0.52 s with ZEROALLOC_RECIPE=fast" in line
    assert "-> set ZEROALLOC_RECIPE=fast to train faster" in line
    # A recipe chosen since, even exact: the advice is history.
    assert "PASS  fast" in recipe_line(ZEROALLOC_REPORT=str(tmp_path / "run"),
                                       ZEROALLOC_RECIPE="fast")
    assert "PASS  exact" in recipe_line(ZEROALLOC_REPORT=str(tmp_path / "run"),
                                        ZEROALLOC_RECIPE="exact")
    # A report without the figures this version writes is passed over, not a crash.
    (tmp_path / "run.rank0.json").write_text(json.dumps({"sections": {"recipe": {"x": 1}}}))
    assert "PASS  exact" in recipe_line(ZEROALLOC_REPORT=str(tmp_path / "run"))


def test_doctor_repeats_a_first_step_short_of_host_memory_with_the_limit_to_set(tmp_path):
    """Note [States made where the CPUs step them]: a run whose first host step left the new
    optimizer states to AdamW for want of host memory to pin its buffers said so in its
    report; doctor, run with the same ZEROALLOC_REPORT, says what was missing and which
    ZEROALLOC_HOST_LIMIT leaves the room, or to free host memory when none would."""
    def host_step_line(section):
        (tmp_path / "run.rank0.json").write_text(json.dumps({"sections": {
            "host_step": section}}))
        result = subprocess.run([sys.executable, "-m", "zeroalloc", "doctor"],
                                env={**os.environ, "PYTHONPATH": str(PACKAGE),
                                     "ZEROALLOC_OFFLOAD": "host",
                                     "ZEROALLOC_REPORT": str(tmp_path / "run")},
                                capture_output=True, text=True)
        lines = result.stdout.splitlines()
        at = [i for i, line in enumerate(lines) if line.startswith("host step ")]
        return " ".join(lines[at[0]:at[0] + 2]) if at else ""

    line = host_step_line({"room_short_bytes": 3 << 29, "suggested_host_limit": "86GiB"})
    assert "WARN" in line and "buffers were 1.5 GiB short of host memory" in line, line
    assert "-> set ZEROALLOC_HOST_LIMIT=86GiB" in line, line
    line = host_step_line({"room_short_bytes": 1 << 30, "suggested_host_limit": None})
    assert "-> free host memory" in line, line
    assert host_step_line({"room_short_bytes": 0}) == ""  # the buffers had room: nothing
    assert host_step_line({"x": 1}) == ""  # not a section this version wrote


def test_doctor_fails_on_a_malformed_variable_and_names_it():
    result = subprocess.run([sys.executable, "-m", "zeroalloc", "doctor"],
                            env={**os.environ, "PYTHONPATH": str(PACKAGE),
                                 "ZEROALLOC_CHUNK_SIZE": "3MiB"},
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert "ZEROALLOC_CHUNK_SIZE='3MiB' is not valid" in result.stdout
    assert "multiple of 2MiB" in result.stdout


def _tmpfs_directory():
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if fields[2] == "tmpfs" and os.access(fields[1], os.W_OK):
                return fields[1]
    return None


def test_doctor_checks_o_direct_on_each_nvme_path(tmp_path):
    directories = [str(tmp_path), "/nonexistent/nvme0"]
    tmpfs = _tmpfs_directory()
    if tmpfs is not None:
        directories.append(tmpfs)
    result = subprocess.run([sys.executable, "-m", "zeroalloc", "doctor"],
                            env={**os.environ, "PYTHONPATH": str(PACKAGE),
                                 "ZEROALLOC_NVME_PATH": ":".join(directories),
                                 "ZEROALLOC_NVME_SIZE": "1MiB"},
                            capture_output=True, text=True)
    lines = result.stdout.splitlines()
    row = next(line for line in lines if line.startswith(f"NVMe path {tmp_path}"))
    assert "O_DIRECT works" in row, result.stdout  # ext4 here; tmpfs since Linux 6.6 too
    assert re.search(r"write [0-9.]+ GB/s, read [0-9.]+ GB/s", row), row  # measured
    assert "PASS" in row or "WARN" in row, row
    assert any("/nonexistent/nvme0 does not exist" in line for line in lines), result.stdout
    if tmpfs is not None:  # memory, not a drive: accepted with a warning, or refused
        tmpfs_row = next(line for line in lines if line.startswith(f"NVMe path {tmpfs} "))
        assert ("WARN" in tmpfs_row and "on tmpfs" in tmpfs_row) or "FAIL" in tmpfs_row
    assert result.returncode == 1  # a configured path that cannot serve the tier fails
    assert not list(tmp_path.iterdir()), "the probe file was left behind"


def test_doctor_fails_an_nvme_size_the_drives_cannot_hold_or_a_missing_one(tmp_path):
    def doctor(**environment):
        result = subprocess.run([sys.executable, "-m", "zeroalloc", "doctor"],
                                env={**os.environ, "PYTHONPATH": str(PACKAGE), **environment},
                                capture_output=True, text=True)
        return result.returncode, result.stdout
    code, out = doctor(ZEROALLOC_NVME_PATH=str(tmp_path), ZEROALLOC_NVME_SIZE="1000000TiB")
    row = next(line for line in out.splitlines() if line.startswith(f"NVMe path {tmp_path}"))
    assert "FAIL" in row and "its share of ZEROALLOC_NVME_SIZE" in row, out
    assert code == 1
    code, out = doctor(ZEROALLOC_NVME_PATH=str(tmp_path))
    row = next(line for line in out.splitlines() if line.startswith("NVMe size"))
    assert "FAIL" in row and "ZEROALLOC_NVME_SIZE is not" in row, out
    assert code == 1


def test_doctor_fails_the_nvme_tier_under_any_access_and_passes_it_under_hinted(tmp_path):
    """The library refuses the NVMe tier under ZEROALLOC_ACCESS=any (the default): doctor
    says so before the training script finds out, and names the variable to set."""
    def access_row(**environment):
        result = subprocess.run([sys.executable, "-m", "zeroalloc", "doctor"],
                                env={**{k: v for k, v in os.environ.items()
                                        if not k.startswith("ZEROALLOC_")},
                                     "PYTHONPATH": str(PACKAGE), "ZEROALLOC_OFFLOAD": "host",
                                     "ZEROALLOC_NVME_PATH": str(tmp_path),
                                     "ZEROALLOC_NVME_SIZE": "1MiB", **environment},
                                capture_output=True, text=True)
        return next((line for line in result.stdout.splitlines()
                     if line.startswith("NVMe access")), None), result
    row, result = access_row()
    assert row is not None and "FAIL" in row, result.stdout
    assert "set ZEROALLOC_ACCESS=hinted" in result.stdout  # what to do
    assert result.returncode == 1
    row, _ = access_row(ZEROALLOC_ACCESS="hinted")
    assert row is None


def test_every_c_abi_function_is_declared_for_ctypes():
    """An undeclared function returns a C int to ctypes: a pointer would be cut to 32 bits."""
    header = (ROOT / "include" / "zeroalloc" / "zeroalloc.h").read_text()
    import re
    declared = set(re.findall(r"^[a-z_ ]+\*?\s*\**(zeroalloc_[a-z_]+)\(", header, re.MULTILINE))
    lib = zeroalloc.library()
    missing = sorted(name for name in declared if getattr(lib, name).restype is ctypes.c_int
                     and name not in {"zeroalloc_abi_version", "zeroalloc_device_count",
                                      "zeroalloc_stats_json", "zeroalloc_snapshot_json",
                                      "zeroalloc_report_write", "zeroalloc_report_render",
                                      "zeroalloc_report_section",
                                      "zeroalloc_options_json", "zeroalloc_set_thread_class",
                                      "zeroalloc_offload", "zeroalloc_fetch",
                                      "zeroalloc_residency", "zeroalloc_room", "zeroalloc_moved_bytes",
                                      "zeroalloc_adamw_on_host", "zeroalloc_adamw_on_host_bf16",
                                      "zeroalloc_host_adamw_rate", "zeroalloc_log",
                                      "zeroalloc_pinned_create", "zeroalloc_pinned_release",
                                      "zeroalloc_last_error_code", "zeroalloc_free_if_owned",
                                      "zeroalloc_memory_info", "zeroalloc_forget_stream",
                                      "zeroalloc_group_join", "zeroalloc_group_rank",
                                      "zeroalloc_group_size", "zeroalloc_group_all_gather",
                                      "zeroalloc_group_reduce_scatter",
                                      "zeroalloc_group_broadcast", "zeroalloc_group_reduce"})
    assert not missing, f"not declared in zeroalloc._library: {missing}"
    stream = lib.zeroalloc_stream_create(0)
    assert stream, zeroalloc._library.last_error()
    lib.zeroalloc_stream_destroy(0, stream)


def test_summary_and_stats_show_offload_when_it_is_on():
    result = run_python(textwrap.dedent("""
        import ctypes, zeroalloc
        lib = zeroalloc.library()
        pointer = lib.zeroalloc_malloc_class(16 << 20, 0, None, 3)
        assert lib.zeroalloc_offload(pointer, 1) == 0, zeroalloc._library.last_error()
        print(zeroalloc.memory_summary())
        print("stat", zeroalloc.memory_stats()["zeroalloc.offload.host_resident_bytes"])
    """), ZEROALLOC_DEVICE="sim", ZEROALLOC_OFFLOAD="host", ZEROALLOC_HOST_LIMIT="64MiB",
        ZEROALLOC_CHUNK_SIZE="8MiB")
    assert result.returncode == 0, result.stderr
    assert "offload to host memory: 16.00 MiB there now" in result.stdout, result.stdout
    assert "stat 16777216" in result.stdout


def test_a_library_preloaded_by_name_is_the_one_the_package_uses(tmp_path):
    # LD_PRELOAD=libzeroalloc.so, found by the dynamic loader along LD_LIBRARY_PATH (an
    # installed copy, not the build tree's): the package must use that copy, not load a
    # second allocator from the build tree.
    built = Path(os.environ.get("ZEROALLOC_LIBRARY") or ROOT / "build" / "libzeroalloc.so")
    library = tmp_path / "libzeroalloc.so"
    library.write_bytes(built.read_bytes())
    code = textwrap.dedent("""
        import ctypes, json
        import zeroalloc
        from zeroalloc._library import library_path
        preloaded = ctypes.CDLL(None)  # the process's global symbols: the preloaded copy
        pointer = zeroalloc.library().zeroalloc_malloc(1 << 20, 0, None)
        assert pointer, zeroalloc._library.last_error()
        buffer = ctypes.create_string_buffer(1 << 20)
        preloaded.zeroalloc_stats_json(0, buffer, len(buffer))
        print(library_path(), json.loads(buffer.value)["total"]["allocations"])
        """)
    env = {key: value for key, value in os.environ.items() if key != "ZEROALLOC_LIBRARY"}
    env.update(PYTHONPATH=str(PACKAGE), LD_PRELOAD=library.name,
               LD_LIBRARY_PATH=str(library.parent))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    path, allocations = result.stdout.split()
    assert Path(path).resolve() == library.resolve()
    assert int(allocations) == 1, "the allocation went to a second copy of the library"


def test_the_settings_page_is_what_the_options_table_generates():
    """docs/settings.md is generated from the library's options table: a variable added,
    renamed, or re-explained there without regenerating the page fails here."""
    result = run_python("import sys; from zeroalloc import settings; sys.exit(settings.main())")
    assert result.returncode == 0, result.stderr
    page = (ROOT / "docs" / "settings.md").read_text()
    assert result.stdout == page, ("docs/settings.md is out of date: "
                                   "python -m zeroalloc settings > docs/settings.md")
