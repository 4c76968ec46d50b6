"""ZEROALLOC_RECIPE and Note [The fast recipe, advised] (zeroalloc/torch/_recipe_advice.py):
what each recipe sets, when a run is told what the fast one would give it, and what it is
told. The steps' figures are given; the rates and memory too (measuring them needs a GPU).

    python3 -m pytest tests/python/test_recipe_advice_logic.py
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "python"
sys.path.insert(0, str(PACKAGE))
torch = pytest.importorskip("torch", reason="skipped: PyTorch is not installed")
if not (ROOT / "build" / "libzeroalloc.so").exists() and "ZEROALLOC_LIBRARY" not in os.environ:
    pytest.skip("skipped: build/libzeroalloc.so is not built", allow_module_level=True)

from zeroalloc import _step_model  # noqa: E402
from zeroalloc.torch import _recipe_advice, _settings  # noqa: E402
from zeroalloc.torch._recipe_advice import Memory, Rates, RecipeAdvice, why_not  # noqa: E402

GIB = 1 << 30
# The 1.3B Llama's bandwidth and CPU rate as the H200 measured them (bench/RESULTS.md).
RATES = Rates(host_to_device_bps=54.7e9, device_to_host_bps=54.5e9, device_bps=4.6e12,
              cpu_params_per_s=4.0e9)
MEMORY = Memory(reserved_bytes=int(28.4 * GIB), limit_bytes=int(13.3 * GIB),
                headroom_bytes=512 << 20)
# 24 layers of 2048 x 5504 (the bench's 1.3B), as shapes in the optimizer's order.
SHAPES = ([(32000, 2048)] + [(2048, 2048)] * 4 * 24 + [(5504, 2048)] * 3 * 24
          + [(2048,)] * 49 + [(32000, 2048)])


@pytest.fixture(autouse=True)
def untold(monkeypatch):
    """Each test starts in a process that was not told yet, with no recipe variable set."""
    monkeypatch.setattr(_recipe_advice, "told", False)
    for name in ("ZEROALLOC_RECIPE", "ZEROALLOC_MASTER_WEIGHTS", "ZEROALLOC_HOST_STEP",
                 "ZEROALLOC_ZERO_STAGE", "ZEROALLOC_ACCESS", "RANK"):
        monkeypatch.delenv(name, raising=False)


def under_autocast() -> RecipeAdvice:
    """The advice of an optimizer whose model's forwards ran under CUDA autocast."""
    advice = RecipeAdvice(None)
    advice.saw_forward(True)
    return advice


def steps(advice, walls, moved, in_step=0.1):
    """Steps of `walls` seconds each (from 1.0 on), `in_step` of each inside the optimizer's
    step, with (to host, to device) moved so far after each."""
    now = 1.0
    for wall, total in zip(walls, moved):  # every move during forward and backward
        now += wall
        advice.after_step(0, in_step, lambda: SHAPES, now=now, moved_now=total,
                          moved_before=total, rates=RATES, memory=MEMORY)


@pytest.fixture
def logged(monkeypatch):
    """What the advice writes to the library's log, and the report sections it sets."""
    lines, sections = [], []
    monkeypatch.setattr(_recipe_advice._offload, "log", lambda level, text: lines.append(
        (level, text)))

    class Library:
        def zeroalloc_report_section(self, name, text):
            sections.append((name.decode(), json.loads(text)))
            return 0

    monkeypatch.setattr(_recipe_advice, "library", lambda: Library())
    return lines, sections


def test_each_recipe_sets_master_weights_and_the_host_step_and_a_variable_overrides_it(
        monkeypatch):
    assert (_settings.recipe(), _settings.master_weights(), _settings.host_step()) == (
        "exact", "none", False)
    monkeypatch.setenv("ZEROALLOC_RECIPE", "fast")
    assert (_settings.master_weights(), _settings.host_step()) == ("bf16", True)
    monkeypatch.setenv("ZEROALLOC_MASTER_WEIGHTS", "none")
    monkeypatch.setenv("ZEROALLOC_HOST_STEP", "0")
    assert (_settings.master_weights(), _settings.host_step()) == ("none", False)
    monkeypatch.setenv("ZEROALLOC_RECIPE", "exact")
    monkeypatch.setenv("ZEROALLOC_HOST_STEP", "1")
    assert (_settings.master_weights(), _settings.host_step()) == ("none", True)
    # Under ZeRO, fast leaves master weights out (they do not combine yet), not the step.
    for name in ("ZEROALLOC_MASTER_WEIGHTS", "ZEROALLOC_HOST_STEP"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("ZEROALLOC_RECIPE", "fast")
    monkeypatch.setenv("ZEROALLOC_ZERO_STAGE", "2")
    assert (_settings.master_weights(), _settings.host_step()) == ("none", True)


def test_a_recipe_that_is_not_one_is_refused_naming_both():
    result = subprocess.run(
        [sys.executable, "-c", "from zeroalloc.torch import _settings; _settings.recipe()"],
        env={**os.environ, "PYTHONPATH": str(PACKAGE), "ZEROALLOC_RECIPE": "quick"},
        capture_output=True, text=True)
    assert result.returncode != 0
    assert "ZEROALLOC_RECIPE" in result.stderr and "exact|fast" in result.stderr, result.stderr


def test_a_run_whose_steps_move_nothing_is_never_told(logged):
    advice = under_autocast()
    steps(advice, [2.0] * 30, [(0, 0)] * 30)
    assert advice.state == "watching" and logged == ([], [])


def test_the_first_timed_step_that_moves_tells_once_with_the_step_models_prediction(logged):
    """Steps 1 and 2 moved (learning the order), step 3 did not, step 4 did: told at step 4
    from the medians of steps 3 and 4, once; a second optimizer is not told again."""
    lines, sections = logged
    advice = under_autocast()
    gib = GIB
    moved = [(gib, 0), (2 * gib, gib), (2 * gib, gib), (3 * gib, 2 * gib), (9 * gib, 9 * gib)]
    steps(advice, [4.9, 3.2, 1.8, 2.0, 2.0], moved, in_step=0.3)
    assert advice.state == "advised"
    assert len(lines) == 1 and lines[0][0] == "warn"
    text = lines[0][1]
    # Steps 3 and 4: walls 1.8 and 2.0 (median 1.9), 0.3 s each in the step, 0 and 2 GiB moved.
    moving = (gib / RATES.device_to_host_bps + gib / RATES.host_to_device_bps) / 2
    compute = 1.9 - 0.3 - moving
    parameters = _step_model.parameters_of(SHAPES)
    total = sum(p.count for p in parameters)
    expected = _step_model.predict_step(
        parameters, _step_model.plan_host(parameters, MEMORY.reserved_bytes,
                                          MEMORY.limit_bytes, MEMORY.headroom_bytes),
        _step_model.Costs(0.38 * compute, 0.62 * compute, total * 100 / RATES.device_bps,
                          RATES.host_to_device_bps, RATES.device_to_host_bps,
                          RATES.cpu_params_per_s))["step_s"]
    assert "step 4 moved memory to stay under the 13.3 GiB limit and took 1.90 s" in text
    assert f"ZEROALLOC_RECIPE=fast it would take about {expected:.2f} s" in text
    assert "ZEROALLOC_RECIPE=exact" in text  # how to keep native numbers, and silence it
    assert sections == [("recipe", {
        "recipe": "exact", "advised": "ZEROALLOC_RECIPE=fast", "measured_step_s": 1.9,
        "predicted_step_s": round(expected, 4), "at_step": 4, "parameters": total,
        "host_params": sections[0][1]["host_params"], "cpu_params_per_s": 4000000000,
        "host_to_device_gbps": 54.7, "device_to_host_gbps": 54.5})]
    # The trade takes 28.4 + 0.5 - 13.3 GiB of the last masters to the host, 12 bytes a
    # parameter: more than all of them hold, so all go.
    assert sections[0][1]["host_params"] == total
    assert 0.2 < expected < 0.9 * 1.9
    steps(advice, [2.0] * 5, [(10 * gib, 10 * gib)] * 5)
    other = under_autocast()
    steps(other, [2.0] * 6, [(i * gib, i * gib) for i in range(6)])
    assert other.state == "quiet" and len(lines) == 1


def test_moves_inside_the_step_are_not_taken_off_twice_and_none_under_hinted_access(
        logged, monkeypatch):
    """The step's own time holds the moves it made; only those of forward and backward are
    taken off the compute, and under ZEROALLOC_ACCESS=hinted (moves overlap compute) none."""
    def predicted(outside_gib):
        monkeypatch.setattr(_recipe_advice, "told", False)
        advice = under_autocast()
        now, total = 1.0, 0
        for _ in range(4):
            now += 2.0
            before = (total + outside_gib * GIB, 0)
            total += 3 * GIB  # 3 GiB a step to the host, `outside_gib` of it before the step
            advice.after_step(0, 0.5, lambda: SHAPES, now=now, moved_now=(total, 0),
                              moved_before=before, rates=RATES, memory=MEMORY)
        return advice.snapshot_figures()["recipe_advice_predicted_s"]

    none_outside, two_outside = predicted(0), predicted(2)
    assert two_outside < none_outside  # 2 GiB less compute: a shorter fast step
    monkeypatch.setenv("ZEROALLOC_ACCESS", "hinted")
    assert predicted(2) == pytest.approx(none_outside)


def test_under_torchrun_only_rank_0_logs_and_every_rank_keeps_it_in_its_report(
        logged, monkeypatch):
    lines, sections = logged
    monkeypatch.setenv("RANK", "1")
    advice = under_autocast()
    steps(advice, [2.0] * 5, [(i * GIB, i * GIB) for i in range(5)], in_step=1.0)
    assert advice.state == "advised" and lines == [] and len(sections) == 1


def test_a_steady_step_that_bounces_states_through_scratch_counts_as_moving(logged):
    """States on the host are copied through device scratch by the step, not moved by the
    engine: a steady run under a limit may move nothing else, and is told all the same."""
    advice = under_autocast()
    now = 1.0
    for step in range(5):
        now += 2.0
        advice.after_step(0, 1.0, lambda: SHAPES, now=now, moved_now=(GIB, GIB),
                          moved_before=(GIB, GIB), rates=RATES, memory=MEMORY,
                          bounced_now=step * 8 * GIB)
    assert advice.state == "advised" and advice.snapshot_figures()["recipe_advice_at_step"] == 3


def test_a_run_whose_forwards_ran_outside_autocast_is_not_told(logged):
    """Under the fast recipe the weights are bf16: a forward outside autocast would feed them
    fp32 inputs and fail. Such a run is not told; its figures say why."""
    advice = RecipeAdvice(None)
    advice.saw_forward(True)
    advice.saw_forward(False)  # an evaluation outside autocast, say
    # The steps of the run that is told in the test above.
    moved = [(GIB, 0), (2 * GIB, GIB), (2 * GIB, GIB), (3 * GIB, 2 * GIB), (9 * GIB, 9 * GIB)]
    steps(advice, [4.9, 3.2, 1.8, 2.0, 2.0], moved, in_step=0.3)
    lines, sections = logged
    assert advice.state == "off" and sections == []
    assert [level for level, _ in lines] == ["debug"]  # no warning: why, at debug level
    figures = advice.snapshot_figures()
    assert figures["recipe_advice_reason"] == (
        "1 of 2 module forwards ran outside CUDA autocast: the fast recipe's bf16 weights "
        "would meet their fp32 inputs")
    assert "recipe_advice_predicted_s" not in figures  # nothing measured for it


def test_a_prediction_not_worth_the_change_says_nothing(logged):
    """Under a limit that leaves the run almost everything, the fast recipe's step is no
    faster than the measured one: nothing is said, and the figures show why."""
    advice = under_autocast()
    memory = Memory(reserved_bytes=int(28.4 * GIB), limit_bytes=int(28 * GIB),
                    headroom_bytes=512 << 20)
    now = 1.0
    for number in range(5):
        now += 0.2
        advice.after_step(0, 0.03, lambda: SHAPES, now=now, moved_now=(number, number),
                          moved_before=(number, number), rates=RATES, memory=memory)
    assert advice.state == "quiet" and logged == ([], [])
    figures = advice.snapshot_figures()
    assert figures["recipe_advice_predicted_s"] > 0.9 * figures["recipe_advice_measured_s"]


def test_a_failed_measurement_stops_the_advice_and_the_step_goes_on(logged, monkeypatch):
    def broken(device):
        raise RuntimeError("CUDA out of memory")
    monkeypatch.setattr(_recipe_advice, "measure_rates", broken)
    advice = under_autocast()
    now = 1.0
    for number in range(5):
        now += 1.0
        advice.after_step(0, 0.1, lambda: SHAPES, now=now, moved_now=(number, 0),
                          memory=MEMORY)
    assert advice.state == "off"
    assert "CUDA out of memory" in advice.snapshot_figures()["recipe_advice_reason"]
    assert logged[0] == [("debug", "zeroalloc: measuring for the recipe's advice failed: "
                                   "CUDA out of memory")]


def test_the_advice_applies_only_where_the_fast_recipe_could_run_and_nothing_was_chosen(
        monkeypatch):
    linear = torch.nn.Linear(8, 8)
    assert why_not(torch.optim.AdamW(linear.parameters()), None) is None
    assert why_not(torch.optim.Adam(linear.parameters()), None) is None
    assert "SGD" in why_not(torch.optim.SGD(linear.parameters(), lr=0.1), None)
    assert "Adam" in why_not(torch.optim.Adam(linear.parameters(), weight_decay=0.1), None)
    assert why_not(torch.optim.AdamW(linear.parameters()), object()) == (
        "the optimizer steps master weights")
    half = torch.nn.Linear(8, 8).to(torch.bfloat16)
    assert why_not(torch.optim.AdamW(half.parameters()), None) == "no parameter is fp32"
    for name, value in (("ZEROALLOC_RECIPE", "exact"), ("ZEROALLOC_MASTER_WEIGHTS", "none"),
                        ("ZEROALLOC_HOST_STEP", "0")):
        monkeypatch.setenv(name, value)
        assert why_not(torch.optim.AdamW(linear.parameters()), None) == f"{name} is set"
        monkeypatch.delenv(name)
    partitioned = torch.optim.AdamW(linear.parameters())
    partitioned._zeroalloc_partition = object()  # zt.partition() called by the script
    assert "ZeRO" in why_not(partitioned, None)
    monkeypatch.setenv("ZEROALLOC_ZERO_STAGE", "1")
    assert "ZeRO" in why_not(torch.optim.AdamW(linear.parameters()), None)
    assert RecipeAdvice("SGD").snapshot_figures()["recipe_advice"] == "off"


def test_the_parameters_shapes_give_the_compute_shares_the_model_replays():
    parameters = _step_model.parameters_of([(4, 8), (8,), (2, 8)])
    assert [p.count for p in parameters] == [32, 8, 16]
    assert [p.compute for p in parameters] == [32 / 48, 0.0, 16 / 48]


def test_the_library_log_takes_a_message_at_a_level_and_refuses_an_unknown_level(tmp_path):
    """zeroalloc_log: what the advice is written with reaches ZEROALLOC_LOG_FILE."""
    log = tmp_path / "zeroalloc.log"
    code = textwrap.dedent("""
        import zeroalloc
        from zeroalloc import _offload
        from zeroalloc._library import library, last_error
        _offload.log("warn", "the fast recipe would help")
        _offload.log("debug", "below the level: dropped")
        print("unknown level:", library().zeroalloc_log(9, b"x"), last_error())
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(PACKAGE),
                                 "ZEROALLOC_DEVICE": "sim", "ZEROALLOC_LOG_FILE": str(log)})
    assert result.returncode == 0, result.stderr
    assert "unknown level: -1 zeroalloc_log: log level 9 is none of" in result.stdout
    text = log.read_text()
    assert "the fast recipe would help" in text and "dropped" not in text


def test_the_host_steps_rate_is_measured_and_a_count_beyond_the_host_is_refused():
    code = textwrap.dedent("""
        from zeroalloc import _offload
        from zeroalloc._library import ZeroallocError
        rate = _offload.host_adamw_rate(0, 1 << 20)
        print("rate", rate)
        try:
            _offload.host_adamw_rate(0, 1 << 50)
        except ZeroallocError as error:
            print("refused:", error)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(PACKAGE),
                                 "ZEROALLOC_DEVICE": "sim"})
    assert result.returncode == 0, result.stderr
    rate = float(result.stdout.split("rate ")[1].split()[0])
    assert 1e6 < rate < 1e12  # a million parameters take between a microsecond and a second
    assert "measuring the host step's rate over 1125899906842624 parameters needs" in (
        result.stdout)
    assert "free host memory" in result.stdout
