"""The Llama bench's parent side, which runs no GPU code: the order of its runs (DeepSpeed's
before an offload limit read from its footprint, the native run before a limit derived from
it), the PCIe-bound estimate, and the tables it prints, from made-up worker results in
place of the workers (bench/python/offload_llama_bench.py).

    python3 -m pytest tests/python/test_offload_llama_bench.py
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "python" / "offload_llama_bench.py"
spec = importlib.util.spec_from_file_location("offload_llama_bench", BENCH)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

GIB = 2**30
BANDWIDTH = bench.Bandwidth(host_to_device_gbps=50.0, device_to_host_gbps=50.0, both_gbps=100.0)


def names(argv):
    return [run.name for run in bench.plan_runs(bench.parse_args(argv))]


def test_the_sweep_accepts_gib_and_deepspeed_footprints():
    limits = bench.parse_limits("ds2, 18,21,24.8")
    assert [(l.label, l.gib, l.footprint_of) for l in limits] == [
        ("ds2", None, "ds2"), ("18", 18.0, ""), ("21", 21.0, ""), ("24.8", 24.8, "")]
    assert bench.parse_limits("") == []


@pytest.mark.parametrize("text", ["18,lots", "-1", "0", "nan", "ds4"])
def test_a_bad_limit_names_the_flag_the_value_and_the_accepted_form(text):
    with pytest.raises(ValueError, match=r"--limits-gib .*ds2,18,21,24\.8"):
        bench.parse_limits(text)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="--modes .*ds5 unknown"):
        names(["--modes", "native,ds5"])


def test_deepspeed_runs_before_the_sweep_that_reads_its_footprint():
    assert names(["--modes", "native,offload,ds2,ds3", "--limits-gib", "ds2,18"]) == [
        "native", "ds2", "ds3", "bandwidth", "offload_ds2", "offload_18GiB"]
    # ds2 only in the sweep: its run is added all the same; no native run is asked for.
    assert names(["--modes", "offload", "--limits-gib", "ds2,21"]) == [
        "ds2", "bandwidth", "offload_ds2", "offload_21GiB"]


def test_the_runs_without_a_sweep_are_those_of_before():
    # scripts/gpu-check.sh's call.
    assert names(["--warmup", "8", "--steps", "8", "--overlap-bytes", "0,2147483648"]) == [
        "native", "zeroalloc", "offload_ov0M", "offload_ov2048M", "fsdp2"]
    # A limit given outright needs no native run.
    assert names(["--modes", "offload", "--limit-gib", "128"]) == ["offload"]


def test_limits_resolve_from_gib_footprints_and_the_native_run():
    results = {"ds2": {"peak_allocated": 20 * GIB},
               "native": {"peak_reserved": 40 * GIB, "parameters": 10**9}}
    assert bench.resolve_limit_bytes(bench.LimitRequest("18", gib=18.0), results, 0.75) == 18 * GIB
    assert bench.resolve_limit_bytes(bench.LimitRequest("ds2", footprint_of="ds2"),
                                     results, 0.75) == 20 * GIB
    assert bench.resolve_limit_bytes(bench.LimitRequest("derived"), results, 0.75) == \
        40 * GIB - 6 * 10**9
    # A DeepSpeed run that failed gives no limit.
    assert bench.resolve_limit_bytes(bench.LimitRequest("ds2", footprint_of="ds2"),
                                     {"ds2": {"error": "..."}}, 0.75) is None


def test_the_pcie_bound_is_the_native_step_when_nothing_must_move():
    assert bench.pcie_bound_step_s(0.15, 30 * GIB, 32 * GIB, BANDWIDTH) == 0.15


def test_the_pcie_bound_moves_the_bytes_over_the_limit_out_and_back():
    over = 10 * 10**9  # 10 GB over the limit: 0.2 s each way alone, 0.2 s both at once
    bound = bench.pcie_bound_step_s(0.15, 20 * GIB + over, 20 * GIB, BANDWIDTH)
    assert bound == pytest.approx(0.2)
    slower_both = bench.Bandwidth(50.0, 50.0, 80.0)  # both at once slower than twice one
    assert bench.pcie_bound_step_s(0.15, 20 * GIB + over, 20 * GIB, slower_both) == \
        pytest.approx(0.25)


def made_up_result(mode, limit_bytes=0):
    """What a worker would print, with figures chosen to be checked by hand."""
    phases = {"forward": 0.04, "backward": 0.07, "step": 0.03}
    result = {"mode": mode, "parameters": 1_300_000_000, "phases_s": phases,
              "model_tflops": 250.0, "loss": 10.0}
    if mode == "bandwidth":
        return {"mode": "bandwidth", "host_to_device_gbps": 50.0, "device_to_host_gbps": 50.0,
                "both_gbps": 100.0}
    if mode == "native":
        return {**result, "step_s": 0.15, "tokens_per_s": 4096 / 0.15,
                "peak_allocated": 30 * GIB, "peak_reserved": 31 * GIB}
    if mode in ("ds2", "ds3"):
        step = 1.0 if mode == "ds2" else 2.0
        return {**result, "step_s": step, "tokens_per_s": 4096 / step,
                "peak_allocated": (21 if mode == "ds2" else 9) * GIB,
                "peak_allocated_run": 26 * GIB, "peak_reserved": 27 * GIB,
                "deepspeed": {"version": "0.19.8", "stage": int(mode[2]),
                              "offloaded": ["optimizer states"], "optimizer": "DeepSpeedCPUAdam",
                              "checkpointing": True}}
    assert mode == "offload"
    step = 0.25 if limit_bytes > 20 * GIB else 0.4
    return {**result, "step_s": step, "tokens_per_s": 4096 / step, "limit_bytes": limit_bytes,
            "offload": {"host_resident_bytes": 8 * GIB, "bytes_to_host": 100 * GIB,
                        "bytes_to_device": 100 * GIB, "prefetch_hit_rate": 0.5,
                        "device_waited_ns": 10**9, "steps": 16},
            "overlap": {}, "timed": {"steps": 8, "bytes_to_host": 40 * GIB,
                                     "bytes_to_device": 40 * GIB, "device_waited_ns": 8 * 10**8,
                                     "uses": 1000, "prefetch_hits": 970,
                                     "bytes_to_host_parameter": 24 * GIB,
                                     "bytes_to_device_parameter": 24 * GIB,
                                     "remap_ns": 4 * 10**9}}


def test_a_sweep_row_counts_the_timed_steps_alone():
    results = {"native": made_up_result("native"), "ds2": made_up_result("ds2")}
    figures = bench.sweep_figures(made_up_result("offload", 24 * GIB), results["native"],
                                  BANDWIDTH, {"ds2": results["ds2"]})
    assert figures["limit_gib"] == 24
    assert figures["hit_rate"] == pytest.approx(0.97)  # not the whole run's 0.5
    assert figures["moved_gib_per_step"] == pytest.approx(10.0)  # 80 GiB over 8 steps
    assert figures["host_gib"] == 8  # what the windowed step bounces each way
    assert figures["device_wait_s_per_step"] == pytest.approx(0.1)
    assert figures["parameter_gib_per_step"] == pytest.approx(6.0)  # 48 of the 80 GiB
    assert figures["remap_s_per_step"] == pytest.approx(0.5)
    bound = 7 * GIB / 50e9  # 31 GiB reserved natively, 24 GiB allowed
    assert figures["pcie_bound_s"] == pytest.approx(bound)
    assert figures["step_over_bound"] == pytest.approx(0.25 / bound)
    assert figures["vs_ds2"] == pytest.approx(4.0)  # 1.0 s against 0.25 s


def test_a_host_step_row_has_the_step_models_time_and_other_rows_none():
    """Note [The step's time model]: a run with master weights and the host step (the
    trade) gets the model's step beside its own, from the native run's phases, the
    bandwidth and the CPUs' rate in the run, in the run's ordering (the CPUs behind the
    forward, or within the step); any other run gets nan."""
    native = {**made_up_result("native"),
              "phases_s": {"forward": 0.045, "backward": 0.072, "step": 0.029}}
    shape = {"hidden": 2048, "intermediate": 5504, "layers": 24, "vocab": 32000}
    traded = made_up_result("offload", int(24.8 * GIB))
    traded.update(masters_traded=True, peak_reserved=int(28.3 * GIB),
                  overlap={"host_behind_steps": 7})
    traded["timed"].update(host_params=4 * 365_000_000, host_cpu_s=4 * 0.09125)  # 4 G/s
    figures = bench.sweep_figures(traded, native, BANDWIDTH, {}, shape)
    parameters = bench.step_model.llama_parameters(**shape)
    expected = bench.step_model.predict_step(
        parameters, bench.step_model.plan_host(parameters, int(28.3 * GIB),
                                               int(24.8 * GIB), 512 << 20),
        bench.step_model.Costs(0.045, 0.072, 0.029, 50e9, 50e9, 4e9))["step_s"]
    assert figures["model_s"] == pytest.approx(expected)
    assert 0.146 < figures["model_s"] < 0.2  # the native step and the CPUs' 0.09 s after it
    assert figures["step_over_model"] == pytest.approx(0.25 / expected)
    # The CPUs within the step (under `any`): the forward waits for every working copy.
    within = bench.sweep_figures({**traded, "overlap": {"host_behind_steps": 0}}, native,
                                 BANDWIDTH, {}, shape)
    assert within["model_s"] == pytest.approx(bench.step_model.predict_step(
        parameters, bench.step_model.plan_host(parameters, int(28.3 * GIB),
                                               int(24.8 * GIB), 512 << 20),
        bench.step_model.Costs(0.045, 0.072, 0.029, 50e9, 50e9, 4e9), behind=False)["step_s"])
    assert within["model_s"] > figures["model_s"]
    for unmodelled in ({**traded, "masters_traded": False}, made_up_result("offload", 24 * GIB)):
        figures = bench.sweep_figures(unmodelled, native, BANDWIDTH, {}, shape)
        assert math.isnan(figures["model_s"]) and math.isnan(figures["step_over_model"])
    assert math.isnan(bench.sweep_figures(traded, native, BANDWIDTH, {})["model_s"])  # no shape


def test_a_host_step_row_is_bound_by_the_cpus_where_their_work_outlasts_the_bus():
    """The CPU bound: the parameters the host step stepped a step over the CPUs' rate alone;
    step/bound takes the larger of it and the PCIe bound. Rows without the host step have
    none."""
    native = made_up_result("native")
    measured = bench.Bandwidth(50.0, 50.0, 100.0, cpu_params_per_s=4e9)
    hosted = made_up_result("offload", 24 * GIB)
    hosted["timed"].update(host_params=8 * 1_000_000_000)  # 1 G parameters a step, 8 steps
    figures = bench.sweep_figures(hosted, native, measured, {})
    assert figures["cpu_bound_s"] == pytest.approx(0.25)  # above the PCIe bound's 0.15
    # The largest bound is the ordered one: the forward's 0.04 s and the backward's 0.07 s,
    # then the CPUs' 0.25 s (not behind the forward: no host_behind_steps in the row).
    assert figures["step_over_bound"] == pytest.approx(0.25 / 0.36)
    plain = bench.sweep_figures(made_up_result("offload", 24 * GIB), native, measured, {})
    assert math.isnan(plain["cpu_bound_s"])
    assert plain["step_over_bound"] == pytest.approx(0.25 / plain["pcie_bound_s"])


def test_a_host_step_row_is_bound_by_the_backward_then_the_cpus():
    """The ordered bound: the CPUs start once the backward is done (the gradients are final
    only at optimizer.step()), and the next forward needs every window they step, so a step
    running them behind the forward takes at least the native backward plus the longer of
    the native forward and the CPUs' work. step/bound takes the largest bound."""
    native = made_up_result("native")  # forward 0.04 s, backward 0.07 s
    measured = bench.Bandwidth(50.0, 50.0, 100.0, cpu_params_per_s=4e9)
    hosted = made_up_result("offload", 16 * GIB)  # 0.4 s a step
    hosted["overlap"] = {"host_behind_steps": 8}
    hosted["timed"].update(host_params=8 * 1_200_000_000)  # 0.3 s of the CPUs a step
    figures = bench.sweep_figures(hosted, native, measured, {})
    assert figures["cpu_bound_s"] == pytest.approx(0.3)
    assert figures["ordered_bound_s"] == pytest.approx(0.07 + 0.3)
    assert figures["pcie_bound_s"] == pytest.approx(15 * GIB / 50e9)  # 0.32 s, below it
    assert figures["step_over_bound"] == pytest.approx(0.4 / 0.37)
    hosted["timed"].update(host_params=8 * 100_000_000)  # 0.025 s: the forward is longer
    assert bench.sweep_figures(hosted, native, measured, {})["ordered_bound_s"] == \
        pytest.approx(0.07 + 0.04)
    row = [line for line in bench.format_sweep_table(
        [bench.Run("offload", "offload", bench.LimitRequest("16", gib=16.0))],
        {"native": native, "offload": hosted},
        measured).splitlines() if line.startswith("offload")][0]
    assert " 0.110 " in row  # the ordered bound's column
    hosted["overlap"] = {}  # the CPUs after the step's forward and backward (under any)
    assert bench.sweep_figures(hosted, native, measured, {})["ordered_bound_s"] == \
        pytest.approx(0.07 + 0.04 + 0.025)


def test_the_main_table_shows_the_warmup_steps_against_the_steady_one():
    result = {**made_up_result("offload", 24 * GIB), "warmup_steps_s": [4.9, 3.2, 1.2],
              "phases_s": {"forward": 0.1, "backward": 0.2, "step": 0.05},
              "model_tflops": 100.0}
    row = bench.format_main_table({"offload": result}).splitlines()[1]
    assert "warm-up steps 4.90 s (19.6 x), 3.20 s (12.8 x), 1.20 s (4.8 x)" in row


def test_a_sweep_row_without_native_run_has_no_bound():
    figures = bench.sweep_figures(made_up_result("offload", 24 * GIB), {}, BANDWIDTH, {})
    assert math.isnan(figures["pcie_bound_s"]) and math.isnan(figures["step_over_bound"])


def test_the_parent_prints_both_tables_from_the_workers_results(monkeypatch, capsys):
    asked = []

    def run_mode(args, mode, limit_bytes=0, window_bytes="", overlap_bytes="",
                 gradient_class="", log_suffix="", step_parameters="", settings=(), host=()):
        asked.append((mode, limit_bytes, log_suffix))
        if mode == "ds3":
            return {"mode": mode, "error": "Traceback ...\nRuntimeError: out of memory\n"}
        return made_up_result(mode, limit_bytes)

    monkeypatch.setattr(bench, "run_mode", run_mode)
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--modes", "native,offload,ds2,ds3",
                                      "--limits-gib", "ds2,18,24.8", "--checkpointing"])
    assert bench.main() == 0
    assert asked == [("native", 0, ""), ("ds2", 0, ""), ("ds3", 0, ""), ("bandwidth", 0, ""),
                     ("offload", 21 * GIB, "_limitds2"), ("offload", 18 * GIB, "_limit18"),
                     ("offload", int(24.8 * GIB), "_limit24.8")]
    out = capsys.readouterr().out
    main_table, sweep_table = out.split("\nbudget sweep\n")
    rows = {line.split()[0]: line for line in main_table.splitlines() if line.strip()}
    assert "ZeRO-2" in rows["ds2"] and "checkpointing on" in rows["ds2"]
    assert "peak allocated 21.0 GiB over the timed steps" in rows["ds2"]
    assert rows["ds3"].split()[1] == "failed"
    assert "limit 18.0 GiB" in rows["offload_18GiB"]
    sweep_lines = sweep_table.splitlines()
    assert "PCIe bound s" in sweep_lines[0] and "vs ds2" in sweep_lines[0]
    assert "vs ds3" not in sweep_lines[0]  # it failed: no ratio to it
    sweep_rows = {line.split()[0]: line.split() for line in sweep_lines[1:]}
    assert sweep_rows["offload_ds2"][1:3] == ["21.0", "(ds2)"]
    assert sweep_rows["offload_18GiB"][-1] == "2.50"  # 1.0 s against 0.4 s
    assert sweep_rows["offload_24.8GiB"][-1] == "4.00"
    assert sweep_rows["ds2"][1] == "21.0"
    assert any(line.startswith("PCIe bound = max(native step") for line in sweep_lines)
    assert any("host to device 50.0 GB/s" in line for line in sweep_lines)
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["bandwidth"]["both_gbps"] == 100.0
    assert set(summary["results"]) == {"native", "ds2", "ds3", "offload_ds2", "offload_18GiB",
                                       "offload_24.8GiB"}


def test_a_sweep_limit_whose_deepspeed_run_failed_is_skipped_and_said_so(monkeypatch, capsys):
    def run_mode(args, mode, limit_bytes=0, *rest):
        if mode == "ds2":
            return {"mode": mode, "error": "ModuleNotFoundError: No module named 'deepspeed'\n"}
        return made_up_result(mode, limit_bytes)

    monkeypatch.setattr(bench, "run_mode", run_mode)
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--modes", "native,offload",
                                      "--limits-gib", "ds2,24"])
    assert bench.main() == 0
    sweep_lines = capsys.readouterr().out.split("\nbudget sweep\n")[1].splitlines()
    assert "vs ds2" not in sweep_lines[0]
    assert sweep_lines[1].split() == ["offload_ds2", "failed:", "no", "ds2", "figure"]
    assert sweep_lines[2].startswith("offload_24GiB")


def test_rounds_rerun_every_mode_at_the_first_rounds_limits_and_give_each_rounds_ratio(
        monkeypatch, capsys):
    """--rounds: DeepSpeed's step varies from one run to the next, so each offload run is
    compared with the DeepSpeed run of its own round, and the medians are printed. Later
    rounds keep the first round's limits (a footprint DeepSpeed changes does not move the
    offload's limit); every other round runs in reverse order; a run that failed is said
    so and left out of the medians."""
    asked = []
    steps = {"ds2": iter([1.0, 0.8, None]), "offload": iter([0.5, 0.5, 0.6])}

    def run_mode(args, mode, limit_bytes=0, window_bytes="", overlap_bytes="",
                 gradient_class="", log_suffix="", *rest):
        asked.append((mode, limit_bytes, log_suffix))
        result = made_up_result(mode, limit_bytes)
        if mode in steps:
            step = next(steps[mode])
            if step is None:
                return {"mode": mode, "error": "RuntimeError: CUDA out of memory\n"}
            result.update(step_s=step, tokens_per_s=4096 / step)
            if mode == "ds2":
                result["peak_allocated"] = (20 + len(asked)) * GIB
        return result

    monkeypatch.setattr(bench, "run_mode", run_mode)
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--modes", "offload,ds2",
                                      "--limits-gib", "ds2", "--rounds", "3"])
    assert bench.main() == 0
    assert asked == [("ds2", 0, ""), ("bandwidth", 0, ""), ("offload", 21 * GIB, "_limitds2"),
                     ("offload", 21 * GIB, "_limitds2_round2"), ("ds2", 0, "_round2"),
                     ("ds2", 0, "_round3"), ("offload", 21 * GIB, "_limitds2_round3")]
    out = capsys.readouterr().out
    table = out.split("\nrounds\n")[1].splitlines()
    assert table[0].split() == ["run", "round", "1", "round", "2", "round", "3", "median"]
    rows = {line.rsplit(None, 4)[0]: line.split()[-4:] for line in table[1:4]}
    assert rows["ds2"] == ["1.000", "0.800", "failed", "0.900"]
    assert rows["offload_ds2"] == ["0.500", "0.500", "0.600", "0.500"]
    assert rows["offload_ds2 vs ds2"] == ["2.00", "1.60", "failed", "1.80"]
    summary = json.loads(out.strip().splitlines()[-1])
    assert [sorted(each) for each in summary["later_rounds"]] == [["ds2", "offload_ds2"]] * 2


def test_later_rounds_leave_out_what_only_served_the_first(monkeypatch, capsys):
    """A native run made only to derive the offload's limit is not made again, nor an
    offload run whose DeepSpeed footprint never came: its row says so in each round."""
    asked = []

    def run_mode(args, mode, limit_bytes=0, window_bytes="", overlap_bytes="",
                 gradient_class="", log_suffix="", *rest):
        asked.append((mode, log_suffix, args.profile_dir))
        ports.append(args.port_offset)
        if mode == "ds2" and not log_suffix:
            return {"mode": mode, "error": "ModuleNotFoundError: No module named 'deepspeed'\n"}
        return made_up_result(mode, limit_bytes)

    monkeypatch.setattr(bench, "run_mode", run_mode)
    ports = []
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--modes", "offload", "--limits-gib", "ds2,24",
                                      "--rounds", "2", "--profile-dir", "/tmp/profiles"])
    assert bench.main() == 0
    assert asked == [("ds2", "", "/tmp/profiles"), ("bandwidth", "", "/tmp/profiles"),
                     ("offload", "_limit24", "/tmp/profiles"), ("offload", "_limit24_round2", ""),
                     ("ds2", "_round2", "")]
    assert ports == [0, 0, 0, 10, 10]  # the later round's process groups on ports of their own
    table = capsys.readouterr().out.split("\nrounds\n")[1].splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in table[1:] if " vs " not in line}
    assert rows["offload_ds2"][:2] == ["failed", "not"]  # "not run" in round 2
    assert rows["ds2"][:2] == ["failed", "1.000"]
    asked.clear()  # a limit derived from native's footprint: native is not run again
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--modes", "offload", "--rounds", "2"])
    assert bench.main() == 0
    assert [mode for mode, *_ in asked] == ["native", "offload", "offload"]


def test_rounds_below_one_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--modes", "offload", "--rounds", "0"])
    assert bench.main() == 2
    assert "--rounds 0: give 1 or more" in capsys.readouterr().err


def test_zero_infinity_puts_states_and_parameters_in_files_under_the_path():
    args = bench.parse_args(["--modes", "ds3nvme", "--nvme-path", "/mnt/a:/mnt/b",
                             "--nvme-size", "40GiB"])
    config = bench.deepspeed_config(args, 3, "/mnt/a/deepspeed")
    zero = config["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "nvme"
    assert zero["offload_optimizer"]["nvme_path"] == zero["offload_param"]["nvme_path"] == \
        "/mnt/a/deepspeed"
    assert config["aio"]["block_size"] == 1 << 20
    # A parameter used again within the reuse distance stays in its swap buffer: with the
    # default distance, checkpointing's recompute kept every one until none was left.
    assert zero["stage3_max_reuse_distance"] == 0
    assert zero["offload_param"]["buffer_count"] * zero["offload_param"]["buffer_size"] >= \
        zero["stage3_max_live_parameters"]
    # The states alone on NVMe: the parameters stay in pinned host memory.
    states_only = bench.deepspeed_config(args, 3, "/mnt/a/deepspeed", parameters_on_nvme=False)
    assert states_only["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    assert states_only["zero_optimization"]["offload_param"]["device"] == "cpu"
    # Without a path: ZeRO-Offload to host memory, as before, and no aio section.
    plain = bench.deepspeed_config(args, 3)
    assert plain["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "aio" not in plain


@pytest.mark.parametrize("mode", ["ds3nvme", "ds3nvmeopt"])
def test_zero_infinity_without_a_path_is_refused(monkeypatch, capsys, mode):
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--modes", mode])
    assert bench.main() == 2
    assert "--nvme-path" in capsys.readouterr().err


def test_nvme_path_and_size_go_together(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--modes", "offload", "--nvme-path", "/x"])
    assert bench.main() == 2
    assert "--nvme-size" in capsys.readouterr().err


def test_without_libaio_or_its_packages_deepspeeds_nvme_mode_says_what_to_carry(
        monkeypatch, tmp_path, capsys):
    if Path("/usr/include/libaio.h").is_file():
        pytest.skip("skipped: this system has libaio's headers, so nothing is unpacked")
    monkeypatch.setattr(bench, "ROOT", tmp_path)  # no .deps/ there
    assert bench.libaio_environment({}) == {}
    assert "apt-get download libaio1 libaio-dev" in capsys.readouterr().err


def test_the_zero_infinity_mode_runs_before_the_sweep_like_the_other_deepspeed_modes():
    assert names(["--modes", "ds3nvme,offload", "--limits-gib", "ds2", "--nvme-path", "/x",
                  "--nvme-size", "1GiB"]) == ["ds2", "ds3nvme", "bandwidth", "offload_ds2"]


def test_the_two_ways_of_stepping_host_parameters_run_side_by_side_at_each_limit():
    assert names(["--modes", "offload", "--limits-gib", "18,21",
                  "--step-parameters", "bounce,fetch"]) == [
        "bandwidth", "offload_18GiB_bounce", "offload_18GiB_fetch", "offload_21GiB_bounce",
        "offload_21GiB_fetch"]
    with pytest.raises(ValueError, match="--step-parameters 'move': accepted: bounce, fetch"):
        names(["--modes", "offload", "--step-parameters", "move"])


@pytest.mark.parametrize("flag, variable, values, names_made, accepted", [
    ("--park", "ZEROALLOC_PARK_PARAMETERS", "1,0",
     ["offload_18GiB_park1", "offload_18GiB_park0"], "0, 1"),
    ("--host-step", "ZEROALLOC_HOST_STEP", "0,1",
     ["offload_18GiB_host0", "offload_18GiB_host1"], "0, 1"),
    ("--host-step-overlap", "ZEROALLOC_HOST_STEP_OVERLAP", "0,1",
     ["offload_18GiB_behind0", "offload_18GiB_behind1"], "0, 1"),
    ("--backward-uses", "ZEROALLOC_BACKWARD_USES", "saved,all",
     ["offload_18GiB_bwdsaved", "offload_18GiB_bwdall"], "saved, all"),
    ("--master-weights", "ZEROALLOC_MASTER_WEIGHTS", "none,bf16",
     ["offload_18GiB_mwnone", "offload_18GiB_mwbf16"], "none, bf16"),
    ("--recipe", "ZEROALLOC_RECIPE", "exact,fast",
     ["offload_18GiB_recipeexact", "offload_18GiB_recipefast"], "exact, fast"),
])
def test_a_setting_swept_runs_side_by_side_each_with_its_variable(
        monkeypatch, flag, variable, values, names_made, accepted):
    """--park (parked or mapped parameters), --host-step (the step on the host or the
    device), --backward-uses and --master-weights: each value its own run, with its variable set, or unset
    when not given."""
    assert names(["--modes", "offload", "--limits-gib", "18", flag, values]) == [
        "bandwidth", *names_made]
    with pytest.raises(ValueError, match=f"{flag} '2': accepted: {accepted} or both"):
        names(["--modes", "offload", flag, "2"])
    seen = []

    class Finished:
        returncode, stdout, stderr = 0, 'result {"mode": "offload"}\n', ""

    def run(command, env, **kwargs):
        seen.append(env.get(variable))
        return Finished()

    monkeypatch.setattr(bench.subprocess, "run", run)
    args = bench.parse_args(["--modes", "offload", "--limits-gib", "18", flag, values])
    for run in bench.plan_runs(args):
        if run.mode == "offload":
            bench.run_mode(args, "offload", 1 << 30, settings=run.settings)
    bench.run_mode(args, "offload", 1 << 30)
    assert seen == [*values.split(","), None]  # not given: the library's default


def offload_commands(monkeypatch, argv) -> list:
    """The worker commands the offload rows that `argv` plans would run, each row's host
    step settings handed to its worker."""
    commands = []

    class Finished:
        returncode, stdout, stderr = 0, 'result {"mode": "offload"}\n', ""

    def run(command, env, **kwargs):
        commands.append(command)
        return Finished()

    monkeypatch.setattr(bench.subprocess, "run", run)
    args = bench.parse_args(argv)
    for planned in bench.plan_runs(args):
        if planned.mode == "offload":
            bench.run_mode(args, "offload", 1 << 30, host=planned.host)
    return commands


def test_merged_cpu_windows_sweep_side_by_side_and_reach_each_worker(monkeypatch):
    """Note [The CPUs' windows]: --host-window-parameters 0,N runs the offload row once for
    each cap, named apart, and each worker is handed its own cap."""
    argv = ["--modes", "offload", "--limits-gib", "13.3",
            "--host-window-parameters", "0,268435456"]
    assert names(argv) == ["bandwidth", "offload_13.3GiB_cpuwin0",
                           "offload_13.3GiB_cpuwin268435456"]
    with pytest.raises(ValueError, match="--host-window-parameters 'many': not a value"):
        names(["--modes", "offload", "--host-window-parameters", "many"])
    handed = [command[command.index("--host-window-parameters") + 1]
              for command in offload_commands(monkeypatch, argv)]
    assert handed == ["0", "268435456"]


def test_the_host_steps_figures_are_of_the_timed_steps_when_the_worker_counted_them():
    """The run's counters include the warm-up (pinned buffers allocated, masters traded):
    the table reads the timed steps' own where the worker reports them."""
    result = made_up_result("offload", 14 * GIB)
    run = {"host_windows": 30, "host_bytes": 60 * GIB, "host_s": 12.0, "host_call_s": 6.0,
           "host_queue_s": 3.0, "host_refused": 0}
    result["overlap"] = {"steps": 12, "staged_bytes": 0, "kept_bytes": 0, **run}
    result["timed"]["host"] = {"host_windows": 16, "host_bytes": 32 * GIB, "host_s": 3.2,
                               "host_call_s": 2.4, "host_queue_s": 0.08}
    row = bench.format_main_table({"offload": result}).splitlines()[1]
    assert ("host step, a timed step: 2.0 windows (4.00 GiB of parameters, CPUs 0.400 s)"
            in row), row
    assert "in library calls 0.300" in row and "queueing their copies 0.010" in row, row
    del result["timed"]["host"]  # an older worker: the run's, said so
    row = bench.format_main_table({"offload": result}).splitlines()[1]
    assert "host step, a step of the run: 2.5 windows (5.00 GiB" in row, row


def test_the_host_steps_settings_sweep_together_and_each_worker_sets_its_own(monkeypatch):
    """HOST_SETTINGS: two of them, two values each, make four rows named apart; a setting
    not given is left out of the worker's command (the library's default)."""
    argv = ["--modes", "offload", "--limits-gib", "13.3", "--queue-gradients-ahead", "0,1",
            "--prepare-windows-ahead", "0,1", "--host-window-parameters", "7"]
    assert names(argv) == ["bandwidth", "offload_13.3GiB_ahead0_prepared0",
                           "offload_13.3GiB_ahead0_prepared1", "offload_13.3GiB_ahead1_prepared0",
                           "offload_13.3GiB_ahead1_prepared1"]
    with pytest.raises(ValueError, match="--prepare-windows-ahead '1,': not a value"):
        names(["--modes", "offload", "--prepare-windows-ahead", "1,"])
    handed = [[each for each in command if each in (
        "--host-window-parameters", "--queue-gradients-ahead", "--prepare-windows-ahead",
        "--pin-buffers-ahead")]
        for command in offload_commands(
            monkeypatch, ["--modes", "offload", "--prepare-windows-ahead", "1"])]
    assert handed == [["--prepare-windows-ahead"]]
    assert names(["--modes", "offload", "--limits-gib", "13.3", "--pin-buffers-ahead",
                  "0,1"]) == ["bandwidth", "offload_13.3GiB_pinned0", "offload_13.3GiB_pinned1"]
