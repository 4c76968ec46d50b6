#!/usr/bin/env python3
"""Where should AdamW step when its states do not fit on the GPU? Side by side in one process,
for the parameter shapes of a Llama-style model (1.3B parameters by default):

  device     every state on the device (the floor)
  in_place   a share of the states moved to pinned host memory by zeroalloc (same addresses);
             the same kernels read and write them over PCIe, nothing migrates
  bounce     the same share stays on the host; each window's states are copied into device
             scratch, stepped there and copied back, copies overlapping the kernels
  shipped    the same share, stepped by what zt.offload(model, optimizer) installs (the
             bounce above, with use hints, in zeroalloc.torch)
  migrate    the same share fetched to the device in windows before the step and evicted
             after it (remapped both ways), as a windowed step with migration does
  host_adam  the share's parameters, gradients and states stepped on the CPU (PyTorch's
             fused CPU AdamW on pinned memory): gradients copied to the host, parameters back

each with PyTorch's fused AdamW, and device, in_place, bounce and shipped also with its
foreach AdamW.
Every mode must produce the parameters the device mode does (checked; the host mode within a
tolerance, the CPU kernel rounds differently). Needs a GPU; runs zeroalloc as PyTorch's
allocator with ZEROALLOC_OFFLOAD=host, set by this script for its own worker process.

    python3 bench/python/optimizer_step_bench.py [--host-share 0.75] [--repeats 5]
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def shapes(hidden: int, intermediate: int, layers: int, vocab: int) -> list:
    per_layer = [(hidden, hidden)] * 4 + [(intermediate, hidden)] * 2 + [(hidden, intermediate)]
    per_layer += [(hidden,)] * 2
    return [(vocab, hidden)] + per_layer * layers + [(hidden,), (vocab, hidden)]


def timed(torch, work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        work()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def worker(args) -> int:
    import torch
    sys.path.insert(0, str(ROOT / "bindings" / "python"))
    import zeroalloc.torch as zt
    zt.install()
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    with zt.allocation_class("parameter"):
        params = [torch.randn(s, device=device) * 0.02 for s in
                  shapes(args.hidden, args.intermediate, args.layers, args.vocab)]
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    count = sum(p.numel() for p in params)
    # The share of parameters (from the front) whose states go to the host.
    host_count, host_params = 0, 0
    for p in params:
        if host_count >= args.host_share * count:
            break
        host_count += p.numel()
        host_params += 1
    results = {"parameters": count, "host_share": host_count / count,
               "state_bytes_on_host": host_count * 8, "host_threads": torch.get_num_threads()}
    references = {}

    def states(optimizer, copies):
        return [optimizer.state[p][k] for p in copies for k in ("exp_avg", "exp_avg_sq")]

    def run(mode, flavour, offload):
        """A fresh optimizer (step 1 creates the states), the share's states offloaded when
        `offload`, then `args.repeats` timed steps of `mode(copies, optimizer)`."""
        copies = [p.detach().clone().requires_grad_(True) for p in params]
        for copy, grad in zip(copies, grads):
            copy.grad = grad
        optimizer = torch.optim.AdamW(copies, lr=1e-3, **{flavour: True})
        with zt.allocation_class("optimizer_state"):
            optimizer.step()
        if offload:
            for state in states(optimizer, copies[:host_params]):
                zt.offload_tensor(state)
        torch.cuda.synchronize()
        work = mode(copies, optimizer)
        name = f"{mode.__name__}_{flavour}"
        results[f"{name}_s"] = timed(torch, work, args.repeats)
        if mode is device:
            references[flavour] = [p.detach().clone() for p in copies]
            results[f"{name}_all_on_device"] = all(
                zt.residency(s) == "device" for s in states(optimizer, copies))
        else:
            tolerance = 1e-5 if mode is host_adam else 0.0
            worst = max(float((a - b).abs().max()) for a, b in zip(copies, references[flavour]))
            results[f"{name}_max_difference"] = worst
            if worst > tolerance:
                print(f"{name}: parameters differ from the device run by up to {worst}",
                      file=sys.stderr)
                results[f"{name}_wrong"] = True
        if offload and mode is in_place:
            results[f"{name}_still_on_host"] = all(
                zt.residency(s) == "host" for s in states(optimizer, copies[:host_params]))
        del copies, optimizer, work
        gc.collect()  # the windowed step is a bound method: optimizer and step form a cycle
        torch.cuda.empty_cache()

    def device(copies, optimizer):
        return optimizer.step

    def in_place(copies, optimizer):
        return optimizer.step  # the same kernels, reaching host-resident states over PCIe

    def windows_of(indices, bytes_each):
        found, current, size = [], [], 0
        for index in indices:
            cost = bytes_each(index)
            if current and size + cost > args.window_bytes:
                found.append(current)
                current, size = [], 0
            current.append(index)
            size += cost
        return found + ([current] if current else [])

    def migrate(copies, optimizer):
        # Each window's states are fetched (use hints on a side stream, which waits for
        # their arrival; the step's stream waits for the side stream), stepped, and evicted.
        # The next window's fetch starts before this window's step. Pessimistic: the host
        # waits for each window's step before evicting it (offload() orders after no stream).
        windows = windows_of(range(host_params), lambda i: copies[i].numel() * 8)
        group = optimizer.param_groups[0]
        everything = group["params"]
        main = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        on_host = states(optimizer, copies[:host_params])

        def window_states(number):
            return states(optimizer, [copies[i] for i in windows[number]])

        kept = states(optimizer, copies[host_params:])

        def step():
            # The device share is hinted too: a state of it may share a chunk with the host
            # share, and a fetch of a chunk whose every use was hinted does not wait for
            # unhinted work (Note [Fault-free migration]).
            group["params"] = copies[host_params:]
            zt._offload.use_in_place_many(zt._pointers(kept), main.cuda_stream)
            optimizer.step()
            zt._end(kept, main.cuda_stream)
            with torch.cuda.stream(side):
                zt._begin(window_states(0))
            for number, window in enumerate(windows):
                if number + 1 < len(windows):
                    with torch.cuda.stream(side):
                        zt._begin(window_states(number + 1))  # starts the fetch
                main.wait_stream(side)
                group["params"] = [copies[i] for i in window]
                optimizer.step()
                zt._end(window_states(number))
                main.synchronize()
                for state in window_states(number):
                    zt.offload_tensor(state, wait=False)
            group["params"] = everything
            side.synchronize()
            while any(zt.residency(state) == "moving" for state in on_host):
                time.sleep(1e-4)  # the evictions belong to this step
            zt._offload.step_boundary()
        return step

    def shipped(copies, optimizer):
        # What zt.offload(model, optimizer) installs: the windowed step of zeroalloc.torch
        # (Note [Stepping states where they are]), with the share's states on the host.
        zt.offload(torch.nn.ParameterList(copies), optimizer, window_bytes=args.window_bytes)
        for state in states(optimizer, copies[:host_params]):
            zt.offload_tensor(state)
        torch.cuda.synchronize()
        return optimizer.step

    def bounce(copies, optimizer):
        # Host-resident states stay where they are; each window's are copied into device
        # scratch on one stream, stepped there, and copied back on another, so that copies in
        # and out overlap each other and the kernels. Nothing is remapped.
        windows = windows_of(range(host_params), lambda i: copies[i].numel() * 8)
        group = optimizer.param_groups[0]
        everything = group["params"]
        main = torch.cuda.current_stream()
        copy_in, copy_out = torch.cuda.Stream(), torch.cuda.Stream()

        def stage(number):
            staged = []
            copy_in.wait_stream(copy_out)  # a state is read after last step's write-back
            with torch.cuda.stream(copy_in):
                for i in windows[number]:
                    state = optimizer.state[copies[i]]
                    for key in ("exp_avg", "exp_avg_sq"):
                        scratch = torch.empty_like(state[key])
                        scratch.copy_(state[key], non_blocking=True)
                        staged.append((state, key, state[key], scratch))
            return staged

        def step():
            group["params"] = copies[host_params:]
            optimizer.step()
            upcoming = stage(0)
            for number, window in enumerate(windows):
                staged = upcoming
                main.wait_stream(copy_in)
                if number + 1 < len(windows):
                    upcoming = stage(number + 1)
                for state, key, _, scratch in staged:
                    scratch.record_stream(main)
                    state[key] = scratch
                group["params"] = [copies[i] for i in window]
                optimizer.step()
                copy_out.wait_stream(main)
                with torch.cuda.stream(copy_out):
                    for state, key, home, scratch in staged:
                        home.copy_(scratch, non_blocking=True)
                        scratch.record_stream(copy_out)
                        state[key] = home
                del staged
            group["params"] = everything
            main.wait_stream(copy_out)
        return step

    def host_adam(copies, optimizer):
        # The share's parameters, gradients and states stepped on the CPU.
        masters = [p.detach().to("cpu").pin_memory() for p in copies[:host_params]]
        host_grads = [torch.empty_like(m).pin_memory() for m in masters]
        for master, grad in zip(masters, host_grads):
            master.grad = grad
        cpu_optimizer = torch.optim.AdamW(masters, lr=1e-3, fused=True)
        for master, copy in zip(masters, copies[:host_params]):  # the states after step 1
            cpu_optimizer.state[master] = {
                key: (value.to("cpu") if torch.is_tensor(value) else value)
                for key, value in optimizer.state.pop(copy).items()}
        optimizer.param_groups[0]["params"] = copies[host_params:]

        def step():
            for grad, copy in zip(host_grads, copies[:host_params]):
                grad.copy_(copy.grad, non_blocking=True)
            optimizer.step()  # the device's share meanwhile
            torch.cuda.current_stream().synchronize()
            cpu_optimizer.step()
            for master, copy in zip(masters, copies[:host_params]):
                copy.data.copy_(master, non_blocking=True)
        return step

    if args.windows:  # zt.offload's step alone, at each window size in turn
        for flavour in ("fused", "foreach"):
            run(device, flavour, offload=False)
            for size in args.windows.split(","):
                args.window_bytes = int(size)
                shipped.__name__ = f"shipped_{size}"
                run(shipped, flavour, offload=False)
        print("result " + json.dumps(results), flush=True)
        return 0
    for flavour in ("fused", "foreach"):
        run(device, flavour, offload=False)
        run(in_place, flavour, offload=True)
        run(bounce, flavour, offload=True)
        run(shipped, flavour, offload=False)  # offloads after zt.offload adopts the states
    run(migrate, "fused", offload=True)
    run(host_adam, "fused", offload=True)
    print("result " + json.dumps(results), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", default=str(ROOT / "build" / "libzeroalloc.so"))
    parser.add_argument("--host-share", type=float, default=0.75)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--window-bytes", type=int, default=1 << 30)
    parser.add_argument("--windows", default="",
                        help="comma-separated window sizes: time only zt.offload's step, at "
                        "each size side by side")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5504)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROALLOC_")}
    env.update({"ZEROALLOC_LIBRARY": str(Path(args.library).resolve()),
                "ZEROALLOC_DEVICE": "cuda", "ZEROALLOC_OFFLOAD": "host",
                "ZEROALLOC_HOST_LIMIT": "24GiB"})
    command = [sys.executable, __file__, "--worker"] + [
        f"--{name.replace('_', '-')}={getattr(args, name)}"
        for name in ("host_share", "repeats", "window_bytes", "hidden", "intermediate",
                     "layers", "vocab", "windows")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    lines = [l for l in done.stdout.splitlines() if l.startswith("result ")]
    if done.returncode != 0 or not lines:
        print(done.stdout[-2000:] + done.stderr[-4000:])
        return 1
    r = json.loads(lines[-1][len("result "):])
    print(f"AdamW step, {r['parameters'] / 1e9:.2f}B parameters, "
          f"{r['host_share']:.2f} of the states ({r['state_bytes_on_host'] / 2**30:.1f} GiB) "
          f"off the device; {r['host_threads']} CPU threads")
    print(f"{'mode':28} {'step s':>8} {'vs device':>10}  parameters")
    names = ("device_fused", "in_place_fused", "bounce_fused", "shipped_fused",
             "migrate_fused", "host_adam_fused", "device_foreach", "in_place_foreach",
             "bounce_foreach", "shipped_foreach")
    if args.windows:
        names = [f"{mode}_{flavour}" for flavour in ("fused", "foreach") for mode in
                 ["device"] + [f"shipped_{size}" for size in args.windows.split(",")]]
    for name in names:
        seconds = r[f"{name}_s"]
        floor = r["device_" + name.rsplit("_", 1)[1] + "_s"]
        verdict = "reference" if name.startswith("device") else (
            "WRONG" if r.get(f"{name}_wrong") else
            f"max difference {r[f'{name}_max_difference']:.1e}")
        print(f"{name:28} {seconds:8.3f} {seconds / floor:10.2f}  {verdict}")
    print(json.dumps({"bench": "optimizer_step", **r}))
    return 1 if any(key.endswith("_wrong") for key in r) else 0


if __name__ == "__main__":
    sys.exit(main())
