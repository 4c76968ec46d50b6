#!/usr/bin/env python3
"""Training a Llama-style model with zeroalloc's offload against PyTorch alone and against
FSDP2 with CPUOffloadPolicy, side by side in one run.

Each configuration runs in its own process (the allocator swap is one per process):
  native   PyTorch's own allocator, everything on the GPU
  zeroalloc  zeroalloc as PyTorch's allocator (zt.install), nothing offloaded
  offload  zeroalloc with ZEROALLOC_OFFLOAD=host, zt.offload(model, optimizer), and a
           ZEROALLOC_MEMORY_LIMIT below what the native run needed, so that most optimizer
           states must live on the host
  fsdp2    torch.distributed.fsdp.fully_shard with CPUOffloadPolicy (one rank)
The model is a transformers LlamaForCausalLM with random weights (1.3B parameters by
default), batch 4 x 1024 tokens, bf16 autocast, AdamW. Prints a table, then one JSON line.

    python3 bench/python/offload_llama_bench.py [--steps 10] [--modes native,zeroalloc,offload,fsdp2]

A model larger than the GPU (13B: its states alone exceed it) runs the offload mode alone,
under a limit given outright, with micro-batches per step and model TFLOPS reported:

    python3 bench/python/offload_llama_bench.py --modes offload --limit-gib 128 \
        --host-limit 96GiB --hidden 5120 --intermediate 13824 --layers 40 --heads 40 \
        --accumulate 4 --checkpointing --no-autocast-cache --warmup 2 --steps 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "python"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", default=str(ROOT / "build" / "libzeroalloc.so"))
    parser.add_argument("--modes", default="native,zeroalloc,offload,fsdp2")
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
    parser.add_argument("--overlap-bytes", default="",
                        help="offload mode: zt.offload's overlap_bytes (states moved while "
                        "forward and backward run; 0: none); several, comma-separated, run "
                        "the offload mode once for each")
    parser.add_argument("--stage-after", type=float, default=-1.0, help=argparse.SUPPRESS)
    parser.add_argument("--gradient-class", default="",
                        help="offload mode: zt.offload's gradient_class, 0 or 1 (1: gradients "
                        "copied into their own allocation class once a step); 0,1 runs the "
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
                        "from the native run (for models that do not fit: no native run needed)")
    parser.add_argument("--host-limit", default="32GiB",
                        help="offload mode: ZEROALLOC_HOST_LIMIT")
    parser.add_argument("--profile-dir", default="",
                        help="after the timed steps, profile one more step of the native and "
                        "offload modes (torch.profiler) into DIR/MODE.trace.json.gz")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--limit-bytes", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build(args, torch, device):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, vocab_size=args.vocab,
                         max_position_embeddings=args.seq)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model


def worker(args) -> int:
    mode = args.worker
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
            options["gradient_class"] = args.gradient_class == "1"
        zt.offload(model, optimizer, **options)
        if args.stage_after >= 0:  # the windowed step's, for this optimizer
            optimizer._zeroalloc_stepper.stage_after = args.stage_after
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
    times, phases = [], []
    loss = None
    for index in range(warmup + steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        if index >= warmup:
            times.append(time.perf_counter() - started)
            phases.append([marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(3)])
        if zeroalloc is not None:  # what each step moved, to standard error (--log-dir)
            stats = zeroalloc.raw_stats(0)
            figures = dict(stats.get("offload") or {})
            figures["reserved"] = stats["total"]["reserved_bytes"]["current"]
            figures["device_held"] = stats.get("held_bytes", 0)  # device memory, pooled too
            figures["pooled"] = stats.get("pooled_bytes", 0)
            for name, each in stats.get("classes", {}).items():
                figures[f"{name}_reserved"] = each["reserved_bytes"]["current"]
            figures["retries"] = stats["total"].get("retries", 0)
            if index > 0:
                moved = {k: figures[k] - previous[k] for k in figures
                         if isinstance(figures[k], (int, float)) and k in previous
                         and figures[k] != previous[k]}
                step_phases = [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(3)]
                overlap = zt.step_figures(optimizer) if mode == "offload" else {}
                print(f"step {index}: {time.perf_counter() - started:.3f} s "
                      f"(fwd/bwd/step {'/'.join(f'{p:.3f}' for p in step_phases)}; "
                      f"overlap {overlap}); device holds "
                      f"{figures['device_held'] / 2**30:.2f} GiB, reserved "
                      f"{figures['reserved'] / 2**30:.2f} GiB; changes: " +
                      ", ".join(f"{k} {v / 2**20 if k.endswith(('bytes', 'reserved', 'held', 'pooled')) else v:.6g}"
                                for k, v in sorted(moved.items())), file=sys.stderr)
            previous = figures
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
    result = {"mode": mode, "parameters": parameters, "step_s": statistics.median(times),
              "steps_s": times, "loss": float(loss)}
    # Device time between marks on the default stream: forward, backward, optimizer step.
    result["phases_s"] = {name: statistics.median(p[i] for p in phases)
                          for i, name in enumerate(("forward", "backward", "step"))}
    result["tokens_per_s"] = args.batch * args.seq * args.accumulate / result["step_s"]
    # Model FLOPs per token, forward and backward, recomputation not counted (Megatron-LM's
    # count: 6 per parameter, plus attention's 12 x layers x hidden x sequence).
    flops_per_token = 6 * parameters + 12 * args.layers * args.hidden * args.seq
    result["model_tflops"] = result["tokens_per_s"] * flops_per_token / 1e12
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
    print("result " + json.dumps(result), flush=True)
    if mode == "fsdp2":
        torch.distributed.destroy_process_group()
    return 0


def run_mode(args, mode: str, limit_bytes: int = 0, window_bytes: str = "",
             overlap_bytes: str = "", gradient_class: str = "") -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith("ZEROALLOC_")}
    env["ZEROALLOC_LIBRARY"] = str(Path(args.library).resolve())
    env["ZEROALLOC_DEVICE"] = "cuda"
    if mode == "offload":
        env["ZEROALLOC_LOG_LEVEL"] = os.environ.get("ZEROALLOC_LOG_LEVEL", "info")
        env["ZEROALLOC_OFFLOAD"] = "host"
        env["ZEROALLOC_HOST_LIMIT"] = args.host_limit
        env["ZEROALLOC_MEMORY_LIMIT"] = str(limit_bytes)
    if mode == "fsdp2":
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"})
    command = [sys.executable, __file__, "--worker", mode]
    for name in ("steps", "warmup", "fsdp2_steps", "hidden", "intermediate", "layers", "heads",
                 "vocab", "batch", "seq", "profile_dir", "accumulate", "stage_after"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    command += ["--window-bytes", window_bytes, "--overlap-bytes", overlap_bytes]
    command += ["--gradient-class", gradient_class]
    command += [f"--{flag.replace('_', '-')}"
                for flag in ("checkpointing", "no_autocast_cache") if getattr(args, flag)]
    print(f"running {mode}" + (f" (ZEROALLOC_MEMORY_LIMIT={limit_bytes})" if limit_bytes else ""),
          flush=True)
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        suffix = f"_{int(window_bytes) >> 20}MiB" if window_bytes else ""
        suffix += f"_ov{int(overlap_bytes) >> 20}MiB" if overlap_bytes else ""
        suffix += f"_grad{gradient_class}" if gradient_class else ""
        (Path(args.log_dir) / f"{mode}{suffix}.log").write_text(result.stderr)
    lines = [line for line in result.stdout.splitlines() if line.startswith("result ")]
    if result.returncode != 0 or not lines:
        ours = [line for line in result.stderr.splitlines() if "zeroalloc" in line]
        print(f"{mode} failed (exit {result.returncode}):\n" + "\n".join(ours[-25:]) +
              "\n" + result.stderr[-1500:], flush=True)
        return {"mode": mode, "error": result.stderr[-500:]}
    return json.loads(lines[-1][len("result "):])


def main() -> int:
    args = parse_args()
    if args.worker:
        return worker(args)
    modes = args.modes.split(",")
    if any(value not in ("0", "1") for value in args.gradient_class.split(",") if value):
        print(f"--gradient-class {args.gradient_class!r}: use 0, 1 or 0,1", file=sys.stderr)
        return 2
    results = {}
    if "native" in modes or ("offload" in modes and not args.limit_gib):
        results["native"] = run_mode(args, "native")
    if "zeroalloc" in modes:
        results["zeroalloc"] = run_mode(args, "zeroalloc")
    if "offload" in modes and (args.limit_gib or "peak_reserved" in results.get("native", {})):
        if args.limit_gib:
            limit = int(args.limit_gib * 2**30)
        else:
            native = results["native"]
            states_bytes = 2 * 4 * native["parameters"]  # AdamW: two fp32 moments
            limit = int(native["peak_reserved"] - args.states_on_host * states_bytes)
        sizes = args.window_bytes.split(",") if args.window_bytes else [""]
        overlaps = args.overlap_bytes.split(",") if args.overlap_bytes else [""]
        gradients = args.gradient_class.split(",") if args.gradient_class else [""]
        for size in sizes:
            for overlap in overlaps:
                for gradient in gradients:
                    name = "offload"
                    if len(sizes) > 1:
                        name += f"_{int(size) >> 20}MiB"
                    if len(overlaps) > 1:
                        name += f"_ov{int(overlap) >> 20}M"
                    if len(gradients) > 1:
                        name += f"_grad{gradient}"
                    results[name] = run_mode(args, "offload", limit, size, overlap, gradient)
    if "fsdp2" in modes:
        results["fsdp2"] = run_mode(args, "fsdp2")
    native_step = results.get("native", {}).get("step_s")
    fsdp_tokens = results.get("fsdp2", {}).get("tokens_per_s")
    print(f"\n{'mode':14} {'step s':>8} {'tokens/s':>10} {'vs native':>10} {'vs fsdp2':>9}  notes")
    for mode, result in results.items():
        if "error" in result:
            print(f"{mode:10} failed")
            continue
        notes = ""
        if result.get("offload"):
            figures = result["offload"]
            notes = (f"limit {result['limit_bytes'] / 2**30:.1f} GiB; host holds "
                     f"{figures['host_resident_bytes'] / 2**30:.1f} GiB; moved "
                     f"{figures['bytes_to_host'] / 2**30:.1f} GiB out, "
                     f"{figures['bytes_to_device'] / 2**30:.1f} GiB in; hit rate "
                     f"{figures['prefetch_hit_rate']:.3f}; device waited "
                     f"{figures['device_waited_ns'] / 1e9 / max(1, figures['steps']):.3f} s/step")
            overlap = result.get("overlap") or {}
            if overlap.get("steps"):
                notes += (f"; staged {overlap['staged_bytes'] / overlap['steps'] / 2**30:.2f}, "
                          f"kept {overlap['kept_bytes'] / overlap['steps'] / 2**30:.2f} GiB/step")
        elif "peak_allocated" in result:
            notes = (f"peak allocated {result['peak_allocated'] / 2**30:.1f} GiB, reserved "
                     f"{result['peak_reserved'] / 2**30:.1f} GiB")
        notes = "fwd/bwd/step {forward:.3f}/{backward:.3f}/{step:.3f} s; ".format(
            **result["phases_s"]) + f"{result['model_tflops']:.0f} model TFLOPS; " + notes
        vs_native = result["step_s"] / native_step if native_step else float("nan")
        vs_fsdp = result["tokens_per_s"] / fsdp_tokens if fsdp_tokens else float("nan")
        print(f"{mode:14} {result['step_s']:8.3f} {result['tokens_per_s']:10.0f} "
              f"{vs_native:10.3f} {vs_fsdp:9.2f}  {notes}")
    print(json.dumps({"bench": "offload_llama", "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
