#!/usr/bin/env python3
"""Cost of `torch.empty(n, dtype=torch.uint8, device="cuda")` + `del` from Python.

Compares zeroalloc (swapped in as PyTorch's allocator) with PyTorch's native caching
allocator. Each allocator runs in its own process, because the swap is one-shot per
process; the processes alternate (native, zeroalloc, native, zeroalloc, ...) so that drift
on a noisy machine hits both, and each allocator's figure is the median over all its
repetitions in all its runs. Prints a table, then one JSON line for bench/RESULTS.md.

    python3 bench/python/torch_empty_bench.py --library build/libzeroalloc.so
"""

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ALLOCATORS = ("native", "zeroalloc")
SIZES = ((512, "512 B"), (64 << 10, "64 KiB"), (1 << 20, "1 MiB"), (16 << 20, "16 MiB"),
         (256 << 20, "256 MiB"))
RESULT_PREFIX = "result "


def default_library() -> str:
    return os.environ.get("ZEROALLOC_LIBRARY") or str(REPO_ROOT / "build" / "libzeroalloc.so")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", default=default_library(),
                        help="path of libzeroalloc.so (default: $ZEROALLOC_LIBRARY or "
                             "<repo>/build/libzeroalloc.so)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="processes per allocator, alternated (default 2)")
    parser.add_argument("--pairs", type=int, default=20000,
                        help="timed pairs per repetition for sizes up to 1 MiB; larger "
                             "sizes use fewer (default 20000)")
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--cpu", type=int, default=2,
                        help="core every worker is pinned to (-1: no pinning)")
    parser.add_argument("--worker", choices=ALLOCATORS, help=argparse.SUPPRESS)
    return parser.parse_args()


def pairs_for(size_bytes: int, pairs: int) -> int:
    # Large blocks cost the same per pair once cached; fewer of them keep a run short.
    if size_bytes <= 1 << 20:
        return pairs
    if size_bytes <= 16 << 20:
        return max(1, pairs // 4)
    return max(1, pairs // 10)


def install_zeroalloc(library_path: str):
    """Makes zeroalloc, loaded from `library_path`, PyTorch's allocator through the package's
    installer (zeroalloc.torch.install); returns the library."""
    sys.path.insert(0, str(REPO_ROOT / "bindings" / "python"))
    os.environ["ZEROALLOC_LIBRARY"] = library_path  # the library this process runs on
    import zeroalloc
    import zeroalloc.torch as zt
    zt.install()
    return zeroalloc.library()


def zeroalloc_stats(library) -> dict:
    import ctypes

    library.zeroalloc_stats_json.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    library.zeroalloc_stats_json.restype = ctypes.c_int
    length = library.zeroalloc_stats_json(0, None, 0)
    if length < 0:
        return {}
    buffer = ctypes.create_string_buffer(length + 1)
    library.zeroalloc_stats_json(0, buffer, length + 1)
    try:
        return json.loads(buffer.value.decode(errors="replace"))
    except ValueError:
        return {"unparsed": buffer.value.decode(errors="replace")}


def run_worker(args: argparse.Namespace) -> int:
    # Every worker runs on the same core: the machines are noisy, and a run that lands on a
    # busier or slower core would otherwise be charged to its allocator.
    if args.cpu >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    import torch

    library = None
    if args.worker == "zeroalloc":
        library = install_zeroalloc(str(Path(args.library).resolve()))
    torch.cuda.set_device(0)

    empty, uint8 = torch.empty, torch.uint8
    figures = []
    for size_bytes, _ in SIZES:
        for _ in range(args.warmup):
            tensor = empty(size_bytes, dtype=uint8, device="cuda")
            del tensor
        torch.cuda.synchronize()
        pairs = pairs_for(size_bytes, args.pairs)
        samples = []
        gc.disable()  # a collection inside a timed loop would be charged to the allocator
        try:
            for _ in range(args.repetitions):
                start_ns = time.perf_counter_ns()
                for _ in range(pairs):
                    tensor = empty(size_bytes, dtype=uint8, device="cuda")
                    del tensor
                samples.append((time.perf_counter_ns() - start_ns) / pairs)
        finally:
            gc.enable()
        figures.append({"size_bytes": size_bytes, "pairs": pairs, "ns_per_pair": samples})

    report = {"allocator": args.worker, "sizes": figures,
              "torch": torch.__version__, "cuda": torch.version.cuda,
              "gpu": torch.cuda.get_device_name(0)}
    if library is not None:
        report["zeroalloc_stats"] = zeroalloc_stats(library)
    print(RESULT_PREFIX + json.dumps(report), flush=True)
    return 0


def run_once(allocator: str, args: argparse.Namespace) -> dict:
    environment = dict(os.environ)
    # The library may reject ZEROALLOC_* names it does not know; the path goes by argument.
    environment.pop("ZEROALLOC_LIBRARY", None)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", allocator,
               "--library", str(Path(args.library).resolve()), "--pairs", str(args.pairs),
               "--repetitions", str(args.repetitions), "--warmup", str(args.warmup),
               "--cpu", str(args.cpu)]
    result = subprocess.run(command, env=environment, capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if result.returncode != 0 or not lines:
        sys.stderr.write(result.stdout[-3000:] + result.stderr[-6000:])
        raise SystemExit(f"{allocator} worker failed (exit {result.returncode})")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> int:
    args = parse_args()
    if args.worker:
        return run_worker(args)
    if not Path(args.library).is_file():
        raise SystemExit(f"{args.library} does not exist: build the library or pass --library")

    runs = {allocator: [] for allocator in ALLOCATORS}
    for round_index in range(args.rounds):
        for allocator in ALLOCATORS:
            print(f"round {round_index + 1}/{args.rounds}: {allocator}", file=sys.stderr,
                  flush=True)
            runs[allocator].append(run_once(allocator, args))

    rows = []
    for size_index, (size_bytes, label) in enumerate(SIZES):
        row = {"size_bytes": size_bytes, "size": label,
               "pairs": runs["native"][0]["sizes"][size_index]["pairs"]}
        for allocator in ALLOCATORS:
            per_run = [run["sizes"][size_index]["ns_per_pair"] for run in runs[allocator]]
            row[f"{allocator}_ns_per_pair"] = statistics.median(
                sample for samples in per_run for sample in samples)
            row[f"{allocator}_ns_per_pair_by_run"] = [statistics.median(s) for s in per_run]
            row[f"{allocator}_ns_per_pair_best_run"] = min(row[f"{allocator}_ns_per_pair_by_run"])
        row["ratio_zeroalloc_over_native"] = (row["zeroalloc_ns_per_pair"]
                                              / row["native_ns_per_pair"])
        row["ratio_best_runs"] = (row["zeroalloc_ns_per_pair_best_run"]
                                  / row["native_ns_per_pair_best_run"])
        rows.append(row)

    first = runs["native"][0]
    print(f"torch.empty + del, {args.rounds} alternated runs per allocator, "
          f"{args.repetitions} repetitions each; median ns per pair")
    print(f"{'size':>8} {'native':>9} {'zeroalloc':>10} {'ratio':>6} {'best':>5}   "
          f"{'native by run':<20} zeroalloc by run")
    for row in rows:
        by_run = {allocator: "/".join(f"{value:.0f}"
                                      for value in row[f"{allocator}_ns_per_pair_by_run"])
                  for allocator in ALLOCATORS}
        print(f"{row['size']:>8} {row['native_ns_per_pair']:>9.0f} "
              f"{row['zeroalloc_ns_per_pair']:>10.0f} "
              f"{row['ratio_zeroalloc_over_native']:>6.2f} {row['ratio_best_runs']:>5.2f}   "
              f"{by_run['native']:<20} {by_run['zeroalloc']}")

    print(json.dumps({
        "bench": "torch_empty_bench",
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "host": platform.node(), "cpu": cpu_model(), "gpu": first["gpu"],
        "torch": first["torch"], "cuda": first["cuda"],
        "rounds": args.rounds, "repetitions": args.repetitions, "warmup": args.warmup,
        "results": rows,
        "zeroalloc_stats_last_run": runs["zeroalloc"][-1].get("zeroalloc_stats", {}),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
