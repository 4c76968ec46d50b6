"""Memory snapshots in the format of PyTorch's torch.cuda.memory._snapshot(), which
torch.cuda._memory_viz and pytorch.org/memory_viz open. A global allocator swap loses
PyTorch's own snapshot, so this is what users get instead."""

from __future__ import annotations

import os
import pickle

from zeroalloc._library import ZeroallocError, library, read_json


def snapshot(device: int | None = None) -> dict:
    """Every segment and block zeroalloc holds, as torch.cuda.memory._snapshot() returns
    them: {"segments": [...], "device_traces": [[]...]}. `device` None: every device
    started so far. Each segment also says its zeroalloc allocation class. Allocation
    traces (stack frames, history) are not recorded: "frames" are empty."""
    raw = read_json(library().zeroalloc_snapshot_json, -1 if device is None else device)
    segments = []
    devices_seen = [0]
    for each in raw["devices"]:
        devices_seen.append(each["device"])
        for segment in each["segments"]:
            blocks = [{"address": block["address"], "size": block["size"],
                       "requested_size": block["requested_size"], "state": block["state"],
                       "frames": []} for block in segment["blocks"]]
            allocated = [block for block in blocks if block["state"] == "active_allocated"]
            segments.append({
                "device": each["device"],
                "address": segment["address"],
                "total_size": segment["total_size"],
                "allocated_size": sum(block["size"] for block in allocated),
                "active_size": sum(block["size"] for block in blocks
                                   if block["state"] != "inactive"),
                "requested_size": sum(block["requested_size"] for block in allocated),
                "stream": segment["stream"],
                "segment_type": segment["kind"],
                "segment_pool_id": (0, 0),
                "is_expandable": False,
                "frames": [],
                "allocation_class": segment["class"],
                "blocks": blocks,
            })
    segments.sort(key=lambda segment: (segment["device"], segment["address"]))
    return {"segments": segments,
            "device_traces": [[] for _ in range(max(devices_seen) + 1)],
            "allocator_settings": {"allocator": "zeroalloc"}}


def dump_snapshot(path: str | os.PathLike, device: int | None = None) -> None:
    """Writes snapshot() as the pickle that torch.cuda._memory_viz and
    pytorch.org/memory_viz open."""
    data = snapshot(device)
    try:
        with open(path, "wb") as out:
            pickle.dump(data, out)
    except OSError as failure:
        raise ZeroallocError(f"cannot write the memory snapshot to {os.fspath(path)}: "
                             f"{failure.strerror}; choose a writable path") from failure
