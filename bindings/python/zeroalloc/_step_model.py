"""The step's time model under a limit: the placement the engine reaches, and the step time it
predicts from figures measured apart from the step (Note [The step's time model]). The
bench holds it against measured steps; the package uses it to advise the fast recipe (Note
[The fast recipe, advised] in zeroalloc/torch/_recipe_advice.py). Plain Python, no torch.

Note [The step's time model]: with master weights and the host step (ZEROALLOC_HOST_STEP=1,
the CPUs finishing behind the forward), the step's time follows from a few figures:

- where the bytes go: the engine evicts what the step reserves above the limit plus the
  room it keeps for prefetches (ZEROALLOC_PREFETCH_BYTES), and the host step trades what it
  evicted of masters for the fewest last masters, whole, that hold as many bytes (Note
  [Whole masters on the host] in zeroalloc/torch/_host_step.py). `plan_host` is that rule
  on the parameters in the order of the forward: the masters whose master weight and two
  moments live on the host;
- what each part costs: the native run's forward, backward and step (device compute), the
  pinned bandwidth each way (the host masters' bf16 gradients go to the host after the
  backward, their bf16 working copies come back after the CPUs), and the CPUs' AdamW rate
  (parameters a second, the host step's kernel on the GPU's NUMA node);
- the timeline: the backward; then the device steps its masters while the gradients of
  the host's are copied, and the CPUs step theirs in the order of the parameters as their
  gradients arrive; the step returns when the device's windows are done, and the next
  forward runs each parameter's layer once the CPUs have written its working copy back
  (on the copy stream, after every gradient's copy). Under ZEROALLOC_ACCESS=any (the
  default) the step returns only once every working copy is back, so the forward starts
  after all of them (`behind=False`).

`predict_step` replays that timeline parameter by parameter. It leaves out what the step
adds around the kernels (the hooks' host time, the windowed step's bookkeeping) and any
eviction during forward and backward (at a steady state under the trade none remains), so
it is a model to hold the measured step against: the bench prints both, and the step's own
figures say where they part.
"""

from __future__ import annotations

from dataclasses import dataclass

MASTER_STATE_BYTES = 12  # an fp32 master weight and AdamW's two fp32 moments, per parameter
WORKING_BYTES = 2  # a bf16 working copy, and its bf16 gradient, per parameter


@dataclass(frozen=True)
class Parameter:
    """One parameter in the order of the forward: its element count, and its share of the
    forward's (and backward's) compute (0 for an embedding's lookup)."""
    count: int
    compute: float


@dataclass(frozen=True)
class Costs:
    """Figures measured apart from the step: the native run's phases in seconds, the pinned
    bandwidth each way in bytes a second, the CPUs' AdamW rate in parameters a second."""
    forward_s: float
    backward_s: float
    step_s: float
    host_to_device_bps: float
    device_to_host_bps: float
    cpu_params_per_s: float


def llama_parameters(hidden: int, intermediate: int, layers: int, vocab: int) -> list:
    """The parameters of the bench's Llama (heads as many as key-value heads, no biases,
    untied embedding) in the order of `model.parameters()`, which is the optimizer's and
    about the forward's, each with its compute share: a layer's matrices in proportion to
    their size, the embedding none (a lookup), the head its size."""
    matrices = [hidden * hidden] * 4 + [hidden * intermediate] * 3  # attention, then MLP
    order = [("embedding", vocab * hidden)]
    for _ in range(layers):  # transformers registers a layer's two norms after its matrices
        order += [("matrix", size) for size in matrices] + [("norm", hidden)] * 2
    order += [("norm", hidden), ("matrix", vocab * hidden)]
    computing = sum(size for kind, size in order if kind == "matrix")
    return [Parameter(size, size / computing if kind == "matrix" else 0.0)
            for kind, size in order]


def parameters_of(shapes) -> list:
    """Parameters in the optimizer's order from their shapes (tuples of sizes), as a run knows
    them without knowing the model: each matrix (two or more dimensions) computes in
    proportion to its size, vectors (norms, biases) nothing. An embedding counts as a matrix,
    so the model gives its layer a share of the forward that a lookup does not take."""
    counts = [_product(shape) for shape in shapes]
    computing = sum(count for count, shape in zip(counts, shapes) if len(shape) >= 2)
    return [Parameter(count, count / computing if len(shape) >= 2 and computing else 0.0)
            for count, shape in zip(counts, shapes)]


def _product(shape) -> int:
    total = 1
    for size in shape:
        total *= int(size)
    return total


def plan_host(parameters: list, reserved_bytes: int, limit_bytes: int,
              headroom_bytes: int) -> list:
    """Note [The step's time model]: whether each parameter's master and moments are on the
    host. The engine evicts what the step reserves (`reserved_bytes`: the peak the run
    reserved, its host-resident chunks included, about the same at every limit) above the
    limit less the headroom it keeps free; the trade makes as many bytes of the last masters
    whole there, the fewest that hold them."""
    needed = max(0, reserved_bytes + headroom_bytes - limit_bytes)
    on_host = [False] * len(parameters)
    held = 0
    for number in reversed(range(len(parameters))):
        if held >= needed:
            break
        on_host[number] = True
        held += parameters[number].count * MASTER_STATE_BYTES
    return on_host


def predict_step(parameters: list, on_host: list, costs: Costs, behind: bool = True) -> dict:
    """Note [The step's time model]: the step time the timeline gives, with its parts:
    `step_s`, `cpu_s` (when the CPUs are done, from the step's start, their waits for the
    gradients included), `forward_wait_s` (the forward waiting for the working copies),
    `host_params`, `device_step_s`. `behind`: the CPUs finish behind the next forward (under
    ZEROALLOC_ACCESS=hinted); else the step returns once every working copy is back (under
    `any`), and the forward waits for all of them."""
    total = sum(p.count for p in parameters)
    host_params = sum(p.count for p, there in zip(parameters, on_host) if there)
    # The device steps its masters (the native step scaled to their share) while the copy
    # stream takes the host masters' gradients, one after the other, in the parameters'
    # order; the CPUs step each once its gradient has arrived.
    device_step_s = costs.step_s * (total - host_params) / total if total else 0.0
    # One copy stream takes every gradient first, then the working copies the CPUs wrote,
    # in their order.
    written = host_params * WORKING_BYTES / costs.device_to_host_bps
    copied = 0.0
    cpu = 0.0
    ready = []  # per parameter: when its working copy is back on the device (0: never left)
    for parameter, there in zip(parameters, on_host):
        if not there:
            ready.append(0.0)
            continue
        copied += parameter.count * WORKING_BYTES / costs.device_to_host_bps
        cpu = max(cpu, copied) + parameter.count / costs.cpu_params_per_s
        written = max(written, cpu) + parameter.count * WORKING_BYTES / costs.host_to_device_bps
        ready.append(written)
    # The forward starts when the step returns and runs each parameter's compute once its
    # working copy is back.
    clock = device_step_s
    waited = 0.0
    if not behind:  # the step itself waits for every working copy
        back = max(ready, default=0.0)
        waited, clock = max(0.0, back - clock), max(clock, back)
    for parameter, back in zip(parameters, ready):
        if back > clock:
            waited += back - clock
            clock = back
        clock += costs.forward_s * parameter.compute
    return {"step_s": costs.backward_s + clock, "cpu_s": cpu, "forward_wait_s": waited,
            "host_params": host_params, "device_step_s": device_step_s}
