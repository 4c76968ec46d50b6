"""The user programs, run natively and under offload, their outputs compared line by line.

    python3 tests/programs/run.py [NAME...]

Each program in this folder is written as a user writes one, with no line for zeroalloc.
It runs twice, each in a fresh process: natively (no zeroalloc), then through the start-up
hook with ZEROALLOC_OFFLOAD=host (the no-code-change mode) under a device limit tight
enough that parameters, optimizer states, gradients and activations all move. Every line a
program prints (losses, norms, evaluations, hashes of weights, devices and dtypes, tokens)
must be identical. The offloaded run also prints, on standard error, the bytes of each class
the engine moved. Exits non-zero when a program fails or differs; the table is printed last.

PROGRAMS_MODE=preload runs the offloaded side with LD_PRELOAD=libzeroalloc.so alone instead:
no Python package, PyTorch's own caching allocator on top of zeroalloc's.
PROGRAMS_LIMIT (default 256MiB, or a program's own in LIMITS) sets the device limit;
PROGRAMS_JOBS (default 4) how many run at once; PROGRAMS_ENV adds variables to the
offloaded runs (NAME=VALUE, separated by spaces).
"""

import concurrent.futures
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PACKAGE = ROOT / "bindings" / "python"
LIBRARY = Path(os.environ.get("ZEROALLOC_LIBRARY", ROOT / "build" / "libzeroalloc.so")).resolve()

# What the start-up hook (zeroalloc-startup.pth) does in an installed package, then the
# program as __main__; at exit, the bytes each class moved.
OFFLOADED = """
import atexit, runpy, sys
import zeroalloc._startup
def moved():
    from zeroalloc import _stats
    parts = []
    for name in ("parameter", "gradient", "optimizer_state", "other"):
        out, back = _stats.moved_bytes(0, name)
        parts.append(f"{name} {out >> 20}/{back >> 20} MiB")
    print("moved to the host/back:", ", ".join(parts), file=sys.stderr)
atexit.register(moved)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# Programs that cannot run at the default limit, with their own and why. A limit below what
# one point of a program needs fails it with an out-of-memory error that names that need.
LIMITS = {
    # AMSGrad steps the 62.5 MiB embedding with its gradient and three states on the device
    # at once (docs/known-limits.md: the step steps whole parameters). At 256 MiB the step
    # failed saying that point needs at least 280 MiB.
    "optimizers": "384MiB",
}


def programs() -> list:
    return sorted(p for p in HERE.glob("*.py") if not p.name.startswith("_") and p.name != "run.py")


def run(program: Path, offloaded: bool) -> "tuple[int, str, str, float]":
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROALLOC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(PACKAGE)])
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    command = [sys.executable, str(program)]
    if offloaded:
        env.update({"ZEROALLOC_OFFLOAD": "host", "ZEROALLOC_LIBRARY": str(LIBRARY),
                    "ZEROALLOC_MEMORY_LIMIT": os.environ.get(
                        "PROGRAMS_LIMIT", LIMITS.get(program.stem, "256MiB")),
                    "ZEROALLOC_CHUNK_SIZE": "8MiB", "ZEROALLOC_HOST_LIMIT": "8GiB"})
        for pair in os.environ.get("PROGRAMS_ENV", "").split():
            name, _, value = pair.partition("=")
            env[name] = value
        command = [sys.executable, "-c", OFFLOADED, str(program)]
        if os.environ.get("PROGRAMS_MODE", "automatic") == "preload":
            env["PYTHONPATH"] = str(HERE)  # no package: the library alone
            env["LD_PRELOAD"] = str(LIBRARY)
            command = [sys.executable, str(program)]
    started = time.monotonic()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400,
                            cwd=HERE)
    return result.returncode, result.stdout, result.stderr, time.monotonic() - started


def compare(program: Path) -> tuple:
    """(name, verdict, native seconds, offloaded seconds, moved), and what to print."""
    code, native, native_err, native_s = run(program, offloaded=False)
    if code != 0:
        return ((program.stem, "native failed", native_s, 0.0, ""),
                f"== {program.stem}: native run failed\n{native_err[-3000:]}")
    code, offload, offload_err, offload_s = run(program, offloaded=True)
    moved = next((l for l in offload_err.splitlines() if l.startswith("moved")), "")
    verdict = "failed" if code != 0 else "identical" if offload == native else "differs"
    told = "" if verdict == "identical" else (
        f"== {program.stem}: {verdict}\n-- native\n{native[-2000:]}\n-- offloaded\n"
        f"{offload[-2000:]}\n{offload_err[-4000:]}")
    return (program.stem, verdict, native_s, offload_s, moved), told


def main(names: list) -> int:
    chosen = [p for p in programs() if not names or p.stem in names]
    # Several at once (PROGRAMS_JOBS, default 4): each process is small beside the GPU.
    jobs = int(os.environ.get("PROGRAMS_JOBS", "4"))
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(compare, program) for program in chosen]
        # Each verdict as it comes: a run stopped by a time limit still says what it found.
        for done in concurrent.futures.as_completed(futures):
            (name, verdict, native_s, offload_s, _), told = done.result()
            print(f"done: {name} {verdict} ({native_s:.1f} s, {offload_s:.1f} s)", flush=True)
            if told:
                print(told, flush=True)
        results = [future.result() for future in futures]
    rows = [row for row, _ in results]
    failed = [row[0] for row in rows if row[1] != "identical"]
    print(f"\n{'program':28} {'result':10} {'native s':>8} {'offload s':>9}  moved")
    for name, verdict, native_s, offload_s, moved in rows:
        print(f"{name:28} {verdict:10} {native_s:8.1f} {offload_s:9.1f}  {moved[23:]}")
    print(f"{len(rows) - len(failed)}/{len(rows)} programs identical under offload")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
