"""The user programs, run natively and under offload, their outputs compared line by line.

    python3 tests/programs/run.py [NAME...]

Each program in this folder is written as a user writes one, with no line for zeroalloc.
It runs natively (no zeroalloc), then under offload in each mode PROGRAMS_MODES names
(comma-separated; default automatic), each run in a fresh process, under a device limit
tight enough that parameters, optimizer states, gradients and activations all move:

- automatic: through the start-up hook with ZEROALLOC_OFFLOAD=host, the no-code-change mode;
- explicit: `zt.install()` first, then `zt.offload(model, optimizer)` as each optimizer of
  PyTorch's is made, with the newest model of the program's own `llama()` whose parameters
  it steps (FSDP's parameters are registered on that model's modules, so they count); a
  program where no optimizer matched is marked "identical, no offload()";
- preload: LD_PRELOAD=libzeroalloc.so alone, no Python package: PyTorch's own caching
  allocator on top of zeroalloc's.

Every line a program prints (losses, norms, evaluations, hashes of weights, devices and
dtypes, tokens) must be identical to the native run's. The automatic and explicit runs also
print, on standard error, the bytes of each class the engine moved. A program in REFUSED
must instead stop at once with zeroalloc's refusal in the modes named there ("refused,
saying why"): what PyTorch itself cannot do under the allocator swap. Exits non-zero when a
program fails or differs in any mode; the table is printed last.

PROGRAMS_LIMIT (default 256MiB) sets the device limit;
PROGRAMS_JOBS (default 4) how many programs run at once; PROGRAMS_ENV adds variables to the
offloaded runs (NAME=VALUE, separated by spaces). PROGRAMS_MODE, one mode, is read when
PROGRAMS_MODES is not set.
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

# At exit, the bytes each class moved (automatic and explicit modes).
MOVED = """
import atexit, sys
def moved():
    from zeroalloc import _stats
    parts = []
    for name in ("parameter", "gradient", "optimizer_state", "other"):
        out, back = _stats.moved_bytes(0, name)
        parts.append(f"{name} {out >> 20}/{back >> 20} MiB")
    print("moved to the host/back:", ", ".join(parts), file=sys.stderr)
atexit.register(moved)
"""

# What the start-up hook (zeroalloc-startup.pth) does in an installed package, then the
# program as __main__.
AUTOMATIC = MOVED + """
import runpy, sys
import zeroalloc._startup
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

# The two lines of the explicit API, as a user adds them: install() before any CUDA work,
# offload(model, optimizer) once both exist. The programs build their models with
# _common.llama(), which is wrapped to remember them; each of PyTorch's optimizers calls
# offload() at the end of its constructor with the newest such model whose parameters it
# steps.
EXPLICIT = MOVED + """
import functools, runpy, sys, weakref
import zeroalloc.torch as zt
from zeroalloc.torch import _module_hints
assert not _module_hints.automatic, "an installed start-up hook made this run automatic"
zt.install()
import torch
import _common
made = []
build = _common.llama
def llama(*args, **kwargs):
    model = build(*args, **kwargs)
    made.append(weakref.ref(model))
    return model
_common.llama = llama
def offloaded_when_made(kind):
    init = kind.__init__
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if type(self) is not kind:
            return
        stepped = {id(p) for group in self.param_groups for p in group["params"]}
        for ref in reversed(made):
            model = ref()
            if model is not None and any(id(p) in stepped for p in model.parameters()):
                zt.offload(model, self)
                print(f"zt.offload({type(model).__name__}, {kind.__name__})", file=sys.stderr)
                return
    kind.__init__ = functools.wraps(init)(__init__)  # inspect.signature as before
for name in ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam",
             "Adadelta", "ASGD"):
    offloaded_when_made(getattr(torch.optim, name))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

MODES = ("automatic", "explicit", "preload")

#: Programs zeroalloc must refuse at once, saying why, in the modes that swap PyTorch's
#: allocator: the modes, and the refusal's first words (Note [CUDA graphs under the swap]
#: in zeroalloc/torch/_swap.py). Under LD_PRELOAD alone they must run identically.
REFUSED = {"cuda_graph_capture": (("automatic", "explicit"), "zeroalloc: capturing a CUDA graph")}


def programs() -> list:
    return sorted(p for p in HERE.glob("*.py") if not p.name.startswith("_") and p.name != "run.py")


def modes() -> list:
    """PROGRAMS_MODES (or PROGRAMS_MODE), checked."""
    chosen = [m.strip() for m in os.environ.get(
        "PROGRAMS_MODES", os.environ.get("PROGRAMS_MODE", "automatic")).split(",") if m.strip()]
    unknown = [m for m in chosen if m not in MODES]
    if unknown or not chosen:
        sys.exit(f"PROGRAMS_MODES={','.join(chosen)!r}: use one or more of {', '.join(MODES)}")
    return chosen


def run(program: Path, mode: str) -> "tuple[int, str, str, float]":
    """The program natively (mode "native") or under offload in `mode`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROALLOC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(PACKAGE)])
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    command = [sys.executable, str(program)]
    if mode != "native":
        env.update({"ZEROALLOC_OFFLOAD": "host", "ZEROALLOC_LIBRARY": str(LIBRARY),
                    "ZEROALLOC_MEMORY_LIMIT": os.environ.get("PROGRAMS_LIMIT", "256MiB"),
                    "ZEROALLOC_CHUNK_SIZE": "8MiB", "ZEROALLOC_HOST_LIMIT": "8GiB"})
        for pair in os.environ.get("PROGRAMS_ENV", "").split():
            name, _, value = pair.partition("=")
            env[name] = value
        if mode == "preload":
            env["PYTHONPATH"] = str(HERE)  # no package: the library alone
            env["LD_PRELOAD"] = str(LIBRARY)
        else:
            code = AUTOMATIC if mode == "automatic" else EXPLICIT
            command = [sys.executable, "-c", code, str(program)]
    started = time.monotonic()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400,
                            cwd=HERE)
    return result.returncode, result.stdout, result.stderr, time.monotonic() - started


def compare(program: Path, chosen: list) -> tuple:
    """(name, native seconds, {mode: (verdict, seconds)}, moved), and what to print."""
    code, native, native_err, native_s = run(program, "native")
    if code != 0:
        return ((program.stem, native_s, {m: ("native failed", 0.0) for m in chosen}, ""),
                f"== {program.stem}: native run failed\n{native_err[-3000:]}")
    verdicts, told, moved = {}, [], ""
    for mode in chosen:
        code, offload, offload_err, offload_s = run(program, mode)
        moved = moved or next((l for l in offload_err.splitlines() if l.startswith("moved")),
                              "")
        verdict = "failed" if code != 0 else "identical" if offload == native else "differs"
        refused_in, refusal = REFUSED.get(program.stem, ((), None))
        if verdict == "failed" and mode in refused_in and refusal in offload_err:
            verdict = "refused, saying why"
        if mode == "explicit" and verdict == "identical" and "zt.offload(" not in offload_err:
            verdict = "identical, no offload()"  # no optimizer of the program's llama()
        verdicts[mode] = (verdict, offload_s)
        if not verdict.startswith("identical"):
            told.append(f"== {program.stem} ({mode}): {verdict}\n-- native\n{native[-2000:]}\n"
                        f"-- offloaded\n{offload[-2000:]}\n{offload_err[-4000:]}")
    return (program.stem, native_s, verdicts, moved), "\n".join(told)


def main(names: list) -> int:
    chosen = [p for p in programs() if not names or p.stem in names]
    ways = modes()
    # Several at once (PROGRAMS_JOBS, default 4): each process is small beside the GPU.
    jobs = int(os.environ.get("PROGRAMS_JOBS", "4"))
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(compare, program, ways) for program in chosen]
        # Each verdict as it comes: a run stopped by a time limit still says what it found.
        for done in concurrent.futures.as_completed(futures):
            (name, native_s, verdicts, _), told = done.result()
            said = ", ".join(f"{mode} {verdict} {seconds:.1f} s"
                             for mode, (verdict, seconds) in verdicts.items())
            print(f"done: {name} (native {native_s:.1f} s; {said})", flush=True)
            if told:
                print(told, flush=True)
        rows = [future.result()[0] for future in futures]
    print(f"\n{'program':28} {'native s':>8}" + "".join(f"  {mode + ' (s)':30}" for mode in ways)
          + "  moved")
    for name, native_s, verdicts, moved in rows:
        print(f"{name:28} {native_s:8.1f}" + "".join(
            f"  {verdict + f' ({seconds:.1f})':30}" for verdict, seconds in verdicts.values())
            + f"  {moved[23:]}")
    failed = 0
    for mode in ways:
        refused = [row[0] for row in rows if row[2][mode][0] == "refused, saying why"]
        bad = [row[0] for row in rows
               if not row[2][mode][0].startswith("identical") and row[0] not in refused]
        failed += len(bad)
        told = f"; refused at once, saying why: {', '.join(refused)}" if refused else ""
        print(f"{len(rows) - len(bad) - len(refused)}/{len(rows)} programs identical under "
              f"offload ({mode}){told}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
