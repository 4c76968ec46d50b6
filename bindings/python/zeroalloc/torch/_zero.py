"""ZeRO stage 1 across the ranks of a torchrun job: each rank steps only the parameters it
owns, so it holds optimizer states for 1/N of the model, and then every parameter is
broadcast from its owner (the library's group: NCCL on GPUs, TCP on the simulated device).

Note [Stage 1 by whole parameters]: a rank owns whole parameters, a contiguous run of the
optimizer's parameters (in param_groups order) holding about 1/N of their bytes, the split
the same on every rank because it is computed from the same list. DeepSpeed cuts a flat
buffer at exact element boundaries instead; by whole parameters the ranks' shares differ by
at most one parameter's size, and the step is the optimizer's own, unchanged, over the
parameters it owns (the others' gradients are hidden from it for the step, so it neither
updates them nor creates their states). The gradients must already be the same on every
rank when the step runs (DistributedDataParallel's all-reduce makes them so): stage 1
partitions the step, not the gradients' reduction (stage 2). The owner's parameters go in
broadcasts of up to 64 MiB (a bucket packed into one buffer, unpacked by the others; a
larger parameter alone, in place), so a model of many small parameters pays a few
collectives a step, not one each. The joined group's
agreement carries the stage and the parameters' count and bytes, so ranks whose models or
settings differ end at the join, every rank with both settings named, instead of
exchanging mismatched bytes.

Note [Checkpoints of a partition]: state_dict() of a partitioned optimizer returns what the
unpartitioned one would: every rank's own states gathered (pickled, through the default
process group, which DistributedDataParallel needs anyway), on the CPU, so
a checkpoint saved from any rank loads into a run with any number of ranks, or none.
load_state_dict() takes such a state and keeps only the states of the parameters the rank
owns. Gathering holds every state on every rank for the moment: a model whose states fit
the ranks' host memory only when partitioned cannot be saved this way yet.
"""

from __future__ import annotations

import ctypes
import json
import pickle
import time

import torch

from zeroalloc import _group
from zeroalloc._library import ZeroallocError, last_error, library
from zeroalloc.torch._use_hints import current_stream


def owners_by_bytes(sizes: list, ranks: int) -> list:
    """The owning rank of each of `sizes` (bytes, in order): contiguous runs of about equal
    bytes, a parameter going to the rank its middle byte falls in."""
    total = sum(sizes)
    owners, before = [], 0
    for size in sizes:
        middle = before + size / 2
        owners.append(min(ranks - 1, int(middle * ranks // total)) if total else 0)
        before += size
    return owners


def _nbytes(parameter: torch.Tensor) -> int:
    return parameter.numel() * parameter.element_size()


def _gather_objects(distributed, value) -> list:
    """Every rank's `value` (picklable), in rank order, through the default process group:
    all_gather_object without its NumPy (which PyTorch needs there and may lack)."""
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    device = (torch.device("cuda", torch.cuda.current_device())
              if distributed.get_backend() == "nccl" else torch.device("cpu"))
    ranks = distributed.get_world_size()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(ranks)]
    distributed.all_gather(sizes, size)
    lengths = [int(each.item()) for each in sizes]
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    everyone = [torch.empty_like(mine) for _ in range(ranks)]
    distributed.all_gather(everyone, mine)
    found = []
    for each, length in zip(everyone, lengths):
        host = each[:length].cpu().contiguous()
        found.append(pickle.loads(ctypes.string_at(host.data_ptr(), length)))
    return found


#: The most bytes of parameters one broadcast carries (a larger parameter goes alone).
BUCKET_BYTES = 64 << 20


def buckets(parameters: list, owners: list) -> list:
    """(owner, parameters) per broadcast: runs of one owner's parameters on one device, up
    to BUCKET_BYTES each. Raises for a parameter that is not contiguous (the bytes are
    broadcast where they are)."""
    found = []
    for parameter, owner in zip(parameters, owners):
        if not parameter.is_contiguous():
            raise ZeroallocError("ZeRO stage 1 broadcasts parameters in place: a parameter of "
                                 f"shape {tuple(parameter.shape)} is not contiguous")
        if found:
            last_owner, members = found[-1]
            if (last_owner == owner and members[0].device == parameter.device
                    and sum(_nbytes(p) for p in members) + _nbytes(parameter) <= BUCKET_BYTES):
                members.append(parameter)
                continue
        found.append((owner, [parameter]))
    return found


class Partition:
    """What partition() returns: the ownership and the figures (``figures``: the parameters
    and bytes this rank owns, the bytes broadcast and the time it took); remove() gives the
    optimizer back its own step."""

    def __init__(self, optimizer, parameters: list, owners: list, rank: int, ranks: int):
        self.optimizer = optimizer
        self.parameters = parameters
        self.owners = owners
        self.rank = rank
        self.ranks = ranks
        self.inner = optimizer.step
        self.inner_state_dict = optimizer.state_dict
        self.inner_load_state_dict = optimizer.load_state_dict
        self.buckets = buckets(parameters, owners)
        owned = [p for p, owner in zip(parameters, owners) if owner == rank]
        self.figures = {"stage": 1, "rank": rank, "ranks": ranks,
                        "owned_parameters": len(owned),
                        "owned_bytes": sum(_nbytes(p) for p in owned),
                        "parameter_bytes": sum(_nbytes(p) for p in parameters),
                        "steps": 0, "broadcasts": 0, "broadcast_bytes": 0,
                        "broadcast_s": 0.0}

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("a ZeRO stage 1 step takes no closure: the closure's backward "
                             "would give the step every parameter's gradient again")
        hidden = []
        for parameter, owner in zip(self.parameters, self.owners):
            if owner != self.rank and parameter.grad is not None:
                hidden.append((parameter, parameter.grad))
                parameter.grad = None
        try:
            loss = self.inner()
        finally:
            for parameter, gradient in hidden:
                parameter.grad = gradient
        self.share()
        self.figures["steps"] += 1
        self.report()
        return loss

    def report(self) -> None:
        """The figures into the memory report's "zero" section (each rank writes its own
        report under torchrun), when one was asked for (ZEROALLOC_REPORT)."""
        status = library().zeroalloc_report_section(b"zero", json.dumps(self.figures).encode())
        if status < 0:
            raise ZeroallocError(f"the report's zero section: {last_error()}")

    def share(self) -> None:
        """Every parameter from its owner, a bucket per broadcast (Note [Stage 1 by whole
        parameters])."""
        started = time.perf_counter()
        for owner, members in self.buckets:
            device = members[0].device
            stream = current_stream(device.index) if device.type == "cuda" else None
            views = [p.detach().reshape(-1).view(torch.uint8) for p in members]
            if len(views) == 1:  # one parameter: in place, no copies
                _group.broadcast(views[0].data_ptr(), views[0].numel(), owner, stream)
            else:
                flat = torch.empty(sum(v.numel() for v in views), dtype=torch.uint8,
                                   device=device)
                if owner == self.rank:
                    torch.cat(views, out=flat)
                _group.broadcast(flat.data_ptr(), flat.numel(), owner, stream)
                if owner != self.rank:
                    offset = 0
                    for view in views:
                        view.copy_(flat[offset:offset + view.numel()])
                        offset += view.numel()
            self.figures["broadcast_bytes"] += sum(v.numel() for v in views)
            self.figures["broadcasts"] += 1
        self.figures["broadcast_s"] += time.perf_counter() - started

    def state_dict(self) -> dict:
        """What the unpartitioned optimizer's state_dict() holds (Note [Checkpoints of a
        partition]): every rank's own states, gathered, on the CPU."""
        import torch.distributed as distributed
        if not (distributed.is_available() and distributed.is_initialized()):
            raise ZeroallocError("the state of a ZeRO-partitioned optimizer is gathered through "
                                 "torch.distributed, which is not initialized (as "
                                 "DistributedDataParallel needs it to be)")
        own = self.inner_state_dict()
        mine = {index: {name: value.detach().cpu() if torch.is_tensor(value) else value
                        for name, value in state.items()}
                for index, state in own["state"].items()}
        everyone = _gather_objects(distributed, mine)
        gathered = {}
        for states in everyone:
            gathered.update(states)
        return {"state": dict(sorted(gathered.items())), "param_groups": own["param_groups"]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads an unpartitioned optimizer's state (or a gathered one), keeping only the
        states of the parameters this rank owns."""
        self.inner_load_state_dict(state_dict)
        for parameter, owner in zip(self.parameters, self.owners):
            if owner != self.rank:
                self.optimizer.state.pop(parameter, None)

    def remove(self) -> None:
        for name in ("step", "state_dict", "load_state_dict"):
            if self.optimizer.__dict__.get(name) == getattr(self, name):
                del self.optimizer.__dict__[name]


def partition(optimizer, stage: int = 1, timeout_s: float = 300.0) -> Partition:
    """Partitions `optimizer`'s step across the ranks of the torchrun job (Note [Stage 1 by
    whole parameters]): from now on each rank steps the parameters it owns and broadcasts
    them to the others. Call it on every rank, after the model is wrapped in
    DistributedDataParallel (whose all-reduce gives every rank the same gradients) and after
    zt.offload(), if used. Joins the library's group the first time (torchrun's variables;
    the library's bootstrap at MASTER_PORT+1)."""
    if stage != 1:
        raise ValueError(f"ZeRO stage {stage} is not available yet: only stage 1 (partitioned "
                         "optimizer step) is")
    parameters, seen = [], set()
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if id(parameter) not in seen:
                seen.add(id(parameter))
                parameters.append(parameter)
    sizes = [_nbytes(p) for p in parameters]
    _group.join(f"ZEROALLOC_ZERO_STAGE=1;parameters={len(parameters)};bytes={sum(sizes)}",
                timeout_s)
    rank, ranks = _group.rank(), _group.size()
    handle = Partition(optimizer, parameters, owners_by_bytes(sizes, ranks), rank, ranks)
    handle.report()
    optimizer.step = handle.step
    optimizer.state_dict = handle.state_dict
    optimizer.load_state_dict = handle.load_state_dict
    return handle


def enable_automatic_partition(stage: int = 1, timeout_s: float = 300.0) -> None:
    """ZeRO with no line changed in the script (ZEROALLOC_ZERO_STAGE=1 under torchrun, with
    the package's start-up hook): every optimizer created from now on is partitioned as
    partition() does, at the end of its construction (every rank builds its optimizers in
    the same order, so their joins and steps meet). Raises at once outside torchrun."""
    import os
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise ZeroallocError(f"ZEROALLOC_ZERO_STAGE={stage} needs torchrun's RANK and "
                             "WORLD_SIZE: start the script with torchrun (nothing is "
                             "partitioned)")
    if stage != 1:
        raise ValueError(f"ZeRO stage {stage} is not available yet: only stage 1 is")
    original_init = torch.optim.Optimizer.__init__

    def init(self, params, defaults, *args, **kwargs):
        original_init(self, params, defaults, *args, **kwargs)
        if getattr(self, "_zeroalloc_partition", None) is None:
            self._zeroalloc_partition = partition(self, stage, timeout_s)

    torch.optim.Optimizer.__init__ = init
