"""Telling a run, once, what the fast recipe would give it (ZEROALLOC_RECIPE).

Note [The fast recipe, advised]: the default recipe, exact, changes no number a run
computes. Under a limit that makes memory move, it is also the slow one: on a 1.3B Llama at
13.3 GiB the fast recipe (master weights in bf16 and AdamW on the CPUs for the masters the
host holds) ran 5 x exact, side by side (bench/RESULTS.md, "Safe by default"). The fast
recipe changes numbers (bf16 weights, the CPUs' rounding), so it is never chosen for the
user. Instead a run that has not named a recipe, whose steps move memory, is told once:
in the library's log (rank 0's, under torchrun), in the memory report (section "recipe",
each rank's) and by `python -m zeroalloc doctor`, which reads that report. The message
names the setting and the step time the step model (Note [The step's time model] in
zeroalloc/_step_model.py) predicts with it.

What it is told from, per optimizer that the host step could step (AdamW, or Adam with
decoupled or no weight decay) with fp32 parameters, outside ZeRO (which has no master
weights yet), and only where neither ZEROALLOC_RECIPE nor ZEROALLOC_MASTER_WEIGHTS nor
ZEROALLOC_HOST_STEP is set (a setting chosen is not second-guessed; ZEROALLOC_RECIPE=exact
keeps the numbers and silences the message):

- the steps: the wall time between the ends of two optimizer steps, the time inside
  optimizer.step(), the bytes the engine moved each way meanwhile (a cheap read), and the
  bytes the step copied through device scratch (host-resident states, which a steady step
  moves without the engine). The first WARMUP_STEPS learn the order and settle the
  placement, so they are not used. The first timed step that moved bytes either way
  triggers the advice, from the medians of the timed steps so far;
- the run's compute: the wall time less the time inside the step, and under
  ZEROALLOC_ACCESS=any (where the device idles while a move runs) less the bytes moved
  during forward and backward at the measured bandwidth; split between forward and
  backward as the 1.3B Llama's native phases split them (FORWARD_SHARE). Kernels that read
  host memory over PCIe stay in it, as does the host time of the hooks, so it errs toward a
  slower prediction. Under ZEROALLOC_ACCESS=hinted moves overlap compute, and nothing is
  taken off for them;
- measured once, at the advice: the pinned bandwidth each way and the device's own copy
  rate (64 MiB copies, about 10 ms), and the CPUs' AdamW rate on the host step's own
  workers (zeroalloc_host_adamw_rate: 1 GiB for a fraction of a second);
- the device's AdamW over every parameter, from its copy rate and DEVICE_STEP_BYTES;
- the placement: the run's lifetime peak reserved (host-resident chunks included, read
  before the probe allocates), the limit and the prefetch headroom, as the trade places
  masters (plan_host). Master weights leave a parameter's bytes as they are (a bf16
  working copy and gradient for an fp32 parameter and gradient; the masters with the
  states), and bf16 activations take no more, so the peak is an upper bound.

The message goes out only where the prediction is at most WORTH of the measured step, and
only to a run whose forwards all ran under CUDA autocast. Under the fast recipe the model's
weights are bf16, and a forward outside autocast that feeds them fp32 inputs fails
("mat1 and mat2 must have the same dtype"): a run that computes in fp32 is not told to
switch. Token ids would be served, but the hooks see modules, not inputs, so such a run
without autocast is not told either. A
failure to measure never fails the step: the advice stops, saying why at debug level and
in zt.step_figures(optimizer)."""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass

from zeroalloc import _offload, _stats, _step_model
from zeroalloc._library import library
from zeroalloc.torch import _settings

#: Steps whose figures are not used: the first learns the order, the second settles the
#: placement (as Note [Gradients' class, decided] counts them).
WARMUP_STEPS = 2
#: Timed steps whose medians the advice reads (the last ones before it).
TIMED_STEPS = 3
#: Advise only where the fast recipe's predicted step is at most this share of the measured.
WORTH = 0.9
#: The forward's share of forward and backward: 0.045 s of 0.117 s in the native 1.3B
#: Llama's phases (bench/RESULTS.md, "AdamW stepped on the host").
FORWARD_SHARE = 0.38
#: Bytes the device's AdamW moves per parameter, as its copy rate counts them: torch's
#: foreach AdamW stepped 1.35 G parameters in 0.029 s on an H200 (46 G a second), whose
#: copies move about 4.6 TB/s.
DEVICE_STEP_BYTES = 100
#: The bytes each copy of the bandwidth probe moves.
PROBE_BYTES = 64 << 20
#: The classes whose moves count.
CLASSES = ("other", "parameter", "gradient", "optimizer_state")

#: Whether this process was told (once per process, whatever the optimizers).
told = False


@dataclass(frozen=True)
class Rates:
    """Measured once, at the advice: bytes a second each way over PCIe (pinned) and within
    the device (a copy's reads and writes together), parameters a second of the CPUs'
    AdamW."""
    host_to_device_bps: float
    device_to_host_bps: float
    device_bps: float
    cpu_params_per_s: float


@dataclass(frozen=True)
class Memory:
    """The run's peak reserved (host-resident chunks included), its limit and the prefetch
    headroom, in bytes."""
    reserved_bytes: int
    limit_bytes: int
    headroom_bytes: int


def why_not(optimizer, masters) -> "str | None":
    """Why the advice does not apply to `optimizer` (its masters, or None), or None when it
    does."""
    for name in ("ZEROALLOC_RECIPE", "ZEROALLOC_MASTER_WEIGHTS", "ZEROALLOC_HOST_STEP"):
        if _settings.setting_if_set(name) is not None:
            return f"{name} is set"
    if masters is not None:
        return "the optimizer steps master weights"
    if (_settings.setting("ZEROALLOC_ZERO_STAGE", "0") != "0"
            or getattr(optimizer, "_zeroalloc_partition", None) is not None):
        return "ZeRO partitions have no master weights yet"
    from zeroalloc.torch._host_step import adamw_settings  # imports torch
    import torch
    if not all(adamw_settings(optimizer, group) is not None for group in optimizer.param_groups):
        return f"the host step cannot step {type(optimizer).__name__} with these settings"
    if not any(p.dtype == torch.float32 for group in optimizer.param_groups
               for p in group["params"]):
        return "no parameter is fp32"
    return None


def moved(device: int) -> tuple:
    """(bytes to the host, bytes to the device) the engine moved so far, every class."""
    pairs = [_stats.moved_bytes(device, name) for name in CLASSES]
    return sum(pair[0] for pair in pairs), sum(pair[1] for pair in pairs)


def measure_rates(device: int) -> Rates:
    """The copies' rates (the best of three after one, on the current stream) and the CPUs'
    AdamW rate."""
    import torch
    with torch.cuda.device(device):
        host = torch.empty(PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
        first = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=device)
        second = torch.empty_like(first)

        def best(copy) -> float:
            times = []
            for _ in range(4):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                copy()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return min(times[1:])

        to_device = best(lambda: first.copy_(host, non_blocking=True))
        to_host = best(lambda: host.copy_(first, non_blocking=True))
        within = best(lambda: second.copy_(first))
    return Rates(PROBE_BYTES / to_device, PROBE_BYTES / to_host, 2 * PROBE_BYTES / within,
                 _offload.host_adamw_rate(device))


def read_memory(device: int) -> Memory:
    stats = _stats.raw_stats(device)
    headroom = _settings.prefetch_headroom_bytes()
    reserved = stats["total"]["reserved_bytes"]
    return Memory(int(reserved.get("lifetime_peak", reserved["peak"])),
                  int(stats["limit_bytes"]), headroom)


def predict(shapes: list, compute_s: float, rates: Rates, memory: Memory) -> dict:
    """The fast recipe's step by the step model: `step_s`, and where the masters would go
    (`host_params` of `parameters`)."""
    parameters = _step_model.parameters_of(shapes)
    total = sum(p.count for p in parameters)
    costs = _step_model.Costs(FORWARD_SHARE * compute_s, (1 - FORWARD_SHARE) * compute_s,
                              total * DEVICE_STEP_BYTES / rates.device_bps,
                              rates.host_to_device_bps, rates.device_to_host_bps,
                              rates.cpu_params_per_s)
    on_host = _step_model.plan_host(parameters, memory.reserved_bytes, memory.limit_bytes,
                                    memory.headroom_bytes)
    predicted = _step_model.predict_step(parameters, on_host, costs)
    return {"step_s": predicted["step_s"], "host_params": predicted["host_params"],
            "parameters": total}


def message(measured_s: float, predicted_s: float, memory: Memory, step: int) -> str:
    gib = 1 << 30
    return (f"zeroalloc: step {step} moved memory to stay under the {memory.limit_bytes / gib:.1f}"
            f" GiB limit and took {measured_s:.2f} s. With ZEROALLOC_RECIPE=fast it would take "
            f"about {predicted_s:.2f} s (the step model's prediction from this run; it counts "
            "this run's waits for moves as compute, so the step may well be faster). That "
            "recipe trains the model in bf16 against fp32 master weights, and the CPUs step "
            "the masters the host holds: the numbers differ from native by bf16 and by the "
            "CPUs' rounding. Set ZEROALLOC_RECIPE=exact to keep native numbers and this message "
            "away.")


class RecipeAdvice:
    """Whether and what one optimizer's steps advise: the windowed step calls after_step."""

    __slots__ = ("state", "reason", "steps", "ended", "moved", "bounced", "began", "timed",
                 "figures", "forwards", "outside_autocast")

    def __init__(self, reason: "str | None"):
        # watching: steps read; advised: told; quiet: decided not to tell (or told
        # already); off: does not apply, or measuring failed (`reason`).
        self.state = "off" if reason else "watching"
        self.reason = reason
        self.steps = 0
        self.ended = None  # time.perf_counter() at the last step's end
        self.moved = None  # (to host, to device) by then
        self.bounced = 0  # bytes the windowed steps copied through scratch by then
        self.began = None  # (to host, to device) when the running step began
        # (wall s, step s, to host and to device outside the step, all moved) of the last
        # timed steps
        self.timed: list = []
        self.figures: dict = {}
        self.forwards = 0  # module forwards seen, and those outside CUDA autocast
        self.outside_autocast = 0

    def saw_forward(self, under_autocast: bool) -> None:
        """A module's forward began (the hooks' use hint), under CUDA autocast or not."""
        self.forwards += 1
        if not under_autocast:
            self.outside_autocast += 1

    def before_step(self, device: int) -> None:
        """The optimizer's step begins: what moved during forward and backward is known."""
        if self.state != "watching":
            return
        try:
            self.began = moved(device)
        except Exception as error:  # noqa: BLE001  the step has not even begun
            self.stop(f"measuring for the recipe's advice failed: {error}")

    def after_step(self, device: int, step_s: float, shapes, now: "float | None" = None,
                   moved_now: "tuple | None" = None, moved_before: "tuple | None" = None,
                   rates=None, memory=None, bounced_now: int = 0) -> None:
        """The optimizer's step ended after `step_s` inside it, on `device`; `shapes` (its
        parameters' shapes, in order) is called only at the advice. `now`, `moved_now` (what
        the engine moved so far) and `moved_before` (by the step's start: before_step's),
        `rates` and `memory` are read or measured when not given. `bounced_now`: the bytes
        the step copied through device scratch so far (host-resident states and parameters,
        which a steady step moves without the engine), which count as moved."""
        if self.state != "watching":
            return
        try:
            now = time.perf_counter() if now is None else now
            moved_now = moved(device) if moved_now is None else moved_now
            moved_before = self.began if moved_before is None else moved_before
            seconds = now - self.ended if self.ended is not None else None
            last, bounced = self.moved, bounced_now - self.bounced
            self.ended, self.moved, self.began = now, moved_now, None
            self.bounced = bounced_now
            self.steps += 1
            if seconds is None or last is None or self.steps <= WARMUP_STEPS:
                return
            before = moved_before if moved_before is not None else last
            outside = (before[0] - last[0], before[1] - last[1])
            total = moved_now[0] - last[0] + moved_now[1] - last[1] + bounced
            self.timed = (self.timed + [(seconds, step_s, *outside, total)])[-TIMED_STEPS:]
            if total > 0:
                self.advise(device, shapes, rates, memory)
        except Exception as error:  # noqa: BLE001  the step itself succeeded
            self.stop(f"measuring for the recipe's advice failed: {error}")

    def advise(self, device: int, shapes, rates, memory) -> None:
        global told
        if told:
            self.state = "quiet"
            return
        if self.outside_autocast or not self.forwards:
            self.stop(f"{self.outside_autocast} of {self.forwards} module forwards ran "
                      "outside CUDA autocast: the fast recipe's bf16 weights would meet "
                      "their fp32 inputs")
            return
        memory = read_memory(device) if memory is None else memory  # before the probe's
        rates = measure_rates(device) if rates is None else rates  # allocations
        wall = statistics.median(t[0] for t in self.timed)
        in_step = statistics.median(t[1] for t in self.timed)
        # Under ZEROALLOC_ACCESS=any the device idles while a move runs; under hinted the
        # moves overlap compute, and none is taken off.
        moving = statistics.median(t[2] / rates.device_to_host_bps
                                   + t[3] / rates.host_to_device_bps for t in self.timed
                                   ) if _settings.any_access() else 0.0
        compute = max(0.0, wall - in_step - moving)
        predicted = predict(list(shapes()), compute, rates, memory)
        self.figures = {"recipe_advice_measured_s": wall,
                        "recipe_advice_predicted_s": predicted["step_s"],
                        "recipe_advice_at_step": self.steps,
                        "recipe_advice_host_params": predicted["host_params"],
                        "recipe_advice_cpu_params_per_s": rates.cpu_params_per_s,
                        "recipe_advice_host_to_device_gbps": rates.host_to_device_bps / 1e9,
                        "recipe_advice_device_to_host_gbps": rates.device_to_host_bps / 1e9}
        if predicted["step_s"] > WORTH * wall:
            self.state = "quiet"
            return
        told = True
        self.state = "advised"
        if os.environ.get("RANK", "0") == "0":  # one message for a job, each rank's report
            _offload.log("warn", message(wall, predicted["step_s"], memory, self.steps))
        section = {"recipe": "exact", "advised": "ZEROALLOC_RECIPE=fast",
                   "measured_step_s": round(wall, 4),
                   "predicted_step_s": round(predicted["step_s"], 4),
                   "at_step": self.steps,
                   "parameters": predicted["parameters"],
                   "host_params": predicted["host_params"],
                   "cpu_params_per_s": round(rates.cpu_params_per_s),
                   "host_to_device_gbps": round(rates.host_to_device_bps / 1e9, 1),
                   "device_to_host_gbps": round(rates.device_to_host_bps / 1e9, 1)}
        library().zeroalloc_report_section(b"recipe", json.dumps(section).encode())

    def stop(self, reason: str) -> None:
        """Off for good, saying why at debug level (the step itself succeeded)."""
        self.state, self.reason = "off", reason
        try:
            _offload.log("debug", f"zeroalloc: {reason}")
        except Exception:  # noqa: BLE001  called from after_step's handler: never raise
            pass

    def snapshot_figures(self) -> dict:
        """What zt.step_figures reports: where the advice stands, why it is off, and once
        made, the measured and predicted steps."""
        return {"recipe_advice": self.state, "recipe_advice_reason": self.reason or "",
                **self.figures}
