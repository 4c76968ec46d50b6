#!/usr/bin/env python3
"""ZeRO across the GPUs of one host: zeroalloc's stages against DistributedDataParallel,
FSDP2 and DeepSpeed ZeRO-3 on the same Llama-style model and batch, side by side in one run.

Each mode runs as its own torchrun job (every rank one GPU):
  ddp      DistributedDataParallel, AdamW: every rank holds everything
  zero1    DDP with zt.partition(stage=1): optimizer states 1/N per rank
  zero2    zt.partition(stage=2), the model not wrapped: and gradients 1/N
  zero3    zt.partition(stage=3, model=model): and parameters 1/N between uses
  fsdp2    torch.distributed.fsdp.fully_shard per decoder layer and at the root
  ds3      DeepSpeed ZeRO-3 (bf16 weights, the client's torch AdamW; no offload)
The model is bench/python/offload_llama_bench.py's (1.3B parameters by default), batch
4 x 1024 tokens per rank, bf16 autocast (DeepSpeed: bf16 weights), AdamW lr 1e-4. Each
rank reports its step time and peak allocated memory; the table shows tokens/s per GPU
(rank 0's median step), the largest peak over the ranks, the last step's loss (the same in
every mode when they train alike) and, for zeroalloc's stages 1 and 2, the host time of
the broadcasts after each step, summed over the run.

    python3 bench/python/zero_bench.py --nproc 2 [--modes ddp,zero1,zero2,zero3,fsdp2,ds3]

DeepSpeed from .whl/ds as for the Llama bench (scripts/install-deepspeed.sh, then its
PYTHONPATH). `--device cpu` runs the zeroalloc and DDP modes over gloo on the CPU with a
tiny model: what the tests check the bench with, no figure to quote.
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODES = ("ddp", "zero1", "zero2", "zero3", "fsdp2", "ds3")


def llama_bench():
    """offload_llama_bench.py as a module: its model and its figures."""
    spec = importlib.util.spec_from_file_location(
        "offload_llama_bench", Path(__file__).with_name("offload_llama_bench.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="ddp,zero1,zero2,zero3,fsdp2,ds3")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (GPUs) per job")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5504)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--port", type=int, default=29531)
    parser.add_argument("--library", default=str(ROOT / "build" / "libzeroalloc.so"))
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.accumulate = 1
    unknown = [m for m in args.modes.split(",") if m and m not in MODES]
    if unknown:
        parser.error(f"--modes: {', '.join(unknown)} unknown (accepted: {','.join(MODES)})")
    if not args.worker and args.device == "cpu" and {"fsdp2", "ds3"} & set(args.modes.split(",")):
        parser.error("--device cpu runs ddp and zeroalloc's stages only")
    return args


def worker(args) -> int:
    import torch
    import torch.distributed as distributed
    cuda = args.device == "cuda"
    rank, ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    distributed.init_process_group("nccl" if cuda else "gloo")
    bench = llama_bench()
    mode = args.worker
    model = bench.build(args, torch, device)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    parameters = sum(p.numel() for p in model.parameters())
    handle, engine = None, None
    if mode == "ds3":
        import deepspeed
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        config = {"train_micro_batch_size_per_gpu": args.batch, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": 3, "overlap_comm": True,
                                        "contiguous_gradients": True},
                  "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
                  "steps_per_print": 10**9}
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                       config=config)
        trained = engine
    else:
        trained = model
        if mode in ("ddp", "zero1"):
            trained = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if cuda else None)
        elif mode == "fsdp2":
            from torch.distributed.fsdp import fully_shard
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        if mode.startswith("zero"):
            import zeroalloc.torch as zt
            stage = int(mode[-1])
            handle = zt.partition(optimizer, stage=stage, model=model if stage == 3 else None)
    data = torch.Generator(device=device).manual_seed(1000 + rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device, generator=data)

    def step():
        if engine is not None:
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            return loss
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = trained(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        return loss

    times = []
    for index in range(args.warmup + args.steps):
        if index == args.warmup and cuda:
            torch.cuda.reset_peak_memory_stats(device)
        if cuda:
            torch.cuda.synchronize(device)
        distributed.barrier()
        started = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize(device)
        if index >= args.warmup:
            times.append(time.perf_counter() - started)
    result = {"mode": mode, "rank": rank, "ranks": ranks, "parameters": parameters,
              "step_s": statistics.median(times), "loss": float(loss.detach()),
              "tokens_per_s_per_gpu": args.batch * args.seq / statistics.median(times),
              "peak_allocated": torch.cuda.max_memory_allocated(device) if cuda else 0}
    if handle is not None:
        figures = handle.figures
        result["zero"] = figures
        result["collectives_s"] = figures.get("broadcast_s", 0.0)
    print("result " + json.dumps(result), flush=True)
    # Every rank done with its collectives before any tears the group down: a gloo rank torn
    # down while its peer still talks to it can end in std::terminate.
    distributed.barrier()
    distributed.destroy_process_group()
    return 0


def run_mode(args, mode: str, port: int) -> list:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(args.nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
               __file__, "--worker", mode, "--device", args.device]
    for name in ("steps", "warmup", "hidden", "intermediate", "layers", "heads", "vocab",
                 "batch", "seq"):
        command += [f"--{name}", str(getattr(args, name))]
    if args.checkpointing:
        command.append("--checkpointing")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT / "bindings" / "python"), os.environ.get("PYTHONPATH")]))}
    env["ZEROALLOC_LIBRARY"] = str(Path(args.library).resolve())
    if args.device == "cpu":
        env["ZEROALLOC_DEVICE"] = "sim"
    print(f"running {mode} on {args.nproc} ranks", flush=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    # The ranks' lines can run together in the one pipe: each result is decoded where its
    # "result " mark starts, up to the end of its JSON.
    decoder, found, at = json.JSONDecoder(), [], done.stdout.find("result {")
    while at >= 0:
        value, end = decoder.raw_decode(done.stdout, at + len("result "))
        found.append(value)
        at = done.stdout.find("result {", end)
    if done.returncode != 0 or len(found) != args.nproc:
        tail = (done.stdout + done.stderr)[-2500:]
        print(f"{mode} failed (exit {done.returncode}):\n{tail}", file=sys.stderr, flush=True)
        return []
    return sorted(found, key=lambda r: r["rank"])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    results = {}
    for offset, mode in enumerate(m for m in args.modes.split(",") if m):
        results[mode] = run_mode(args, mode, args.port + 3 * offset)
    print(f"\n{'mode':<7} {'tok/s/GPU':>10} {'step s':>8} {'peak GiB':>9} "
          f"{'bcast s':>8} {'loss':>8}")
    for mode, ranks in results.items():
        if not ranks:
            print(f"{mode:<7} failed")
            continue
        first = ranks[0]
        peak = max(r["peak_allocated"] for r in ranks) / 2**30
        collectives = first.get("collectives_s")
        print(f"{mode:<7} {first['tokens_per_s_per_gpu']:>10.0f} {first['step_s']:>8.3f} "
              f"{peak:>9.2f} {collectives if collectives is not None else float('nan'):>8.3f} "
              f"{first['loss']:>8.4f}")
    print(json.dumps({"bench": "zero", "nproc": args.nproc, "results": results}))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
