"""The optimizer's step in windows (Notes [Stepping states where they are], [Windows and
buffers] and [Overlapping the step] at windowed_step): states pinned where they are, those
on the host bounced through device scratch, and between steps the first windows staged
during the backward and the last kept on the device after the step."""

from __future__ import annotations

import time
import warnings
import weakref

import torch

from zeroalloc import _offload, _stats
from zeroalloc._library import ZeroallocError
from zeroalloc.torch import _adoption, _module_hints, _settings, _use_hints
from zeroalloc.torch._host_step import PARTLY_ON_HOST, Behind, HostStep, guard, guard_proof
from zeroalloc.torch._master_weights import masters_of
from zeroalloc.torch._backward_uses import BackwardUses, backward_uses, graph_task
from zeroalloc.torch._gradient_choice import GradientChoice
from zeroalloc.torch._recipe_advice import RecipeAdvice, why_not
from zeroalloc.torch._step_listeners import WindowedSteps, windowed_steps
from zeroalloc.torch._step_records import (
    CopyStreams, StagedWindow, StateEntry, StepRun, StepScratch, WindowPlaces, copied_bytes,
    current, is_bounced, is_out_of_memory, is_parameter, padded, put, residency_or_foreign,
    scratch_size)
from zeroalloc.torch._weak_methods import BoundWeakly, unbound


def steps_by_param_groups(optimizer) -> bool:
    """Whether the optimizer's step steps exactly the parameters of its param_groups (Note
    [Steps that follow param_groups]): the class that defines its step is one of torch.optim's
    own, and not LBFGS."""
    if isinstance(optimizer, torch.optim.LBFGS):
        return False
    for cls in type(optimizer).__mro__:
        if "step" in vars(cls):
            # The function, not the class: Optimizer.__init__ may have written a profiling
            # wrapper of an inherited step onto a plain subclass (functools.wraps keeps the
            # wrapped function's module).
            return getattr(vars(cls)["step"], "__module__", "").startswith("torch.optim.")
    return False


def windowed_step(optimizer, original_step, window_bytes: int, overlap_bytes: int = 0,
                  adopt=None, listeners: WindowedSteps = windowed_steps,
                  backward: BackwardUses = backward_uses,
                  gradients: "GradientChoice | None" = None):
    """optimizer.step in windows of about `window_bytes` of parameters and states, as a bound
    method (LR schedulers wrap it through __func__ and __self__); `overlap_bytes` of states
    are moved while forward and backward run (Note [Overlapping the step]).

    Note [Stepping states where they are]: optimizer states are touched once per step, in one
    pass, so they are not fetched (a remap of host memory costs more than the transfer): each
    window's states are pinned where they are (use_in_place); those on the host are copied
    into device scratch on one stream while the previous window steps, stepped there by the
    optimizer's own kernels, and copied back on another stream. Copies in and out overlap
    each other and the kernels; the results are bit for bit those of a step on the device
    (bench/python/optimizer_step_bench.py compares this with stepping over PCIe, with
    fetching and evicting, and with a CPU Adam). States that are not contiguous are reached
    where they are. The step's temporaries (foreach intermediates) are allocated with the
    activations; states the step creates move into the optimizer-state class after their
    window. Every hint opened is closed, and the copies are waited for in the step's
    stream, also when a window fails.
    Note [Windows and buffers]: copies in and out run at once, each at the PCIe rate, while
    the kernels take a fraction of that. A window's copy out follows its copy in and its
    step, so the step costs the bytes bounced one way plus about one window (the out stream
    waits for the first, the in stream has nothing left during the last). Smaller windows
    shorten that and add per-window costs (Python, launches): from 128 MiB to 1 GiB the step
    measured the same (bench/RESULTS.md). Ramping the sizes at the ends does not help: the
    out stream then waits for the first large window instead. Window n uses scratch buffer
    n mod B, B at least three: with two, a window's copy in would wait for the write-back
    of the window just before it, which waits for that window's step, adding half a
    window's kernels to every window; with three it waits for one long done. Copies in are
    queued up to B - 1 windows ahead.
    Note [Overlapping the step]: even so the step costs the host-resident states' bytes
    over PCIe one way, while the link idles during forward and backward. So the first
    windows' states are staged into scratch during the backward before a step (their
    values are final since the last step), and the last windows' states stay in scratch
    after the step, in the state dict (so a reader sees their values; state_dict() puts
    the states' own tensors back first), and are written back during the next forward;
    each at most `overlap_bytes` of device memory (a window's buffer counts whole).
    Staging begins once 60% of the last backward's accumulations into the optimizer's
    parameters are done (learned from the step before, so with gradient accumulation it
    happens in the last backward only), one window per accumulation, while the device has
    room under its limit for it plus a margin (the backward frees activations as it goes);
    windows with nothing on the host are left to the step. It needs the same windows as
    the last step with the same, unwritten state tensors, else what was staged is
    dropped, as it is when a forward of the model comes before the step. States are kept only
    when module hints ran between the last two steps (a training loop: the next forward's
    first hint writes them back, and the forward of any hinted module after that puts the
    state tensors back and frees the scratch once the copies are done: a model hinted as
    one group would otherwise hold it until its backward, at its forward's peak); the next
    step, load_state_dict and OffloadHandle.remove() write them
    back first. Staged and kept states stay pinned (use_in_place) until their copies end,
    also across the step boundary.
    Note [Parameters stepped where they are]: a parameter the forward and backward pushed
    to the host under a limit is stepped as its states are: pinned where it is, its bytes
    copied into the window's scratch, stepped there (the parameter's data is the scratch
    meanwhile) and copied back, with no remap. Fetching it for the step instead (a remap to
    device memory, usually after a remap of another chunk to the host to make room) put it
    back on the device only for the engine to move it out again before its next forward
    use: at 18 GiB of 31 the 1.3B bench model moved its weights out and in about twice a
    step, and those remaps were what the step waited for (bench/RESULTS.md). Parameters on
    the device are pinned there for their window. Only the step's own windows do this:
    windows staged during the backward leave their parameters to use hints (the backward
    still needs them on the device), and no parameter stays in scratch after the step.
    Note [Stepped in place without room]: a window's scratch is as large as its bounced
    states, and the step steps whole parameters. A window of 1 GiB held a whole 65 MiB
    model, and AMSGrad's three states took 195 MiB of scratch under a 256 MiB limit
    (bench/RESULTS.md). Windows are capped by the limit since, but one parameter with its
    states may still be larger than the room left, and the scratch's allocation fails.
    The window is then stepped where its states are, pinned (use_in_place): the
    optimizer's kernels read and write the host's
    copies over PCIe, correct and slower, as a state that left the device before its pin
    is stepped. The step goes on with the windows after it; the allocation's failure is in
    the log, followed by one warning naming the cause, and zt.step_figures(optimizer)
    counts such windows (in_place_windows, in_place_bytes). A refused size is not asked
    again in that step (each refusal costs the allocator's whole relief, and writes an
    out-of-memory report); a smaller window's may still be. Staging during backward never
    does this: without room it stops, and the step meets the window. Windows are at most a
    sixteenth of the limit, so this is a last resort.
    Known limits: the optimizer's step hooks (register_step_pre_hook / post_hook) run once
    per window, with the window's parameters in param_groups; an optimizer whose parameters
    span several devices steps in one piece, without windows. Between a step and the next
    forward, the last windows' state tensors are device scratch: writing into them before
    the next forward is kept, replacing them is honoured; their storage is not the
    optimizer-state class's (offload_tensor, fetch_tensor and residency act on the states'
    own tensors). A state written in place between the backward that staged it and the
    step is staged again (its version counter changed); a write the counter does not see
    (through .data, DLPack or a kernel of one's own) is overwritten by the staged copy. Not
    thread-safe: one thread's forwards and steps per optimizer (DataParallel replicas would
    race)."""
    if getattr(original_step, "_zeroalloc_windowed", False):
        return original_step  # offload() and the automatic mode never wrap twice
    stepper = WindowedStep(optimizer, original_step, window_bytes, overlap_bytes, adopt,
                           listeners, backward, gradients)
    optimizer._zeroalloc_stepper = stepper

    def step(self, closure=None, **kwargs):
        return stepper.step(closure, **kwargs)

    step._zeroalloc_windowed = True
    if getattr(original_step, "_wrapped_by_lr_sched", False):
        # An LR scheduler made before offload() wrapped the step to see it called; its
        # wrapper still runs (each window calls it), so say so, or the scheduler warns that
        # the step was overridden after it.
        step._wrapped_by_lr_sched = True
    return BoundWeakly(step, optimizer)  # Note [No cycles through the optimizer]


STAGE_AFTER = 0.6  # of the last backward's accumulations: when staging begins
STAGE_RETRY = 4  # accumulations to wait after finding no room
MIN_WINDOW_BYTES = 8 << 20  # the smallest window a device limit makes
NO_ROOM_UNKNOWN = 1 << 62  # no scratch size was refused yet


class NoRoom(RuntimeError):
    """A window's scratch the device limit could not serve (Note [Stepped in place without
    room])."""


def on_gpu(device) -> bool:
    """Whether parameters on `device` step in windows (they have CUDA streams)."""
    return device.type == "cuda"


class WindowedStep:
    """The windowed step of one optimizer and what it holds between steps: the states of
    its windows as StateEntry records."""

    def __init__(self, optimizer, original_step, window_bytes: int, overlap_bytes: int,
                 adopt=None, listeners: WindowedSteps = windowed_steps,
                 backward: BackwardUses = backward_uses,
                 gradients: "GradientChoice | None" = None):
        # Weakly, and the original step unbound (Note [No cycles through the optimizer]):
        # the optimizer holds this, through its step.
        self._optimizer = weakref.ref(optimizer)
        # Parameters that need hooks after offload() (a parameter unfrozen since; in the
        # automatic mode, whose hints cover every module, also a group added with
        # add_param_group) get them at the next step: adopt(parameters, hooked) -> hooks,
        # appending (parameter, mark) for each hook to `hooked`.
        self.adopt = adopt
        self.late_hooks: list = []
        self.late_hooked: list = []  # (weak reference, mark), as OffloadHandle's
        self._original_step = unbound(original_step, optimizer)
        self.window_bytes = window_bytes
        self.overlap_bytes = overlap_bytes
        # Module hints and accumulations reach it through `listeners`; at its step boundary
        # it forgets the uses `backward` began.
        self.listeners = listeners
        self.backward = backward
        # Note [Gradients' class, decided] (_gradient_choice.py): whether the gradient hooks
        # of its parameters copy them into their class; told after each step.
        self.gradients = gradients if gradients is not None else GradientChoice(False)
        # Note [Steps that follow param_groups]: a window is stepped by narrowing param_groups
        # and calling the optimizer's own step, which is right only for a step that steps
        # exactly the parameters of param_groups, once: PyTorch's own optimizers (LBFGS
        # excepted: it steps a list of its own, and needs its closure). Any other (a
        # ZeroRedundancyOptimizer steps its whole shard through an inner optimizer; a
        # subclass may override step) steps in one piece, each parameter once.
        self.by_groups = steps_by_param_groups(optimizer)
        if not self.by_groups:
            warnings.warn(f"zeroalloc: {type(optimizer).__name__}.step does not step the "
                          "parameters of param_groups as torch.optim's optimizers do, so it "
                          "runs in one piece, not in windows: host-resident states are reached "
                          "where they are (slower)")
        # Note [Parameters stepped where they are]; False: the step's use hints fetch them
        # (what bench/python/offload_llama_bench.py --step-parameters compares).
        self.bounce_parameters = True
        # Note [Host windows] (_host_step.py): with ZEROALLOC_HOST_STEP, windows all on the
        # host step there, on the CPUs.
        self.host = HostStep() if _settings.host_step() else None
        # Note [The host step finishes behind the forward] (_host_step.py)
        self.behind_allowed = self.host is not None and _settings.host_step_overlap()
        self.hints_seen = 0  # listeners.hints at the end of the last step
        self.streams: dict = {}  # device index -> CopyStreams
        self.warned = False
        self.cache = None  # parameter id -> its states, during a step
        # Scratch: window n uses slot n mod len(slots); free[slot]: its last write-back.
        self.slots: list = []
        self.free: list = []
        self.slot_bytes = 0
        # The step's bounced parameters have slots of their own, never kept or staged.
        self.parameter_slots: list = []
        self.parameter_free: list = []
        self.parameter_slot_bytes = 0
        self.retired: list = []  # buffers replaced by larger ones, freed after the step
        # Learned from the last step (Note [Overlapping the step]).
        self.plan: list = []  # its windows
        self.plan_bytes = 0  # the scratch of its largest window
        self.per_step = 0  # gradient accumulations between the last two steps
        self.last_backward = 0  # of those, in the backward just before the step
        self.accumulations = 0  # since the last step
        self.stage_after = STAGE_AFTER  # of the last backward's accumulations: staging begins
        self.in_backward = 0  # in the running backward
        self.task = None
        # Ids of the parameters it steps: only their accumulations count.
        # Note [Master weights] (_master_weights.py): the fp32 masters it steps for bf16
        # working copies, or None.
        self.masters = masters_of(optimizer)
        # Note [The fast recipe, advised] (_recipe_advice.py): told after each step.
        self.advice = RecipeAdvice(why_not(optimizer, self.masters))
        self.step_started = 0.0  # time.perf_counter() when the running step began
        self.members = self.member_ids(p for group in optimizer.param_groups
                                       for p in group["params"])
        self.hinted = False  # a module hint since the last step
        # Held between steps.
        self.staged: list = []  # StagedWindow or None (nothing to copy) of windows 0, 1, ...
        self.staged_bytes = 0
        self.staging_stream = None
        self.staging_device = None
        self.limit_bytes = 0
        self.staging_done = False
        self.next_attempt = 0
        self.next_window = None  # WindowPlaces of the next window to stage
        self.kept: list = []  # entries whose states stay in scratch after the step
        self.written = None  # event: the kept states' write-back is done
        self.figures = {"steps": 0, "staged_windows": 0, "staged_bytes": 0, "kept_windows": 0,
                        "kept_bytes": 0, "bounced_state_bytes": 0,
                        "bounced_parameter_bytes": 0,
                        "written_back_during_forward": 0,
                        "staging_host_s": 0.0, "staging_no_room": 0, "staging_began_at": 0.0,
                        "in_place_windows": 0, "in_place_bytes": 0}
        self.told_in_place = False  # Note [Stepped in place without room]: warned once
        self.no_room_bytes = NO_ROOM_UNKNOWN  # the smallest scratch refused in this step
        if overlap_bytes > 0:
            listeners.overlapping.add(self)
        if self.host is not None:  # Note [Pinned buffers made ahead] (_host_step.py)
            listeners.first_hint.add(self)

    # -- helpers ---------------------------------------------------------------------------
    @property
    def optimizer(self):
        return self._optimizer()

    def original_step(self, *args, **kwargs):
        return self._original_step(self.optimizer, *args, **kwargs)

    def items(self, parameter) -> list:
        if self.cache is not None:
            found = self.cache.get(id(parameter))
            if found is not None:
                return found
        found = [(key, value) for key, value in self.optimizer.state.get(parameter, {}).items()
                 if _adoption.is_paged_state(value)]
        if self.cache is not None:
            self.cache[id(parameter)] = found
        return found

    def member_ids(self, parameters) -> set:
        """Ids of the parameters whose accumulations count: those it steps, and the working
        copies of those that are masters."""
        parameters = list(parameters)
        if self.masters is not None:
            return self.masters.members(parameters)
        return {id(p) for p in parameters}

    def gradient(self, parameter):
        """The gradient the step reads for `parameter` (a master's: its working copy's)."""
        if self.masters is not None:
            return self.masters.gradient(parameter)
        return parameter.grad

    def begin_masters(self, parameters, stream) -> list:
        """Note [Master weights]: the masters among `parameters` get fp32 gradients."""
        if self.masters is None:
            return []
        return self.masters.begin_step(parameters, stream)

    def end_masters(self, written: list, stream, stepped: bool) -> None:
        if written:
            self.masters.end_step(written, stream, stepped)

    def forget(self, parameters) -> None:
        for parameter in parameters:
            self.cache.pop(id(parameter), None)

    def budget(self) -> int:
        """Bytes of states moved between steps: overlap_bytes, at most an eighth of the
        device's limit (read at the last step)."""
        return min(self.overlap_bytes, self.limit_bytes // 8)

    def windows(self, groups, limit_bytes: int = 0) -> list:
        """Windows over the parameters with gradients, from the groups as they were before
        any window narrowed them: each about window_bytes of parameters and their states, at
        most a sixteenth of the device's limit `limit_bytes` (0: none), since at least three
        windows' scratch is on the device at once (Note [Windows and buffers])."""
        cap = self.window_bytes
        if limit_bytes > 0:
            cap = min(cap, max(MIN_WINDOW_BYTES, limit_bytes // 16))
        found, current, size = [], [], 0
        for params in groups:
            for parameter in params:
                if self.gradient(parameter) is None:
                    continue
                # The parameter and its states (two, as Adam's, before the first step).
                states = len(self.items(parameter)) or 2
                cost = parameter.numel() * parameter.element_size() * (1 + states)
                if current and size + cost > cap:
                    found.append(current)
                    current, size = [], 0
                current.append(parameter)
                size += cost
        if current:
            found.append(current)
        return found

    def scratch_bytes(self, window, places) -> int:
        """Room for the window's bounced states: those on the device need none, and the
        buffers come out of the memory the activations just left (larger ones would make
        that class grow, and push more states to the host)."""
        return sum(scratch_size(value) for parameter in window
                   for _, value in self.items(parameter) if is_bounced(value, places))

    def parameter_scratch_bytes(self, window, places) -> int:
        """Room for the window's bounced parameters (Note [Parameters stepped where they
        are]); 0 for a window whose parameters' residency was not asked (staged)."""
        return sum(scratch_size(p) for p in window
                   if id(p) in places and is_bounced(p, places))

    def streams_of(self, device):
        if device.index not in self.streams:
            self.streams[device.index] = CopyStreams(torch.cuda.Stream(device),
                                                     torch.cuda.Stream(device))
        return self.streams[device.index]

    def stage(self, window, slot: int, places, copy_in, main, held: list,
              parameters: bool = False, in_place_without_room: bool = False):
        """Pins the window's states (with `parameters`, also its managed parameters: Note
        [Parameters stepped where they are]) where they are (their entries go into `held`
        first: a failure still ends them) and starts copying the bounced ones into scratch
        slot `slot`, after that slot's last write-back; returns (entries, event after the
        copies, or None when nothing is copied). With `in_place_without_room`, a scratch
        the limit has no room for leaves the window stepped where it is (Note [Stepped in
        place without room])."""
        entries = []
        for parameter in window:
            state = self.optimizer.state.get(parameter, {})
            for key, home in self.items(parameter):
                entries.append(StateEntry(state, key, home, None,
                                          places[id(home)] != "foreign", parameter,
                                          home._version))
        if parameters:
            entries += [StateEntry(None, None, parameter.data, None, True, parameter, 0)
                        for parameter in window if places[id(parameter)] != "foreign"]
        pinned = [entry for entry in entries if entry.pinned]
        held.extend(entries)
        if pinned:
            _offload.use_in_place_many(_use_hints.pointers(entry.home for entry in pinned),
                                       copy_in.cuda_stream)
        # A parameter's residency is asked of the parameter: its .data is a new tensor.
        bounced = [entry for entry in pinned
                   if is_bounced(entry.parameter if is_parameter(entry) else entry.home, places)]
        if not bounced:
            if not any(is_parameter(entry) for entry in pinned):
                return StagedWindow(entries, None)
            # Note [Parameters parked] (lib/tier/offload_engine.hpp): a parameter that was on
            # the device when `places` was asked may have been parked since, and the pin
            # fetches it back in copy_in's order: the step waits for copy_in.
            done = torch.cuda.Event()
            done.record(copy_in)
            return StagedWindow(entries, done)
        states = [entry for entry in bounced if not is_parameter(entry)]
        params = [entry for entry in bounced if is_parameter(entry)]
        try:
            if states:
                self.carve(states, self.slots, self.free, slot, self.slot_bytes, window,
                           copy_in, main)
            if params:
                self.carve(params, self.parameter_slots, self.parameter_free, slot,
                           self.parameter_slot_bytes, window, copy_in, main)
        except NoRoom as error:
            if not in_place_without_room:
                raise
            return self.in_place(entries, bounced, copy_in, error)
        with torch.cuda.stream(copy_in):
            for entry in bounced:
                entry.scratch.copy_(entry.home, non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy_in)
        return StagedWindow(entries, done)

    def in_place(self, entries: list, bounced: list, copy_in, error) -> "StagedWindow":
        """Note [Stepped in place without room]: the window's bounced entries get no scratch;
        pinned where they are, the step reaches them there."""
        for entry in bounced:
            entry.scratch = None
        nbytes = sum(entry.home.numel() * entry.home.element_size() for entry in bounced)
        self.figures["in_place_windows"] += 1
        self.figures["in_place_bytes"] += nbytes
        if not self.told_in_place:
            self.told_in_place = True
            warnings.warn(
                f"zeroalloc: the optimizer step's scratch for {nbytes / 2**20:.1f} MiB of "
                "states and parameters did not fit under the device limit (the library's "
                f"log has the allocation's failure: {str(error)[:120]}...). The step reaches "
                "them where they are, in host memory, over PCIe: correct, slower. A higher "
                "ZEROALLOC_MEMORY_LIMIT avoids it; zt.step_figures(optimizer) counts such "
                "windows (in_place_windows)", stacklevel=5)
        # A parameter parked meanwhile comes back in copy_in's order (stage()).
        done = torch.cuda.Event()
        done.record(copy_in)
        return StagedWindow(entries, done)

    def scratch_buffer(self, need: int, slot_bytes: int, device):
        """A slot's buffer: slot_bytes (the largest window's need), else `need` alone; a size
        the limit refused once in this step is not asked again (each refusal costs the
        allocator's whole relief: Note [Stepped in place without room]). Raises NoRoom."""
        failure = None
        for size in sorted({max(need, slot_bytes), need}, reverse=True):
            if size >= self.no_room_bytes:
                continue
            try:
                with _stats.allocation_class("other"):
                    return torch.empty(size, dtype=torch.uint8, device=device)
            except RuntimeError as error:
                if not is_out_of_memory(error):
                    raise
                self.no_room_bytes = size
                failure = error
        raise NoRoom(str(failure) if failure is not None else
                     f"no room for {need} bytes of scratch under the device limit in this step")

    def carve(self, bounced, slots: list, free: list, slot: int, slot_bytes: int, window,
              copy_in, main) -> None:
        """Gives each bounced entry its scratch in buffer `slot` of `slots` (grown when too
        small), and has copy_in wait for that slot's last write-back (`free`)."""
        need = sum(scratch_size(entry.home) for entry in bounced)
        while len(slots) <= slot:
            slots.append(None)
            free.append(None)
        buffer = slots[slot]
        if buffer is None or buffer.numel() < need:
            larger = self.scratch_buffer(need, slot_bytes, window[0].device)
            # copy_in writes it and copy_out reads it, streams the allocator would not know
            # of: recorded, a move of its chunk under pressure waits for their work too (under
            # ZEROALLOC_ACCESS=hinted moves do not drain the device), and so does its reuse.
            for stream in self.streams_of(window[0].device):
                larger.record_stream(stream)
            if buffer is not None:
                self.retired.append(buffer)
            buffer = slots[slot] = larger
            copy_in.wait_stream(main)  # the memory may be what main's last kernels used
        offset = 0
        for entry in bounced:
            home = entry.home
            nbytes = home.numel() * home.element_size()
            entry.scratch = buffer[offset:offset + nbytes].view(home.dtype).view(home.shape)
            offset += padded(nbytes)
        if free[slot] is not None:
            copy_in.wait_event(free[slot])  # the slot's last step and write-back

    # -- between steps (Note [Overlapping the step]) ---------------------------------------
    def first_hint(self) -> None:
        """The first module hint after this step was made, whatever it overlaps: the device's
        peak so far is noted (Note [The first step's room]), and the host step's pinned
        buffers may be made from here on (Note [Pinned buffers made ahead])."""
        if self.host is None:
            return
        try:  # Note [The first step's room] (_host_step.py): without it, nothing is sent
            self.host.note_peak(self)
        except Exception:  # noqa: BLE001  the user's forward runs on, whatever failed here
            self.host.peak_before = None
        try:
            self.host.make_ahead(self)
        except Exception as error:  # noqa: BLE001  the user's forward runs on: the step makes them
            warnings.warn(f"zeroalloc: the host step's pinned buffers were not made ahead "
                          f"({error}); the step makes them when it needs them")

    def module_hint(self, own: list, forward: bool) -> None:
        self.hinted = True
        if forward and self.advice.state == "watching":
            # Note [The fast recipe, advised]: told only to forwards under autocast.
            self.advice.saw_forward(torch.is_autocast_enabled("cuda"))
        if self.kept:
            self.write_back_kept(wait=False)
        if (forward and self.staged and graph_task() is None
                and any(id(p) in self.members for p in own)):
            self.drop_staged()  # staged for a step that did not come: unpin, free
            self.staging_done = True

    def accumulated(self, task) -> None:
        """A gradient accumulation into a managed parameter: may stage the next step's first
        windows. A failure stops staging until the next step and never reaches the
        backward."""
        if task != self.task:
            self.task, self.in_backward = task, 0
        self.in_backward += 1
        self.accumulations += 1
        if (self.staging_done or not self.plan or not self.per_step
                or self.accumulations < self.next_attempt):
            return
        if self.accumulations < self.per_step - (1 - self.stage_after) * self.last_backward:
            return
        if self.host is not None:  # staging reads masters: the CPUs must be done with them
            self.host.finish_behind()
        started = time.perf_counter()
        try:
            self.stage_next()
        except Exception as error:  # noqa: BLE001 (the step does without)
            self.staging_done = True
            try:
                self.drop_staged()
            except Exception:  # noqa: BLE001
                pass
            if not self.warned:
                self.warned = True
                warnings.warn(f"zeroalloc: staging optimizer states during backward failed "
                              f"({error}); the step copies them itself")
        finally:
            self.figures["staging_host_s"] += time.perf_counter() - started

    def stage_next(self) -> None:
        number = len(self.staged)
        if number >= len(self.plan):
            self.staging_done = True
            return
        window = self.plan[number]
        device = window[0].device
        main = torch.cuda.current_stream(device)
        copy_in, copy_out = self.streams_of(device)
        if self.staging_stream is None:
            self.write_back_kept(wait=True)  # done long ago: the homes hold the values
            self.staging_stream = main
            self.staging_device = device
            self.slot_bytes = self.plan_bytes
            copy_in.wait_stream(main)
            copy_in.wait_stream(copy_out)  # the last step's write-backs
        elif self.staging_stream != main:
            self.staging_done = True
            return
        if self.next_window is None or self.next_window.number != number:
            # Asked once per window (a library call per state), not on every attempt.
            places = self.state_places([window])
            self.next_window = WindowPlaces(number, places, self.scratch_bytes(window, places))
        places, need = self.next_window.places, self.next_window.scratch_bytes
        if need and self.hosts_states(places):
            need = 0  # Note [Whole masters on the host]: the CPUs step them, not scratch
        if not need:  # nothing to copy: the step pins it, no earlier
            self.staged.append(None)
            self.next_window = None
            return
        size = max(need, self.slot_bytes)  # the slot's buffer, what the device holds
        if self.staged_bytes + size > self.budget():
            self.staging_done = True
            return
        # A cached block the backward freed, or room under the limit with a margin left for
        # the rest of the backward (the first steps may release cache for it; the block
        # stays cached for later ones).
        largest, unallocated = _stats.room(device.index, "other")
        margin = max(1 << 30, self.limit_bytes // 16)
        if largest < size and unallocated < size + margin:
            self.next_attempt = self.accumulations + STAGE_RETRY
            self.figures["staging_no_room"] += 1
            return
        if not any(self.staged):
            self.figures["staging_began_at"] = self.accumulations / max(1, self.per_step)
        held: list = []
        try:
            self.staged.append(self.stage(window, number, places, copy_in, main, held))
        except BaseException:
            self.end_uses(held, copy_in)
            raise
        self.staged_bytes += size
        self.next_window = None
        self.figures["staged_windows"] += 1
        self.figures["staged_bytes"] += need

    def hosts_states(self, places: dict) -> bool:
        """Note [Whole masters on the host] (_host_step.py): whether a window's states, of
        which `places` holds the residency, are the CPUs' to step (the host step with master
        weights, a state on the host)."""
        return (self.host is not None and not self.host.unavailable and self.host.completing
                and self.masters is not None
                and any(place in PARTLY_ON_HOST for place in places.values()))

    def end_uses(self, entries, stream) -> None:
        pinned = [entry for entry in entries if entry.pinned]
        if pinned:
            _offload.use_ends_many(_use_hints.pointers(entry.home for entry in pinned),
                                   stream.cuda_stream)

    def drop_staged(self) -> None:
        """Ends what was staged and frees its scratch after its copies."""
        staged, self.staged, self.staged_bytes = self.staged, [], 0
        self.staging_stream = None
        if self.staging_device is None:
            return
        copy_in = self.streams_of(self.staging_device).copy_in
        for each in staged:
            if each is not None:
                self.end_uses(each.entries, copy_in)
        for buffer in self.slots:
            if buffer is not None:
                buffer.record_stream(copy_in)
        self.slots, self.free = [], []
        self.staging_device = None

    def take_staged(self, found, main) -> list:
        """What the backward staged, when it is what this step would stage (else dropped)."""
        if not any(self.staged):
            self.drop_staged()  # also a slot a failed staging left
            return []
        valid = self.staging_stream == main and len(found) >= len(self.staged)
        for number, each in enumerate(self.staged):
            if not valid:
                break
            if each is None:
                continue
            entries = each.entries
            window, planned = found[number], self.plan[number]
            # Same parameters, same state tensors, none written since it was staged.
            valid = (len(window) == len(planned)
                     and all(a is b for a, b in zip(window, planned))
                     and len(entries) == sum(len(self.items(p)) for p in window)
                     and all(self.optimizer.state.get(entry.parameter) is entry.state
                             and entry.state.get(entry.key) is entry.home
                             and entry.home._version == entry.version for entry in entries))
        if not valid:
            self.drop_staged()
            return []
        staged, self.staged, self.staged_bytes = self.staged, [], 0
        self.staging_stream = None
        self.staging_device = None
        return staged

    def write_back_kept(self, wait: bool) -> None:
        """Writes back the states the last step kept in scratch (copy out, after the current
        stream) and, once that is done, puts the states' own tensors back in the state
        dicts. `wait`: the current stream waits for it, so they are back now."""
        if not self.kept:
            return
        device = self.kept[0].home.device
        main = torch.cuda.current_stream(device)
        if self.written is None:
            copy_out = self.streams_of(device).copy_out
            copy_out.wait_stream(main)
            with torch.cuda.stream(copy_out):
                for entry in self.kept:
                    state, key, home = entry.state, entry.key, entry.home
                    current = state.get(key)
                    entry.scratch = current
                    if (self.optimizer.state.get(entry.parameter) is not state
                            or not torch.is_tensor(current) or current.shape != home.shape
                            or current.device != home.device or current.dtype != home.dtype):
                        entry.scratch = None  # replaced (load_state_dict): nothing to write back
                        continue
                    if current is not home:
                        home.copy_(current, non_blocking=True)
                        current.record_stream(copy_out)  # freed in another stream's order
                self.end_uses(self.kept, copy_out)
            self.written = torch.cuda.Event()
            self.written.record(copy_out)
            self.listeners.writing_back.add(self)
            for entry in self.kept:  # the stream's own memory from here: no more pins
                entry.pinned = False
        if wait:
            main.wait_event(self.written)
        elif not self.written.query():
            return
        else:
            self.figures["written_back_during_forward"] += 1
        for entry in self.kept:
            if entry.scratch is not None and entry.state.get(entry.key) is entry.scratch:
                entry.state[entry.key] = entry.home
        kept_states = self.listeners.kept_states
        for registered in [key for key, owner in kept_states.items() if owner is self]:
            del kept_states[registered]
        self.listeners.writing_back.discard(self)
        self.kept, self.written = [], None

    def repin(self) -> None:
        """After a step boundary (which closes every use): pins again what this step holds."""
        held = [entry for entry in self.kept if entry.pinned]
        held += [entry for each in self.staged if each is not None for entry in each.entries
                 if entry.pinned]
        if held:
            _use_hints.hint(_offload.use_in_place_many, [entry.home for entry in held], 0)

    def settle(self) -> None:
        """Writes back what was kept and drops what was staged (load_state_dict, remove()),
        once the CPUs are done."""
        if self.host is not None:
            self.host.finish_behind()
        self.write_back_kept(wait=True)
        self.drop_staged()

    def detach(self) -> None:
        """What was kept or staged goes home, and the hooks reach this step no more
        (OffloadHandle.remove())."""
        self.settle()
        self.listeners.overlapping.discard(self)

    def configure(self, window_bytes: int, overlap_bytes: int, adopt) -> None:
        """New sizes (a later offload() of the same optimizer), from the next step on: what
        was kept or staged goes home, and the windows are learned again."""
        self.settle()
        self.window_bytes, self.overlap_bytes, self.adopt = window_bytes, overlap_bytes, adopt
        self.plan, self.plan_bytes = [], 0
        if overlap_bytes > 0:
            self.listeners.overlapping.add(self)
        else:
            self.listeners.overlapping.discard(self)

    # -- the step --------------------------------------------------------------------------
    def adopt_new_states(self, fresh) -> None:
        """States the optimizer created in this window (in the step's class, "other") move
        into the optimizer-state class, where the engine may page them."""
        for parameter in fresh:
            state = self.optimizer.state.get(parameter, {})
            for key, value in self.items(parameter):
                state[key] = _adoption.move_into_class(value, "optimizer_state")

    def step_in_one_piece(self, groups, closure, kwargs):
        """The optimizer's own step over every parameter at once, its paged states and its
        parameters pinned where they are for it (hint every use of a class, or none: an
        unhinted step could find a parameter parked behind unmapped addresses, Note
        [Parameters parked] in lib/tier/offload_engine.hpp), and the states it creates moved
        into the optimizer-state class afterwards, as a window's are."""
        parameters = [p for params in groups for p in params]
        states = [value for p in parameters for _, value in self.items(p)]
        pinned = states + [p for p in parameters if on_gpu(p.device) and p.numel() > 0]
        fresh = [p for p in parameters if not self.items(p)]
        written, stepped = [], False
        try:
            if pinned:  # inside: a pin that fails half-way is still ended (surplus ends
                _use_hints.hint(_offload.use_in_place_many, pinned, 0)  # are ignored)
            written = self.begin_masters(parameters, 0)
            with _stats.allocation_class("other"):
                if closure is not None and not self.by_groups:
                    loss = self.original_step(closure, **kwargs)
                else:
                    loss = self.original_step(**kwargs)
            stepped = True
        finally:
            self.end_masters(written, 0, stepped)
            if pinned:
                _use_hints.hint(_offload.use_ends_many, pinned, 0)
        self.forget(fresh)  # the step may have created their states
        self.adopt_new_states(fresh)
        self.forget(fresh)
        return loss

    def keep_from(self, found, staged, places) -> int:
        """The first of the last windows whose bounced states stay in scratch after the step
        (len(found): none)."""
        first, total = len(found), 0
        if self.overlap_bytes <= 0:
            return first
        if not self.hinted:
            return first
        budget = self.budget()
        while first > 0 and len(found) - first < max(3, len(staged) + 2):
            number = first - 1
            if number < len(staged) and staged[number] is not None:
                bounced = any(e.scratch is not None for e in staged[number].entries)
            else:
                bounced = self.scratch_bytes(found[number], places) > 0
            cost = self.slot_bytes if bounced else 0  # a kept window holds its slot's buffer
            if total + cost > budget:
                break
            total += cost
            first = number
        return first

    def step(self, closure=None, **kwargs):
        """The optimizer's step: in windows (plan_windows, prepare_scratch, step_windows), or
        in one piece; then the step boundary, and what the next step learns from this one."""
        self.step_started = time.perf_counter()
        if self.advice.state == "watching":  # Note [The fast recipe, advised]
            first = next((p for group in self.optimizer.param_groups for p in group["params"]),
                         None)
            if first is not None and on_gpu(first.device):
                self.advice.before_step(first.device.index or 0)
        if self.host is not None:  # Note [The host step finishes behind the forward]
            self.host.finish_behind()
        self.adopt_late_parameters()
        loss = None
        if closure is not None and self.by_groups:  # evaluated once, then the windows step
            with torch.enable_grad():
                loss = closure()
        self.cache = {}
        run = StepRun([group["params"] for group in self.optimizer.param_groups])
        succeeded = False
        try:
            self.write_back_kept(wait=True)
            run.windows = self.plan_windows(run.saved)
            if run.windows:
                self.step_windows(run, kwargs)
            else:  # nothing to stage for the next step either
                self.drop_staged()
                result = self.step_in_one_piece(run.saved, closure, kwargs)
                loss = result if result is not None else loss
            succeeded = True
        finally:
            self.finish(run, succeeded)
        self.pass_boundary()
        self.learn_from(run)
        return loss

    def state_places(self, windows) -> dict:
        """Where each state of the windows' parameters is (by id): a library call each."""
        return {id(value): residency_or_foreign(value) for window in windows
                for parameter in window for _, value in self.items(parameter)}

    def hooked_parameters(self) -> list:
        """The parameters whose hooks tell about this optimizer's: its own, or for a master
        its working copy."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.masters is not None:  # a master's hooks are its working copy's
            params = [self.masters.working(p) if self.masters.working(p) is not None else p
                      for p in params]
        return params

    def hook_gradients(self, on: bool) -> None:
        """Note [Gradients' class, decided]: a trial of the gradients' class begins (`on`):
        the adopted parameters get the hooks that copy their gradients into it, which
        "auto" leaves out until then (the gradients they hold now stay where they are: the
        next backward's are the trial's); or it ended with the class off: every hook of this
        choice goes, late parameters' too. A failure while hooking (the step itself
        succeeded) takes the hooks out again and leaves the class off, with a warning."""
        if on:
            try:
                for parameter in self.hooked_parameters():
                    if parameter.requires_grad and getattr(parameter, "_zeroalloc_adopted",
                                                           False):
                        hooked: list = []
                        for hook in _adoption.hook_gradient(parameter, self.gradients, hooked,
                                                            move_existing=False):
                            # OffloadHandle.remove() takes them out with the others.
                            self.late_hooks.append(hook)
                            self.late_hooked += [(weakref.ref(p), mark) for p, mark in hooked]
                return
            except Exception as error:  # noqa: BLE001
                warnings.warn(f"zeroalloc: the gradients' class stays off: hooking the "
                              f"gradients for its trial failed: {error}")
                self.gradients.give_up()
        gone = {id(p) for p in _adoption.unhook_gradients(self.hooked_parameters(),
                                                          self.gradients)}
        self.late_hooked = [(reference, mark) for reference, mark in self.late_hooked
                            if mark != "_zeroalloc_gradient_hooked" or id(reference()) not in gone]

    def adopt_late_parameters(self) -> None:
        """Hooks for the parameters that need them since offload() (see `adopt`)."""
        if self.adopt is None:
            return
        params = self.hooked_parameters()
        late = [p for p in params
                if p.requires_grad and not getattr(p, "_zeroalloc_hooked", False)]
        if late:
            hooked: list = []
            self.late_hooks += self.adopt(late, hooked)
            self.late_hooked += [(weakref.ref(parameter), mark) for parameter, mark in hooked]

    def plan_windows(self, groups) -> list:
        """The windows of this step, or none when it steps in one piece: a step that does not
        follow param_groups, parameters that span several devices, or parameters in host
        memory (CPU master weights, a small side model: nothing there is paged, and CUDA
        streams do not exist for them)."""
        found = []
        if self.by_groups:
            first = next((p for params in groups for p in params
                          if self.gradient(p) is not None), None)
            # Read once a step: the windows, staging's margin and budget() use it.
            self.limit_bytes = (_stats.raw_stats(first.device.index)["limit_bytes"]
                                if first is not None and on_gpu(first.device) else 0)
            found = self.windows(groups, self.limit_bytes)
        devices = {p.device for window in found for p in window}
        if len(devices) > 1 and not self.warned:
            self.warned = True
            warnings.warn("zeroalloc: the optimizer's parameters span several devices "
                          f"({sorted(str(d) for d in devices)}); its step runs in one "
                          "piece, reaching host-resident states where they are (slower)")
        if not found or len(devices) > 1 or not on_gpu(next(iter(devices))):
            return []
        return found

    def prepare_scratch(self, run: "StepRun", main, hosting: bool) -> "StepScratch":
        """Takes what the backward staged, asks the other states where they are, sizes the
        scratch slots, and chooses the last windows that stay in scratch after the step."""
        found = run.windows
        # Windows the backward staged (None: one with nothing to copy, left to now).
        staged = self.take_staged(found, main)
        for each in staged:
            if each is not None:
                run.held.extend(each.entries)
        # Each state's residency, asked once (a call into the library each). A state the
        # engine moves before its window is pinned is still stepped correctly: in place if it
        # left the device, through a redundant copy if it came back; a parameter parked
        # meanwhile comes back in copy_in's order, which the step waits for (stage()).
        unstaged = [window for number, window in enumerate(found)
                    if number >= len(staged) or staged[number] is None]
        places = self.state_places(unstaged)
        if self.bounce_parameters:
            places.update({id(parameter): residency_or_foreign(parameter)
                           for window in unstaged for parameter in window})
        if hosting:  # Note [Whole masters on the host] (_host_step.py)
            self.host.whole_on_host(self, unstaged, places, self.groups_of(run))
        sizes = [copied_bytes(each.entries) for each in staged if each is not None]
        sizes += [self.scratch_bytes(window, places) for window in unstaged]
        self.slot_bytes = max(sizes)
        self.parameter_slot_bytes = max(self.parameter_scratch_bytes(window, places)
                                        for window in found)
        keep_from = self.keep_from(found, staged, places)
        slot_count = min(len(found), max(3, len(staged) + 2, len(found) - keep_from))
        while len(self.slots) < slot_count:
            self.slots.append(None)
            self.free.append(None)
        run.copies.copy_in.wait_stream(main)  # the scratch is allocated in main's order
        run.copies.copy_in.wait_stream(run.copies.copy_out)  # and the last step's write-backs
        queued = [None] * len(found)
        for number, each in enumerate(staged):
            queued[number] = each
        return StepScratch(places, keep_from, slot_count, queued)

    def step_windows(self, run: "StepRun", kwargs) -> None:
        """Steps the windows in order: each window's states staged up to slot_count windows
        ahead (Note [Windows and buffers]), stepped, and written back or kept."""
        device = run.windows[0][0].device
        run.copies = self.streams_of(device)
        main = torch.cuda.current_stream(device)
        # A step with arguments (a GradScaler's, say) is the optimizer's own business.
        hosting = self.host is not None and not self.host.unavailable and not kwargs
        self.no_room_bytes = NO_ROOM_UNKNOWN  # what staging in backward met is not now's
        if hosting:  # Note [States made where the CPUs step them] (_host_step.py)
            self.host.make_states(self, run.windows, self.groups_of(run), main)
        scratch = self.prepare_scratch(run, main, hosting)
        # Note [Host windows]: the parameters on the host step there, on a thread, while
        # the device steps the rest of each window (run.windows stays as planned: the next
        # step's staging compares with it).
        left, host_run = {}, None
        if self.host is not None and self.host.unavailable:
            self.host = None  # the library never steps on the host on this driver
        behind = False
        if self.host is not None and not kwargs:
            chosen = self.host_parts(run, scratch)
            turns = self.host.merged(chosen)  # Note [The CPUs' windows] (_host_step.py)
            behind = bool(turns) and self.may_finish_behind(turns)
            if turns:
                host_run = self.host.start(self, turns, self.groups_of(run), main, behind)
            for number, hosted in chosen:
                ids = {id(p) for p in hosted}
                left[number] = [p for p in run.windows[number] if id(p) not in ids]
        try:
            self.step_device_parts(run, scratch, left, main, kwargs)
        except BaseException:
            behind = False  # the step raises: the CPUs' part ends within it
            raise
        finally:
            if behind:  # Note [The host step finishes behind the forward]
                deferred = Behind(self, run, host_run, turns, main.device)
                self.host.defer(deferred)
                if not self.behind_allowed:  # Note [Behind the forward, guarded]
                    guard(deferred)
                    self.host.figures["host_guarded_steps"] += 1
                # The gradients' copies are queued: what comes after the step (zeroed in
                # place, an accumulation into them) waits for them.
                main.wait_event(host_run.gradients_copied)
                refused = []
            else:
                refused = host_run.join() if host_run is not None else []
                if host_run is not None:  # Note [Master weights]: the working copies it wrote
                    main.wait_stream(self.host.stream)
        # Moved to the device meanwhile, or left by a failure: stepped there, where they are.
        for parameters in refused:
            self.step_pinned(run, parameters, main, kwargs)
        if host_run is not None and not behind:
            host_run.optimizer = None  # what the run left is stepped: it needs it no more
            if host_run.error is not None:
                raise host_run.error

    def may_finish_behind(self, chosen: list) -> bool:
        """Note [The host step finishes behind the forward]: whether the CPUs' windows may
        finish after the step returns: asked for (under ZEROALLOC_ACCESS=hinted, or guarded:
        Note [Behind the forward, guarded]), module hints ran since the last step (they are
        what waits), and every parameter the CPUs step is a master."""
        if (self.listeners.hints == self.hints_seen or self.masters is None
                or not all(self.masters.working(p) is not None
                           for _, hosted in chosen for p in hosted)):
            return False
        return self.behind_allowed or self.guards_behind(chosen)

    def guards_behind(self, chosen: list) -> bool:
        """Note [Behind the forward, guarded] (_host_step.py): under ZEROALLOC_ACCESS=any,
        asked for, and shown safe for the run's working copies."""
        return (self.host.guard_behind and _settings.any_access()
                and _settings.enabled("ZEROALLOC_HOST_STEP_OVERLAP", "1")
                and guard_proof([self.masters.working(p) for _, hosted in chosen
                                 for p in hosted]))

    def step_behind(self, behind: "Behind", parameters: list) -> None:
        """Note [The host step finishes behind the forward]: masters whose host call was
        refused, stepped on the device after the step returned, from their bf16 gradients
        kept on the host (the working copies' own may be gone: zero_grad), with the groups'
        settings of that step (a scheduler may have changed them since)."""
        run, gradients = behind.step_run, behind.run.saved
        main = torch.cuda.current_stream(parameters[0].device)
        workings = [self.masters.working(p) for p in parameters]
        before = [w.grad for w in workings]
        groups = self.optimizer.param_groups
        now = [{key: group[key] for key in settings} for group, settings
               in zip(groups, behind.settings)]
        self.cache = {}
        try:
            for group, settings in zip(groups, behind.settings):
                group.update(settings)
            for master, working in zip(parameters, workings):
                kept = gradients.get(id(master))
                working.grad = (kept.view(working.shape).to(working.device)
                                if kept is not None else None)
            self.step_pinned(run, parameters, main, {})
            for master in parameters:
                gradients.pop(id(master), None)
        finally:
            for working, grad in zip(workings, before):
                working.grad = grad
            for group, params, settings in zip(groups, run.saved, now):
                group["params"] = params
                group.update(settings)
            self.cache = None

    def step_device_parts(self, run: "StepRun", scratch: "StepScratch", left: dict, main,
                          kwargs) -> None:
        """The windows on the device, in order (for a window the host stepped in part, what
        `left` says is left of it)."""
        cursor = 0  # the next window that may need staging
        for number, window in enumerate(run.windows):
            window = left.get(number, window)
            if not window:
                continue
            while cursor < len(run.windows) and cursor < number + scratch.slot_count:
                if scratch.queued[cursor] is None and left.get(cursor, True):
                    scratch.queued[cursor] = self.stage(
                        left.get(cursor, run.windows[cursor]), cursor % scratch.slot_count,
                        scratch.places,
                        run.copies.copy_in, main, run.held,
                        parameters=self.bounce_parameters, in_place_without_room=True)
                cursor += 1
            entries = scratch.queued[number].entries
            fresh = self.step_window(run, window, scratch.queued[number], main, kwargs)
            self.write_back_window(run, entries, number >= scratch.keep_from,
                                   number % scratch.slot_count, main)
            self.adopt_new_states(fresh)  # after the write-backs: a failure here loses none
            self.forget(fresh)

    def host_parts(self, run: "StepRun", scratch: "StepScratch") -> list:
        """Note [Host windows] (_host_step.py): (window number, its parameters that are on the
        host with their states) for the windows nothing staged, in order."""
        groups = self.groups_of(run)
        chosen = []
        for number, window in enumerate(run.windows):
            if scratch.queued[number] is None:
                hosted = [p for p in window
                          if self.host.eligible(self, p, scratch.places, groups)]
                if hosted:
                    chosen.append((number, hosted))
        return chosen

    def groups_of(self, run: "StepRun") -> dict:
        return {id(p): group for group, params in zip(self.optimizer.param_groups, run.saved)
                for p in params}

    def step_pinned(self, run: "StepRun", parameters: list, main, kwargs) -> None:
        """Steps `parameters` with the optimizer's own step where they and their states are,
        each pinned there (the host's refusals: rare, so not bounced)."""
        chosen = {id(p) for p in parameters}
        for group, params in zip(self.optimizer.param_groups, run.saved):
            group["params"] = [p for p in params if id(p) in chosen]
        pinned = [value for p in parameters for _, value in self.items(p)] + list(parameters)
        _use_hints.hint(_offload.use_in_place_many, pinned, main.cuda_stream)
        written, stepped = [], False
        try:
            written = self.begin_masters(parameters, main.cuda_stream)
            with _stats.allocation_class("other"):
                self.original_step(**kwargs)
            stepped = True
        finally:
            self.end_masters(written, main.cuda_stream, stepped)
            _use_hints.hint(_offload.use_ends_many, pinned, main.cuda_stream)
            self.forget(parameters)

    def step_window(self, run: "StepRun", window, staged: "StagedWindow", main,
                    kwargs) -> list:
        """Steps one window with the optimizer's own step: its bounced states' (and
        parameters') scratch in the state dict (the parameters' data), its parameters alone
        in param_groups, the use of those not pinned with it hinted. Returns its parameters
        that had no states (the step may have created them)."""
        if staged.copied is not None:
            main.wait_event(staged.copied)
        for entry in staged.entries:
            if entry.scratch is not None:
                put(entry, entry.scratch)
                run.swapped.append(entry)
        chosen = {id(p) for p in window}
        fresh = [p for p in window if not self.items(p)]
        pinned = {id(entry.parameter) for entry in staged.entries if is_parameter(entry)}
        run.begun = [p for p in window if id(p) not in pinned]
        if run.begun:
            # A master (Note [Master weights]) is read by the step alone: pinned where it
            # is, not fetched.
            masters = [p for p in run.begun
                       if self.masters is not None and self.masters.working(p) is not None]
            if masters:
                _use_hints.hint(_offload.use_in_place_many, masters, main.cuda_stream)
            others = [p for p in run.begun if self.masters is None
                      or self.masters.working(p) is None]
            if others:
                _use_hints.begin(others, main.cuda_stream)
        for group, params in zip(self.optimizer.param_groups, run.saved):
            group["params"] = [p for p in params if id(p) in chosen]
        # Temporaries of the step (foreach intermediates) go with activations.
        written, stepped = [], False
        try:
            written = self.begin_masters(window, main.cuda_stream)
            with _stats.allocation_class("other"):
                self.original_step(**kwargs)
            stepped = True
        finally:
            self.end_masters(written, main.cuda_stream, stepped)
        if run.begun:
            _use_hints.end(run.begun, main.cuda_stream)
        run.begun = None
        self.forget(window)  # the optimizer may have created or replaced states
        return fresh

    def write_back_window(self, run: "StepRun", entries: list, keep: bool, slot: int,
                          main) -> None:
        """After a window's step, on the copy-out stream: its bounced states are copied home
        and the homes put back in the state dict, or, in the last windows (`keep`), stay in
        scratch (Note [Overlapping the step]); bounced parameters are always copied home;
        its pins end, and its slot is free for the window after next once the copies are
        done."""
        copy_out = run.copies.copy_out
        if keep:
            self.figures["kept_windows"] += 1
            self.figures["kept_bytes"] += copied_bytes(entries, parameters=False)
        self.figures["bounced_state_bytes"] += copied_bytes(entries, parameters=False)
        self.figures["bounced_parameter_bytes"] += sum(
            e.home.numel() * e.home.element_size() for e in entries
            if is_parameter(e) and e.scratch is not None)

        def stays(entry) -> bool:  # in scratch after the step
            return keep and entry.scratch is not None and not is_parameter(entry)

        ending = [e for e in entries if e.pinned and not stays(e)]
        copy_out.wait_stream(main)
        with torch.cuda.stream(copy_out):
            for entry in entries:
                if entry.scratch is None:
                    continue
                run.swapped.remove(entry)  # by identity (eq=False)
                if stays(entry):
                    run.kept.append(entry)
                    continue
                now = current(entry)
                entry.home.copy_(now, non_blocking=True)
                # The optimizer replaced it (a parameter's .data is a new object each time).
                if now.data_ptr() != entry.scratch.data_ptr():
                    now.record_stream(copy_out)
                put(entry, entry.home)
            # Every end on copy_out, which follows main: the chunk's fence covers both the
            # step and the write-back.
            if ending:
                _offload.use_ends_many(_use_hints.pointers(e.home for e in ending),
                                       copy_out.cuda_stream)
            done_ids = {id(e) for e in entries}
            run.held[:] = [e for e in run.held if id(e) not in done_ids]
            written = torch.cuda.Event()
            written.record(copy_out)
            if not keep:
                self.free[slot] = written
            if slot < len(self.parameter_free):
                self.parameter_free[slot] = written

    def finish(self, run: "StepRun", succeeded: bool) -> None:
        """Also when a window failed: its states stay as they were, param_groups are put
        back, the main stream waits for every copy, and every pin and use still open ends.
        Raises a device error met while waiting only when the step itself succeeded."""
        for entry in run.swapped:  # a window failed: its states stay as they were
            put(entry, entry.home)
        for group, params in zip(self.optimizer.param_groups, run.saved):
            group["params"] = params
        fence, wait_error = 0, None
        if run.copies is not None:
            main = torch.cuda.current_stream(run.copies.copy_in.device)
            fence = main.cuda_stream
            try:
                # The scratch is freed in main's order after every copy; later reads see the
                # write-backs.
                main.wait_stream(run.copies.copy_in)
                main.wait_stream(run.copies.copy_out)
            except Exception as error:  # a device error; a failed step's own error wins
                wait_error = error
        self.kept.extend(run.kept)  # empty, unless writing back the last step's failed
        if not succeeded and run.kept:
            try:  # stepped: written back now
                self.write_back_kept(wait=True)
            except Exception as error:  # noqa: BLE001
                wait_error = wait_error or error
        # Pinned by a window that failed or never ran.
        _offload.use_ends_many(
            _use_hints.pointers(entry.home for entry in run.held if entry.pinned), fence)
        if run.begun:
            _use_hints.end(run.begun, fence)
        self.slots, self.free, self.retired = [], [], []
        self.parameter_slots, self.parameter_free = [], []
        self.cache = None
        if wait_error is not None and succeeded:
            raise wait_error

    def pass_boundary(self) -> None:
        """The step boundary, which closes every use: what the windowed steps hold between
        steps is pinned again, and the hooks forget what they began."""
        _offload.step_boundary()
        # A backward that raised never ran the callback that forgets what it began (and
        # holds those parameters).
        self.backward.forget_all()
        self.listeners.repin()
        for entry in self.kept:
            self.listeners.kept_states[id(entry.state.get(entry.key))] = self
        _module_hints.forget_open_forwards()

    def learn_from(self, run: "StepRun") -> None:
        """What the next step and the staging before it learn from this step (Note
        [Overlapping the step]), and the gradients' class (Note [Gradients' class, decided])."""
        self.figures["steps"] += 1
        self.members = self.member_ids(p for params in run.saved for p in params)
        self.plan = run.windows
        self.plan_bytes = self.slot_bytes
        self.per_step, self.last_backward = self.accumulations, self.in_backward
        self.accumulations = self.in_backward = 0
        self.task = None
        self.hinted = False
        self.hints_seen = self.listeners.hints
        self.staging_done = False
        self.next_attempt = 0
        self.next_window = None
        first = next((p for params in run.saved for p in params), None)
        if first is not None and on_gpu(first.device):  # last: it may warn, never raise
            was = self.gradients.state
            self.gradients.after_step(first.device.index or 0)
            if self.gradients.state != was:
                self.hook_gradients(self.gradients.on)
            self.advice.after_step(first.device.index or 0,  # Note [The fast recipe, advised]
                                   time.perf_counter() - self.step_started,
                                   lambda: [tuple(p.shape) for params in run.saved
                                            for p in params],
                                   bounced_now=self.figures["bounced_state_bytes"]
                                   + self.figures["bounced_parameter_bytes"])


def step_figures(optimizer) -> dict:
    """What the windowed step of `optimizer` (offload()) moved while forward and backward ran,
    over its steps: windows and bytes staged during backward, kept on the device after a
    step, and writes-back finished during a forward (Note [Overlapping the step])."""
    stepper = getattr(optimizer, "_zeroalloc_stepper", None)
    if stepper is None:
        raise ZeroallocError("this optimizer's step is not zeroalloc's windowed step: "
                             "pass it to zeroalloc.torch.offload() first")
    figures = dict(stepper.figures)
    figures.update(stepper.gradients.figures())  # Note [Gradients' class, decided]
    figures.update(stepper.advice.snapshot_figures())  # Note [The fast recipe, advised]
    if stepper.host is not None:  # Note [Host windows]: which windows ran where
        figures.update(stepper.host.figures)
    return figures

