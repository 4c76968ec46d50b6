"""Memory reports (ZEROALLOC_REPORT): written at exit, on SIGUSR1 and on out-of-memory,
readable JSON and a self-contained page that headless Chromium draws; an unwritable path
warns and changes nothing else. Runs on the simulated device."""

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "python"
if not (ROOT / "build" / "libzeroalloc.so").exists() and "ZEROALLOC_LIBRARY" not in os.environ:
    pytest.skip("skipped: build/libzeroalloc.so is not built", allow_module_level=True)

# The offload engine with a small host tier, for reports that show it.
OFFLOAD = {"ZEROALLOC_OFFLOAD": "host", "ZEROALLOC_HOST_LIMIT": "256MiB",
           "ZEROALLOC_CHUNK_SIZE": "8MiB"}

PROGRAM_PRELUDE = """
    import os, signal, sys, time
    import zeroalloc
    lib = zeroalloc.library()
"""


def run_program(body: str, **environment) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(PACKAGE), "ZEROALLOC_DEVICE": "sim", **environment}
    code = textwrap.dedent(PROGRAM_PRELUDE) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          errors="replace", timeout=120)


def test_report_at_exit_holds_figures_timeline_and_largest_allocations(tmp_path):
    prefix = tmp_path / "run"
    result = run_program("""
        kept = lib.zeroalloc_malloc(48 << 20, 0, None)
        for _ in range(100):
            lib.zeroalloc_free(lib.zeroalloc_malloc(1 << 20, 0, None), 0, 0, None)
        time.sleep(0.5)  # a few timeline samples
    """, ZEROALLOC_REPORT=str(prefix))
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["reason"] == "exit"
    assert report["settings"]["ZEROALLOC_REPORT"] == str(prefix)
    device = report["devices"][0]
    assert device["stats"]["total"]["allocations"] == 101
    assert device["largest_allocations"][0]["size"] == 48 << 20
    assert device["largest_allocations"][0]["class"] == "other"
    timeline = report["timeline"]
    assert len(timeline["t_ms"]) >= 2
    assert max(timeline["devices"]["0"]["allocated"]) >= 48 << 20
    page = (tmp_path / "run.html").read_text()
    assert '"reason":"exit"' in page and "<script" in page and "http" not in page.split("<script")[1]
    assert "report (exit)" in result.stderr and "peak allocated 49.00 MiB" in result.stderr
    # The device first, as the page leads; the virtual figures after, labelled.
    line = next(l for l in result.stderr.splitlines() if "report (exit)" in l)
    assert re.search(r": limit [0-9.]+ [KMGT]?i?B; the device held at most [0-9.]+ [KMGT]?i?B, "
                     r"the host at most [0-9.]+ [KMGT]?i?B; virtual: peak allocated", line), line


def test_reports_show_the_peaks_of_the_whole_run_after_a_reset(tmp_path):
    """A program that resets its peak statistics (as training loops do each step) still gets
    a report of the whole run; memory_stats keeps PyTorch's meaning (since the reset)."""
    prefix = tmp_path / "run"
    result = run_program("""
        big = lib.zeroalloc_malloc(96 << 20, 0, None)
        lib.zeroalloc_free(big, 0, 0, None)
        lib.zeroalloc_reset_peak_stats(0)
        kept = lib.zeroalloc_malloc(8 << 20, 0, None)
        stats = zeroalloc.memory_stats(0)
        print("since reset", stats["allocated_bytes.all.peak"])
    """, ZEROALLOC_REPORT=str(prefix))
    assert result.returncode == 0, result.stderr
    assert "since reset 8388608" in result.stdout
    total = json.loads((tmp_path / "run.json").read_text())["devices"][0]["stats"]["total"]
    assert total["allocated_bytes"]["peak"] == 8 << 20
    assert total["allocated_bytes"]["lifetime_peak"] == 96 << 20
    assert "peak allocated 96.00 MiB" in result.stderr
    summary = subprocess.run([sys.executable, "-m", "zeroalloc", "report", str(tmp_path / "run.json")],
                             env={**os.environ, "PYTHONPATH": str(PACKAGE)}, capture_output=True,
                             text=True, timeout=60)
    assert "peak allocated 96.00 MiB" in summary.stdout, summary.stdout + summary.stderr
    lines = summary.stdout.splitlines()
    assert re.match(r"device 0 \(.*\): limit [0-9.]+ [KMGT]?i?B; the device held at most",
                    lines[1]), lines
    assert lines[2].strip().startswith("virtual, wherever the bytes are: peak allocated"), lines


def test_a_limit_set_during_the_run_counts_what_the_device_held_from_then_on(tmp_path):
    """Note [Held under the limit]: 96 MiB held with no limit, then a limit of 64 MiB and 32
    MiB held under it. The summary and the page say what was held under the limit, from
    when it took effect, and what before, apart: never "held 96 MiB" beside "limit 64 MiB"."""
    result = run_program("""
        MiB = 1 << 20
        big = lib.zeroalloc_malloc(96 * MiB, 0, None)
        time.sleep(0.6)
        lib.zeroalloc_free(big, 0, 0, None)
        lib.zeroalloc_empty_cache()
        lib.zeroalloc_set_memory_fraction(64 / 8192, 0)   # 64 MiB of the 8 GiB device
        small = lib.zeroalloc_malloc(32 * MiB, 0, None)
        time.sleep(0.6)
    """, ZEROALLOC_REPORT=str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stderr.splitlines() if "report (exit)" in line)
    assert re.search(r"limit 64\.00 MiB from \d+\.\d s; the device held at most 32\.00 MiB "
                     r"under it \(96\.00 MiB before\)", line), line
    summary = subprocess.run([sys.executable, "-m", "zeroalloc", "report",
                              str(tmp_path / "run.json")],
                             env={**os.environ, "PYTHONPATH": str(PACKAGE)},
                             capture_output=True, text=True).stdout
    assert re.search(r"limit 64\.00 MiB from \d+\.\d s; the device held at most 32\.00 MiB "
                     r"under it \(96\.00 MiB before\)", summary), summary
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is not None:  # the page says the same
        dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                              "--dump-dom", (tmp_path / "run.html").as_uri()],
                             capture_output=True, text=True, timeout=120).stdout
        headline = re.search(r'<p class="headline"[^>]*>([^<]*)</p>', dom)
        assert headline and "the device held at most 32.00 MiB under it (96.00 MiB before)" in (
            headline.group(1)), dom[-2000:]


def test_sigusr1_writes_a_report_while_the_program_runs(tmp_path):
    result = run_program(f"""
        kept = lib.zeroalloc_malloc(8 << 20, 0, None)
        os.kill(os.getpid(), signal.SIGUSR1)
        path = {str(tmp_path / 'live.json')!r}
        for _ in range(100):
            if os.path.exists(path):
                break
            time.sleep(0.05)
        import json
        print(json.load(open(path))["reason"])
    """, ZEROALLOC_REPORT=str(tmp_path / "live"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "SIGUSR1"


def test_out_of_memory_writes_its_own_report_and_later_reports_keep_the_message(tmp_path):
    result = run_program("""
        kept = lib.zeroalloc_malloc(40 << 20, 0, None)
        assert not lib.zeroalloc_malloc(100 << 20, 0, None)
    """, ZEROALLOC_REPORT=str(tmp_path / "run"), ZEROALLOC_MEMORY_LIMIT="64MiB")
    assert result.returncode == 0, result.stderr
    at_failure = json.loads((tmp_path / "run.oom.json").read_text())
    assert at_failure["reason"].startswith("out of memory: out of memory on simulated device 0")
    assert "ZEROALLOC_MEMORY_LIMIT=64MiB" in at_failure["reason"]
    assert at_failure["devices"][0]["largest_allocations"][0]["size"] == 40 << 20
    at_exit = json.loads((tmp_path / "run.json").read_text())
    assert at_exit["reason"] == "exit"
    assert "tried to allocate 100.00 MiB" in at_exit["last_out_of_memory"]["message"]


def test_each_rank_writes_its_own_report(tmp_path):
    for rank in ("0", "1"):
        result = run_program("kept = lib.zeroalloc_malloc(1 << 20, 0, None)",
                             ZEROALLOC_REPORT=str(tmp_path / "run"), RANK=rank)
        assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "run.rank0.json").read_text())["reason"] == "exit"
    assert json.loads((tmp_path / "run.rank1.json").read_text())["reason"] == "exit"


def test_a_section_set_by_the_layers_above_is_in_the_report_and_its_summary(tmp_path):
    """zeroalloc_report_section: the last value of each section is kept, in the JSON and in
    `python -m zeroalloc report`'s summary; text that is not a JSON object is refused with
    a message, and without ZEROALLOC_REPORT the call keeps nothing and says so (1)."""
    result = run_program("""
        first = lib.zeroalloc_report_section(b"zero", b'{"stage": 1, "owned_bytes": 1024}')
        again = lib.zeroalloc_report_section(b"zero", b'{"stage": 1, "owned_bytes": 2048}')
        bad = lib.zeroalloc_report_section(b"zero", b'[1, 2]')
        print("statuses", first, again, bad, zeroalloc._library.last_error())
    """, ZEROALLOC_REPORT=str(tmp_path / "s"))
    assert result.returncode == 0, result.stderr
    assert "statuses 0 0 -1" in result.stdout and "not a JSON object" in result.stdout
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["sections"] == {"zero": {"stage": 1, "owned_bytes": 2048}}
    summary = subprocess.run([sys.executable, "-m", "zeroalloc", "report", str(tmp_path / "s.json")],
                             env={**os.environ, "PYTHONPATH": str(PACKAGE)},
                             capture_output=True, text=True)
    assert "zero: stage 1, owned_bytes 2.00 KiB" in summary.stdout, summary.stdout
    unreported = run_program("""
        print("status", lib.zeroalloc_report_section(b"zero", b'{"stage": 1}'))
    """)
    assert "status 1" in unreported.stdout, unreported.stderr


def test_unwritable_report_path_warns_and_the_program_goes_on():
    result = run_program("""
        pointer = lib.zeroalloc_malloc(1 << 20, 0, None)
        assert pointer
        print("still running")
    """, ZEROALLOC_REPORT="/nonexistent/directory/run")
    assert result.returncode == 0, result.stderr
    assert "still running" in result.stdout
    assert "report: cannot write /nonexistent/directory/run.json" in result.stderr
    assert "Set ZEROALLOC_REPORT to a path prefix in a writable directory" in result.stderr


def test_report_command_prints_the_summary_and_rebuilds_the_page(tmp_path):
    run_program("kept = lib.zeroalloc_malloc(3 << 20, 0, None)", ZEROALLOC_REPORT=str(tmp_path / "r"))
    written_by_the_library = (tmp_path / "r.html").read_bytes()
    (tmp_path / "r.html").unlink()
    result = subprocess.run([sys.executable, "-m", "zeroalloc", "report", str(tmp_path / "r.json")],
                            env={**os.environ, "PYTHONPATH": str(PACKAGE)},
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "because of: exit" in result.stdout
    assert "live: 3.00 MiB (other)" in result.stdout
    assert (tmp_path / "r.html").read_bytes() == written_by_the_library, \
        "the rebuilt page differs from the one the library wrote (one template, one rendering)"


def test_report_command_rebuilds_the_page_without_the_native_library(tmp_path):
    """The package renders the page itself, from its own template: an installed copy of the
    package, with no libzeroalloc.so to be found, rebuilds it and never maps the library."""
    run_program("kept = lib.zeroalloc_malloc(3 << 20, 0, None)", ZEROALLOC_REPORT=str(tmp_path / "r"))
    written_by_the_library = (tmp_path / "r.html").read_bytes()
    (tmp_path / "r.html").unlink()
    installed = tmp_path / "site-packages"
    shutil.copytree(PACKAGE / "zeroalloc", installed / "zeroalloc",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    code = textwrap.dedent(f"""
        import sys
        from zeroalloc import report
        status = report.main([{str(tmp_path / "r.json")!r}])
        mapped = open("/proc/self/maps").read()
        print("library mapped:", "libzeroalloc" in mapped)
        sys.exit(status)
    """)
    environment = {name: value for name, value in os.environ.items()
                   if name not in ("LD_PRELOAD", "PYTHONPATH")}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                            env={**environment, "PYTHONPATH": str(installed),
                                 "ZEROALLOC_LIBRARY": str(tmp_path / "absent" / "libzeroalloc.so")},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "library mapped: False" in result.stdout
    assert (tmp_path / "r.html").read_bytes() == written_by_the_library


def test_report_command_says_what_is_wrong_with_a_file_that_is_not_a_report(tmp_path):
    (tmp_path / "other.json").write_text('{"time": "now"}')
    result = subprocess.run([sys.executable, "-m", "zeroalloc", "report",
                             str(tmp_path / "other.json")],
                            env={**os.environ, "PYTHONPATH": str(PACKAGE)},
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert "is JSON, but not a zeroalloc report" in result.stderr
    assert "Traceback" not in result.stderr


def test_page_draws_its_plot_in_headless_chromium(tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("skipped: chromium is not installed (apt-get install chromium)")
    run_program("""
        import ctypes
        kept = lib.zeroalloc_malloc(16 << 20, 0, None)
        state = lib.zeroalloc_malloc_class(16 << 20, 0, None, 3)   # an optimizer state
        lib.zeroalloc_offload.argtypes = (ctypes.c_void_p, ctypes.c_int)
        lib.zeroalloc_offload(state, 1)
        lib.zeroalloc_report_section(b"zero", b'{"stage": 1, "owned_bytes": 3145728}')
        time.sleep(0.5)
    """, ZEROALLOC_REPORT=str(tmp_path / "page"), **OFFLOAD)
    result = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                             "--dump-dom", (tmp_path / "page.html").as_uri()],
                            capture_output=True, text=True, timeout=120)
    drawn = re.search(r'data-points-drawn="(\d+)"', result.stdout)
    assert drawn, "the page's script did not run:\n" + result.stdout[-2000:] + result.stderr[-2000:]
    assert int(drawn.group(1)) >= 2
    assert '<polyline' in result.stdout and 'data-series="reserved"' in result.stdout
    assert 'data-series="host"' in result.stdout  # the host tier, drawn
    assert "offload to host memory: 16.00 MiB moved out" in result.stdout
    assert 'data-sections="1"' in result.stdout and "3.00 MiB" in result.stdout  # the section


def test_reports_show_the_bytes_offloaded_to_host_memory(tmp_path):
    prefix = tmp_path / "tiers"
    result = run_program("""
        import ctypes
        kept = lib.zeroalloc_malloc_class(32 << 20, 0, None, 1)   # a parameter
        lib.zeroalloc_offload.argtypes = (ctypes.c_void_p, ctypes.c_int)
        assert lib.zeroalloc_offload(kept, 1) == 0, zeroalloc._library.last_error()
        time.sleep(0.6)                                           # sampled on the host
    """, ZEROALLOC_REPORT=str(prefix), **OFFLOAD)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "tiers.json").read_text())
    offload = report["devices"][0]["offload"]
    assert offload["bytes_to_host"] == 32 << 20
    assert offload["host_resident_bytes"] == 32 << 20
    assert offload["host_limit_bytes"] == 256 << 20
    series = report["timeline"]["devices"]["0"]
    assert max(series["host"]) == 32 << 20, "the timeline misses the host tier"
    assert min(series["device"]) >= 0 and max(series["device"]) >= 32 << 20
    summary = subprocess.run([sys.executable, "-m", "zeroalloc", "report",
                              str(tmp_path / "tiers.json")],
                             env={**os.environ, "PYTHONPATH": str(PACKAGE)},
                             capture_output=True, text=True)
    assert "offload: 32.00 MiB to the host" in summary.stdout, summary.stdout
    page = (tmp_path / "tiers.html").read_text()
    assert "offloaded to host memory" in page


def test_without_offload_the_timeline_has_no_host_series(tmp_path):
    run_program("kept = lib.zeroalloc_malloc(4 << 20, 0, None)",
                ZEROALLOC_REPORT=str(tmp_path / "plain"))
    report = json.loads((tmp_path / "plain.json").read_text())
    assert report["devices"][0]["offload"] is None
    assert "host" not in report["timeline"]["devices"]["0"]
    assert "device" in report["timeline"]["devices"]["0"]


def test_a_setting_that_is_not_utf8_still_gives_a_readable_report(tmp_path):
    """Settings come from the environment, where any bytes may stand: the report stays valid
    UTF-8 JSON (the bytes replaced) that the page inlines."""
    prefix = tmp_path / "run-\udcff"  # the byte 0xff in the file name
    result = run_program("kept = lib.zeroalloc_malloc(1 << 20, 0, None)",
                         ZEROALLOC_REPORT=str(prefix))
    assert result.returncode == 0, result.stderr
    written = Path(f"{prefix}.json").read_bytes()
    report = json.loads(written.decode("utf-8"))  # strict: valid UTF-8
    assert report["settings"]["ZEROALLOC_REPORT"].endswith("run-\ufffd")
    assert written.decode("utf-8") in Path(f"{prefix}.html").read_bytes().decode("utf-8")


def test_reports_show_per_step_what_was_resident_what_moved_and_the_limit(tmp_path):
    """Each step boundary (zeroalloc_step_boundary) starts a step: the report says, per step,
    what each class held on the device at its end and what moved each way during it; the
    timeline samples the limit in force."""
    result = run_program("""
        MiB = 1 << 20
        parameters = lib.zeroalloc_malloc_class(32 * MiB, 0, None, 1)
        assert parameters, zeroalloc._library.last_error()
        time.sleep(0.3)
        lib.zeroalloc_step_boundary()                               # step 1: allocated
        assert lib.zeroalloc_offload(parameters, 1) == 0, zeroalloc._library.last_error()
        time.sleep(0.3)
        lib.zeroalloc_step_boundary()                               # step 2: to the host
        assert lib.zeroalloc_fetch(parameters, 1) == 0, zeroalloc._library.last_error()
        time.sleep(0.3)
        lib.zeroalloc_step_boundary()                               # step 3: back
        time.sleep(0.3)                                             # step 4, under way at exit
    """, ZEROALLOC_REPORT=str(tmp_path / "steps"), ZEROALLOC_MEMORY_LIMIT="512MiB", **OFFLOAD)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "steps.json").read_text())
    steps = report["steps"]
    assert [(s["first_step"], s["last_step"], s["ended"]) for s in steps] == \
        [(1, 1, True), (2, 2, True), (3, 3, True), (4, 4, False)]
    assert steps[0]["start_ms"] == 0
    for earlier, later in zip(steps, steps[1:]):
        assert later["start_ms"] == earlier["end_ms"] >= earlier["start_ms"] + 250
    figures = [s["devices"]["0"] for s in steps]
    assert [f["device_class_bytes"]["parameter"] for f in figures] == [32 << 20, 0, 32 << 20, 32 << 20]
    assert [f["bytes_to_host"] for f in figures] == [0, 32 << 20, 0, 0]
    assert [f["bytes_to_device"] for f in figures] == [0, 0, 32 << 20, 0]
    assert all(f["device_waited_ns"] >= 0 for f in figures)
    # What each class held on the host at each step's end, and the program's waits.
    assert [f["host_class_bytes"]["parameter"] for f in figures] == [0, 32 << 20, 0, 0]
    assert all(f["waited_for_room_ns"] >= 0 and f["waited_for_moves_ns"] >= 0 for f in figures)
    limits = report["timeline"]["devices"]["0"]["limit"]
    assert len(limits) == len(report["timeline"]["t_ms"]) and set(limits) == {512 << 20}
    summary = subprocess.run([sys.executable, "-m", "zeroalloc", "report",
                              str(tmp_path / "steps.json")],
                             env={**os.environ, "PYTHONPATH": str(PACKAGE)},
                             capture_output=True, text=True, timeout=60)
    assert "steps: 3 ended, the last at" in summary.stdout, summary.stdout + summary.stderr


def test_the_disk_tier_shows_in_the_report_and_its_steps(tmp_path):
    """With ZEROALLOC_NVME_PATH, optimizer states beyond the host limit go to disk: the
    report says how much is there, and each step what was written and read."""
    swap = tmp_path / "swap"
    swap.mkdir()
    result = run_program("""
        import ctypes
        MiB = 1 << 20
        states = []
        for i in range(8):  # 64 MiB: 32 on the device, 16 on the host, 16 on disk
            state = lib.zeroalloc_malloc_class(8 * MiB, 0, None, 3)
            assert state, zeroalloc._library.last_error()
            lib.zeroalloc_use_begins(ctypes.c_void_p(state), None)
            lib.zeroalloc_use_ends(ctypes.c_void_p(state), None)
            states.append(state)
        lib.zeroalloc_step_boundary()                               # step 1: some to disk
        for state in states:                                        # step 2: all used again
            lib.zeroalloc_use_begins(ctypes.c_void_p(state), None)
            lib.zeroalloc_use_ends(ctypes.c_void_p(state), None)
        lib.zeroalloc_step_boundary()
    """, ZEROALLOC_REPORT=str(tmp_path / "disk"), ZEROALLOC_MEMORY_LIMIT="32MiB",
        ZEROALLOC_OFFLOAD="host", ZEROALLOC_HOST_LIMIT="16MiB", ZEROALLOC_CHUNK_SIZE="8MiB",
        ZEROALLOC_NVME_PATH=str(swap), ZEROALLOC_NVME_SIZE="64MiB", ZEROALLOC_ACCESS="hinted")
    if "O_DIRECT" in result.stderr or "io_uring" in result.stderr:
        pytest.skip(f"skipped: the disk tier cannot run here: {result.stderr[-300:]}")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "disk.json").read_text())
    offload = report["devices"][0]["offload"]
    assert offload["disk_capacity_bytes"] == 64 << 20
    assert offload["bytes_to_disk"] >= 16 << 20 and offload["bytes_from_disk"] >= 16 << 20
    steps = [s["devices"]["0"] for s in report["steps"] if s["ended"]]
    assert steps[0]["bytes_to_disk"] >= 16 << 20, steps
    assert steps[0]["disk_resident_bytes"] >= 16 << 20, steps
    assert steps[1]["bytes_from_disk"] >= 16 << 20, steps  # brought back for their uses
    assert sum(s["disk_ns"] for s in steps) > 0
    summary = subprocess.run([sys.executable, "-m", "zeroalloc", "report",
                              str(tmp_path / "disk.json")],
                             env={**os.environ, "PYTHONPATH": str(PACKAGE)},
                             capture_output=True, text=True, timeout=60)
    assert "disk tier: " in summary.stdout and "of 64.00 MiB" in summary.stdout, summary.stdout


def test_steps_are_recorded_without_offload_and_stay_bounded_over_a_long_run(tmp_path):
    result = run_program("""
        kept = lib.zeroalloc_malloc_class(32 << 20, 0, None, 2)  # gradients
        for _ in range(1100):
            lib.zeroalloc_step_boundary()
    """, ZEROALLOC_REPORT=str(tmp_path / "long"))
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "long.json").read_text())
    steps = report["steps"]
    ended = [s for s in steps if s["ended"]]
    assert len(ended) <= 512, "the step records grow with the run"
    assert ended[0]["first_step"] == 1 and ended[-1]["last_step"] == 1100
    for earlier, later in zip(ended, ended[1:]):  # merged neighbours: no step lost
        assert later["first_step"] == earlier["last_step"] + 1
    assert steps[-1]["first_step"] == 1101 and not steps[-1]["ended"]
    figures = steps[-1]["devices"]["0"]
    assert figures["device_class_bytes"]["gradient"] == 32 << 20
    assert figures["bytes_to_host"] == 0 and report["devices"][0]["offload"] is None
    # A device's limit without ZEROALLOC_MEMORY_LIMIT: its whole memory.
    assert set(report["timeline"]["devices"]["0"]["limit"]) == \
        {report["devices"][0]["stats"]["limit_bytes"]}


def test_a_run_that_marks_no_steps_has_none(tmp_path):
    run_program("kept = lib.zeroalloc_malloc(1 << 20, 0, None)", ZEROALLOC_REPORT=str(tmp_path / "r"))
    assert json.loads((tmp_path / "r.json").read_text())["steps"] == []


def png_pixels(path: Path) -> tuple[int, int, list[tuple[int, int, int]]]:
    """Width, height and the RGB pixels of an 8-bit RGB or RGBA PNG (what Chromium writes),
    decoded with the standard library."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    offset, compressed, header = 8, b"", None
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset:offset + 4])
        kind, body = data[offset + 4:offset + 8], data[offset + 8:offset + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            compressed += body
        offset += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    channels = 3 if colour == 2 else 4
    raw = zlib.decompress(compressed)
    stride = width * channels
    rows, previous = [], bytearray(stride)
    for r in range(height):
        start = r * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up = previous[i]
            up_left = previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                estimate = left + up - up_left
                nearest = min((abs(estimate - left), 0, left), (abs(estimate - up), 1, up),
                              (abs(estimate - up_left), 2, up_left))[2]
                line[i] = (line[i] + nearest) & 0xFF
        rows.append(line)
        previous = line
    pixels = [tuple(row[i:i + 3]) for row in rows for i in range(0, stride, channels)]
    return width, height, pixels


def test_page_draws_the_limit_and_the_steps_in_a_screenshot(tmp_path):
    """A run of several steps under a limit, opened in headless Chromium as a user would: the
    script runs without error, the limit is a red dashed line on the timeline with a marker
    where each step begins, both axes name their units, the steps table has a row per step,
    and the screenshot shows the limit's red."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("skipped: chromium is not installed (apt-get install chromium)")
    result = run_program("""
        MiB = 1 << 20
        states = lib.zeroalloc_malloc_class(48 * MiB, 0, None, 3)   # optimizer states
        for step in range(5):
            activations = [lib.zeroalloc_malloc(16 * MiB, 0, None) for _ in range(2 + step % 3)]
            time.sleep(0.25)
            for pointer in activations:
                lib.zeroalloc_free(pointer, 0, 0, None)
            if step == 2:
                assert lib.zeroalloc_offload(states, 1) == 0, zeroalloc._library.last_error()
            lib.zeroalloc_step_boundary()
        time.sleep(0.2)
    """, ZEROALLOC_REPORT=str(tmp_path / "run"), ZEROALLOC_MEMORY_LIMIT="160MiB", **OFFLOAD)
    assert result.returncode == 0, result.stderr
    page = (tmp_path / "run.html").as_uri()
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--window-size=1280,1300"]
    dom = subprocess.run([*flags, "--dump-dom", page], capture_output=True, text=True,
                         timeout=120).stdout
    failure = re.search(r'<html[^>]*data-script-error="([^"]*)"', dom)
    assert failure is None, f"the page's script failed: {failure and failure.group(1)}"
    assert re.search(r'data-points-drawn="[1-9]', dom), "the page's script did not finish:\n" + dom[-2000:]
    assert re.search(r'<polyline[^>]*class="limit-line"[^>]*data-limit-bytes="167772160"', dom)
    assert 'data-on-scale="true"' in dom
    assert 'data-step-markers="5"' in dom  # steps 2 to 6 begin on the timeline
    assert all(f'class="step-marker" data-step="{step}"' in dom for step in range(2, 7))
    assert "time since zeroalloc started (s)" in dom and "memory (MiB)" in dom
    # The device first: its limit, what it held (physical bytes, within the limit), the host.
    headline = re.search(r'<p class="headline" data-device-held-bytes="(\d+)">([^<]*)</p>', dom)
    assert headline, dom[-3000:]
    assert 0 < int(headline.group(1)) <= 160 << 20, headline.group(0)
    assert headline.group(2).startswith("limit 160.00 MiB (set by ZEROALLOC_MEMORY_LIMIT"), headline.group(2)
    assert "the host held at most 48.00 MiB" in headline.group(2), headline.group(2)
    assert "moved between device and host per step" in headline.group(2), headline.group(2)
    assert "Virtual, wherever the bytes are: peak allocated" in dom
    assert 'data-fits-width="true"' in dom, "the page is wider than a 1,280 px window"
    assert 'data-step-rows="6"' in dom and "6 (under way)" in dom
    heads = re.findall(r"<th>([^<]*)</th>", re.search(r"<tr>(<th>step</th>.*?)</tr>", dom).group(1))
    cells = re.findall(r"<td>([^<]*)</td>", re.search(r"<tr>(<td>3</td>.*?)</tr>", dom).group(1))
    moved = heads.index("to host")
    assert cells[moved:moved + 2] == ["48.00 MiB", "0 B"], cells  # step 3 moved the states out
    waited = heads.index("program waited")  # then what each class holds on the host
    assert heads[waited + 1:] == heads[3:moved], heads
    host_states = waited + 1 + heads[3:moved].index("optimizer states")
    assert cells[host_states] == "48.00 MiB" and cells[waited].endswith(" ms"), cells

    screenshot = tmp_path / "run.png"
    shot = subprocess.run([*flags, f"--screenshot={screenshot}", page], capture_output=True,
                          text=True, timeout=120)
    assert screenshot.exists(), shot.stderr[-2000:]
    width, height, pixels = png_pixels(screenshot)
    assert (width, height) == (1280, 1300)
    limit_red = sum(1 for r, g, b in pixels if abs(r - 214) < 24 and g < 80 and b < 80)
    assert limit_red > 400, f"only {limit_red} pixels of the limit's red in {screenshot}"
    assert len(set(pixels)) > 50, "the screenshot is blank"
