"""The host step on the GPU (ZEROALLOC_HOST_STEP; Note [Stepped on the host] in
lib/tier/host_step.hpp, Note [Host windows] in zeroalloc/torch/_host_step.py): a model
trained through zt.offload under a limit that its parameters, gradients and states do not
fit steps the windows whose states and parameters are on the host there, on the CPUs, and
its losses and final parameters stay within fp32 rounding of plain training on the device.

    python3 -m pytest -s tests/python/test_host_step.py
"""

import ast
import concurrent.futures

import pytest

from gpu_script import field, require_gpu, run_script

torch = require_gpu()

# With REFUSE set, every other call of the host step finds a chunk of its first parameter and
# of its first state moved to the device just before it (as a prefetch or another use would
# move it; with master weights the working copies go to the host first, to make room): the
# library refuses the call, changing nothing, and the windowed step steps those parameters on
# the device (step_pinned; behind the forward, step_behind). Printed: the calls so refused.
REFUSALS = r"""
if os.environ.get("REFUSE"):
    from zeroalloc import _offload
    refusals = [0, 0]

    def moved_first(real):
        def call(parameters, gradients, exp_avgs, *rest, **settings):
            refusals[0] += 1
            if refusals[0] % 2:
                for working in model.parameters():  # bf16 working copies: room for the fetch
                    if working.dtype == torch.bfloat16:
                        _offload.offload_pointer(working.untyped_storage().data_ptr())
                _offload.fetch_pointer(parameters[0])
                _offload.fetch_pointer(exp_avgs[0])
            stepped = real(parameters, gradients, exp_avgs, *rest, **settings)
            refusals[1] += not stepped
            return stepped
        return call

    _offload.adamw_on_host = moved_first(_offload.adamw_on_host)
    _offload.adamw_on_host_bf16 = moved_first(_offload.adamw_on_host_bf16)
"""

# Twelve layers of 16 MiB: 192 MiB of parameters, as much of gradients, twice as much of
# AdamW states: 768 MiB, under a limit of 448 MiB.
TRAIN = r"""
import os, sys, torch
import zeroalloc, zeroalloc.torch as zt
zt.install()
""" + REFUSALS + r"""
offload = os.environ.get("ZEROALLOC_OFFLOAD") == "host"
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(12)]).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
if offload:
    zt.offload(model, optimizer, hint_group_bytes=16 << 20, window_bytes=64 << 20,
               overlap_bytes=0)
data = [(torch.randn(256, 2048, device="cuda"), torch.randn(256, 2048, device="cuda"))
        for _ in range(8)]
losses = []
for x, y in data:
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    losses.append(loss.item())
print("losses", " ".join(f"{value!r}" for value in losses))
if offload:
    print("figures", zt.step_figures(optimizer))
if os.environ.get("REFUSE"):
    print("refused", refusals[1], "of", refusals[0])
with torch.no_grad():
    values = {}
    for name, p in model.named_parameters():
        with zt.using(p):
            values[name] = p.detach().to("cpu")
torch.save(values, sys.argv[1])
"""


def host_step_against_the_device(tmp_path, **settings) -> tuple:
    """Trains TRAIN on the device without a limit and with the host step under one (plus
    `settings`); asserts losses and final parameters within fp32 rounding of each other and
    returns the host run's output and figures."""
    plain = run_script(TRAIN, str(tmp_path / "plain.pt"))
    hosted = run_script(TRAIN, str(tmp_path / "hosted.pt"), ZEROALLOC_OFFLOAD="host",
                        ZEROALLOC_HOST_LIMIT="4GiB", ZEROALLOC_MEMORY_LIMIT="448MiB",
                        ZEROALLOC_HOST_STEP="1", **settings)
    figures = ast.literal_eval(field(hosted, "figures"))  # a dict printed by the run
    print("host step figures:", figures)
    assert figures["host_windows"] > 0, hosted
    expected = [float(v) for v in field(plain, "losses").split()]
    got = [float(v) for v in field(hosted, "losses").split()]
    worst_loss = max(abs(a - b) / abs(a) for a, b in zip(expected, got))
    reference = torch.load(tmp_path / "plain.pt")
    stepped = torch.load(tmp_path / "hosted.pt")
    worst = max(((stepped[name] - value).abs().max() / value.abs().max()).item()
                for name, value in reference.items())
    print(f"worst relative loss difference {worst_loss:.2e}; worst parameter difference "
          f"{worst:.2e} of the tensor's largest value")
    assert worst_loss < 1e-4, (expected, got)
    assert worst < 1e-4
    return hosted, figures


def test_windows_on_the_host_step_there_within_rounding_of_the_device(tmp_path):
    host_step_against_the_device(tmp_path)


def test_host_calls_refused_for_chunks_moved_meanwhile_step_on_the_device(tmp_path):
    hosted, figures = host_step_against_the_device(tmp_path, REFUSE="1")
    refused, calls = (int(v) for v in field(hosted, "refused").split(" of "))
    print(f"{refused} of {calls} host calls refused")
    assert refused > 0 and figures["host_refused"] == refused, hosted


# Note [Master weights] (zeroalloc/torch/_master_weights.py): the same model trained in bf16
# with fp32 masters, by the recipe in plain PyTorch (RECIPE=plain) or by zt.offload's
# master_weights.
MASTERS = r"""
import os, sys, torch
import zeroalloc, zeroalloc.torch as zt
zt.install()
""" + REFUSALS + r"""
plain = os.environ["RECIPE"] == "plain"
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(12)]).cuda()


def groups(parameters):  # one group, or with GROUPS the Trainer's two (biases: no decay)
    parameters = list(parameters)
    if not os.environ.get("GROUPS"):
        return parameters
    return [{"params": [p for p in parameters if p.dim() > 1]},
            {"params": [p for p in parameters if p.dim() == 1], "weight_decay": 0.0}]


def in_model_order(saved):  # the masters' state_dict entry is in param_groups' order
    # param_groups hold the masters; the model holds their working copies.
    working = optimizer._zeroalloc_stepper.masters.working
    grouped = [working(m) for g in optimizer.param_groups for m in g["params"]]
    where = {id(p): number for number, p in enumerate(grouped)}
    return [saved[where[id(p)]] for p in model.parameters()]


if plain:
    masters = [p.detach().clone() for p in model.parameters()]
    model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(groups(masters), lr=1e-3, weight_decay=0.1)
else:
    optimizer = torch.optim.AdamW(groups(model.parameters()), lr=1e-3, weight_decay=0.1)
    zt.offload(model, optimizer, hint_group_bytes=8 << 20, window_bytes=64 << 20,
               overlap_bytes=0, master_weights=True)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    if os.environ.get("MERGE") is not None and optimizer._zeroalloc_stepper.host is not None:
        optimizer._zeroalloc_stepper.host.window_parameters = int(os.environ["MERGE"])
    if os.environ.get("PIECES") and optimizer._zeroalloc_stepper.host is not None:
        optimizer._zeroalloc_stepper.host.piece_parameters = int(os.environ["PIECES"])
    if os.environ.get("PREPARE") and optimizer._zeroalloc_stepper.host is not None:
        optimizer._zeroalloc_stepper.host.prepare_ahead = True
    if os.environ.get("PINNED") and optimizer._zeroalloc_stepper.host is not None:
        optimizer._zeroalloc_stepper.host.pin_ahead = True
    if os.environ.get("GUARD") and optimizer._zeroalloc_stepper.host is not None:
        optimizer._zeroalloc_stepper.host.guard_behind = True
    if os.environ.get("STATES") and optimizer._zeroalloc_stepper.host is not None:
        optimizer._zeroalloc_stepper.host.make_states_on_host = os.environ["STATES"] == "1"
    if os.environ.get("ROOM") and optimizer._zeroalloc_stepper.host is not None:
        optimizer._zeroalloc_stepper.host.room_first = os.environ["ROOM"] == "1"
# A learning rate that changes every step: the CPUs and any parameter refused to them step
# with the rate of their step, whenever they finish (it falls, which also keeps two bf16
# runs from drifting apart as fast as a constant rate lets them).
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1 / (done + 1))
data = [(torch.randn(256, 2048, device="cuda"), torch.randn(256, 2048, device="cuda"))
        for _ in range(8)]
losses, first, second, stale = [], None, None, []
for number, (x, y) in enumerate(data):
    if os.environ.get("PARTLY") and number == 0:
        optimizer._zeroalloc_stepper.host.last_on_host = os.environ["PARTLY"] == "last"
    if os.environ.get("PARTLY") and number == 3:
        # One moment of the first master to the host, the master and its other moment left
        # on the device: the CPUs can step it only once the rest follows.
        from zeroalloc import _offload
        moved = optimizer.param_groups[0]["params"][0]
        _offload.offload_pointer(optimizer.state[moved]["exp_avg"].untyped_storage().data_ptr())
    if os.environ.get("DROP") and number == len(data) - 1:  # the weights before the last step
        with torch.no_grad():
            before = {}
            for name, p in model.named_parameters():
                with zt.using(p):
                    before[name] = p.detach().to("cpu")
    if number in (1, 2):  # after the first step, and after the second
        if plain:
            after = [m.detach().to("cpu") for m in masters]
        else:
            after = [m.detach().to("cpu")
                     for m in in_model_order(optimizer.state_dict()["zeroalloc_master_weights"])]
        first, second = (after, second) if number == 1 else (first, after)
    if number == 1:  # the states the first step made, as the optimizer's state_dict has them
        print("made", " | ".join(
            f"{index} " + " ".join(f"{key}:{value.dtype}:{value.device.type}:{tuple(value.shape)}"
                                   for key, value in entry.items())
            for index, entry in optimizer.state_dict()["state"].items()))
    loss = torch.nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)
    loss.backward()
    if plain:
        for master, working in zip(masters, model.parameters()):
            master.grad = working.grad.float()
        optimizer.step()
        with torch.no_grad():
            for master, working in zip(masters, model.parameters()):
                working.copy_(master)
                master.grad = None
        model.zero_grad(set_to_none=True)
    else:
        optimizer.step()
        if os.environ.get("SNAPSHOT"):
            # Right after the step, with no hint, as an EMA reads: the CPUs may still be on it.
            early = [w.detach().clone() for w in model.parameters()]
            optimizer.state_dict()  # the CPUs finish
            stale.append(sum(not torch.equal(a, w.detach())
                             for a, w in zip(early, model.parameters())))
        if os.environ.get("DROP") and number == len(data) - 1:
            # Dropped as soon as the last step returns, the CPUs still on its windows.
            host = optimizer._zeroalloc_stepper.host
            print("running", host.behind is not None and not host.behind.run.finished)
            break
        optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    losses.append(loss.item())
print("losses", " ".join(f"{value!r}" for value in losses))
print("stale", " ".join(str(count) for count in stale))
if os.environ.get("DROP"):
    import gc, threading, weakref
    dropped = weakref.ref(optimizer)
    del optimizer, scheduler, host
    gc.collect()
    with torch.no_grad():
        for name, p in model.named_parameters():
            with zt.using(p):
                print("stepped", name, not torch.equal(p.detach().to("cpu"), before[name]))
    for thread in threading.enumerate():  # its last lines let go of the optimizer
        if thread.name == "zeroalloc-host-step":
            thread.join()
    gc.collect()
    print("collected", dropped() is None)
    sys.exit(0)
if not plain:
    saved = optimizer.state_dict()["zeroalloc_master_weights"]  # the CPUs finish first
    masters = [m.detach().to("cpu") for m in in_model_order(saved)]
    print("figures", zt.step_figures(optimizer))
    if os.environ.get("PARTLY"):
        from zeroalloc import _offload
        params = optimizer.param_groups[0]["params"]
        for name, master in (("first", params[0]), ("last", params[-2])):  # weights
            state = optimizer.state[master]
            print(name, "master", " ".join(
                _offload.residency_of(t.untyped_storage().data_ptr())
                for t in (master, state["exp_avg"], state["exp_avg_sq"])))
if os.environ.get("REFUSE"):
    print("refused", refusals[1], "of", refusals[0])
with torch.no_grad():
    values = {"masters": [m.detach().to("cpu") for m in masters], "first": first,
              "second": second}
    for name, p in model.named_parameters():
        with zt.using(p):
            values[name] = p.detach().to("cpu")
torch.save(values, sys.argv[1])
"""

# MASTERS through zt.offload with the host step: 96 MiB of bf16 weights, as much of
# gradients, 576 MiB of masters and moments under a limit of 320 MiB; most windows are on
# the host and step there.
HOSTED = {"RECIPE": "offload", "ZEROALLOC_OFFLOAD": "host", "ZEROALLOC_HOST_LIMIT": "4GiB",
          "ZEROALLOC_MEMORY_LIMIT": "320MiB", "ZEROALLOC_HOST_STEP": "1"}


def test_master_weights_train_as_the_recipe_in_plain_pytorch_on_the_device_and_the_host(
        tmp_path):
    plain = run_script(MASTERS, str(tmp_path / "plain.pt"), RECIPE="plain")
    # Room for everything: the windows step on the device, bit for bit the plain recipe.
    device = run_script(MASTERS, str(tmp_path / "device.pt"), RECIPE="offload",
                        ZEROALLOC_OFFLOAD="host")
    expected = [float(v) for v in field(plain, "losses").split()]
    assert [float(v) for v in field(device, "losses").split()] == expected
    reference = torch.load(tmp_path / "plain.pt")
    on_device = torch.load(tmp_path / "device.pt")
    for name, value in reference.items():
        if name in ("masters", "first", "second"):
            assert all(torch.equal(a, b) for a, b in zip(value, on_device[name]))
        else:
            assert value.dtype == torch.bfloat16 and torch.equal(value, on_device[name]), name
    # Under ZEROALLOC_ACCESS=any (the default) optimizer.step() returns with the CPUs done.
    hosted = masters_on_the_host_against(plain, tmp_path)
    figures = ast.literal_eval(field(hosted, "figures"))
    assert figures["host_behind_steps"] == 0, figures
    # Note [The host step finishes behind the forward]: on by default under hinted.
    hosted = masters_on_the_host_against(plain, tmp_path, ZEROALLOC_ACCESS="hinted")
    figures = ast.literal_eval(field(hosted, "figures"))
    assert figures["host_behind_steps"] > 0, figures


def test_the_first_step_makes_the_moments_on_the_host_and_the_cpus_step_it(tmp_path):
    """Note [States made where the CPUs step them]: by default the first step makes the
    moments of the masters the host holds there, as AdamW makes them (the same keys, dtypes,
    devices and shapes in the optimizer's state_dict), and the CPUs step them from that
    step on: one more step on the CPUs than when AdamW makes them on the device."""
    plain = run_script(MASTERS, str(tmp_path / "plain.pt"), RECIPE="plain")
    hosted = masters_on_the_host_against(plain, tmp_path)
    made = ast.literal_eval(field(hosted, "figures"))
    on_device = ast.literal_eval(field(masters_on_the_host_against(
        plain, tmp_path, STATES="0"), "figures"))
    print("made on the host:", made, "made on the device:", on_device)
    assert made["host_made_state_bytes"] > 0 == on_device["host_made_state_bytes"], made
    assert field(hosted, "made") == field(plain, "made"), (field(hosted, "made"),
                                                           field(plain, "made"))
    # The host's windows of the first step are stepped by the CPUs, not the device.
    assert made["host_windows"] > on_device["host_windows"], (made, on_device)


def test_the_first_step_sends_the_masters_beyond_the_limit_to_the_host_with_their_moments(
        tmp_path):
    """Note [The first step's room]: at 640 MiB the first forward and backward fit (about
    450 MiB: bf16 weights and gradients, fp32 masters), and AdamW's 384 MiB of moments would
    not. The first step sends the last masters to the host and makes their moments there,
    and the CPUs step them in that step, where AdamW would make every moment on the device.
    Both train within rounding of the plain recipe."""
    plain = run_script(MASTERS, str(tmp_path / "plain.pt"), RECIPE="plain")
    room = ast.literal_eval(field(masters_on_the_host_against(
        plain, tmp_path, ZEROALLOC_MEMORY_LIMIT="640MiB"), "figures"))
    none = ast.literal_eval(field(masters_on_the_host_against(
        plain, tmp_path, ZEROALLOC_MEMORY_LIMIT="640MiB", ROOM="0"), "figures"))
    print("the first step's room:", room, "none:", none)
    assert none["host_placed_bytes"] == 0 == none["host_made_state_bytes"], none
    assert room["host_placed_bytes"] > 0, room
    assert room["host_made_state_bytes"] >= 2 * room["host_placed_bytes"], room
    # The first step's windows of those masters are stepped by the CPUs, not the device.
    assert room["host_windows"] > none["host_windows"], (room, none)


@pytest.mark.parametrize("access", ["any", "hinted"])
def test_merged_cpu_windows_train_as_the_windows_alone(tmp_path, access):
    """Note [The CPUs' windows]: by default the CPUs step the host's windows merged into
    fewer, within rounding of the plain recipe, as the windows alone (MERGE=0) do."""
    plain = run_script(MASTERS, str(tmp_path / "plain.pt"), RECIPE="plain")
    alone = ast.literal_eval(field(masters_on_the_host_against(
        plain, tmp_path, ZEROALLOC_ACCESS=access, MERGE="0"), "figures"))
    merged = ast.literal_eval(field(masters_on_the_host_against(
        plain, tmp_path, ZEROALLOC_ACCESS=access), "figures"))
    print("windows alone:", alone, "merged:", merged)
    assert 0 < merged["host_windows"] < alone["host_windows"], (alone, merged)


@pytest.mark.parametrize("access", ["any", "hinted"])
def test_what_the_step_prepares_or_pins_ahead_trains_as_the_usual_step(tmp_path, access):
    """Note [Windows prepared ahead]: the library calls prepared before the CPUs' thread
    starts, the counts raised and the copies back queued in one call each. Note [Pinned
    buffers made ahead]: the gradients' and the bf16 masters' pinned buffers made by the
    library from the first forward on, and used by the CPUs' runs. Each trains within
    rounding of the plain recipe, as the usual step does."""
    plain = run_script(MASTERS, str(tmp_path / "plain.pt"), RECIPE="plain")
    usual, prepared, pinned = (ast.literal_eval(field(masters_on_the_host_against(
        plain, tmp_path, ZEROALLOC_ACCESS=access, **setting), "figures"))
        for setting in ({}, {"PREPARE": "1"}, {"PINNED": "1"}))
    print("usual:", usual, "prepared ahead:", prepared, "pinned ahead:", pinned)
    assert usual["host_prepare_s"] == 0 < prepared["host_prepare_s"], (usual, prepared)
    assert usual["host_pinned_ahead_bytes"] == 0, usual
    # Every master's bf16 gradient (24 of them, 96 MiB in all) and two buffers for the bf16
    # masters of a merged window (all of them: the model is smaller than the cap).
    assert pinned["host_pinned_ahead_bytes"] >= 3 * 96 * 2**20, pinned


@pytest.mark.parametrize("access", ["any", "hinted"])
def test_the_runs_ends_in_pieces_train_as_the_usual_step(tmp_path, access):
    """Note [The run's ends in pieces]: the first piece of the CPUs' first window, stepped
    as soon as its own gradients are on the host, and the last piece of their last, stepped
    apart, train within rounding of the plain recipe, as the usual step does."""
    plain = run_script(MASTERS, str(tmp_path / "plain.pt"), RECIPE="plain")
    pieces = ast.literal_eval(field(masters_on_the_host_against(
        plain, tmp_path, ZEROALLOC_ACCESS=access, PIECES=str(4 << 20)), "figures"))
    print("in pieces:", pieces)
    assert pieces["host_pieces"] > 0, pieces


def test_windows_of_two_groups_train_as_the_plain_recipe(tmp_path):
    """Note [The CPUs' windows]: with the Trainer's two groups (weights with decay, biases
    without), each window is two library calls whose masters lie apart in its pinned buffer;
    the run trains within rounding of the plain recipe with the same groups."""
    plain = run_script(MASTERS, str(tmp_path / "plain.pt"), RECIPE="plain", GROUPS="1")
    figures = ast.literal_eval(field(masters_on_the_host_against(plain, tmp_path, GROUPS="1"),
                                     "figures"))
    print("two groups:", figures)
    # Windows of more than one call: a window holds both groups' masters.
    assert figures["host_calls"] > figures["host_windows"] > 0, figures


def four_runs_at_once(tmp_path, **settings) -> tuple:
    """MASTERS four times at once under HOSTED plus `settings`: (figures, losses) of each."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda n: run_script(MASTERS, str(tmp_path / f"run{n}.pt"),
                                                  **{**HOSTED, **settings}), range(4)))
    return ([ast.literal_eval(field(out, "figures")) for out in outs],
            [field(out, "losses") for out in outs])


def test_runs_inside_the_step_under_hinted_train_the_same_every_time(tmp_path):
    """Under hinted with ZEROALLOC_HOST_STEP_OVERLAP=0 the CPUs finish inside
    optimizer.step(), and four runs at once give the same losses to the bit."""
    figures, losses = four_runs_at_once(tmp_path, ZEROALLOC_ACCESS="hinted",
                                        ZEROALLOC_HOST_STEP_OVERLAP="0")
    print("under hinted, four runs:", losses)
    assert all(f["host_windows"] > 0 and f["host_behind_steps"] == 0 for f in figures), figures
    assert len(set(losses)) == 1, losses


def test_runs_behind_the_forward_under_hinted_train_the_same_every_time(tmp_path):
    """Under hinted the CPUs finish behind the next forward by default, unguarded. Four runs
    at once give the same losses to the bit, as the runs inside the step do. They drifted
    apart (1e-3) while a forward on the default stream waited for the CPUs' copies on a
    stream of PyTorch's pool instead (Note [Behind the forward under hinted])."""
    figures, losses = four_runs_at_once(tmp_path, ZEROALLOC_ACCESS="hinted")
    print("behind the forward, four runs:", [f["host_behind_steps"] for f in figures], losses)
    assert all(f["host_behind_steps"] > 0 and f["host_guarded_steps"] == 0 for f in figures), \
        figures
    assert len(set(losses)) == 1, losses


def test_guarded_runs_finish_behind_the_forward_under_any_and_every_read_waits(tmp_path):
    """Note [Behind the forward, guarded]: under ZEROALLOC_ACCESS=any, with guard_behind, the
    CPUs finish behind the forward; a read right after optimizer.step() with no hint (what an
    EMA does) sees the weights the step wrote, never the ones before; and the run trains as
    the plain recipe does."""
    plain = run_script(MASTERS, str(tmp_path / "plain.pt"), RECIPE="plain")
    snapshots = masters_on_the_host_against(plain, tmp_path, GUARD="1", SNAPSHOT="1")
    figures = ast.literal_eval(field(snapshots, "figures"))
    stale = [int(count) for count in field(snapshots, "stale").split()]
    print("guarded, read right after each step:", figures, "stale working copies:", stale)
    assert figures["host_guarded_steps"] > 0 and figures["host_behind_steps"] > 0, figures
    assert len(stale) == 8 and not any(stale), stale
    behind = ast.literal_eval(field(masters_on_the_host_against(plain, tmp_path, GUARD="1"),
                                    "figures"))
    assert behind["host_guarded_steps"] > 0, behind


@pytest.mark.parametrize("behind", ["1", "0"])
def test_master_weights_refused_on_the_host_step_on_the_device(tmp_path, behind):
    """Refused calls step on the device: within the step (ZEROALLOC_HOST_STEP_OVERLAP=0), or
    behind the forward, from the gradients kept on the host (Note [The host step finishes
    behind the forward])."""
    plain = run_script(MASTERS, str(tmp_path / "plain.pt"), RECIPE="plain")
    hosted = masters_on_the_host_against(plain, tmp_path, REFUSE="1", ZEROALLOC_ACCESS="hinted",
                                         ZEROALLOC_HOST_STEP_OVERLAP=behind)
    refused, calls = (int(v) for v in field(hosted, "refused").split(" of "))
    print(f"{refused} of {calls} host calls refused")
    figures = ast.literal_eval(field(hosted, "figures"))
    assert refused > 0 and figures["host_refused"] == refused, hosted
    assert (figures["host_behind_steps"] > 0) == (behind == "1"), figures


@pytest.mark.parametrize("how", ["whole", "last"])
def test_a_master_partly_on_the_host_goes_there_whole_and_steps_on_the_cpus(tmp_path, how):
    """Note [Whole masters on the host]: with room for everything, one moment of the first
    master is moved to the host after three steps. The next step moves the master and its
    other moment there too ("whole"), or brings the moment back and moves the last masters
    (the last layer's weight and bias: the fewest that hold as many bytes) there whole
    ("last", last_on_host, the default); the CPUs step the master on the host from then on
    (bounced through scratch instead, it would cost its host bytes over PCIe every step)."""
    plain = run_script(MASTERS, str(tmp_path / "plain.pt"), RECIPE="plain")
    hosted = run_script(MASTERS, str(tmp_path / "hosted.pt"), RECIPE="offload",
                        ZEROALLOC_OFFLOAD="host", ZEROALLOC_HOST_STEP="1",
                        PARTLY=how)
    figures = ast.literal_eval(field(hosted, "figures"))
    first, last = field(hosted, "first master").split(), field(hosted, "last master").split()
    print("a master partly on the host:", figures, first, last)
    tensor_bytes = 2048 * 2048 * 4
    if how == "whole":
        assert first == ["host"] * 3 and last == ["device"] * 3, hosted
        assert figures["host_completed_bytes"] >= 2 * tensor_bytes, figures
    else:
        assert first == ["device"] * 3 and last == ["host"] * 3, hosted
        assert figures["host_completed_bytes"] >= 3 * tensor_bytes, figures
        assert figures["host_returned_bytes"] >= tensor_bytes, figures
    # Steps 4 to 8 on the CPUs, each at least that master.
    assert figures["host_windows"] >= 5 and figures["host_bytes"] >= 5 * tensor_bytes, figures
    assert figures["host_refused"] == 0, figures
    expected = [float(v) for v in field(plain, "losses").split()]
    got = [float(v) for v in field(hosted, "losses").split()]
    assert got[:4] == expected[:4]  # the device's steps: bit for bit the recipe
    assert max(abs(a - b) / abs(a) for a, b in zip(expected, got)) < 1e-3, (expected, got)


def test_a_script_that_drops_its_optimizer_after_the_last_step_keeps_that_step(tmp_path):
    """Note [The host step finishes behind the forward]: a script that drops its optimizer
    right after its last step, while the CPUs still step that step's masters, finds that
    step in every weight of its model (it used to fail at its next read, or at exit, with
    "'NoneType' object has no attribute ..."); the optimizer is freed once they are done."""
    out = run_script(MASTERS, str(tmp_path / "dropped.pt"), **HOSTED, DROP="1",
                     ZEROALLOC_ACCESS="hinted")  # the step behind the forward
    assert field(out, "running") == "True", out  # else this run did not test the drop
    stepped = [line.split() for line in out.splitlines() if line.startswith("stepped ")]
    assert len(stepped) == 24 and all(flag == "True" for _, _, flag in stepped), out
    assert field(out, "collected") == "True", out


def masters_on_the_host_against(plain: str, tmp_path, **settings) -> str:
    """Trains MASTERS with the host step under a limit (plus `settings`) and checks it
    against the plain recipe's run `plain` (saved at tmp_path/plain.pt); returns its output."""
    hosted = run_script(MASTERS, str(tmp_path / "hosted.pt"), **{**HOSTED, **settings})
    expected = [float(v) for v in field(plain, "losses").split()]
    reference = torch.load(tmp_path / "plain.pt")
    figures = ast.literal_eval(field(hosted, "figures"))
    print("master weights on the host:", figures)
    assert figures["host_windows"] > 0 and figures["host_copy_bytes"] > 0, hosted
    # Where the CPUs' time went: the library's calls, inside the windows' time.
    assert 0 < figures["host_call_s"] <= figures["host_s"], figures
    assert figures["host_run_s"] > 0, figures
    got = [float(v) for v in field(hosted, "losses").split()]
    worst_loss = max(abs(a - b) / abs(a) for a, b in zip(expected, got))
    stepped = torch.load(tmp_path / "hosted.pt")
    # One host step from the same values: fp32 rounding apart. That is the first step when
    # it made the states on the host (Note [States made where the CPUs step them]), else the
    # second (the first made them on the device, bit for bit). Later steps read bf16
    # gradients of working copies that a rounding flip made differ, and drift apart as any
    # two bf16 runs do.
    one = "first" if figures["host_made_state_bytes"] else "second"
    second = max(((b - a).abs().max() / a.abs().max()).item()
                 for a, b in zip(reference[one], stepped[one]))
    worst = max(((b - a).abs().max() / a.abs().max()).item()
                for a, b in zip(reference["masters"], stepped["masters"]))
    print(f"worst relative loss difference {worst_loss:.2e}; worst master difference after "
          f"the first host step {second:.2e}, after all {worst:.2e} of the tensor's largest "
          "value")
    assert second < 1e-5
    assert worst_loss < 1e-3, (expected, got)
    # Whatever the drift, every working copy the host wrote is its master rounded.
    working = [value for name, value in stepped.items()
               if name not in ("masters", "first", "second")]
    assert len(working) == len(stepped["masters"]) == 24
    for value, master in zip(working, stepped["masters"]):
        assert torch.equal(value, master.to(torch.bfloat16))
    return hosted
