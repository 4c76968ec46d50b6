"""ZeRO stages 1 and 2 across the ranks of a torchrun job: each rank steps only the
parameters it owns, so it holds optimizer states for 1/N of the model, and then every
parameter is broadcast from its owner (the library's group: NCCL on GPUs, TCP on the
simulated device). Stage 2 also reduces each gradient to its owner alone, so a rank holds
gradients for 1/N of the model once its backward is over.

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

Note [Stage 2 by whole parameters]: the gradients go to the parameters' owners (the
ownership of stage 1) by reduce, in buckets fixed at partition(): runs of one owner's
parameters in reverse order (the order a backward makes their gradients), up to 64 MiB
each. A bucket goes once every gradient in it has been accumulated (a post-accumulate hook
per parameter), buckets in their order, and the end of the backward sends what is left, a
parameter without a gradient as zeros, so that every rank calls the same reduces in the
same order. Each rank's gradient is divided by the number of ranks as it arrives (a hook
on the parameter, as DistributedDataParallel's predivision), so the owner's sum is the
average DistributedDataParallel's all-reduce makes, added to what the owner accumulated
before (gradient accumulation over micro-batches works as without ZeRO: the others'
gradients are None again after each reduce). Afterwards a rank holds the gradients of what
it owns and None for the rest; the step is stage 1's. The model must not be wrapped in
DistributedDataParallel (its all-reduce would give every rank every gradient), and
torch.nn.utils.clip_grad_norm_ sees only the rank's own gradients: Partition.clip_grad_norm_
clips by the norm over every rank's. Bit for bit DistributedDataParallel's when the number
of ranks is a power of two (g x 1/N is then g / N exactly); otherwise to rounding. Limits:
a parameter no rank gave a gradient gets zeros on its owner (AdamW then decays it, where
DistributedDataParallel leaves it); every rank must use the same parameters in a backward
(a bucket whose gradients are ready on one rank and missing on another is sent at
different times, and the ranks' collectives no longer match: the group's timeout ends
them, naming the calls); with reentrant activation checkpointing, each segment's backward
is a nested one whose end comes while the outer is open, and only the outer's end sends
what is left, except where the outer backward accumulates nothing before the first
segment's does (every parameter checkpointed): then each segment's end sends the buckets
not ready yet (zeros), which is correct but multiplies the traffic (use_reentrant=False
does not); and fp16 with a GradScaler is not supported
(each rank would find its own infinities). With offload (zt.offload before partition) the
windowed step steps the rank's own parameters, their states wherever the engine put them;
a gradient that offload keeps in its class is divided into that class (predivision), and
the broadcasts pin the parameters (Note [Collectives on paged parameters]); at stage 3 only
the rank's own parameters stay offload's (Note [Stage 3 under offload]).

Note [Checkpoints of a partition]: state_dict() of a partitioned optimizer returns what the
unpartitioned one would: every rank's own states gathered (pickled, through the default
process group, which DistributedDataParallel needs anyway), on the CPU, so
a checkpoint saved from any rank loads into a run with any number of ranks, or none.
load_state_dict() takes such a state and keeps only the states of the parameters the rank
owns. Gathering holds every state on every rank, unless state_dict(rank0_only=True) asks
for rank 0 alone to hold them (the others get an empty dict).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import pickle
import time
import weakref

import torch

from zeroalloc import _group, _stats
from zeroalloc._library import ZeroallocError, last_error, library
from zeroalloc.torch._use_hints import current_stream
from zeroalloc.torch import _zero_ddp
from zeroalloc.torch._zero_parameters import ParameterShards, pinned_where_they_are


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


def _graph_task():
    """The backward (autograd graph task) running now; None where PyTorch cannot say, and
    then every end is taken as the backward's."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else None


def _nbytes(parameter: torch.Tensor) -> int:
    return parameter.numel() * parameter.element_size()


def _gather_objects(distributed, value, to: "int | None" = None) -> "list | None":
    """Every rank's `value` (picklable), in rank order, through the default process group:
    all_gather_object without its NumPy (which PyTorch needs there and may lack). With `to`,
    only that rank gets them (the others None), and no other rank holds every value."""
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
    if to is None:
        everyone = [torch.empty_like(mine) for _ in range(ranks)]
        distributed.all_gather(everyone, mine)
    else:
        here = distributed.get_rank() == to
        everyone = [torch.empty_like(mine) for _ in range(ranks)] if here else None
        distributed.gather(mine, everyone, dst=to)
        if not here:
            return None
    found = []
    for each, length in zip(everyone, lengths):
        host = each[:length].cpu().contiguous()
        found.append(pickle.loads(ctypes.string_at(host.data_ptr(), length)))
    return found


def gradient_class_of(parameter):
    """Where a gradient made for `parameter` is allocated: the gradient class when offload
    put its gradients there (Note [Gradients' class]), else where it is now."""
    choice = getattr(parameter, "_zeroalloc_gradient_hooked", None)
    if choice is not None and choice.on:  # Note [Gradients' class, decided]
        return _stats.allocation_class("gradient")
    return contextlib.nullcontext()


def predivision(parameter, scale: float):
    """Stage 2's hook: each gradient divided by the number of ranks as it arrives. A first
    gradient of a parameter whose gradients offload keeps in their class is made there (the
    accumulation adopts the tensor the hook returns)."""
    owner = weakref.ref(parameter)

    def hook(gradient):
        held = owner()
        if held is not None and held.grad is None and not torch.is_grad_enabled():
            with gradient_class_of(held):
                return gradient * scale
        return gradient * scale

    return hook


#: The most bytes of parameters one broadcast carries (a larger parameter goes alone).
BUCKET_BYTES = 64 << 20


def gradient_buckets(parameters: list, owners: list) -> list:
    """(owner, parameters) per reduce of stage 2: runs of one owner's parameters of one
    device and dtype, in reverse order (the backward's), up to BUCKET_BYTES each; parameters
    that take no gradient are left out."""
    found = []
    for parameter, owner in reversed(list(zip(parameters, owners))):
        if not parameter.requires_grad:
            continue
        if found:
            last_owner, members = found[-1]
            if (last_owner == owner and members[0].device == parameter.device
                    and members[0].dtype == parameter.dtype
                    and sum(_nbytes(p) for p in members) + _nbytes(parameter) <= BUCKET_BYTES):
                members.append(parameter)
                continue
        found.append((owner, [parameter]))
    return found


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

    def __init__(self, optimizer, parameters: list, owners: list, rank: int, ranks: int,
                 stage: int = 1, model=None):
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
        self.stage = stage
        self.hooks = []
        self.figures = {"stage": stage, "rank": rank, "ranks": ranks,
                        "owned_parameters": len(owned),
                        "owned_bytes": sum(_nbytes(p) for p in owned),
                        "parameter_bytes": sum(_nbytes(p) for p in parameters),
                        "steps": 0, "broadcasts": 0, "broadcast_bytes": 0,
                        "broadcast_s": 0.0}
        self.shards = None
        if stage >= 2:
            self.figures.update({"reduces": 0, "reduced_bytes": 0})
            self._install_gradient_reduction()
        if stage == 3:  # Note [Stage 3 by whole parameters]
            self.figures.update({"gathers": 0, "gathered_bytes": 0})
            self.shards = ParameterShards(
                model, {id(p): owner for p, owner in zip(parameters, owners)}, rank,
                self.figures)

    def _install_gradient_reduction(self) -> None:
        """Note [Stage 2 by whole parameters]."""
        self.gradient_buckets = gradient_buckets(self.parameters, self.owners)
        self.bucket_of = {}
        for index, (_, members) in enumerate(self.gradient_buckets):
            for parameter in members:
                self.bucket_of[id(parameter)] = index
        self.ready = [0] * len(self.gradient_buckets)
        self.next_bucket = 0
        self.open_tasks = set()  # the backwards (graph tasks) whose end is queued
        scale = 1.0 / self.ranks
        for parameter in self.parameters:
            if not parameter.requires_grad:
                continue
            self.hooks.append(parameter.register_hook(predivision(parameter, scale)))
            self.hooks.append(parameter.register_post_accumulate_grad_hook(self._accumulated))

    def _accumulated(self, parameter) -> None:
        # Note [Stage 2 by whole parameters]: an end per backward, run when it ends; a
        # reentrant checkpoint's nested backward is a task of its own, whose end comes while
        # the outer one is still open.
        task = _graph_task()
        if task not in self.open_tasks:
            self.open_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._task_ended(task))
        index = self.bucket_of[id(parameter)]
        self.ready[index] += 1
        if self.shards is not None:  # its gradient is made: the gathered copy may go
            self.shards.release(parameter)
        while (self.next_bucket < len(self.gradient_buckets)
               and self.ready[self.next_bucket] == len(self.gradient_buckets[self.next_bucket][1])):
            self._reduce(self.next_bucket)
            self.next_bucket += 1

    def _task_ended(self, task) -> None:
        self.open_tasks.discard(task)
        if not self.open_tasks:  # else a nested backward ended inside one still running
            self._backward_ended()

    def _backward_ended(self) -> None:
        """The buckets not sent yet (a parameter the backward gave no gradient: zeros), then
        the next backward starts over."""
        try:
            while self.next_bucket < len(self.gradient_buckets):
                self._reduce(self.next_bucket)
                self.next_bucket += 1
        finally:
            self.ready = [0] * len(self.gradient_buckets)
            self.next_bucket = 0
            self.open_tasks = set()
            if self.shards is not None:
                self.shards.release_all()

    def _reduce(self, index: int) -> None:
        owner, members = self.gradient_buckets[index]
        device = members[0].device
        stream = current_stream(device.index) if device.type == "cuda" else None
        gradients = [p.grad if p.grad is not None else
                     torch.zeros(self._shape(p), dtype=p.dtype, device=p.device)
                     for p in members]
        if len(members) == 1 and gradients[0].is_contiguous():
            flat = gradients[0].reshape(-1)
        else:
            flat = torch.cat([g.reshape(-1) for g in gradients])
        bfloat16 = flat.dtype == torch.bfloat16
        _group.reduce(flat.data_ptr(), flat.data_ptr(), flat.numel(), bfloat16, owner, stream)
        self.figures["reduces"] += 1
        self.figures["reduced_bytes"] += flat.numel() * flat.element_size()
        if owner != self.rank:
            for parameter in members:
                parameter.grad = None
            return
        offset = 0
        for parameter, gradient in zip(members, gradients):
            shape = self._shape(parameter)
            count = shape.numel()
            part = flat[offset:offset + count].view(shape)
            offset += count
            if parameter.grad is None:
                with gradient_class_of(parameter):
                    parameter.grad = part.clone() if len(members) > 1 else part
            elif part.data_ptr() != parameter.grad.data_ptr():
                parameter.grad.copy_(part)

    def _shape(self, parameter) -> torch.Size:
        return parameter.shape if self.shards is None else self.shards.shape_of(parameter)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Stage 2's torch.nn.utils.clip_grad_norm_: the norm over every rank's gradients
        (each rank holds only its own; Note [Stage 2 by whole parameters]), and each rank's
        gradients scaled by the same factor. Returns the total norm, on every rank."""
        if norm_type != 2.0:
            raise ValueError(f"clip_grad_norm_ of a ZeRO stage 2 partition takes the 2-norm "
                             f"only, not norm_type={norm_type}")
        owned = [p.grad for p, owner in zip(self.parameters, self.owners)
                 if owner == self.rank and p.grad is not None]
        device = self.parameters[0].device  # where every rank's sum meets
        squares = torch.zeros(1, dtype=torch.float32, device=device)
        for gradient in owned:
            squares += gradient.detach().float().pow(2).sum().to(device)
        everyone = torch.empty(self.ranks, dtype=torch.float32, device=device)
        stream = current_stream(device.index) if device.type == "cuda" else None
        _group.all_gather(squares.data_ptr(), everyone.data_ptr(), 4, stream)
        total = everyone.sum().sqrt()
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for gradient in owned:
            gradient.mul_(coefficient.to(gradient.dtype))
        return total

    def step(self, closure=None):
        if closure is not None:
            raise ValueError(f"a ZeRO stage {self.stage} step takes no closure: the "
                             "closure's backward would give the step every parameter's "
                             "gradient again")
        if self.stage >= 2:
            # A backward that raised left its counts (and no end callback will come).
            self.ready = [0] * len(self.gradient_buckets)
            self.next_bucket = 0
            self.open_tasks = set()
        if self.shards is not None:
            # Copies gathered by a backward that accumulated nothing (torch.autograd.grad)
            # or a forward that raised: after this step they would be stale.
            self.shards.release_all()
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
        if self.shards is None:  # stage 3: the others gather them at their next use
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
        with pinned_where_they_are(self.parameters):
            self._broadcast_buckets()
        self.figures["broadcast_s"] += time.perf_counter() - started

    def _broadcast_buckets(self) -> None:
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

    def state_dict(self, rank0_only: bool = False) -> dict:
        """What the unpartitioned optimizer's state_dict() holds (Note [Checkpoints of a
        partition]): every rank's own states, gathered, on the CPU. With `rank0_only`, only
        rank 0 gets them (the others an empty dict), so no other rank needs room for every
        state; every rank must call it either way."""
        import torch.distributed as distributed
        if not (distributed.is_available() and distributed.is_initialized()):
            raise ZeroallocError("the state of a ZeRO-partitioned optimizer is gathered through "
                                 "torch.distributed, which is not initialized (as "
                                 "DistributedDataParallel needs it to be)")
        own = self.inner_state_dict()
        mine = {index: {name: value.detach().cpu() if torch.is_tensor(value) else value
                        for name, value in state.items()}
                for index, state in own["state"].items()}
        everyone = _gather_objects(distributed, mine, to=0 if rank0_only else None)
        if everyone is None:
            return {}
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
        """The optimizer's own methods back; at stage 3 every rank gathers every parameter
        back (a collective: every rank must call it)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        if self.shards is not None:
            self.shards.remove()
            self.shards = None
        for name in ("step", "state_dict", "load_state_dict"):
            if self.optimizer.__dict__.get(name) == getattr(self, name):
                del self.optimizer.__dict__[name]


def partition(optimizer, stage: int = 1, timeout_s: float = 300.0, model=None) -> Partition:
    """Partitions `optimizer`'s step across the ranks of the torchrun job (Note [Stage 1 by
    whole parameters]): from now on each rank steps the parameters it owns and broadcasts
    them to the others. Stage 1: call it after the model is wrapped in
    DistributedDataParallel (whose all-reduce gives every rank the same gradients). Stage 2:
    the model is not wrapped; each gradient is reduced to its owner as the backward makes
    it, and the others free theirs (Note [Stage 2 by whole parameters]). Stage 3, with
    `model`: as stage 2, and each rank keeps only the parameters it owns, the others
    gathered while a module uses them (Note [Stage 3 by whole parameters]). On every rank,
    after zt.offload(), if used. Joins the library's group the first time (torchrun's
    variables; the library's bootstrap at MASTER_PORT+1)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage {stage} does not exist: stage 1 partitions the "
                         "optimizer's step, 2 also the gradients, 3 also the parameters")
    if stage == 3 and model is None:
        raise ValueError("ZeRO stage 3 partitions the model's parameters: pass the model "
                         "(zt.partition(optimizer, stage=3, model=model))")
    if getattr(optimizer, "_zeroalloc_masters", None) is not None:
        # Its param_groups hold the fp32 masters, whose gradients are the working copies'.
        raise ZeroallocError("ZeRO stages do not combine with master weights (offload's "
                             "master_weights, ZEROALLOC_MASTER_WEIGHTS) yet: partition an "
                             "optimizer without them")
    parameters, seen = [], set()
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if id(parameter) not in seen:
                seen.add(id(parameter))
                parameters.append(parameter)
    sizes = [_nbytes(p) for p in parameters]
    if stage >= 2:
        for parameter in parameters:
            if parameter.requires_grad and parameter.dtype not in (torch.float32,
                                                                   torch.bfloat16):
                raise ZeroallocError(f"ZeRO stage {stage} reduces float32 and bfloat16 "
                                     "gradients: a "
                                     f"parameter of shape {tuple(parameter.shape)} is "
                                     f"{parameter.dtype}")
    # Stage 1 and 2 ranks agree on the broadcasts but not on the reduces: the stage is
    # part of the agreement.
    _group.join(f"ZEROALLOC_ZERO_STAGE={stage};parameters={len(parameters)};"
                f"bytes={sum(sizes)}", timeout_s)
    rank, ranks = _group.rank(), _group.size()
    handle = Partition(optimizer, parameters, owners_by_bytes(sizes, ranks), rank, ranks,
                       stage, model)
    if stage == 2:  # every rank's replica the owners' from the start (stage 3 keeps owners')
        handle.share()
    handle.report()
    optimizer.step = handle.step
    optimizer.state_dict = handle.state_dict
    optimizer.load_state_dict = handle.load_state_dict
    return handle


def enable_automatic_partition(stage: int = 1, timeout_s: float = 300.0) -> None:
    """ZeRO with no line changed in the script (ZEROALLOC_ZERO_STAGE=1, 2 or 3 under
    torchrun, with the package's start-up hook): every optimizer created from now on is
    partitioned as partition() does, at the end of its construction (every rank builds its
    optimizers in the same order, so their joins and steps meet). At stages 2 and 3 the
    script's DistributedDataParallel is a stand-in that leaves the gradients to the
    partition (Note [DistributedDataParallel under stages 2 and 3]), and stage 3 partitions
    the model it wrapped. Raises at once outside torchrun."""
    import os
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise ZeroallocError(f"ZEROALLOC_ZERO_STAGE={stage} needs torchrun's RANK and "
                             "WORLD_SIZE: start the script with torchrun (nothing is "
                             "partitioned)")
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage {stage} does not exist: use 1, 2 or 3")
    if stage >= 2:
        _zero_ddp.replace_distributed_data_parallel()
    original_init = torch.optim.Optimizer.__init__

    def init(self, params, defaults, *args, **kwargs):
        original_init(self, params, defaults, *args, **kwargs)
        if getattr(self, "_zeroalloc_partition", None) is not None:
            return
        model = None
        if stage == 3:
            stepped = [p for group in self.param_groups for p in group["params"]]
            model = _zero_ddp.model_of(stepped)
            if model is None:
                raise ZeroallocError(
                    "ZEROALLOC_ZERO_STAGE=3 partitions the model an optimizer steps, found "
                    "as the module wrapped in DistributedDataParallel: this optimizer's "
                    "parameters are not all in one wrapped module (wrap the model before "
                    "building its optimizer)")
        self._zeroalloc_partition = partition(self, stage, timeout_s, model=model)

    torch.optim.Optimizer.__init__ = init
