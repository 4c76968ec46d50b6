#!/usr/bin/env python3
"""Replays a zeroalloc allocation trace through PyTorch's native CUDA caching allocator.

The trace is the one `zeroalloc-demo --emit-trace PATH` writes, so PyTorch's allocator sees
exactly the requests zeroalloc sees in the demo, and the two fragmentation figures (peak
reserved / peak allocated) can be compared. Prints one JSON line:

    {"allocator": "torch-native", "peak_allocated": ..., "peak_reserved": ..., "ratio": ...}

    zeroalloc-demo --emit-trace /tmp/llama.trace
    python3 bench/python/replay_trace_torch.py /tmp/llama.trace
    python3 bench/python/replay_trace_torch.py /tmp/llama.trace --expandable

Trace lines: "a <id> <bytes> <stream> <class>", "f <id>", "r <id> <stream>", "s"; lines
starting with '#' are comments. Stream 0 is the current stream, every other number a
stream of its own; the class is ignored (PyTorch's allocator has none).
"""

import argparse
import json
import os
import sys
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="trace file written by zeroalloc-demo --emit-trace")
    parser.add_argument("--expandable", action="store_true",
                        help="set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True first")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    return parser.parse_args()


def read_trace(path: str) -> list:
    """Parses the whole trace first, so that parsing is not mixed into the replay."""
    events = []
    with open(path, encoding="ascii") as lines:
        for number, line in enumerate(lines, 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            kind, arguments = fields[0], fields[1:]
            expected = {"a": 4, "f": 1, "r": 2, "s": 0}.get(kind)
            if expected is None or len(arguments) != expected:
                sys.exit(f"{path}:{number}: malformed event: {line.strip()!r}")
            try:
                events.append((kind, *(int(value) for value in arguments)))
            except ValueError:
                sys.exit(f"{path}:{number}: malformed event: {line.strip()!r}")
    return events


def main() -> int:
    args = parse_args()
    if args.expandable:
        # Read once, when CUDA is first used: it must be set before torch is imported.
        current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = (
            f"{current},expandable_segments:True" if current else "expandable_segments:True")
    events = read_trace(args.trace)

    import torch  # pylint: disable=import-outside-toplevel

    if not torch.cuda.is_available():
        sys.exit("replay_trace_torch: CUDA is not available; this measures PyTorch's CUDA "
                 "allocator and needs a GPU")
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    streams = {0: torch.cuda.current_stream(device)}
    live = {}
    steps = 0
    torch.cuda.reset_peak_memory_stats(device)

    started = time.perf_counter()
    for event in events:
        kind = event[0]
        if kind == "a":
            _, allocation, size, stream_index, _ = event
            stream = streams.get(stream_index)
            if stream is None:
                stream = streams[stream_index] = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                live[allocation] = torch.empty(size, dtype=torch.uint8, device=device)
        elif kind == "f":
            # The last reference goes: the block returns to the cache of its stream.
            del live[event[1]]
        elif kind == "r":
            _, allocation, stream_index = event
            stream = streams.get(stream_index)
            if stream is None:
                stream = streams[stream_index] = torch.cuda.Stream(device)
            live[allocation].record_stream(stream)
        else:
            steps += 1
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started

    peak_allocated = torch.cuda.max_memory_allocated(device)
    peak_reserved = torch.cuda.max_memory_reserved(device)
    print(json.dumps({
        "allocator": "torch-native",
        "expandable_segments": args.expandable,
        "trace": os.path.basename(args.trace),
        "events": len(events),
        "steps": steps,
        "peak_allocated": peak_allocated,
        "peak_reserved": peak_reserved,
        "ratio": round(peak_reserved / peak_allocated, 4) if peak_allocated else None,
        "replay_seconds": round(seconds, 3),
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device),
    }))
    live.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
