#!/usr/bin/env python3
"""Training step time with libzeroalloc.so preloaded against without, in the same run.

Runs tests/python/train_small_transformer.py (PyTorch's own allocator, unmodified) in
alternating processes, with and without LD_PRELOAD, and reports the median seconds per step
of each and the overhead (target: at most 1%). The first steps (warm-up, cuBLAS set-up) are
in both and so cancel out; run enough steps that they do not dominate.

    python3 bench/python/preload_overhead_bench.py --library build/libzeroalloc.so --steps 200
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "python" / "train_small_transformer.py"


def run(library: Path, steps: int, preload: bool) -> float:
    env = dict(os.environ)
    env.pop("ZEROALLOC_LIBRARY", None)
    env["ZEROALLOC_DEVICE"] = "cuda"
    if preload:
        env["LD_PRELOAD"] = str(library)
    result = subprocess.run([sys.executable, str(SCRIPT), "--allocator", "native", "--steps",
                             str(steps)], env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        sys.exit(f"training failed (preload={preload}):\n{result.stderr[-3000:]}")
    seconds = float(re.search(r"seconds=([0-9.]+)", result.stdout).group(1))
    return seconds / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", default=str(ROOT / "build" / "libzeroalloc.so"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    library = Path(args.library).resolve()
    times = {"native": [], "preloaded": []}
    for round_index in range(args.rounds):
        for name, preload in (("native", False), ("preloaded", True)):
            times[name].append(run(library, args.steps, preload))
            print(f"round {round_index + 1}: {name} {times[name][-1] * 1e3:.3f} ms/step",
                  file=sys.stderr, flush=True)
    native = statistics.median(times["native"])
    preloaded = statistics.median(times["preloaded"])
    print(f"step time: native {native * 1e3:.3f} ms, preloaded {preloaded * 1e3:.3f} ms, "
          f"overhead {(preloaded / native - 1) * 100:+.2f}%")
    print(json.dumps({"bench": "preload_overhead", "steps": args.steps, "rounds": args.rounds,
                      "native_s_per_step": times["native"],
                      "preloaded_s_per_step": times["preloaded"],
                      "overhead": preloaded / native - 1}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
