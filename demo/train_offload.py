#!/usr/bin/env python3
"""The demo on a GPU: train a Llama-style model through zeroalloc's offload engine.

Two runs of the same training, each in its own process with zeroalloc as PyTorch's
allocator: first with the whole device, to measure the model's footprint; then under a
ZEROALLOC_MEMORY_LIMIT that leaves room for only part of its AdamW states, with
ZEROALLOC_OFFLOAD=host and `zt.offload(model, optimizer)`, so that the rest lives in pinned
host memory. The optimizer step runs on the device in both, so the losses must be
identical bit for bit; the demo prints them side by side, what moved, and the step times,
and the offload run writes its report (ZEROALLOC_REPORT).

    python3 demo/train_offload.py --library build/libzeroalloc.so --report build/demo-report/train
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", default=str(ROOT / "build" / "libzeroalloc.so"))
    parser.add_argument("--report", default=str(ROOT / "build" / "demo-report" / "train"),
                        help="ZEROALLOC_REPORT prefix of the offload run")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--states-kept", type=float, default=0.4,
                        help="share of the AdamW states the limit leaves room for")
    parser.add_argument("--worker", choices=("whole", "offload"), help=argparse.SUPPRESS)
    return parser.parse_args()


def build_model(torch, args):
    nn = torch.nn
    functional = torch.nn.functional

    causal = torch.ones(args.seq, args.seq, dtype=torch.bool, device="cuda").triu(1)

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(args.hidden))

        def forward(self, x):
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(
                x.dtype) * self.weight

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm = RMSNorm()
            self.qkv = nn.Linear(args.hidden, 3 * args.hidden, bias=False)
            self.out = nn.Linear(args.hidden, args.hidden, bias=False)
            self.mlp_norm = RMSNorm()
            self.gate_up = nn.Linear(args.hidden, 2 * args.ffn, bias=False)
            self.down = nn.Linear(args.ffn, args.hidden, bias=False)

        def forward(self, x):
            batch, seq, _ = x.shape
            q, k, v = self.qkv(self.attention_norm(x)).view(
                batch, seq, 3, args.heads, -1).permute(2, 0, 3, 1, 4)
            # Written out: the fused attention kernels' backward passes are not
            # deterministic, and the demo compares two runs bit for bit.
            scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
            scores = scores.masked_fill(causal[:seq, :seq], float("-inf"))
            attended = scores.softmax(dim=-1) @ v
            x = x + self.out(attended.transpose(1, 2).reshape(batch, seq, -1))
            gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
            return x + self.down(functional.silu(gate) * up)

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(args.vocab, args.hidden)
            self.position = nn.Embedding(args.seq, args.hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(args.layers))
            self.norm = RMSNorm()
            self.head = nn.Linear(args.hidden, args.vocab, bias=False)

        def forward(self, tokens):
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.embedding(tokens) + self.position(positions)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return Decoder()


def worker(args) -> int:
    """One training run; prints one JSON line prefixed "result "."""
    sys.path.insert(0, str(ROOT / "bindings" / "python"))
    import torch
    import zeroalloc
    import zeroalloc.torch as zt

    zt.install()
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(torch, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    if args.worker == "offload":
        zt.offload(model, optimizer)
    # A task the model can learn: each sequence counts up from its own start, with its own
    # stride, modulo the vocabulary, so the loss falls step after step.
    generator = torch.Generator(device="cpu").manual_seed(1)
    starts = torch.randint(0, args.vocab, (args.steps, args.batch, 1), generator=generator)
    strides = torch.randint(1, 7, (args.steps, args.batch, 1), generator=generator)
    batches = ((starts + strides * torch.arange(args.seq + 1)) % args.vocab).to(device)

    losses, seconds = [], []
    for step in range(args.steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        tokens = batches[step]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        offload = zeroalloc.raw_stats(0).get("offload") or {}
        print(json.dumps({"step": step, "loss": losses[-1], "seconds": seconds[-1],
                          "host_bytes": offload.get("host_resident_bytes", 0),
                          "to_host": offload.get("bytes_to_host", 0),
                          "to_device": offload.get("bytes_to_device", 0)}), flush=True)
    stats = zeroalloc.raw_stats(0)
    state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                      for t in s.values() if torch.is_tensor(t) and t.is_cuda)
    print("result " + json.dumps({
        "device_name": torch.cuda.get_device_name(device),
        "parameters": sum(p.numel() for p in model.parameters()),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "state_bytes": state_bytes,
        "peak_allocated": stats["total"]["allocated_bytes"]["lifetime_peak"],
        "peak_reserved": stats["total"]["reserved_bytes"]["lifetime_peak"],
        "limit_bytes": stats["limit_bytes"], "held_bytes": stats.get("held_bytes", 0),
        "offload": stats.get("offload"),
        "losses": [float.hex(x) for x in losses], "seconds": seconds}), flush=True)
    return 0


def run(args, mode: str, env_extra: dict) -> tuple[dict, list]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROALLOC_")}
    env.update({"ZEROALLOC_LIBRARY": str(Path(args.library).resolve()),
                "ZEROALLOC_DEVICE": "cuda", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                **env_extra})
    command = [sys.executable, __file__, "--worker", mode] + [
        f"--{name}={getattr(args, name)}"
        for name in ("layers", "hidden", "ffn", "heads", "vocab", "batch", "seq", "steps")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    lines = done.stdout.splitlines()
    results = [json.loads(l[len("result "):]) for l in lines if l.startswith("result ")]
    if done.returncode != 0 or not results:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
        raise SystemExit(f"the {mode} run failed (exit code {done.returncode})")
    steps = [json.loads(l) for l in lines if l.startswith("{")]
    return results[-1], steps


def main() -> int:
    args = parse_args()
    if args.worker:
        return worker(args)
    print("run 1: the whole device, to measure the footprint", flush=True)
    whole, _ = run(args, "whole", {})
    states = whole["state_bytes"]
    limit = int(whole["peak_reserved"] - (1 - args.states_kept) * states)
    limit -= limit % (2 << 20)
    host_limit = -(-(states + whole["parameter_bytes"]) // GiB) + 1
    print(f"model: {whole['parameters'] / 1e9:.2f}B parameters, Llama-style, on "
          f"{whole['device_name']}; batch {args.batch} x {args.seq} tokens, bf16 autocast, "
          f"AdamW\nfootprint: {whole['peak_allocated'] / GiB:.2f} GiB at the peak, "
          f"{whole['peak_reserved'] / GiB:.2f} GiB reserved; parameters "
          f"{whole['parameter_bytes'] / GiB:.2f} GiB, AdamW states {states / GiB:.2f} GiB")
    print(f"run 2: ZEROALLOC_MEMORY_LIMIT={limit} ({limit / GiB:.2f} GiB, room for "
          f"{args.states_kept:.0%} of the states), ZEROALLOC_OFFLOAD=host, "
          f"ZEROALLOC_HOST_LIMIT={host_limit}GiB", flush=True)
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    offload, steps = run(args, "offload", {
        "ZEROALLOC_MEMORY_LIMIT": str(limit), "ZEROALLOC_OFFLOAD": "host",
        "ZEROALLOC_HOST_LIMIT": f"{host_limit}GiB", "ZEROALLOC_REPORT": args.report})

    print(f"\n{'step':>4} {'loss, whole device':>19} {'loss, under the limit':>22} "
          f"{'same bits':>9} {'step s':>7} {'s, whole':>8} {'on host GiB':>11}")
    same = 0
    for index, each in enumerate(steps):
        identical = offload["losses"][index] == whole["losses"][index]
        same += identical
        print(f"{index:>4} {float.fromhex(whole['losses'][index]):>19.6f} "
              f"{each['loss']:>22.6f} {'yes' if identical else 'NO':>9} "
              f"{each['seconds']:>7.3f} {whole['seconds'][index]:>8.3f} "
              f"{each['host_bytes'] / GiB:>11.2f}")
    figures = offload["offload"] or {}
    tail = slice(len(steps) // 2, None)
    median = lambda xs: sorted(xs)[len(xs) // 2]
    print(f"\nlosses identical bit for bit in {same} of {len(steps)} steps")
    print(f"moved {figures.get('bytes_to_host', 0) / GiB:.1f} GiB to the host and "
          f"{figures.get('bytes_to_device', 0) / GiB:.1f} GiB back; prefetch hit rate "
          f"{figures.get('prefetch_hit_rate', 0):.3f}; the device holds "
          f"{offload['held_bytes'] / GiB:.2f} GiB at the end, under a limit of "
          f"{limit / GiB:.2f} GiB")
    print(f"step time (median of the later steps): {median(offload['seconds'][tail]):.3f} s "
          f"under the limit, {median(whole['seconds'][tail]):.3f} s with the whole device")
    if steps[-1]["host_bytes"] == 0:
        print("nothing was offloaded: the limit did not bind (raise --layers or lower "
              "--states-kept)")
        return 1
    return 0 if same == len(steps) else 1


if __name__ == "__main__":
    sys.exit(main())
