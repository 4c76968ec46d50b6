"""The step's time model (Note [The step's time model] in zeroalloc/_step_model.py): the
placement it plans is the host step's trade, and the step time it predicts from measured
figures follows the limit and the recorded GPU runs."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "python"
spec = importlib.util.spec_from_file_location("step_model",
                                              PACKAGE / "zeroalloc" / "_step_model.py")
model = importlib.util.module_from_spec(spec)
sys.modules["step_model"] = model
spec.loader.exec_module(model)

GIB = 1 << 30
HEADROOM = 512 << 20
LLAMA = model.llama_parameters(hidden=2048, intermediate=5504, layers=24, vocab=32000)
# The native run of the 1.3B bench model (bench/RESULTS.md, "AdamW stepped on the host",
# 2026-12-03) and the pinned bandwidth of the 2026-12-04 sweep.
NATIVE = dict(forward_s=0.045, backward_s=0.072, step_s=0.029)
BANDWIDTH = dict(host_to_device_bps=54.7e9, device_to_host_bps=54.5e9)


def host_bytes(parameters, on_host) -> int:
    return sum(p.count for p, there in zip(parameters, on_host) if there) * model.MASTER_STATE_BYTES


def test_the_bench_model_has_its_parameter_count():
    assert sum(p.count for p in LLAMA) == 1_345_423_360  # the bench's figure
    assert math.isclose(sum(p.compute for p in LLAMA), 1.0)
    assert LLAMA[0].compute == 0.0  # the embedding is a lookup


@pytest.mark.parametrize("limit_gib", [13.3, 18, 21, 24.8, 27.9])
def test_the_plan_puts_the_fewest_last_masters_that_hold_what_is_over_the_limit(limit_gib):
    reserved = int(28.3 * GIB)
    on_host = model.plan_host(LLAMA, reserved, int(limit_gib * GIB), HEADROOM)
    needed = reserved + HEADROOM - int(limit_gib * GIB)
    held = host_bytes(LLAMA, on_host)
    if needed >= host_bytes(LLAMA, [True] * len(LLAMA)):  # more than all masters: all there
        assert all(on_host)
        return
    first = on_host.index(True)
    assert all(on_host[first:]) and not any(on_host[:first])  # the last ones, whole
    assert held >= needed  # as many bytes
    assert held - LLAMA[first].count * model.MASTER_STATE_BYTES < needed  # the fewest


def test_nothing_goes_to_the_host_where_the_step_fits_with_its_headroom():
    reserved = int(28.3 * GIB)
    assert not any(model.plan_host(LLAMA, reserved, reserved + HEADROOM, HEADROOM))
    assert model.plan_host(LLAMA, reserved, reserved + HEADROOM - 1, HEADROOM)[-1]


def test_the_plan_is_the_host_steps_trade():
    """The runtime's rule (HostStep.trade) and the model's (plan_host) choose the same
    masters: the engine left 72 bytes of masters on the host (the first master, and one
    moment of the second)."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc.torch import _host_step

    counts = [5, 3, 8, 2, 6, 4]
    masters = [tuple(torch.zeros(count) for _ in range(3)) for count in counts]
    places = [["host"] * 3, ["device", "host", "device"]] + [["device"] * 3] * 4
    host = _host_step.HostStep()
    to_host, to_device = host.trade(list(zip(masters, places)))
    traded = {number for number, tensors in enumerate(masters)
              if any(tensor is moved for tensor in tensors for moved in to_host)}
    parameters = [model.Parameter(count, 1 / len(counts)) for count in counts]
    held = 5 * 12 + 3 * 4
    planned = model.plan_host(parameters, reserved_bytes=1000, limit_bytes=1000 + 64 - held,
                              headroom_bytes=64)
    assert traded == {number for number, there in enumerate(planned) if there} == {4, 5}
    assert {id(t) for t in to_device} == {id(masters[0][0]), id(masters[0][1]),
                                          id(masters[0][2]), id(masters[1][1])}


def costs(cpu_params_per_s: float) -> "model.Costs":
    return model.Costs(**NATIVE, **BANDWIDTH, cpu_params_per_s=cpu_params_per_s)


def test_with_nothing_on_the_host_the_step_is_the_native_one():
    predicted = model.predict_step(LLAMA, [False] * len(LLAMA), costs(4e9))
    assert predicted["step_s"] == pytest.approx(sum(NATIVE.values()))
    assert predicted["forward_wait_s"] == 0 and predicted["cpu_s"] == 0


def test_cpus_that_finish_before_the_forward_needs_the_last_layers_cost_no_wait():
    on_host = [False] * (len(LLAMA) - 1) + [True]  # the head alone (65.5 M parameters)
    fast = model.predict_step(LLAMA, on_host, costs(1e12))
    assert fast["forward_wait_s"] == pytest.approx(0.0, abs=1e-3)
    slow = model.predict_step(LLAMA, on_host, costs(0.5e9))  # 0.13 s of CPU for the head
    assert slow["cpu_s"] > 0.13
    assert slow["forward_wait_s"] > 0.05
    assert slow["step_s"] > fast["step_s"] + 0.05


def test_the_predicted_step_has_no_cliff_as_the_limit_grows():
    """Each half GiB more never makes the step more than 1% longer (a few last masters on
    the CPUs take that much off the device's step), and with room for everything it is the
    native step."""
    reserved = int(28.3 * GIB)
    previous = math.inf
    for limit_gib in [x / 2 for x in range(20, 60)]:
        on_host = model.plan_host(LLAMA, reserved, int(limit_gib * GIB), HEADROOM)
        step = model.predict_step(LLAMA, on_host, costs(4e9))["step_s"]
        assert step <= previous * 1.01, limit_gib
        previous = step
    assert previous == pytest.approx(sum(NATIVE.values()))


# The sweep of 2026-12-04 (bench/RESULTS.md, "The trade sized to what the limit takes",
# call 2): limit GiB, peak reserved GiB, the CPUs' rate over the timed steps (parameters a
# second), measured step s, host GiB.
RECORDED = [(18.0, 28.234, 4.17e9, 0.288, 10.90),
            (21.0, 28.264, 4.00e9, 0.235, 7.93),
            (24.8, 28.332, 3.83e9, 0.155, 4.10)]


@pytest.mark.parametrize("limit_gib, reserved_gib, rate, measured_s, host_gib", RECORDED)
def test_the_model_is_within_a_fifth_of_the_recorded_gpu_runs(limit_gib, reserved_gib, rate,
                                                              measured_s, host_gib):
    on_host = model.plan_host(LLAMA, int(reserved_gib * GIB), int(limit_gib * GIB), HEADROOM)
    assert host_bytes(LLAMA, on_host) / GIB == pytest.approx(host_gib, abs=0.25)
    predicted = model.predict_step(LLAMA, on_host, costs(rate))["step_s"]
    assert 0.8 <= measured_s / predicted <= 1.2, (predicted, measured_s)


# Two runs of 2026-12-06 under ZEROALLOC_ACCESS=any, the CPUs within the step (bench/
# RESULTS.md, "Moments made on the host in the first step", calls 1 and 5): limit GiB, peak
# reserved GiB, native forward, backward and step s, pinned GB/s to the device and back, the
# CPUs' rate over the timed steps, measured step s.
RECORDED_WITHIN = [
    (13.343, 28.236, (0.046, 0.080, 0.039), (55.06, 54.96), 4.077e9, 0.521),
    (13.343, 28.164, (0.0452, 0.0801, 0.0402), (51.86, 54.86), 4.938e9, 0.441)]


@pytest.mark.parametrize("limit_gib, reserved_gib, phases, pinned, rate, measured_s",
                         RECORDED_WITHIN)
def test_within_the_step_the_model_is_within_a_fifth_of_the_recorded_gpu_runs(
        limit_gib, reserved_gib, phases, pinned, rate, measured_s):
    """Under `any` the step returns once every working copy is back, and the forward starts
    after it: the model with behind=False holds the recorded steps within a fifth, and the
    timeline behind the forward (what hinted runs get) would predict them a fifth faster."""
    on_host = model.plan_host(LLAMA, int(reserved_gib * GIB), int(limit_gib * GIB), HEADROOM)
    costs_then = model.Costs(*phases, pinned[0] * 1e9, pinned[1] * 1e9, rate)
    within = model.predict_step(LLAMA, on_host, costs_then, behind=False)["step_s"]
    behind = model.predict_step(LLAMA, on_host, costs_then)["step_s"]
    assert 1.0 <= measured_s / within <= 1.2, (within, measured_s)
    assert measured_s / behind > 1.2, (behind, measured_s)
