#!/usr/bin/env python3
"""Training a Llama-style model with zeroalloc's offload against PyTorch alone, against
FSDP2 with CPUOffloadPolicy and against DeepSpeed's ZeRO-Offload, side by side in one run.

Each configuration runs in its own process (the allocator swap is one per process):
  native   PyTorch's own allocator, everything on the GPU
  zeroalloc  zeroalloc as PyTorch's allocator (zt.install), nothing offloaded
  offload  zeroalloc with ZEROALLOC_OFFLOAD=host, zt.offload(model, optimizer), and a
           ZEROALLOC_MEMORY_LIMIT below what the native run needed, so that most optimizer
           states must live on the host
  fsdp2    torch.distributed.fsdp.fully_shard with CPUOffloadPolicy (one rank)
  ds2      DeepSpeed ZeRO-2, optimizer states on the host, CPU Adam (one rank, bf16)
  ds3      DeepSpeed ZeRO-3, optimizer states and parameters on the host (one rank, bf16)
  ds3nvme  DeepSpeed ZeRO-Infinity: ZeRO-3 with optimizer states and parameters on NVMe
           under --nvme-path (libaio; its packages in .deps/ where the system lacks them)
  ds3nvmeopt  ZeRO-Infinity with the optimizer states alone on NVMe, parameters on the host
The model is a transformers LlamaForCausalLM with random weights (1.3B parameters by
default), batch 4 x 1024 tokens, bf16 autocast, AdamW. Prints a table, then one JSON line.

    python3 bench/python/offload_llama_bench.py [--steps 10] [--modes native,zeroalloc,offload,fsdp2]

A budget sweep runs the offload mode once per limit and prints one more table: tokens/s,
hit rate, bytes moved and device wait per step, and the step's PCIe-bound estimate from
the native run and pinned bandwidth measured in the same run. `ds2` in the list stands for
the peak DeepSpeed ZeRO-2-Offload allocated in this run (its ds2 run comes first):

    python3 bench/python/offload_llama_bench.py --modes native,offload,ds2,ds3 \
        --limits-gib ds2,18,21,24.8

DeepSpeed is not installed with PyTorch; from the wheels in .whl/ds (no network needed):

    bash scripts/install-deepspeed.sh            # prints the export line for PYTHONPATH
    export PYTHONPATH=/tmp/deepspeed-site${PYTHONPATH:+:$PYTHONPATH}

A model larger than the GPU (13B: its states alone exceed it) runs the offload mode alone,
under a limit given outright, with micro-batches per step and model TFLOPS reported:

    python3 bench/python/offload_llama_bench.py --modes offload --limit-gib 128 \
        --host-limit 96GiB --hidden 5120 --intermediate 13824 --layers 40 --heads 40 \
        --accumulate 4 --checkpointing --no-autocast-cache --warmup 2 --steps 3

DeepSpeed's step varies by a quarter from one run to the next on a shared host. With
--rounds N every run runs N times, its later rounds at the limits of the first, in reverse
order every other round (an even N puts each run first as often as the others). A last
table gives each run's step a round, each offload run against each DeepSpeed run of its
own round, and the medians:

    python3 bench/python/offload_llama_bench.py --modes offload,ds2 --limits-gib 13.3 \
        --recipe fast --warmup 3 --steps 4 --rounds 4
"""

import argparse
import itertools
import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "python"


def _load_step_model():
    """The package's step model (zeroalloc/_step_model.py), loaded by path: the bench runs
    before the package is installed, and importing it must not load the library."""
    name = "zeroalloc_bench_step_model"
    spec = importlib.util.spec_from_file_location(
        name, PACKAGE / "zeroalloc" / "_step_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


step_model = _load_step_model()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", default=str(ROOT / "build" / "libzeroalloc.so"))
    parser.add_argument("--modes", default="native,zeroalloc,offload,fsdp2",
                        help="comma-separated, run in this order whatever the order given: "
                        "native, zeroalloc, ds2, ds3, ds3nvme, ds3nvmeopt, offload, fsdp2 (the ds modes need "
                        "DeepSpeed: scripts/install-deepspeed.sh)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--fsdp2-steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5504)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--states-on-host", type=float, default=0.75,
                        help="offload mode: the limit leaves room for all but this share of "
                             "the optimizer states")
    parser.add_argument("--log-dir", help="write each mode's standard error to DIR/MODE.log")
    parser.add_argument("--window-bytes", default="",
                        help="offload mode: zt.offload's window_bytes; several, comma-separated, "
                        "run the offload mode once for each")
    parser.add_argument("--step-parameters", default="",
                        help="offload mode: how the windowed step reaches parameters on the "
                        "host: bounce (copied through scratch, the default) or fetch (brought "
                        "back by use hints); a comma list runs each side by side")
    parser.add_argument("--park", default="",
                        help="offload mode: ZEROALLOC_PARK_PARAMETERS (1: evicted parameters "
                        "parked behind unmapped addresses, the default; 0: mapped on the host); "
                        "0,1 runs both side by side")
    parser.add_argument("--access", default="",
                        help="offload mode: ZEROALLOC_ACCESS (any: every move drains the device "
                        "first, the default; hinted: moves overlap compute); any,hinted runs "
                        "both side by side")
    parser.add_argument("--host-step", default="",
                        help="offload mode: ZEROALLOC_HOST_STEP (1: AdamW windows whose states "
                        "and parameters are all on the host step there, on the CPUs; 0: on the "
                        "device, the default); 0,1 runs both side by side")
    parser.add_argument("--host-step-overlap", default="",
                        help="offload mode: ZEROALLOC_HOST_STEP_OVERLAP (1: with the host step "
                        "and master weights, the CPUs finish their windows while the next "
                        "forward runs, the default; 0: within optimizer.step()); 0,1 runs both "
                        "side by side")
    parser.add_argument("--backward-uses", default="",
                        help="offload mode: ZEROALLOC_BACKWARD_USES (saved: a module's backward "
                        "brings back only the parameters its forward saved, the default; all: "
                        "every one); saved,all runs both side by side")
    parser.add_argument("--master-weights", default="",
                        help="offload mode: ZEROALLOC_MASTER_WEIGHTS (none: fp32 weights under "
                        "autocast, the default; bf16: a bf16 model whose fp32 masters are stepped "
                        "with the optimizer's states, DeepSpeed's recipe); none,bf16 runs both "
                        "side by side")
    parser.add_argument("--recipe", default="",
                        help="offload mode: ZEROALLOC_RECIPE (exact: native numbers, the "
                        "default; fast: master weights and the host step); exact,fast runs "
                        "both side by side. Not given, rows set exact (no advice in their "
                        "timed steps); ',fast' leaves it unset in one row, which is told what "
                        "fast would give it (the row's notes show the prediction)")
    parser.add_argument("--overlap-bytes", default="",
                        help="offload mode: zt.offload's overlap_bytes (states moved while "
                        "forward and backward run; 0: none); several, comma-separated, run "
                        "the offload mode once for each")
    parser.add_argument("--stage-after", type=float, default=-1.0, help=argparse.SUPPRESS)
    # Note [Whole masters on the host], for measuring it side by side: 0: masters partly on
    # the host stay so (bounced); 1: each goes there whole; 2: the last masters go there
    # whole, the others come back (last_on_host, the default).
    parser.add_argument("--whole-masters", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--switch-interval", type=float, default=0.0,
                        help="zeroalloc's workers' sys.setswitchinterval in seconds (0: Python's "
                        "0.005): "
                        "how long the host step's thread may wait for the interpreter while "
                        "the training thread runs Python")
    for _, flag, _, _, _, described in HOST_SETTINGS:
        parser.add_argument(flag, default="", help=f"offload mode: {described}; the "
                            "library's default when not given; several, comma-separated, run "
                            "the offload mode once for each")
    parser.add_argument("--gradient-class", default="",
                        help="offload mode: zt.offload's gradient_class, 0, 1 or auto (1: "
                        "gradients copied into their own allocation class once a step; auto: "
                        "tried once activations had to move, the default); 0,1,auto runs the "
                        "offload mode once for each")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="micro-batches (forward and backward) per optimizer step")
    parser.add_argument("--checkpointing", action="store_true",
                        help="recompute each layer's activations in backward (transformers' "
                        "gradient checkpointing)")
    parser.add_argument("--no-autocast-cache", action="store_true",
                        help="autocast without its cache of low-precision weight copies (for a "
                        "large model the cache holds a bf16 copy of every weight for the "
                        "whole forward: 24 GiB at 13B; without it each use casts again)")
    parser.add_argument("--limit-gib", type=float, default=0.0,
                        help="offload mode: this ZEROALLOC_MEMORY_LIMIT instead of one derived "
                        "from the native run (for models that do not fit: no native run "
                        "needed); --limits-gib, when given, replaces it")
    parser.add_argument("--limits-gib", default="",
                        help="budget sweep: run the offload mode once per limit, comma-separated "
                        "GiB or 'ds2' (the peak DeepSpeed ZeRO-2-Offload allocated in this run; "
                        "its run is added), e.g. ds2,18,21,24.8; then print the sweep's table. "
                        "Its PCIe-bound column needs the native mode in --modes")
    parser.add_argument("--host-limit", default="32GiB",
                        help="offload mode: ZEROALLOC_HOST_LIMIT")
    parser.add_argument("--nvme-path", default="",
                        help="offload mode: ZEROALLOC_NVME_PATH, the disk tier's directories "
                        "(needs --nvme-size)")
    parser.add_argument("--nvme-size", default="",
                        help="offload mode: ZEROALLOC_NVME_SIZE, the disk tier's size")
    parser.add_argument("--nvme-parameters", action="store_true",
                        help="offload mode: ZEROALLOC_NVME_PARAMETERS=1, parameters may go to "
                        "disk too, after the optimizer states")
    parser.add_argument("--profile-dir", default="",
                        help="after the timed steps, profile one more step of the native and "
                        "offload modes (torch.profiler) into DIR/MODE.trace.json.gz")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every mode this many times, each round at the limits of the "
                        "first, every other round in reverse order; prints each offload run "
                        "against each DeepSpeed run of its round, and the medians")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--limit-bytes", type=int, default=0, help=argparse.SUPPRESS)
    # Added to each process group's port in later rounds (--rounds): a mode that runs twice
    # in a row at a round's boundary does not wait for its own port to be let go.
    parser.add_argument("--port-offset", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


GIB = 2**30
DEEPSPEED_MODES = ("ds2", "ds3", "ds3nvme", "ds3nvmeopt")
KNOWN_MODES = ("native", "zeroalloc", *DEEPSPEED_MODES, "offload", "fsdp2")
# The one-rank process groups' ports, one per mode: a mode never waits for the port of the
# mode before it to be let go.
MASTER_PORTS = {"fsdp2": "29517", "ds2": "29518", "ds3": "29519", "ds3nvme": "29520",
                "ds3nvmeopt": "29521"}
BANDWIDTH_COPY_BYTES = 256 * 2**20
BANDWIDTH_REPETITIONS = 10


@dataclasses.dataclass(frozen=True)
class LimitRequest:
    """One ZEROALLOC_MEMORY_LIMIT of the offload mode, as asked for: GiB given outright, the
    peak another mode of this run allocated (footprint_of="ds2"), or, with neither, the
    native run's peak reserved less the share of the optimizer states sent to the host."""
    label: str
    gib: Optional[float] = None
    footprint_of: str = ""


def parse_limits(text: str) -> list[LimitRequest]:
    """--limits-gib: comma-separated GiB or DeepSpeed modes ("ds2,18,21,24.8")."""
    requests = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item in DEEPSPEED_MODES:
            requests.append(LimitRequest(item, footprint_of=item))
            continue
        try:
            gib = float(item)
        except ValueError:
            gib = math.nan
        if not (math.isfinite(gib) and gib > 0):
            raise ValueError(f"--limits-gib {text!r}: {item!r} is neither a positive number of "
                             f"GiB nor one of {', '.join(DEEPSPEED_MODES)} "
                             "(accepted: e.g. ds2,18,21,24.8)")
        requests.append(LimitRequest(item, gib=gib))
    return requests


def resolve_limit_bytes(request: LimitRequest, results: dict,
                        states_on_host: float) -> Optional[int]:
    """The limit in bytes, or None when the run it is read from gave no figure."""
    if request.gib is not None:
        return int(request.gib * GIB)
    if request.footprint_of:
        peak = results.get(request.footprint_of, {}).get("peak_allocated")
        return int(peak) if peak else None
    native = results.get("native", {})
    if "peak_reserved" not in native:
        return None
    states_bytes = 2 * 4 * native["parameters"]  # AdamW: two fp32 moments
    return int(native["peak_reserved"] - states_on_host * states_bytes)


@dataclasses.dataclass(frozen=True)
class Run:
    """One worker process: `name` is its row in the tables and its key in the JSON line."""
    name: str
    mode: str
    limit: Optional[LimitRequest] = None
    window_bytes: str = ""
    overlap_bytes: str = ""
    gradient_class: str = ""
    log_suffix: str = ""
    step_parameters: str = ""
    #: (variable, value) of each swept setting given a value (SWEPT_SETTINGS)
    settings: tuple = ()
    #: (argument, value) of each host step's setting given a value (HOST_SETTINGS)
    host: tuple = ()


#: Library settings the offload mode sweeps side by side: (argument, flag, variable, the
#: values accepted, the run name's tag).
SWEPT_SETTINGS = (
    ("park", "--park", "ZEROALLOC_PARK_PARAMETERS", ("0", "1"), "park"),
    ("access", "--access", "ZEROALLOC_ACCESS", ("any", "hinted"), "access"),
    ("host_step", "--host-step", "ZEROALLOC_HOST_STEP", ("0", "1"), "host"),
    ("host_step_overlap", "--host-step-overlap", "ZEROALLOC_HOST_STEP_OVERLAP", ("0", "1"),
     "behind"),
    ("backward_uses", "--backward-uses", "ZEROALLOC_BACKWARD_USES", ("saved", "all"), "bwd"),
    ("master_weights", "--master-weights", "ZEROALLOC_MASTER_WEIGHTS", ("none", "bf16"), "mw"),
    ("recipe", "--recipe", "ZEROALLOC_RECIPE", ("exact", "fast"), "recipe"),
)


#: The host step's own settings the offload mode sweeps side by side: (argument, flag, the
#: HostStep attribute the worker sets, the values accepted (a test of one), the run name's
#: tag, what the flag is for).
HOST_SETTINGS = (
    ("host_window_parameters", "--host-window-parameters", "window_parameters", str.isdigit,
     "cpuwin", "the most parameters the CPUs step in one merged window (Note [The CPUs' "
     "windows]; 0: each window alone)"),
    ("host_piece_parameters", "--host-piece-parameters", "piece_parameters", str.isdigit,
     "pieces", "the least parameters of the first piece of the CPUs' first window and of the "
     "last piece of their last, each stepped apart (Note [The run's ends in pieces]; 0: "
     "none)"),
    ("queue_gradients_ahead", "--queue-gradients-ahead", "queue_ahead", ("0", "1").__contains__,
     "ahead", "1: every gradient's copy to the host queued before the CPUs' thread starts "
     "(Note [Gradients queued ahead]), 0: by that thread"),
    ("prepare_windows_ahead", "--prepare-windows-ahead", "prepare_ahead",
     ("0", "1").__contains__, "prepared", "1: every window's library calls prepared before "
     "the CPUs' thread starts (Note [Windows prepared ahead]), 0: by that thread"),
    ("pin_buffers_ahead", "--pin-buffers-ahead", "pin_ahead", ("0", "1").__contains__,
     "pinned", "1: the host step's pinned buffers made by the library from the first forward "
     "on (Note [Pinned buffers made ahead]), 0: by the step when it first needs them"),
    ("moments_on_host", "--moments-on-host", "make_states_on_host", ("0", "1").__contains__,
     "moments", "1: the first step makes the moments of the masters the host holds there and "
     "the CPUs step them in that step (Note [States made where the CPUs step them]), 0: "
     "AdamW makes them on the device"),
    ("first_step_room", "--first-step-room", "room_first", ("0", "1").__contains__, "room",
     "1: the first step sends the masters whose moments would overflow the limit to the host "
     "and makes their moments there (Note [The first step's room]), 0: AdamW makes them on "
     "the device"),
    ("guard_behind", "--guard-behind", "guard_behind", ("0", "1").__contains__, "guarded",
     "1: under ZEROALLOC_ACCESS=any, the CPUs finish behind the next forward, the working "
     "copies guarded (Note [Behind the forward, guarded]), 0: within the step"),
)


def host_values(args) -> list:
    """Per host step's setting, the values asked for ([""] when none: the library's)."""
    values = []
    for attribute, flag, _, accepted, _, _ in HOST_SETTINGS:
        given = getattr(args, attribute)
        asked = given.split(",") if given else [""]
        if not all(accepted(each) for each in asked if each) or "" in asked and given:
            raise ValueError(f"{flag} {given!r}: not a value it takes, or several "
                             "comma-separated")
        values.append(asked)
    return values


def swept_values(args) -> list:
    """Per swept setting, the values asked for ([""] when none: the library's default)."""
    values = []
    for attribute, flag, _, accepted, _ in SWEPT_SETTINGS:
        given = getattr(args, attribute)
        asked = given.split(",") if given else [""]
        if any(each not in ("", *accepted) for each in asked):
            raise ValueError(f"{flag} {given!r}: accepted: {', '.join(accepted)} or both")
        values.append(asked)
    return values


def plan_runs(args) -> list[Run]:
    """The runs in the order they must happen: native before the offload limit derived from
    it, DeepSpeed before an offload limit read from its footprint, and the bandwidth
    measurement (for the sweep's PCIe-bound column) before the sweep."""
    modes = [mode for mode in args.modes.split(",") if mode]
    unknown = [mode for mode in modes if mode not in KNOWN_MODES]
    if unknown:
        raise ValueError(f"--modes {args.modes!r}: {', '.join(unknown)} unknown "
                         f"(accepted: {','.join(KNOWN_MODES)}, any of them)")
    sweep = parse_limits(args.limits_gib)
    offload = "offload" in modes or bool(sweep)
    if sweep:
        limits = sweep
    elif args.limit_gib:
        limits = [LimitRequest(f"{args.limit_gib:g}", gib=args.limit_gib)]
    else:
        limits = [LimitRequest("derived")]
    runs = []
    derived = offload and any(l.gib is None and not l.footprint_of for l in limits)
    if "native" in modes or derived:
        runs.append(Run("native", "native"))
    if "zeroalloc" in modes:
        runs.append(Run("zeroalloc", "zeroalloc"))
    footprints = {l.footprint_of for l in limits if offload and l.footprint_of}
    for mode in DEEPSPEED_MODES:
        if mode in modes or mode in footprints:
            runs.append(Run(mode, mode))
    if sweep:
        runs.append(Run("bandwidth", "bandwidth"))
    if offload:
        sizes = args.window_bytes.split(",") if args.window_bytes else [""]
        overlaps = args.overlap_bytes.split(",") if args.overlap_bytes else [""]
        gradients = args.gradient_class.split(",") if args.gradient_class else [""]
        reaches = args.step_parameters.split(",") if args.step_parameters else [""]
        hosts = host_values(args)
        unknown = [each for each in reaches if each not in ("", "bounce", "fetch")]
        if unknown:
            raise ValueError(f"--step-parameters {args.step_parameters!r}: accepted: bounce, fetch")
        swept = swept_values(args)
        for limit, size, overlap, gradient, reach, host, chosen in itertools.product(
                limits, sizes, overlaps, gradients, reaches, itertools.product(*hosts),
                itertools.product(*swept)):
            name = "offload"
            if sweep:
                name += f"_{limit.label}" + ("GiB" if limit.gib is not None else "")
            if len(sizes) > 1:
                name += f"_{int(size) >> 20}MiB"
            if len(overlaps) > 1:
                name += f"_ov{int(overlap) >> 20}M"
            if len(gradients) > 1:
                name += f"_grad{gradient}"
            if len(reaches) > 1:
                name += f"_{reach}"
            host_tags = "".join(f"_{tag}{value}" for (_, _, _, _, tag, _), value, values
                                in zip(HOST_SETTINGS, host, hosts) if len(values) > 1)
            name += host_tags
            tags = "".join(f"_{tag}{value}" for (_, _, _, _, tag), value, values
                           in zip(SWEPT_SETTINGS, chosen, swept) if len(values) > 1)
            name += tags
            settings = tuple((variable, value) for (_, _, variable, _, _), value
                             in zip(SWEPT_SETTINGS, chosen) if value)
            runs.append(Run(name, "offload", limit, size, overlap, gradient,
                            (f"_limit{limit.label}" if sweep else "")
                            + (f"_{reach}" if len(reaches) > 1 else "") + host_tags + tags,
                            reach, settings,
                            tuple((attribute, value) for (attribute, *_), value
                                  in zip(HOST_SETTINGS, host) if value)))
    if "fsdp2" in modes:
        runs.append(Run("fsdp2", "fsdp2"))
    return runs


@dataclasses.dataclass(frozen=True)
class Bandwidth:
    """Pinned host memory to and from the device, GB/s (1e9 bytes a second): medians of
    several copies of BANDWIDTH_COPY_BYTES; `both` counts the bytes of both directions
    copied at once, over the time the pair took."""
    host_to_device_gbps: float
    device_to_host_gbps: float
    both_gbps: float
    #: The host step's AdamW on the GPU's NUMA node, parameters a second
    #: (zeroalloc_host_adamw_rate); nan where it could not be measured.
    cpu_params_per_s: float = math.nan

    @classmethod
    def from_result(cls, result: dict) -> Optional["Bandwidth"]:
        if "error" in result:
            return None
        return cls(result["host_to_device_gbps"], result["device_to_host_gbps"],
                   result["both_gbps"], result.get("cpu_params_per_s", math.nan))


PCIE_BOUND_FORMULA = ("PCIe bound = max(native step, over / d2h, over / h2d, 2 x over / both), "
                      "over = max(0, native peak reserved - limit): a lower bound, see "
                      "pcie_bound_step_s; CPU bound = the parameters the CPUs stepped a step "
                      "(the host step) / their AdamW rate measured alone; ordered bound = "
                      "native backward + native forward + CPU bound, or with the CPUs behind "
                      "the forward (hinted) native backward + max(native forward, CPU bound): "
                      "the CPUs start when optimizer.step() is called, once the backward's "
                      "gradients are final, and the next forward needs every window they "
                      "step; step/bound: the step over the largest bound")


def pcie_bound_step_s(native_step_s: float, native_peak_reserved: int, limit_bytes: int,
                      bandwidth: Bandwidth) -> float:
    """The step time the bus allows at a limit (PCIE_BOUND_FORMULA): the bytes the native run
    held above the limit must leave the device and come back once a step, no faster than
    pinned copies move, and the step is no shorter than the native one.

    This is a lower bound under its model, not a prediction: it assumes each byte above the
    limit is needed every step and crosses exactly once each way, at the bandwidth of large
    copies with nothing else on the bus, entirely hidden behind the native step's compute,
    and that the offload run needs no more device memory than the native run reserved. The
    offload run pays what the model leaves out (copies that cannot overlap the work waiting
    for them, the hooks' host time, remaps), so measured / bound at or above 1 is expected
    and how far above 1 is what is left to win above the bus. Where the model is off the
    other way (the native peak reserved counts the caching allocator's slack, so fewer
    bytes may really need to move), a ratio below 1 says so."""
    over_bytes = max(0, native_peak_reserved - limit_bytes)
    to_host_s = over_bytes / (bandwidth.device_to_host_gbps * 1e9)
    to_device_s = over_bytes / (bandwidth.host_to_device_gbps * 1e9)
    both_s = 2 * over_bytes / (bandwidth.both_gbps * 1e9)
    return max(native_step_s, to_host_s, to_device_s, both_s)


STEP_MODEL_NOTE = ("model s: the step time of Note [The step's time model] (zeroalloc/"
                   "_step_model.py) from the native run's phases, the pinned bandwidth and the "
                   "CPUs' AdamW rate in the run, with the masters the trade puts on the host, "
                   "in the run's ordering (the CPUs behind the forward, or within the step); "
                   "only for master weights with the host step (else nan)")


def prefetch_headroom_bytes() -> int:
    """ZEROALLOC_PREFETCH_BYTES as the library reads it (zeroalloc doctor's reading), else
    its default, 512 MiB."""
    text = os.environ.get("ZEROALLOC_PREFETCH_BYTES", "")
    if not text.strip():
        return 512 << 20
    if str(PACKAGE) not in sys.path:
        sys.path.insert(0, str(PACKAGE))
    from zeroalloc.doctor import _byte_size
    size = _byte_size(text)
    if not size:
        raise ValueError(f"ZEROALLOC_PREFETCH_BYTES={text!r} is not a byte size the library "
                         "reads (for example 512MiB or 1GiB)")
    return size


def modelled_step(result: dict, native: dict, bandwidth: Optional[Bandwidth],
                  shape: Optional[dict]) -> dict:
    """Note [The step's time model] for one offload run, {} where it does not apply: a run
    with master weights and the host step (the trade), a native run's phases, the bandwidth
    and the model's shape (hidden, intermediate, layers, vocab) known. Its ordering is the
    run's: the CPUs behind the forward where they ran behind it, else within the step."""
    timed = result.get("timed") or {}
    phases = native.get("phases_s")
    behind = (result.get("overlap") or {}).get("host_behind_steps", 0) > 0
    if not (result.get("masters_traded") and timed.get("host_params")
            and timed.get("host_cpu_s") and phases and bandwidth is not None and shape
            and "peak_reserved" in result):
        return {}
    costs = step_model.Costs(phases["forward"], phases["backward"], phases["step"],
                             bandwidth.host_to_device_gbps * 1e9,
                             bandwidth.device_to_host_gbps * 1e9,
                             timed["host_params"] / timed["host_cpu_s"])
    parameters = step_model.llama_parameters(**shape)
    on_host = step_model.plan_host(parameters, result["peak_reserved"], result["limit_bytes"],
                                   prefetch_headroom_bytes())
    return step_model.predict_step(parameters, on_host, costs, behind)


def sweep_figures(result: dict, native: dict, bandwidth: Optional[Bandwidth],
                  deepspeed: dict, shape: Optional[dict] = None) -> dict:
    """One offload run's row of the sweep: figures per timed step (the worker's `timed`
    deltas, warmup left out), the PCIe bound where the native run and the bandwidth are
    known (else nan), and tokens/s over each DeepSpeed mode's."""
    timed = result.get("timed") or {}
    steps = timed.get("steps") or 0
    nan = math.nan
    if timed.get("uses"):
        hit_rate = timed["prefetch_hits"] / timed["uses"]
    else:  # no use in the timed steps: the whole run's figure
        hit_rate = (result.get("offload") or {}).get("prefetch_hit_rate", nan)
    figures = {
        "limit_gib": result["limit_bytes"] / GIB,
        "tokens_per_s": result["tokens_per_s"],
        "step_s": result["step_s"],
        "hit_rate": hit_rate,
        "moved_gib_per_step": (timed["bytes_to_host"] + timed["bytes_to_device"]) / steps / GIB
        if steps else nan,
        "host_gib": (result.get("offload") or {}).get("host_resident_bytes", nan) / GIB,
        "device_wait_s_per_step": timed["device_waited_ns"] / 1e9 / steps if steps else nan,
        # Of what moved, the parameters (both ways), and the migrator's remapping time.
        "parameter_gib_per_step": (timed.get("bytes_to_host_parameter", nan) +
                                   timed.get("bytes_to_device_parameter", nan)) / steps / GIB
        if steps else nan,
        "remap_s_per_step": timed.get("remap_ns", nan) / 1e9 / steps if steps else nan,
        # Note [Parameters parked]: evictions that left their addresses unmapped, and
        # parked chunks mapped on the host after all, per step.
        "parked_per_step": timed.get("chunks_parked", nan) / steps if steps else nan,
        "unparked_per_step": timed.get("chunks_unparked", nan) / steps if steps else nan,
        "pcie_bound_s": nan,
        "cpu_bound_s": nan,
        "ordered_bound_s": nan,
        "step_over_bound": nan,
        "model_s": nan,
        "step_over_model": nan,
    }
    modelled = modelled_step(result, native, bandwidth, shape)
    if modelled:
        figures["model_s"] = modelled["step_s"]
        figures["step_over_model"] = result["step_s"] / modelled["step_s"]
    if bandwidth is not None and steps and timed.get("host_params"):
        # The host step's CPUs over what they stepped a step, at their rate alone.
        figures["cpu_bound_s"] = timed["host_params"] / steps / bandwidth.cpu_params_per_s
        phases = native.get("phases_s") or {}
        if "forward" in phases and "backward" in phases:
            # The CPUs wait for the backward, and the next forward for the CPUs: behind it
            # where they ran behind it (ZEROALLOC_HOST_STEP_OVERLAP, hinted only), else after.
            cpus = figures["cpu_bound_s"]
            behind = (result.get("overlap") or {}).get("host_behind_steps", 0) > 0
            figures["ordered_bound_s"] = phases["backward"] + (
                max(phases["forward"], cpus) if behind else phases["forward"] + cpus)
    if bandwidth is not None and "step_s" in native and "peak_reserved" in native:
        bound = pcie_bound_step_s(native["step_s"], native["peak_reserved"],
                                  result["limit_bytes"], bandwidth)
        figures["pcie_bound_s"] = bound
        largest = max([bound] + [figures[name] for name in ("cpu_bound_s", "ordered_bound_s")
                                 if not math.isnan(figures[name])])
        figures["step_over_bound"] = result["step_s"] / largest
    for mode, each in deepspeed.items():
        figures[f"vs_{mode}"] = result["tokens_per_s"] / each["tokens_per_s"]
    return figures


def format_sweep_table(sweep: list[Run], results: dict, bandwidth: Optional[Bandwidth],
                       shape: Optional[dict] = None) -> str:
    """The budget sweep's table: one row per offload run of `sweep` (Runs), then each
    DeepSpeed mode's own footprint and speed for reference, then how the bound was made."""
    deepspeed = {mode: results[mode] for mode in DEEPSPEED_MODES
                 if "tokens_per_s" in results.get(mode, {})}
    native = results.get("native", {})
    width = max([len(run.name) for run in sweep] + [len(mode) for mode in deepspeed] + [14])
    header = (f"{'run':{width}} {'limit GiB':>10} {'tok/s':>8} {'step s':>7} {'hit rate':>8} "
              f"{'GiB/step':>8} {'params':>6} {'remap s':>7} {'parked':>6} {'mapped':>6} "
              f"{'host GiB':>8} {'wait s/step':>11} "
              f"{'PCIe bound s':>12} {'CPU bound s':>11} {'ordered s':>9} {'step/bound':>10} "
              f"{'model s':>7} "
              f"{'step/model':>10}")
    header += "".join(f" {'vs ' + mode:>7}" for mode in deepspeed)
    lines = [header]
    for run in sweep:
        result = results.get(run.name, {})
        if "tokens_per_s" not in result:
            last_words = (result.get("error") or "").strip().splitlines()[-1:]
            lines.append(f"{run.name:{width}} failed" + "".join(f": {w}" for w in last_words))
            continue
        f = sweep_figures(result, native, bandwidth, deepspeed, shape)
        limit = f"{f['limit_gib']:.1f}"
        if run.limit.footprint_of:
            limit += f" ({run.limit.label})"
        line = (f"{run.name:{width}} {limit:>10} {f['tokens_per_s']:8.0f} {f['step_s']:7.3f} "
                f"{f['hit_rate']:8.3f} {f['moved_gib_per_step']:8.2f} "
                f"{f['parameter_gib_per_step']:6.2f} {f['remap_s_per_step']:7.3f} "
                f"{f['parked_per_step']:6.0f} {f['unparked_per_step']:6.0f} {f['host_gib']:8.2f} "
                f"{f['device_wait_s_per_step']:11.3f} {f['pcie_bound_s']:12.3f} "
                f"{f['cpu_bound_s']:11.3f} {f['ordered_bound_s']:9.3f} "
                f"{f['step_over_bound']:10.2f} {f['model_s']:7.3f} "
                f"{f['step_over_model']:10.2f}")
        line += "".join(f" {f['vs_' + mode]:7.2f}" for mode in deepspeed)
        lines.append(line)
    for mode, result in deepspeed.items():  # the reference: its footprint, its speed
        lines.append(f"{mode:{width}} {result['peak_allocated'] / GIB:10.1f} "
                     f"{result['tokens_per_s']:8.0f} {result['step_s']:7.3f}")
    if deepspeed:
        lines.append(f"{', '.join(deepspeed)}: DeepSpeed itself, its peak allocated over the "
                     "timed steps as the limit")
    lines.append("GiB/step: what the engine migrated (bytes to host + to device over the timed "
                 "steps, per step); the windowed step's copies of host-resident states through "
                 "device scratch are not in it: they are about host GiB each way a step; params: "
                 "the parameters' share of it; remap s: the migrator's time remapping chunks, "
                 "per step; parked: evictions a step that left their addresses unmapped "
                 "(ZEROALLOC_PARK_PARAMETERS), mapped: parked chunks mapped on the host for a "
                 "use after all")
    lines.append(PCIE_BOUND_FORMULA)
    lines.append(STEP_MODEL_NOTE)
    if bandwidth is None:
        lines.append("pinned bandwidth: not measured (the bandwidth run failed)")
    else:
        lines.append(f"pinned bandwidth ({BANDWIDTH_COPY_BYTES >> 20} MiB copies): host to "
                     f"device {bandwidth.host_to_device_gbps:.1f} GB/s, device to host "
                     f"{bandwidth.device_to_host_gbps:.1f} GB/s, both at once "
                     f"{bandwidth.both_gbps:.1f} GB/s; the host step's AdamW "
                     f"{bandwidth.cpu_params_per_s / 1e9:.2f} G parameters/s")
    if not native.get("peak_reserved"):
        lines.append("no PCIe bound: the native run failed or was not asked for (--modes native)")
    return "\n".join(lines)


#: The host step's counters (zt.step_figures) the worker also reports over the timed steps.
HOST_TIMED = ("host_windows", "host_bytes", "host_s", "host_call_s", "host_copy_wait_s",
              "host_write_s", "host_gradient_wait_s", "host_queue_s", "host_run_s")


def format_main_table(results: dict) -> str:
    """Every run side by side: step time, tokens/s, against native and FSDP2, and notes."""
    native_step = results.get("native", {}).get("step_s")
    fsdp_tokens = results.get("fsdp2", {}).get("tokens_per_s")
    width = max([14] + [len(mode) for mode in results])
    lines = [f"{'mode':{width}} {'step s':>8} {'tokens/s':>10} {'vs native':>10} "
             f"{'vs fsdp2':>9}  notes"]
    for mode, result in results.items():
        if "error" in result:
            lines.append(f"{mode:{width}} failed")
            continue
        notes = ""
        if result.get("offload"):
            figures = result["offload"]
            notes = (f"limit {result['limit_bytes'] / GIB:.1f} GiB; host holds "
                     f"{figures['host_resident_bytes'] / GIB:.1f} GiB; moved "
                     f"{figures['bytes_to_host'] / GIB:.1f} GiB out, "
                     f"{figures['bytes_to_device'] / GIB:.1f} GiB in; hit rate "
                     f"{figures['prefetch_hit_rate']:.3f}; device waited "
                     f"{figures['device_waited_ns'] / 1e9 / max(1, figures['steps']):.3f} s/step")
            timed = result.get("timed") or {}
            if timed.get("steps") and "in_place_host_bytes" in timed:
                # Kernels that used a chunk where it lay on the host read it over PCIe.
                notes += (f"; used in place on the host "
                          f"{timed['in_place_host_bytes'] / timed['steps'] / GIB:.2f} GiB/step")
            if figures.get("disk_capacity_bytes"):
                steps = max(1, figures["steps"])
                notes += (f"; disk holds {figures['disk_resident_bytes'] / GIB:.1f} GiB, wrote "
                          f"{figures['bytes_to_disk'] / steps / GIB:.1f} and read "
                          f"{figures['bytes_from_disk'] / steps / GIB:.1f} GiB/step")
            overlap = result.get("overlap") or {}
            if overlap.get("steps"):
                notes += (f"; staged {overlap['staged_bytes'] / overlap['steps'] / GIB:.2f}, "
                          f"kept {overlap['kept_bytes'] / overlap['steps'] / GIB:.2f}, parameters "
                          f"bounced {overlap.get('bounced_parameter_bytes', 0) / overlap['steps'] / GIB:.2f}"
                          " GiB/step")
                if "gradient_class" in overlap:  # Note [Gradients' class, decided]
                    notes += f"; gradient class {overlap['gradient_class']}"
                    if overlap.get("gradient_class_on_s"):
                        notes += (f" (trial {overlap['gradient_class_on_s']:.3f} s/step against "
                                  f"{overlap['gradient_class_off_s']:.3f} without)")
                if overlap.get("recipe_advice_predicted_s"):  # Note [The fast recipe,
                    notes += (f"; recipe advice {overlap['recipe_advice']} at step "  # advised]
                              f"{overlap['recipe_advice_at_step']}: fast predicted "
                              f"{overlap['recipe_advice_predicted_s']:.3f} s/step against "
                              f"{overlap['recipe_advice_measured_s']:.3f} measured")
                if "host_windows" in overlap:  # Note [Host windows]: which path ran
                    # Over the timed steps where the worker counted them, else over the run.
                    timed = result.get("timed") or {}
                    host, steps, over = timed.get("host"), timed.get("steps"), "timed step"
                    if not host or not steps:
                        host, steps, over = overlap, overlap["steps"], "step of the run"
                    notes += (f"; host step, a {over}: {host['host_windows'] / steps:.1f} "
                              f"windows ({host['host_bytes'] / steps / GIB:.2f}"
                              f" GiB of parameters, CPUs {host['host_s'] / steps:.3f}"
                              f" s), {overlap['host_refused']} refused in all")
                    if "host_call_s" in host:  # where the CPUs' windows spend their time
                        per = {name: host.get(name, 0.0) / steps for name in (
                            "host_call_s", "host_copy_wait_s", "host_write_s",
                            "host_gradient_wait_s", "host_queue_s", "host_run_s")}
                        notes += (f" (in library calls {per['host_call_s']:.3f}, waiting for "
                                  f"copies {per['host_copy_wait_s']:.3f}, queueing copies back "
                                  f"{per['host_write_s']:.3f}; waiting for gradients "
                                  f"{per['host_gradient_wait_s']:.3f}, queueing their copies "
                                  f"{per['host_queue_s']:.3f}; runs {per['host_run_s']:.3f}"
                                  " s start to end)")
                    if overlap.get("host_behind_steps"):  # Note [The host step finishes
                        notes += (f"; finished behind the forward in "  # behind the forward]
                                  f"{overlap['host_behind_steps']} steps, uses waited "
                                  f"{overlap['host_behind_s'] / overlap['steps']:.3f} s/step")
                    if overlap.get("host_completed_bytes"):  # Note [Whole masters on the host]
                        notes += (f"; masters made whole: "
                                  f"{overlap['host_completed_bytes'] / GIB:.2f} GiB to the host,"
                                  f" {overlap.get('host_returned_bytes', 0) / GIB:.2f} back, in all")
                    if overlap.get("host_pieces"):  # Note [The run's ends in pieces]
                        notes += (f"; in pieces: {overlap['host_pieces'] / overlap['steps']:.1f}"
                                  " more a step")
                    if overlap.get("host_made_state_bytes"):  # Note [States made where
                        notes += (f"; moments made on the host: "  # the CPUs step them]
                                  f"{overlap['host_made_state_bytes'] / GIB:.2f} GiB")
                        if overlap.get("host_placed_bytes"):  # Note [The first step's room]
                            notes += (f", for {overlap['host_placed_bytes'] / GIB:.2f} GiB of "
                                      "masters the first step sent there")
                    elif overlap.get("host_state_room_short_bytes"):
                        notes += (f"; moments left to AdamW: the host step's buffers "
                                  f"{overlap['host_state_room_short_bytes'] / GIB:.2f} GiB "
                                  "short of room")
        elif result.get("deepspeed"):
            setup = result["deepspeed"]
            notes = (f"DeepSpeed {setup['version']} ZeRO-{setup['stage']}, "
                     f"{' and '.join(setup['offloaded'])}, "
                     f"{setup['optimizer']}, bf16 weights; checkpointing "
                     f"{'on' if setup['checkpointing'] else 'off'}; peak allocated "
                     f"{result['peak_allocated'] / GIB:.1f} GiB over the timed steps, "
                     f"{result['peak_allocated_run'] / GIB:.1f} GiB over the run; reserved "
                     f"{result['peak_reserved'] / GIB:.1f} GiB")
        elif "peak_allocated" in result:
            notes = (f"peak allocated {result['peak_allocated'] / GIB:.1f} GiB, reserved "
                     f"{result['peak_reserved'] / GIB:.1f} GiB")
        notes = "fwd/bwd/step {forward:.3f}/{backward:.3f}/{step:.3f} s; ".format(
            **result["phases_s"]) + f"{result['model_tflops']:.0f} model TFLOPS; " + notes
        if result.get("warmup_steps_s"):  # the first steps against the steady one
            notes += "; warm-up steps " + ", ".join(
                f"{seconds:.2f} s ({seconds / result['step_s']:.1f} x)"
                for seconds in result["warmup_steps_s"])
        vs_native = result["step_s"] / native_step if native_step else math.nan
        vs_fsdp = result["tokens_per_s"] / fsdp_tokens if fsdp_tokens else math.nan
        lines.append(f"{mode:{width}} {result['step_s']:8.3f} {result['tokens_per_s']:10.0f} "
                     f"{vs_native:10.3f} {vs_fsdp:9.2f}  {notes}")
    return "\n".join(lines)


def build(args, torch, device, context=None):
    """The bench's Llama, its weights made on `device`, or inside `context` when given (a
    context that places them itself, as DeepSpeed's zero.Init does)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, vocab_size=args.vocab,
                         max_position_embeddings=args.seq)
    torch.manual_seed(0)
    with context if context is not None else torch.device(device):
        model = LlamaForCausalLM(config)
    return model


# The offload engine's counters whose change over the timed steps the offload worker reports
# (raw_stats' `offload` at the end counts the warmup steps too).
TIMED_COUNTERS = ("bytes_to_host", "bytes_to_device", "device_waited_ns", "uses", "prefetch_hits",
                  "bytes_to_host_parameter", "bytes_to_device_parameter", "remap_ns",
                  "chunks_parked", "chunks_unparked", "in_place_fetches", "in_place_host_bytes",
                  "bytes_to_disk", "bytes_from_disk", "disk_ns", "disk_prefetches")


def offload_counters(zeroalloc) -> dict:
    figures = zeroalloc.raw_stats(0).get("offload") or {}
    return {name: figures.get(name, 0) for name in TIMED_COUNTERS}


def timing_result(args, mode: str, parameters: int, times: list, phases: list, loss) -> dict:
    """The figures every training worker reports, from its timed steps."""
    result = {"mode": mode, "parameters": parameters, "step_s": statistics.median(times),
              "steps_s": times, "loss": float(loss.detach())}
    # Device time between marks on the default stream: forward, backward, optimizer step.
    result["phases_s"] = {name: statistics.median(p[i] for p in phases)
                          for i, name in enumerate(("forward", "backward", "step"))}
    result["tokens_per_s"] = args.batch * args.seq * args.accumulate / result["step_s"]
    # Model FLOPs per token, forward and backward, recomputation not counted (Megatron-LM's
    # count: 6 per parameter, plus attention's 12 x layers x hidden x sequence).
    flops_per_token = 6 * parameters + 12 * args.layers * args.hidden * args.seq
    result["model_tflops"] = result["tokens_per_s"] * flops_per_token / 1e12
    return result


def worker(args) -> int:
    mode = args.worker
    if mode in DEEPSPEED_MODES:
        return deepspeed_worker(args)
    if mode == "bandwidth":
        return bandwidth_worker()
    if args.switch_interval > 0:
        sys.setswitchinterval(args.switch_interval)
    import torch
    zt = zeroalloc = None
    if mode in ("zeroalloc", "offload"):
        sys.path.insert(0, str(PACKAGE))
        import zeroalloc
        import zeroalloc.torch as zt
        zt.install()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    if mode == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
        dist.init_process_group("nccl", rank=0, world_size=1)
        model = build(args, torch, "cpu")
        for layer in model.model.layers:
            fully_shard(layer, offload_policy=CPUOffloadPolicy())
        fully_shard(model, offload_policy=CPUOffloadPolicy())
    else:
        model = build(args, torch, device)
        if args.checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if mode == "offload":
        options = {}
        if args.window_bytes:
            options["window_bytes"] = int(args.window_bytes)
        if args.overlap_bytes:
            options["overlap_bytes"] = int(args.overlap_bytes)
        if args.gradient_class:
            options["gradient_class"] = ("auto" if args.gradient_class == "auto"
                                         else args.gradient_class == "1")
        zt.offload(model, optimizer, **options)
        if args.stage_after >= 0:  # the windowed step's, for this optimizer
            optimizer._zeroalloc_stepper.stage_after = args.stage_after
        if optimizer._zeroalloc_stepper.host is not None:
            optimizer._zeroalloc_stepper.host.completing = args.whole_masters > 0
            optimizer._zeroalloc_stepper.host.last_on_host = args.whole_masters == 2
            for argument, _, attribute, _, _, _ in HOST_SETTINGS:  # one value each here
                if getattr(args, argument):
                    setattr(optimizer._zeroalloc_stepper.host, attribute,
                            int(getattr(args, argument)))
        if args.step_parameters:  # Note [Parameters stepped where they are], or not
            optimizer._zeroalloc_stepper.bounce_parameters = args.step_parameters == "bounce"
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)

    marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]

    def step():
        # Phases: the first micro-batch's forward; then every backward (and the forwards of
        # later micro-batches); then the optimizer step.
        marks[0].record()
        for micro in range(args.accumulate):
            with torch.autocast("cuda", dtype=torch.bfloat16,
                                cache_enabled=not args.no_autocast_cache):
                loss = model(input_ids=tokens, labels=tokens).loss / args.accumulate
            if micro == 0:
                marks[1].record()
            if zeroalloc is not None and zeroalloc._library.last_error():
                print(f"zeroalloc last error: {zeroalloc._library.last_error()}",
                      file=sys.stderr)
            loss.backward()
        marks[2].record()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks[3].record()
        return loss

    steps = args.fsdp2_steps if mode == "fsdp2" else args.steps
    warmup = 1 if mode == "fsdp2" else args.warmup
    times, phases, warmup_times = [], [], []
    loss = None
    timed_from = None
    host_from, overlap_before, previous = {}, {}, {}
    for index in range(warmup + steps):
        if index == warmup and mode == "offload":
            timed_from = offload_counters(zeroalloc)
            host_from = zt.step_figures(optimizer)
        torch.cuda.synchronize()
        started = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        if index >= warmup:
            times.append(time.perf_counter() - started)
            phases.append([marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(3)])
        else:
            warmup_times.append(time.perf_counter() - started)
        if zeroalloc is not None:  # what each step moved, to standard error (--log-dir)
            stats = zeroalloc.raw_stats(0)
            figures = dict(stats.get("offload") or {})
            figures["reserved"] = stats["total"]["reserved_bytes"]["current"]
            figures["device_held"] = stats.get("held_bytes", 0)  # device memory, pooled too
            figures["pooled"] = stats.get("pooled_bytes", 0)
            for name, each in stats.get("classes", {}).items():
                figures[f"{name}_reserved"] = each["reserved_bytes"]["current"]
            figures["retries"] = stats["total"].get("retries", 0)
            moved = {k: figures[k] - previous[k] for k in figures
                     if isinstance(figures[k], (int, float)) and k in previous
                     and figures[k] != previous[k]}
            step_phases = [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(3)]
            overlap = zt.step_figures(optimizer) if mode == "offload" else {}
            # The step's figures count from the run's start: this step's share of each.
            own = {k: v - overlap_before.get(k, 0) for k, v in overlap.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and v != overlap_before.get(k, 0)}
            print(f"step {index}: {time.perf_counter() - started:.3f} s "
                  f"(fwd/bwd/step {'/'.join(f'{p:.3f}' for p in step_phases)}; "
                  f"this step's figures {own}); device holds "
                  f"{figures['device_held'] / 2**30:.2f} GiB, reserved "
                  f"{figures['reserved'] / 2**30:.2f} GiB; changes: " +
                  ", ".join(f"{k} {v / 2**20 if k.endswith(('bytes', 'reserved', 'held', 'pooled')) else v:.6g}"
                            for k, v in sorted(moved.items())), file=sys.stderr)
            previous, overlap_before = figures, overlap
    timed = None
    if timed_from is not None:
        timed_to = offload_counters(zeroalloc)
        timed = {name: timed_to[name] - timed_from[name] for name in TIMED_COUNTERS}
        timed["steps"] = steps
        # Note [Host windows]: what the CPUs stepped in the timed steps, and their time (each
        # window's calls, bf16 write-backs included, without the waits for its gradients:
        # the step's time model reads their rate from it). A run behind the forward may be
        # midway at either snapshot; over several steps that is a small part.
        host_to = zt.step_figures(optimizer)
        if "host_bytes" in host_to:
            timed["host_params"] = (host_to["host_bytes"] - host_from.get("host_bytes", 0)) // 4
            timed["host_cpu_s"] = host_to["host_s"] - host_from.get("host_s", 0.0)
            # The host step's counters over the timed steps alone: the run's include the
            # warm-up, its pinned buffers allocated and its masters traded.
            timed["host"] = {name: host_to[name] - host_from.get(name, 0)
                             for name in HOST_TIMED if name in host_to}
    if args.profile_dir and mode == "offload":
        # Host time inside the engine's hint calls during one step, by call.
        from zeroalloc import _offload
        spent = {}

        def timed_call(name, function):
            def call(*arguments):
                started = time.perf_counter()
                try:
                    return function(*arguments)
                finally:
                    entry = spent.setdefault(name, [0, 0.0])
                    entry[0] += 1
                    entry[1] += time.perf_counter() - started
            return call

        originals = {name: getattr(_offload, name)
                     for name in ("use_begins_many", "use_ends_many", "use_in_place_many",
                                  "residency_of")}
        for name, function in originals.items():
            setattr(_offload, name, timed_call(name, function))
        torch.cuda.synchronize()
        step()
        torch.cuda.synchronize()
        for name, function in originals.items():
            setattr(_offload, name, function)
        print("hint calls in one step: " + ", ".join(
            f"{name} {count} calls {seconds * 1e3:.1f} ms"
            for name, (count, seconds) in spent.items()), file=sys.stderr, flush=True)
    if args.profile_dir and mode in ("native", "offload"):
        import gzip
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiled:
            step()
            torch.cuda.synchronize()
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
        plain = Path(args.profile_dir) / f"{mode}.trace.json"
        profiled.export_chrome_trace(str(plain))
        with open(plain, "rb") as source, gzip.open(f"{plain}.gz", "wb") as packed:
            packed.write(source.read())
        plain.unlink()
    result = timing_result(args, mode, parameters, times, phases, loss)
    result["warmup_steps_s"] = warmup_times  # the "warm-up": against the steady step
    if mode == "native":
        result["peak_allocated"] = torch.cuda.max_memory_allocated(device)
        result["peak_reserved"] = torch.cuda.max_memory_reserved(device)
    if zeroalloc is not None:
        stats = zeroalloc.raw_stats(0)
        result["peak_allocated"] = stats["total"]["allocated_bytes"]["peak"]
        result["peak_reserved"] = stats["total"]["reserved_bytes"]["peak"]
        result["limit_bytes"] = stats["limit_bytes"]
        result["offload"] = stats.get("offload")
        result["classes"] = stats.get("classes")
        if mode == "offload":
            result["overlap"] = zt.step_figures(optimizer)
            result["timed"] = timed
            # Which rule placed the masters on the host (Note [The step's time model] models
            # the trade, 2, with master weights).
            from zeroalloc.torch._master_weights import masters_of
            result["masters_traded"] = (masters_of(optimizer) is not None
                                        and args.whole_masters == 2)
    print("result " + json.dumps(result), flush=True)
    if mode == "fsdp2":
        torch.distributed.destroy_process_group()
    return 0


def deepspeed_config(args, stage: int, nvme_path: str = "",
                     parameters_on_nvme: bool = True) -> dict:
    """ZeRO-Offload as DeepSpeed documents it for one GPU: optimizer states (and at stage 3
    the parameters) in pinned host memory, DeepSpeed's CPU Adam ("AdamW" with an offloaded
    optimizer becomes DeepSpeedCPUAdam with adamw_mode), bf16 weights; the AdamW of the
    other modes (lr 1e-4, weight decay 0.01), no gradient clipping (DeepSpeed's default
    clips at 1.0). With `nvme_path` (ds3nvme), ZeRO-Infinity: optimizer states and
    parameters in files under that directory, through DeepSpeed's libaio swapper with its
    documented settings (1 MiB blocks, queue depth 8, overlapped events). Its parameter
    swapper needs a pinned buffer for each parameter live at once: the default 5 stops a
    Llama layer (9 parameters) with "Not enough buffers 0 for swapping 1", so 24 (two
    layers and some; 4.8 GB pinned at 1e8 bf16 elements each), and no parameter is kept
    for a reuse ahead (`stage3_max_reuse_distance` 0: with checkpointing each layer's
    parameters are used again in the recompute, and the default 1e9 elements kept every
    one live until the buffers ran out). With `parameters_on_nvme` false (ds3nvmeopt) the
    parameters stay in pinned host memory and only the optimizer states go to NVMe."""
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True, "contiguous_gradients": True}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if nvme_path:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path,
                                     "pin_memory": True, "buffer_count": 4}
        if parameters_on_nvme:
            # Each buffer must hold the largest parameter (the embedding: vocab x hidden).
            zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path,
                                     "pin_memory": True, "buffer_count": 24,
                                     "buffer_size": max(100_000_000, args.vocab * args.hidden)}
            zero["stage3_max_reuse_distance"] = 0
            zero["stage3_max_live_parameters"] = 100_000_000
            zero["stage3_prefetch_bucket_size"] = 50_000_000
    extra = {"aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1,
                     "single_submit": False, "overlap_events": True}} if nvme_path else {}
    return {**extra,"train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": args.accumulate,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
            "zero_optimization": zero,
            "gradient_clipping": 0.0,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False}


def prepare_cpu_adam_build(torch) -> None:
    """DeepSpeed installed with DS_BUILD_OPS=0 compiles CPU Adam at its first use
    (torch.utils.cpp_extension.load, through ninja, into ~/.cache/torch_extensions). It is a
    host-only extension: it needs a C++ compiler with OpenMP, ninja on PATH and Python's
    headers, not nvcc. ninja's wheel installed with --target puts the program in TARGET/bin,
    beside the packages, which is on no one's PATH: add it. CUDA_HOME and the architecture
    list are set for any CUDA op DeepSpeed might build, so that it is built for this GPU
    alone."""
    if shutil.which("ninja") is None:
        places = []
        spec = importlib.util.find_spec("deepspeed")
        if spec is not None and spec.origin:
            places.append(Path(spec.origin).resolve().parents[1] / "bin")
        try:
            import ninja
            places.append(Path(ninja.BIN_DIR))
        except (ImportError, AttributeError, TypeError):
            pass
        for place in places:
            if (place / "ninja").is_file():
                os.environ["PATH"] = f"{place}{os.pathsep}{os.environ.get('PATH', '')}"
                break
        else:
            print("ninja is not on PATH nor beside deepspeed: DeepSpeed cannot build CPU Adam "
                  "(scripts/install-deepspeed.sh installs it into TARGET/bin)", file=sys.stderr)
    if "CUDA_HOME" not in os.environ and Path("/usr/local/cuda").is_dir():
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
    major, minor = torch.cuda.get_device_capability()
    # DeepSpeed 0.19.8 reads each entry of the list as numbers (with "+PTX" at most): an
    # architecture-specific entry such as "9.0a", which some images set, stops its JIT build
    # with "invalid literal for int()". Such a list is replaced by the device's own.
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").split()
    if not arch_list or any(not re.fullmatch(r"\d+\.\d+(\+PTX)?", arch) for arch in arch_list):
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    # torch.utils.cpp_extension includes this directory; a Python without its development
    # files (python3.12-dev on Ubuntu) fails the build with "Python.h: No such file".
    # Headers of the same minor version carried beside DeepSpeed's files
    # (.whl/ds/python-include/python3.X) stand in for them on the compiler's search path.
    headers = Path(sysconfig.get_path("include", scheme="posix_prefix"))
    carried = ROOT / ".whl" / "ds" / "python-include" / headers.name
    if not (headers / "Python.h").is_file() and (carried / "Python.h").is_file():
        for variable in ("CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH"):
            os.environ[variable] = os.pathsep.join(
                filter(None, [str(carried), os.environ.get(variable)]))
        print(f"{headers}/Python.h is missing: compiling CPU Adam with {carried}",
              file=sys.stderr)
    elif not (headers / "Python.h").is_file():
        print(f"{headers}/Python.h is missing: DeepSpeed's CPU Adam will not compile "
              "(install Python's development headers)", file=sys.stderr)
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        print("no C++ compiler (c++ or $CXX) on PATH: DeepSpeed's CPU Adam will not compile",
              file=sys.stderr)


def deepspeed_worker(args) -> int:
    """ds2 / ds3: the same model, batch, steps and timing as the other modes, trained by
    DeepSpeed's engine on one rank (the environment run_mode sets stands in for its
    launcher). DeepSpeed's bf16 mode trains bf16 weights with fp32 master weights on the
    host, where the other modes autocast over fp32 weights."""
    mode = args.worker
    stage = int(mode[len("ds")])
    nvme_path = ""
    if "nvme" in mode:
        nvme_path = str(Path(args.nvme_path.split(":")[0]) / "deepspeed")
        Path(nvme_path).mkdir(parents=True, exist_ok=True)
    import torch
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    prepare_cpu_adam_build(torch)
    import deepspeed
    deepspeed.init_distributed()
    config = deepspeed_config(args, stage, nvme_path, parameters_on_nvme=mode == "ds3nvme")
    # ZeRO-3 partitions a model built on the host while it initialises (the engine casts it
    # to bf16, moves it and converts its parameters), so the full fp32 model never has to fit
    # on the device; ZeRO-2 keeps the bf16 weights on the device anyway.
    if nvme_path:
        # ZeRO-Infinity's way for models larger than host memory: each layer's weights are
        # partitioned to NVMe as it is made (zero.Init), so the whole model never exists
        # in fp32 anywhere.
        placed = deepspeed.zero.Init(config_dict_or_path=config,
                                     remote_device="nvme" if mode == "ds3nvme" else "cpu",
                                     pin_memory=True)
        model = build(args, torch, device, context=placed)
    else:
        model = build(args, torch, "cpu" if stage == 3 else device)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    # Partitioned by zero.Init, a parameter holds no elements here: ds_numel is its size.
    parameters = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine, optimizer, _, _ = deepspeed.initialize(model=model,
                                                   model_parameters=model.parameters(),
                                                   config=config)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]

    def step():
        # The phases of the other modes: first forward; the backwards (with later forwards,
        # and the engine.step calls inside the accumulation, which only count); the last
        # engine.step, where the optimizer runs.
        marks[0].record()
        for micro in range(args.accumulate):
            loss = engine(input_ids=tokens, labels=tokens).loss
            if micro == 0:
                marks[1].record()
            engine.backward(loss)
            if micro + 1 < args.accumulate:
                engine.step()
        marks[2].record()
        engine.step()
        marks[3].record()
        return loss

    times, phases = [], []
    loss = None
    peak_allocated_before = 0
    for index in range(args.warmup + args.steps):
        if index == args.warmup:
            peak_allocated_before = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize()
        started = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        if index >= args.warmup:
            times.append(time.perf_counter() - started)
            phases.append([marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(3)])
        print(f"step {index}: {time.perf_counter() - started:.3f} s, allocated "
              f"{torch.cuda.memory_allocated(device) / GIB:.2f} GiB", file=sys.stderr, flush=True)
    result = timing_result(args, mode, parameters, times, phases, loss)
    result["peak_allocated"] = torch.cuda.max_memory_allocated(device)  # the timed steps
    result["peak_reserved"] = torch.cuda.max_memory_reserved(device)
    result["peak_allocated_run"] = max(peak_allocated_before, result["peak_allocated"])
    result["deepspeed"] = {
        "version": deepspeed.__version__, "stage": stage,
        "offloaded": [f"optimizer states on {'NVMe' if nvme_path else 'the host'}"]
                     + ([f"parameters on {'NVMe' if mode == 'ds3nvme' else 'the host'}"]
                        if stage == 3 else []),
        "nvme_path": nvme_path,
        "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
        "checkpointing": bool(args.checkpointing), "config": config}
    print("result " + json.dumps(result), flush=True)
    torch.distributed.destroy_process_group()
    return 0


def bandwidth_worker() -> int:
    """Pinned host memory to and from the device, each way alone and both at once on two
    streams: the medians of BANDWIDTH_REPETITIONS copies of BANDWIDTH_COPY_BYTES, after two
    untimed ones."""
    import torch
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    size = BANDWIDTH_COPY_BYTES
    host_source = torch.ones(size, dtype=torch.uint8).pin_memory()
    host_target = torch.empty(size, dtype=torch.uint8).pin_memory()
    device_target = torch.empty(size, dtype=torch.uint8, device=device)
    device_source = torch.ones(size, dtype=torch.uint8, device=device)
    to_device, to_host = torch.cuda.Stream(device), torch.cuda.Stream(device)
    main = torch.cuda.current_stream(device)

    def seconds(copy_to_device: bool, copy_to_host: bool) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        for stream, wanted, target, source in ((to_device, copy_to_device, device_target,
                                                host_source),
                                               (to_host, copy_to_host, host_target,
                                                device_source)):
            if wanted:
                stream.wait_event(start)
                with torch.cuda.stream(stream):
                    target.copy_(source, non_blocking=True)
                main.wait_stream(stream)
        end.record(main)
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def median_gbps(copy_to_device: bool, copy_to_host: bool) -> float:
        for _ in range(2):
            seconds(copy_to_device, copy_to_host)
        moved = size * (int(copy_to_device) + int(copy_to_host))
        return statistics.median(moved / seconds(copy_to_device, copy_to_host) / 1e9
                                 for _ in range(BANDWIDTH_REPETITIONS))

    result = {"mode": "bandwidth", "copy_bytes": size, "repetitions": BANDWIDTH_REPETITIONS,
              "host_to_device_gbps": median_gbps(True, False),
              "device_to_host_gbps": median_gbps(False, True),
              "both_gbps": median_gbps(True, True)}
    # The host step's CPUs alone (Note [The host step's rate]): the CPU bound's rate.
    try:
        sys.path.insert(0, str(PACKAGE))
        from zeroalloc import _offload
        result["cpu_params_per_s"] = _offload.host_adamw_rate(0)
    except Exception as error:  # noqa: BLE001  the bound is then left out, saying why
        result["cpu_rate_error"] = str(error)
    print("result " + json.dumps(result), flush=True)
    return 0


LIBAIO_PREFIX = Path("/tmp/zeroalloc-libaio")


def libaio_environment(env: dict) -> dict:
    """DeepSpeed's NVMe swapper (its async_io op, compiled at first use) needs libaio's
    headers and library. Where the system lacks them, Debian's packages carried in .deps/
    (`apt-get download libaio1 libaio-dev`) are unpacked into a prefix of their own, which
    the compiler (CPATH, LIBRARY_PATH) and the loader (LD_LIBRARY_PATH) then search."""
    if Path("/usr/include/libaio.h").is_file():
        return {}
    packages = sorted((ROOT / ".deps").glob("libaio*.deb"))
    if not packages:
        print("libaio.h is missing and .deps/ holds no libaio package: DeepSpeed's NVMe "
              "offload will not build (apt-get download libaio1 libaio-dev into .deps/)",
              file=sys.stderr)
        return {}
    for package in packages:
        subprocess.run(["dpkg", "-x", str(package), str(LIBAIO_PREFIX)], check=True)
    library = LIBAIO_PREFIX / "usr" / "lib" / "x86_64-linux-gnu"

    def first(name: str, value: str) -> str:
        return os.pathsep.join(filter(None, [value, env.get(name)]))

    return {"CPATH": first("CPATH", str(LIBAIO_PREFIX / "usr" / "include")),
            "LIBRARY_PATH": first("LIBRARY_PATH", str(library)),
            "LD_LIBRARY_PATH": first("LD_LIBRARY_PATH", str(library))}


def run_mode(args, mode: str, limit_bytes: int = 0, window_bytes: str = "",
             overlap_bytes: str = "", gradient_class: str = "", log_suffix: str = "",
             step_parameters: str = "", settings: tuple = (), host: tuple = ()) -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith("ZEROALLOC_")}
    env["ZEROALLOC_LIBRARY"] = str(Path(args.library).resolve())
    env["ZEROALLOC_DEVICE"] = "cuda"
    if mode == "offload":
        env["ZEROALLOC_LOG_LEVEL"] = os.environ.get("ZEROALLOC_LOG_LEVEL", "info")
        env["ZEROALLOC_OFFLOAD"] = "host"
        env["ZEROALLOC_HOST_LIMIT"] = args.host_limit
        env["ZEROALLOC_MEMORY_LIMIT"] = str(limit_bytes)
        # Note [The fast recipe, advised]: its probe would land in a timed step of a row
        # that did not ask for it; a row swept with the recipe unset ("--recipe ,fast")
        # shows the advice.
        if not args.recipe:
            env["ZEROALLOC_RECIPE"] = "exact"
        env.update(settings)  # the swept settings given a value (SWEPT_SETTINGS)
        if args.nvme_path:
            env["ZEROALLOC_NVME_PATH"] = args.nvme_path
            env["ZEROALLOC_NVME_SIZE"] = args.nvme_size
            # The NVMe tier needs hinted access (a state on disk has no readable bytes).
            env.setdefault("ZEROALLOC_ACCESS", "hinted")
            if args.nvme_parameters:
                env["ZEROALLOC_NVME_PARAMETERS"] = "1"
    if mode in MASTER_PORTS:  # one rank of a process group, without a launcher
        env.update({"MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(int(MASTER_PORTS[mode]) + args.port_offset)})
    if mode in DEEPSPEED_MODES:
        env.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "DS_ACCELERATOR": "cuda"})
        if "CUDA_HOME" not in env and Path("/usr/local/cuda").is_dir():
            env["CUDA_HOME"] = "/usr/local/cuda"
        if "nvme" in mode:
            env.update(libaio_environment(env))
    command = [sys.executable, __file__, "--worker", mode]
    for name in ("steps", "warmup", "fsdp2_steps", "hidden", "intermediate", "layers", "heads",
                 "vocab", "batch", "seq", "profile_dir", "accumulate", "stage_after",
                 "whole_masters", "switch_interval"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    command += ["--window-bytes", window_bytes, "--overlap-bytes", overlap_bytes]
    command += ["--gradient-class", gradient_class, "--step-parameters", step_parameters]
    flags = {argument: flag for argument, flag, *_ in HOST_SETTINGS}
    command += [each for argument, value in host for each in (flags[argument], value)]
    command += ["--nvme-path", args.nvme_path, "--nvme-size", args.nvme_size]
    command += [f"--{flag.replace('_', '-')}"
                for flag in ("checkpointing", "no_autocast_cache") if getattr(args, flag)]
    print(f"running {mode}" + (f" (ZEROALLOC_MEMORY_LIMIT={limit_bytes})" if limit_bytes else ""),
          flush=True)
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    if "nvme" in mode:
        # DeepSpeed leaves its swap files behind; the next mode needs the disk they fill.
        shutil.rmtree(Path(args.nvme_path.split(":")[0]) / "deepspeed", ignore_errors=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("result ")]
    others = [line for line in result.stdout.splitlines() if not line.startswith("result ")]
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        suffix = f"_{int(window_bytes) >> 20}MiB" if window_bytes else ""
        suffix += f"_ov{int(overlap_bytes) >> 20}MiB" if overlap_bytes else ""
        suffix += f"_grad{gradient_class}" if gradient_class else ""
        # DeepSpeed logs to standard output: what a worker printed there besides its result.
        (Path(args.log_dir) / f"{mode}{suffix}{log_suffix}.log").write_text(
            result.stderr + "".join(f"{line}\n" for line in others))
    if result.returncode != 0 or not lines:
        ours = [line for line in result.stderr.splitlines() if "zeroalloc" in line]
        print(f"{mode} failed (exit {result.returncode}):\n" + "\n".join(ours[-25:]) +
              "\n" + "\n".join(others[-10:]) + "\n" + result.stderr[-1500:], flush=True)
        return {"mode": mode, "error": result.stderr[-500:]}
    return json.loads(lines[-1][len("result "):])


def run_planned(args, run: Run, limit_bytes: int, log_suffix: str = "") -> dict:
    """run_mode for one Run of plan_runs, its log named with `log_suffix` more."""
    return run_mode(args, run.mode, limit_bytes, run.window_bytes, run.overlap_bytes,
                    run.gradient_class, run.log_suffix + log_suffix, run.step_parameters,
                    run.settings, run.host)


def run_round(args, runs: list[Run], limits: dict, number: int) -> dict:
    """Round `number` (2 or more) of --rounds: every run the first round made again, at the
    limit it had then, so that only the speeds differ. Not again: the bandwidth measurement,
    a native run made only to derive a limit, and offload runs whose limit the first round
    could not set. Even rounds run in reverse order: over an even number of rounds, a host
    growing slower or faster over the call favours no run. No profile is taken again, and
    the process groups take ports of their own (the same mode may end one round and begin the
    next)."""
    asked = args.modes.split(",")
    again = [run for run in runs if run.mode != "bandwidth" and
             (run.mode != "native" or "native" in asked) and
             (run.limit is None or run.name in limits)]
    if number % 2 == 0:
        again.reverse()
    later = argparse.Namespace(**{**vars(args), "profile_dir": "",
                                  "port_offset": 10 * (number - 1)})
    results = {}
    for run in again:
        results[run.name] = run_planned(later, run, limits.get(run.name, 0), f"_round{number}")
    return results


def format_rounds_table(runs: list[Run], rounds: list[dict]) -> str:
    """Each run's step in each round and their median, then each offload run's tokens/s over
    each DeepSpeed run's of the same round, and the median of those ratios."""
    names = [run.name for run in runs if any(run.name in each for each in rounds)]
    deepspeed = [name for name in names if name in DEEPSPEED_MODES]
    offload = [run.name for run in runs if run.mode == "offload" and run.name in names]
    width = max([len(name) for name in names] +
                [len(f"{name} vs {mode}") for name in offload for mode in deepspeed] + [14])
    header = f"{'run':{width}}" + "".join(f" {f'round {n}':>8}" for n in range(1, len(rounds) + 1))
    lines = [header + f" {'median':>8}"]

    def row(label: str, values: list, digits: int) -> str:
        known = [value for value in values if isinstance(value, float)]
        cells = "".join(f" {value if isinstance(value, str) else f'{value:.{digits}f}':>8}"
                        for value in values)
        middle = f"{statistics.median(known):.{digits}f}" if known else "none"
        return f"{label:{width}}{cells} {middle:>8}"

    def figure(result: Optional[dict], key: str):
        """The figure, else why there is none: not run that round, or failed."""
        if result is None:
            return "not run"
        return float(result[key]) if key in result else "failed"

    for name in names:
        lines.append(row(name, [figure(each.get(name), "step_s") for each in rounds], 3))
    for name in offload:
        for mode in deepspeed:
            ratios = []
            for each in rounds:
                ours, theirs = figure(each.get(name), "tokens_per_s"), figure(each.get(mode),
                                                                              "tokens_per_s")
                missing = [value for value in (ours, theirs) if isinstance(value, str)]
                ratios.append(missing[0] if missing else ours / theirs)
            lines.append(row(f"{name} vs {mode}", ratios, 2))
    lines.append("step s a round" + ("; 'vs': tokens/s over the DeepSpeed run's in the same "
                                     "round" if offload and deepspeed else "") +
                 "; every round at the first round's limits, even rounds in reverse order")
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    if args.worker:
        return worker(args)
    if any(value not in ("0", "1", "auto") for value in args.gradient_class.split(",") if value):
        print(f"--gradient-class {args.gradient_class!r}: use 0, 1, auto or several of them, "
              "comma-separated", file=sys.stderr)
        return 2
    if {"ds3nvme", "ds3nvmeopt"} & set(args.modes.split(",")) and not args.nvme_path:
        print("--modes ds3nvme and ds3nvmeopt (DeepSpeed ZeRO-Infinity) need --nvme-path: the directory "
              "for its swap files", file=sys.stderr)
        return 2
    if bool(args.nvme_path) != bool(args.nvme_size):
        print("--nvme-path and --nvme-size go together (the disk tier's directories and its "
              "size, e.g. --nvme-path /mnt/nvme --nvme-size 40GiB)", file=sys.stderr)
        return 2
    try:
        runs = plan_runs(args)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"--rounds {args.rounds}: give 1 or more", file=sys.stderr)
        return 2
    results, bandwidth_result, sweep, limits = {}, None, [], {}
    for run in runs:
        if run.mode == "bandwidth":
            bandwidth_result = run_mode(args, "bandwidth")
            continue
        limit_bytes = 0
        if run.limit is not None:
            limit_bytes = resolve_limit_bytes(run.limit, results, args.states_on_host)
            if args.limits_gib:
                sweep.append(run)
            if limit_bytes is None:
                source = run.limit.footprint_of or "native"
                print(f"{run.name} skipped: the {source} run gave no figure to set its limit",
                      flush=True)
                results[run.name] = {"mode": run.mode, "error": f"no {source} figure"}
                continue
        limits[run.name] = limit_bytes
        results[run.name] = run_planned(args, run, limit_bytes)
    print("\n" + format_main_table(results))
    if sweep:
        bandwidth = Bandwidth.from_result(bandwidth_result) if bandwidth_result else None
        shape = {"hidden": args.hidden, "intermediate": args.intermediate,
                 "layers": args.layers, "vocab": args.vocab}
        print("\nbudget sweep\n" + format_sweep_table(sweep, results, bandwidth, shape))
    rounds = [results]
    for number in range(2, args.rounds + 1):
        rounds.append(run_round(args, runs, limits, number))
    if len(rounds) > 1:
        print("\nrounds\n" + format_rounds_table(runs, rounds))
    output = {"bench": "offload_llama", "results": results}
    if len(rounds) > 1:
        output["later_rounds"] = rounds[1:]
    if bandwidth_result is not None:
        output["bandwidth"] = bandwidth_result
    print(json.dumps(output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
