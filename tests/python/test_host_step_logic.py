"""The host step (ZEROALLOC_HOST_STEP; Note [Stepped on the host] in lib/tier/host_step.hpp)
on the simulated device: zeroalloc_adamw_on_host steps states the engine holds on the host as
torch.optim.AdamW steps the same values on the CPU, to fp32 rounding, and refuses (changing
nothing) while a state is on the device; the windowed step's choice of what may step there.
Each case runs in a fresh process (the library reads its variables once)."""

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "python"

if not (ROOT / "build" / "libzeroalloc.so").exists() and "ZEROALLOC_LIBRARY" not in os.environ:
    pytest.skip("skipped: build/libzeroalloc.so is not built", allow_module_level=True)


def run_python(code: str, **environment) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(PACKAGE), "ZEROALLOC_DEVICE": "sim",
           "ZEROALLOC_OFFLOAD": "host", "ZEROALLOC_HOST_LIMIT": "256MiB",
           "ZEROALLOC_CHUNK_SIZE": "8MiB", **environment}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)


def test_adamw_on_host_matches_torch_adamw_and_refuses_states_on_the_device():
    result = run_python("""
        import ctypes
        import torch
        import zeroalloc
        from zeroalloc import _offload
        lib = zeroalloc.library()
        torch.manual_seed(0)
        # Two parameters: one across two 8 MiB chunks and a half, one small; two groups of
        # hyperparameters as two calls.
        shapes = [(2_500_000,), (1000,)]
        classes = {"param": 1, "exp_avg": 3, "exp_avg_sq": 3}

        def allocate(values, cls):
            pointer = lib.zeroalloc_malloc_class(values.numel() * 4, 0, None, cls)
            assert pointer, zeroalloc._library.last_error()
            ctypes.memmove(pointer, values.data_ptr(), values.numel() * 4)  # host memory: sim
            return pointer

        def read(pointer, count):
            out = torch.empty(count, dtype=torch.float32)
            ctypes.memmove(out.data_ptr(), pointer, count * 4)
            return out

        reference = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
        optimizer = torch.optim.AdamW([{"params": [reference[0]]},
                                       {"params": [reference[1]], "lr": 3e-3, "weight_decay": 0.0,
                                        "betas": (0.8, 0.95), "maximize": True}],
                                      lr=1e-3, weight_decay=0.1, foreach=False)
        ours = []
        for p in reference:
            ours.append({"param": allocate(p.detach(), 1),
                         "exp_avg": allocate(torch.zeros_like(p), 3),
                         "exp_avg_sq": allocate(torch.zeros_like(p), 3), "count": p.numel()})
        for each in ours:
            for key in ("param", "exp_avg", "exp_avg_sq"):
                _offload.offload_pointer(each[key])
        refused = None
        for step in range(1, 4):
            grads = [torch.randn(shape) * 0.1 for shape in shapes]
            for p, g in zip(reference, grads):
                p.grad = g.clone()
            optimizer.step()
            if step == 2:  # a state brought back to the device: refused, nothing changed
                _offload.fetch_pointer(ours[0]["exp_avg"])
                before = read(ours[0]["param"], ours[0]["count"])
                group = optimizer.param_groups[0]
                refused = _offload.adamw_on_host(
                    [ours[0]["param"]], [grads[0].data_ptr()], [ours[0]["exp_avg"]],
                    [ours[0]["exp_avg_sq"]], [ours[0]["count"]], lr=group["lr"],
                    betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                    step=step)
                assert torch.equal(read(ours[0]["param"], ours[0]["count"]), before)
                _offload.offload_pointer(ours[0]["exp_avg"])
            for each, g, group in zip(ours, grads, optimizer.param_groups):
                assert _offload.adamw_on_host(
                    [each["param"]], [g.data_ptr()], [each["exp_avg"]], [each["exp_avg_sq"]],
                    [each["count"]], lr=group["lr"], betas=group["betas"], eps=group["eps"],
                    weight_decay=group["weight_decay"], step=step,
                    maximize=group["maximize"]), zeroalloc._library.last_error()
        print("refused", refused)
        for each, p in zip(ours, reference):
            state = optimizer.state[p]
            for key, expected in (("param", p.detach()), ("exp_avg", state["exp_avg"]),
                                  ("exp_avg_sq", state["exp_avg_sq"])):
                got = read(each[key], each["count"])
                scale = expected.abs().max().item()
                worst = ((got - expected).abs() / (expected.abs() + 1e-3 * scale)).max().item()
                print(key, each["count"], "worst relative error", worst)
                assert worst < 2e-5, (key, worst)
            assert _offload.residency_of(each["param"]) == "host"
        print("ok")
    """)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "refused False" in result.stdout, result.stdout
    assert "ok" in result.stdout


def test_adamw_settings_chooses_only_the_updates_the_host_step_runs():
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc.torch._host_step import adamw_settings, whole_fp32

    p = torch.nn.Parameter(torch.zeros(4))
    adamw = torch.optim.AdamW([p], lr=torch.tensor(0.01), betas=(0.9, 0.99))
    assert adamw_settings(adamw, adamw.param_groups[0]) == {
        "lr": pytest.approx(0.01), "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01,
        "maximize": False}
    # A fused step unscales a GradScaler's gradients and skips overflowed steps in its kernel.
    assert adamw_settings(adamw, {**adamw.param_groups[0], "fused": True}) is None
    adamw.grad_scale = torch.tensor(1024.0)
    assert adamw_settings(adamw, adamw.param_groups[0]) is None
    del adamw.grad_scale

    class Custom(torch.optim.AdamW):  # may step otherwise
        pass

    custom = Custom([p])
    assert adamw_settings(custom, custom.param_groups[0]) is None
    assert adamw_settings(torch.optim.AdamW([p], amsgrad=True),
                          torch.optim.AdamW([p], amsgrad=True).param_groups[0]) is None
    adam = torch.optim.Adam([p])  # no weight decay: AdamW's update
    assert adamw_settings(adam, adam.param_groups[0])["weight_decay"] == 0.0
    l2 = torch.optim.Adam([p], weight_decay=0.1)  # L2 in the gradient: not AdamW's update
    assert adamw_settings(l2, l2.param_groups[0]) is None
    sgd = torch.optim.SGD([p], lr=0.1)
    assert adamw_settings(sgd, sgd.param_groups[0]) is None
    whole = torch.zeros(8)
    assert whole_fp32(whole)
    assert not whole_fp32(whole[2:])  # a view: not the allocation's start
    assert not whole_fp32(whole[:4])  # a view: not the whole allocation
    assert not whole_fp32(whole.to(torch.bfloat16))


def masters_of_an_adamw(sizes: list) -> tuple:
    """fp32 masters of `sizes` elements, and an AdamW over them whose moments exist."""
    masters = [torch.nn.Parameter(torch.zeros(size)) for size in sizes]
    optimizer = torch.optim.AdamW(masters)
    for master in masters:
        optimizer.state[master] = {"exp_avg": torch.zeros_like(master),
                                   "exp_avg_sq": torch.zeros_like(master)}
    return masters, optimizer


def tensors_of(optimizer, master) -> tuple:
    """A master and its two moments."""
    return (master, optimizer.state[master]["exp_avg"], optimizer.state[master]["exp_avg_sq"])


def host_step_with_masters(monkeypatch, optimizer, own_weight=None) -> tuple:
    """A HostStep, and a stand-in for the windowed step over `optimizer` under master
    weights: every parameter a master but `own_weight`, each steppable with its moments."""
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc.torch import _host_step

    stepper = types.SimpleNamespace(optimizer=optimizer, masters=object())
    monkeypatch.setattr(_host_step, "working_of",
                        lambda _, parameter: None if parameter is own_weight else object())
    host = _host_step.HostStep()
    monkeypatch.setattr(host, "steppable",
                        lambda _, parameter, groups: tensors_of(optimizer, parameter))
    return host, stepper


def test_a_master_a_trade_drags_partly_to_the_host_stays_so(monkeypatch):
    """Note [Whole masters on the host]: a chunk holds bytes of two masters, so moving the
    last master out can take part of the one before it along. That one stays where it is
    (bounced) and is not counted again: traded for one more master whole, its move would
    drag the next one along, and the line would creep down a master a step."""
    masters, optimizer = masters_of_an_adamw([4] * 5)
    host, stepper = host_step_with_masters(monkeypatch, optimizer)
    from zeroalloc.torch import _host_step
    assert host.last_on_host  # the default

    def tensors(master):
        return tensors_of(optimizer, master)

    def pointer(tensor):
        return tensor.untyped_storage().data_ptr()

    where = {pointer(t): "device" for master in masters for t in tensors(master)}
    where[pointer(tensors(masters[0])[1])] = "host"  # the engine evicted one moment
    shared = pointer(tensors(masters[3])[2])  # shares a chunk with the last master
    calls = []

    def mover(kind, landing):
        def move(address, wait=True):
            calls.append((kind, address))
            if wait:
                where[address] = landing
                if address == pointer(masters[4]):
                    where[shared] = "split"  # dragged along
        return move

    monkeypatch.setattr(_host_step, "residency_or_foreign",
                        lambda tensor: where[pointer(tensor)])
    monkeypatch.setattr(_host_step._offload, "offload_pointer", mover("out", "host"))
    monkeypatch.setattr(_host_step._offload, "fetch_pointer", mover("in", "device"))
    host.whole_on_host(stepper, [masters], {}, {})
    assert {address for kind, address in calls if kind == "out"} == {
        pointer(t) for t in tensors(masters[4])}
    assert where[shared] == "split"
    for _ in range(3):  # the steps after: the line stays where it is
        calls.clear()
        host.whole_on_host(stepper, [masters], {}, {})
        assert calls == []


def test_masters_partly_on_the_host_are_traded_for_the_last_masters_whole(monkeypatch):
    """Note [Whole masters on the host]: the parts of masters the host holds are traded for
    as many bytes of the last masters, whole (moved out first, all queued before any is
    waited for), and the others come back whole; in the order as planned nothing moves. A
    model's own weight, and a master with a chunk on disk or moving, are left where they
    are. When the host tier refuses, it warns once and moves nothing more."""
    masters, optimizer = masters_of_an_adamw([4] * 9)
    host, stepper = host_step_with_masters(monkeypatch, optimizer, own_weight=masters[5])
    from zeroalloc._library import ZeroallocError
    from zeroalloc.torch import _host_step
    host.last_on_host = True

    def tensors(master):
        return tensors_of(optimizer, master)

    placed = [("device", "host", "device"),  # one moment on the host: comes back
              ("split", "device", "device"),  # a chunk of the master on the host: back
              ("device", "device", "device"),
              ("device", "disk", "split"),  # a chunk on disk: left
              ("moving", "host", "device"),  # left
              ("device", "host", "device"),  # the model's own weight: left
              ("device", "device", "device"),  # the last three: to the host, whole
              ("device", "device", "device"),
              ("host", "device", "host_unmapped")]
    where = {}

    def pointer(tensor):
        return tensor.untyped_storage().data_ptr()

    for master, places in zip(masters, placed):
        for tensor, place in zip(tensors(master), places):
            where[pointer(tensor)] = place
    calls = []

    def mover(kind, landing):
        def move(address, wait=True):
            calls.append((kind, address, wait))
            if wait:
                where[address] = landing
        return move

    monkeypatch.setattr(_host_step, "residency_or_foreign",
                        lambda tensor: where[pointer(tensor)])
    monkeypatch.setattr(_host_step._offload, "offload_pointer", mover("out", "host"))
    monkeypatch.setattr(_host_step._offload, "fetch_pointer", mover("in", "device"))
    places = {}
    host.whole_on_host(stepper, [masters[:4], masters[4:]], places, {})
    # The host held 56 bytes of masters (16 of the first, half of the second's 16, 32 of the
    # last): the last two masters, 96 bytes whole, are the fewest that hold as many.
    out = [pointer(t) for t in tensors(masters[7])] + [pointer(tensors(masters[8])[1])]
    back = [pointer(tensors(masters[0])[1]), pointer(masters[1])]
    assert calls == ([("out", a, False) for a in out] + [("out", a, True) for a in out]
                     + [("in", a, False) for a in back] + [("in", a, True) for a in back])
    for master in masters[7:]:
        assert all(places[id(t)] in ("host", "host_unmapped") for t in tensors(master))
    assert places[id(tensors(masters[3])[1])] == "disk"
    for master in masters[:3] + [masters[6]]:
        assert all(places[id(t)] == "device" for t in tensors(master))
    assert host.figures["host_completed_bytes"] == 4 * 16
    assert host.figures["host_returned_bytes"] == 2 * 16
    calls.clear()
    host.whole_on_host(stepper, [masters], {}, {})  # as planned: nothing moves
    assert calls == []
    assert host.completing
    # A master brought back, partly on the host again (a chunk it shares with one moved
    # out): left so, and not counted (the line stays where it is).
    where[pointer(masters[1])] = "split"
    host.whole_on_host(stepper, [masters], {}, {})
    assert calls == []
    where[pointer(masters[1])] = "device"

    # Without the trade, each master the host holds a part of goes there whole.
    host.last_on_host = False
    where[pointer(tensors(masters[2])[2])] = "host"
    host.whole_on_host(stepper, [masters], {}, {})
    assert [(kind, address) for kind, address, _ in calls] == [
        ("out", pointer(masters[2])), ("out", pointer(tensors(masters[2])[1]))] * 2

    def refused(address, wait=True):
        raise ZeroallocError("the host tier is full (ZEROALLOC_HOST_LIMIT)")

    monkeypatch.setattr(_host_step._offload, "offload_pointer", refused)
    where[pointer(masters[3])] = "host"
    where[pointer(masters[0])] = "host"
    with pytest.warns(UserWarning, match="the host tier is full"):
        host.whole_on_host(stepper, [masters], {}, {})
    assert not host.completing
    calls.clear()
    monkeypatch.setattr(_host_step._offload, "offload_pointer", mover("out", "host"))
    host.whole_on_host(stepper, [masters], {}, {})
    assert calls == []


@pytest.mark.parametrize("chunk_floats, evicted_chunks", [(64, 5), (48, 9), (100, 3)])
def test_the_trade_settles_on_chunks_shared_by_masters(monkeypatch, chunk_floats,
                                                       evicted_chunks):
    """Note [Whole masters on the host], on a layout like the engine's: masters of mixed sizes
    back to back, then their moments, in chunks that straddle tensors; a fetch or an
    eviction moves whole chunks, dragging the neighbours' bytes along. The engine evicted
    the first chunks of the moments (stepped longest ago). Step after step the trade moves
    the last masters out, brings the rest back, and settles: no move after the third step,
    the masters whole on the host are the last ones, and the host holds no more than the
    engine evicted plus one master and the two chunks the line straddles (a creep, or each
    partial master made whole, holds far more)."""
    sizes = [24, 40, 8, 56, 16, 32, 8, 48, 24, 40, 8, 64, 16, 32]  # floats per master
    masters, optimizer = masters_of_an_adamw(sizes)
    host, stepper = host_step_with_masters(monkeypatch, optimizer)
    from zeroalloc.torch import _host_step

    def tensors(master):
        return tensors_of(optimizer, master)

    # The engine's address space, in floats: the masters, then each master's two moments.
    span = {}
    offset = 0
    for master in masters:
        span[tensors(master)[0].untyped_storage().data_ptr()] = (offset, master.numel())
        offset += master.numel()
    for master in masters:
        for moment in tensors(master)[1:]:
            span[moment.untyped_storage().data_ptr()] = (offset, moment.numel())
            offset += moment.numel()
    chunks = ["device"] * -(-offset // chunk_floats)
    for number in range(len(chunks) // 2, len(chunks) // 2 + evicted_chunks):
        chunks[number] = "host"  # the first moments' chunks
    evicted = evicted_chunks * chunk_floats * 4

    def chunks_of(pointer):
        start, count = span[pointer]
        return range(start // chunk_floats, (start + count - 1) // chunk_floats + 1)

    def residency(tensor):
        places = {chunks[number] for number in chunks_of(tensor.untyped_storage().data_ptr())}
        return places.pop() if len(places) == 1 else "split"

    moves = []

    def mover(landing):
        def move(address, wait=True):
            if wait:
                moves.append(address)
                for number in chunks_of(address):
                    chunks[number] = landing
        return move

    monkeypatch.setattr(_host_step, "residency_or_foreign", residency)
    monkeypatch.setattr(_host_step._offload, "offload_pointer", mover("host"))
    monkeypatch.setattr(_host_step._offload, "fetch_pointer", mover("device"))
    windows = [masters[:5], masters[5:9], masters[9:]]
    for step in range(8):
        moves.clear()
        host.whole_on_host(stepper, windows, {}, {})
        if step >= 3:
            assert moves == [], f"step {step} still moves"
    whole = [all(residency(t) == "host" for t in tensors(m)) for m in masters]
    first = whole.index(True)
    assert all(whole[first:]), whole  # the last masters, whole
    host_bytes = chunks.count("host") * chunk_floats * 4
    assert host_bytes <= evicted + max(sizes) * 12 + 2 * chunk_floats * 4, (host_bytes, evicted)


def test_pinned_buffers_made_ahead_are_exact_writable_and_go_back_with_their_last_view():
    """Note [Pinned buffers made ahead]: the library's pinned buffers, as tensors: of the
    size asked (a whole number of pages held), written and read by the CPUs, counted while
    any view lives, released after it; made on a thread of their own; one the host cannot
    spare is left to the step, saying why in the log."""
    result = run_python("""
        import gc, os, threading, time
        import torch
        from zeroalloc import _offload
        from zeroalloc.torch._host_step import PinnedAhead, pinned_tensor
        before = _offload.pinned_bytes(0)
        buffer = pinned_tensor(0, 10_000, [0])
        assert buffer.dtype == torch.uint8 and buffer.numel() == 10_000
        page = os.sysconf("SC_PAGE_SIZE")
        held = -(-10_000 // page) * page  # whole pages
        assert _offload.pinned_bytes(0) - before == held, _offload.pinned_bytes(0)
        view = buffer[4096:4104].view(torch.bfloat16)
        view.copy_(torch.arange(4, dtype=torch.bfloat16))
        del buffer
        gc.collect()
        assert _offload.pinned_bytes(0) - before == held  # the view holds it
        assert view.tolist() == [0.0, 1.0, 2.0, 3.0]
        del view
        gc.collect()
        for _ in range(1000):  # released once the stream's work is done, by a thread
            if _offload.pinned_bytes(0) == before:
                break
            time.sleep(0.01)
        assert _offload.pinned_bytes(0) == before, _offload.pinned_bytes(0)
        making = PinnedAhead(0, {"gradients": 5000, "copies": 3000}, [0])
        made = making.take()
        assert made["gradients"].numel() == 5000, made
        assert [c.numel() for c in made["copies"]] == [3000, 3000], made
        assert not any(t.name == "zeroalloc-pinned-buffers" for t in threading.enumerate())
        refused = PinnedAhead(0, {"gradients": 1 << 50}, [0]).take()
        assert refused == {}, refused
        print("ok")
    """, ZEROALLOC_LOG_LEVEL="info")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok" in result.stdout, result.stdout
    assert "pinned buffers were not made ahead" in result.stderr, result.stderr
    assert "keeps in reserve" in result.stderr, result.stderr


def test_a_step_that_overlaps_nothing_still_hears_the_first_module_hint_once():
    """Note [Pinned buffers made ahead]: the buffers are made from the first forward on,
    also for a step made with overlap_bytes=0, which the hints otherwise never reach."""
    result = run_python("""
        from zeroalloc.torch._step_listeners import WindowedSteps
        heard = []

        class Step:
            def first_hint(self):
                heard.append("first")

            def module_hint(self, own, forward):
                heard.append("hint")

        listeners = WindowedSteps()
        step = Step()
        listeners.first_hint.add(step)
        for _ in range(3):
            listeners.module_hint([], True)
        print(heard, listeners.hints)
    """)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split("\n")[0] == "['first'] 3", result.stdout


def test_pinned_buffers_leave_what_the_host_tier_may_still_take():
    """Note [Pinned buffers made ahead]: with the host tier allowed all the host's memory, a
    buffer made ahead would take room the engine's moves may need later: it is refused,
    saying why, and the step does without it."""
    result = run_python("""
        from zeroalloc import ZeroallocError, _offload
        try:
            _offload.pinned_create(0, 1 << 20)
            print("made")
        except ZeroallocError as refused:
            print("refused:", refused)
    """, ZEROALLOC_HOST_LIMIT="1TiB")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "refused:" in result.stdout, result.stdout
    assert "host tier may still take up to ZEROALLOC_HOST_LIMIT" in result.stdout, result.stdout


@pytest.mark.parametrize("settings, guarded", [
    ({}, False),
    ({"ZEROALLOC_HOST_STEP_GUARDED": "1"}, True),
    ({"ZEROALLOC_HOST_STEP_GUARDED": "1", "ZEROALLOC_HOST_STEP_OVERLAP": "0"}, False),
    # Under hinted the CPUs finish behind the forward unguarded: the hooks see every read.
    ({"ZEROALLOC_HOST_STEP_GUARDED": "1", "ZEROALLOC_ACCESS": "hinted"}, False),
])
def test_the_guarded_step_is_asked_for_by_its_variable_under_any(settings, guarded):
    """Note [Behind the forward, guarded]: ZEROALLOC_HOST_STEP_GUARDED=1 asks for it."""
    result = run_python("""
        from zeroalloc.torch._host_step import HostStep
        print(HostStep().guard_behind)
    """, **settings)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == [str(guarded)], result.stdout + result.stderr


@pytest.mark.parametrize("settings, behind", [
    ({"ZEROALLOC_ACCESS": "hinted"}, True),
    ({"ZEROALLOC_ACCESS": "hinted", "ZEROALLOC_HOST_STEP_OVERLAP": "0"}, False),
    ({"ZEROALLOC_HOST_STEP_OVERLAP": "1"}, False),  # under any only the guarded form
])
def test_the_step_finishes_behind_the_forward_under_hinted_unless_told_not_to(settings, behind):
    """Note [The host step finishes behind the forward]: under hinted by default, inside
    optimizer.step() with ZEROALLOC_HOST_STEP_OVERLAP=0, and never under any (the guarded
    form aside)."""
    result = run_python("""
        from zeroalloc.torch import _settings
        print(_settings.host_step_overlap())
    """, **settings)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == [str(behind)], result.stdout + result.stderr


def test_a_malformed_guarded_setting_is_told_naming_the_variable():
    result = run_python("""
        from zeroalloc.torch._host_step import HostStep
        HostStep()
    """, ZEROALLOC_HOST_STEP_GUARDED="sometimes")
    assert result.returncode != 0
    assert "ZEROALLOC_HOST_STEP_GUARDED" in result.stderr and "sometimes" in result.stderr, \
        result.stderr


@pytest.mark.parametrize("counts, first, last, size, ends", [
    ([4, 4, 4, 4], True, False, 5, [2, 4]),  # the first piece: at least 5 elements
    ([4, 4, 4, 4], False, True, 5, [2, 4]),  # the last piece: at least 5, from the end
    ([4, 4, 4, 4, 4, 4], True, True, 4, [1, 5, 6]),  # one window, the run's only one
    ([4, 4, 4, 4], True, True, 8, [2, 4]),  # a last piece would overlap the first
    ([4, 4], True, False, 8, [2]),  # a piece as large as the window: none
    ([4, 4, 4], True, True, 0, [3]),  # off
    ([4, 4, 4], False, False, 4, [3]),  # a window between: whole
    ([], True, True, 4, [0])])
def test_the_runs_ends_are_cut_into_pieces_of_at_least_the_size_asked(
        counts, first, last, size, ends):
    """Note [The run's ends in pieces]: the run's first window gets a first piece and its
    last a last piece, each of at least the size asked, never the whole window and never
    overlapping."""
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc.torch._host_step import piece_ends
    assert piece_ends(counts, first, last, size) == ends


def test_a_window_in_pieces_steps_each_once_its_gradients_are_there_at_offsets_of_its_own(
        monkeypatch):
    """Note [The run's ends in pieces]: a window in pieces waits for each piece's own event
    before planning and calling it, waits for its pinned buffer's last copies once, before
    the first piece, and lays the pieces' masters out one after the other in that buffer;
    refused parameters of every piece come back."""
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc.torch import _host_step
    host = _host_step.HostStep()
    happened = []

    class Event:
        def __init__(self, name):
            self.name = name

        def synchronize(self):
            happened.append(("arrived", self.name))

    window = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 20, 30, 40)]
    views = [f"view {n}" for n in range(4)]
    offsets = []

    def plan(stepper, part, part_views, groups, settings, slot, offset=None):
        offsets.append(offset[0])
        outputs = host.output_views([(p, None) for p in part], slot, offset)
        happened.append(("planned", [p.numel() for p in part], part_views))
        return [outputs]

    def run_calls(stepper, planned, slot, batched):
        happened.append(("called",))
        return [window[3]] if planned[0][-1].numel() == 40 else []

    monkeypatch.setattr(host, "plan", plan)
    monkeypatch.setattr(host, "run_calls", run_calls)
    monkeypatch.setattr(host, "wait_copies", lambda slot: happened.append(("waited", slot)))
    host.copies = [None, torch.zeros(1 << 16, dtype=torch.uint8)]
    refused = host.step(None, window, (views, Event("window")), {}, {}, slot=1,
                        pieces=[(1, Event("first")), (4, Event("window"))])
    assert happened == [
        ("arrived", "first"), ("waited", 1), ("planned", [10], ["view 0"]), ("called",),
        ("arrived", "window"), ("planned", [20, 30, 40], ["view 1", "view 2", "view 3"]),
        ("called",)]
    a = _host_step.aligned
    assert offsets == [0, a(20)]  # the second piece's masters begin after the first's
    assert refused == [window[3]]
    assert host.figures["host_pieces"] == 1 and host.figures["host_windows"] == 1


def test_a_window_of_two_groups_waits_for_its_buffers_copies_once_and_lays_them_apart(
        monkeypatch):
    """Note [The CPUs' windows]: a window whose masters are in two groups (weights with decay,
    norms without, as the Trainer makes them) is two library calls. The CPUs wait for the
    pinned buffer's last copies once, before the first call, and the second call's masters
    begin after the first's: neither call waits for the other's copies back."""
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc.torch import _host_step
    host = _host_step.HostStep()
    window = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 20, 30)]
    optimizer = torch.optim.AdamW([{"params": [window[0], window[2]]},
                                   {"params": [window[1]], "weight_decay": 0.0}])
    for parameter in window:
        optimizer.state[parameter].update(
            step=torch.tensor(0.0), exp_avg=torch.zeros_like(parameter),
            exp_avg_sq=torch.zeros_like(parameter))

    class Masters:
        def working(self, parameter):
            return parameter

    class Stepper:
        pass

    stepper = Stepper()
    stepper.optimizer, stepper.masters = optimizer, Masters()
    groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    settings = {id(group): {} for group in optimizer.param_groups}
    happened, laid = [], []

    class Event:
        def synchronize(self):
            happened.append("arrived")

    def run_calls(stepper, planned, slot, batched):
        for call in planned:
            laid.append([(o.data_ptr() - host.copies[slot].data_ptr(), o.numel())
                         for o in call.outputs])
            happened.append(("called", [p.numel() for p, _ in call.members]))
        return []

    monkeypatch.setattr(host, "run_calls", run_calls)
    monkeypatch.setattr(host, "wait_copies", lambda slot: happened.append(("waited", slot)))
    host.copies = [torch.zeros(1 << 16, dtype=torch.uint8), None]
    views = [torch.zeros(p.numel(), dtype=torch.bfloat16) for p in window]
    assert host.step(stepper, window, (views, Event()), groups, settings, slot=0) == []
    assert happened == ["arrived", ("waited", 0), ("called", [10, 30]), ("called", [20])]
    a = _host_step.aligned
    assert laid == [[(0, 10), (a(20), 30)], [(a(20) + a(60), 20)]]
    # Planned ahead (Note [Windows prepared ahead]) into a slot with no buffer yet: one
    # buffer for the whole window, made before the first call, and the calls still apart.
    made = []
    empty = torch.empty

    def pinned(*shape, pin_memory=False, **kwargs):
        made.append(shape)
        return empty(*shape, **kwargs)

    monkeypatch.setattr(torch, "empty", pinned)
    planned = host.plan(stepper, window, views, groups, settings, 1, ahead=True)
    # The whole block PyTorch pins for it (Note [Buffers as large as their blocks]).
    assert made == [(_host_step.power_of_two(a(20) + a(40) + a(60)),)]
    assert [[(o.data_ptr() - host.copies[1].data_ptr(), o.numel()) for o in call.outputs]
            for call in planned] == laid


def test_a_pinned_buffer_a_little_short_for_a_later_run_is_used_again(monkeypatch):
    """Note [Buffers as large as their blocks]: the host step's pinned buffers take the
    whole power-of-two block PyTorch pins for them, so a later run that needs a little more
    (but no more than the block) uses the same buffer; one that needs more gets a new one."""
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc.torch import _host_step
    made = []
    empty = torch.empty

    def pinned(*shape, pin_memory=False, **kwargs):
        assert pin_memory
        made.append(shape)
        return empty(*shape, **kwargs)

    monkeypatch.setattr(torch, "empty", pinned)
    host = _host_step.HostStep()
    first = host.grow_copies(0, 3000)
    assert host.grow_copies(0, 4000) is first and first.numel() == 4096
    assert host.grow_copies(0, 5000).numel() == 8192
    assert made == [(4096,), (8192,)]


@pytest.mark.parametrize("default_dtype", [torch.float32, torch.float64])
def test_a_step_count_made_ahead_is_the_one_adamw_makes(default_dtype):
    """Note [States made where the CPUs step them]: the first step's count, made by the
    host step for the moments it makes on the host, has the dtype, device and value of the
    one torch.optim.AdamW makes in its first step (float64 under a float64 default)."""
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc.torch._host_step import step_count_zero
    before = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        parameter = torch.nn.Parameter(torch.ones(3))
        optimizer = torch.optim.AdamW([parameter])
        made = step_count_zero()
        parameter.grad = torch.ones(3)
        optimizer.step()
    finally:
        torch.set_default_dtype(before)
    expected = optimizer.state[parameter]["step"] - 1
    assert made.dtype == expected.dtype == (torch.float64 if default_dtype == torch.float64
                                            else torch.float32)
    assert made.device == expected.device and made.shape == expected.shape
    assert torch.equal(made, expected)


@pytest.mark.parametrize("available_gib, ahead_gib, behind, held, made", [
    (38, 16, False, False, True), (37, 16, False, False, False),  # every gradient's buffer
    (37, 1, True, False, False),  # the same buffer for a run that may finish behind
    (22, 1, False, False, True), (21, 1, False, False, False),  # the windows' buffers alone
    (18, 16, False, True, True)])  # every buffer held already: room for the tier alone
def test_moments_go_to_the_host_in_the_first_step_only_with_room_for_the_buffers(
        monkeypatch, available_gib, ahead_gib, behind, held, made):
    """Note [States made where the CPUs step them]: the first step makes the moments on the
    host only when the host can pin the host step's buffers (rounded up to powers of two)
    beside what the host tier may still create up to its limit and its reserve. For a 7B
    model: two 2 GiB buffers for a merged window's bf16 masters, and 16 GiB for every bf16
    gradient when they are queued ahead or the run may finish behind the forward; the tier
    may grow by 10 GiB, and keeps 8 GiB of the host's 128 GiB. Buffers held already count
    for nothing."""
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc.torch import _host_step
    gib = 1 << 30
    masters = [types.SimpleNamespace(numel=lambda: 6_000_000_000),
               types.SimpleNamespace(numel=lambda: 740_000_000)]
    stepper = types.SimpleNamespace(
        optimizer=types.SimpleNamespace(param_groups=[{"params": masters}]),
        masters=types.SimpleNamespace(working=lambda p: p), behind_allowed=behind)
    monkeypatch.setattr(_host_step._stats, "raw_stats", lambda device: {
        "offload": {"host_limit_bytes": 100 * gib, "host_created_bytes": 90 * gib}})
    monkeypatch.setattr(_host_step, "available_host_bytes", lambda: available_gib * gib)
    monkeypatch.setattr(_host_step, "host_memory_bytes", lambda: 128 * gib)
    host = _host_step.HostStep()
    host.ahead_bytes = ahead_gib * gib
    if held:  # made ahead by the library, or by an earlier step
        host.gradients = types.SimpleNamespace(numel=lambda: 16 * gib)
        host.copies = [types.SimpleNamespace(numel=lambda: 2 * gib)] * 2
    assert host.room_for_buffers(stepper, 0) is made


@pytest.mark.parametrize("available_gib, created_gib, short_gib, told", [
    (37, 90, 1, "ZEROALLOC_HOST_LIMIT=99GiB or less leaves the room"),
    (20, 99.5, 8.5, "Freeing host memory leaves the room")])
def test_a_first_step_without_room_for_the_buffers_tells_the_log_once_what_is_missing(
        monkeypatch, available_gib, created_gib, short_gib, told):
    """Note [States made where the CPUs step them]: without room for the buffers, the log
    is told once what the buffers need, what is missing, and the host tier's limit in whole
    GiB that leaves the room, unless the tier has created that much already. The step's
    figures hold what is missing."""
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc.torch import _host_step
    gib = 1 << 30
    masters = [types.SimpleNamespace(numel=lambda: 6_740_000_000)]
    stepper = types.SimpleNamespace(
        optimizer=types.SimpleNamespace(param_groups=[{"params": masters}]),
        masters=types.SimpleNamespace(working=lambda p: p), behind_allowed=False)
    monkeypatch.setattr(_host_step._stats, "raw_stats", lambda device: {
        "offload": {"host_limit_bytes": 100 * gib, "host_created_bytes": int(created_gib * gib)}})
    monkeypatch.setattr(_host_step, "available_host_bytes", lambda: available_gib * gib)
    monkeypatch.setattr(_host_step, "host_memory_bytes", lambda: 128 * gib)
    logged, sections = [], []
    monkeypatch.setattr(_host_step._offload, "log",
                        lambda level, text: logged.append((level, text)))

    class Library:
        def zeroalloc_report_section(self, name, text):
            sections.append((name.decode(), json.loads(text)))
            return 0

    monkeypatch.setattr(_host_step, "library", lambda: Library())
    host = _host_step.HostStep()
    host.ahead_bytes = 16 * gib  # every gradient's buffer (16 GiB) and two of 2 GiB: 20 GiB
    assert host.room_for_buffers(stepper, 0) is False
    assert host.room_for_buffers(stepper, 0) is False
    assert len(logged) == 1 and logged[0][0] == "warn", logged
    assert "buffers need 20.0 GiB" in logged[0][1] and f"{short_gib:.1f} GiB are missing" \
        in logged[0][1] and told in logged[0][1], logged[0][1]
    assert host.figures["host_state_room_short_bytes"] == int(short_gib * gib)
    assert [name for name, _ in sections] == ["host_step"], sections  # for doctor, once
    section = sections[0][1]
    assert section["room_short_bytes"] == int(short_gib * gib)
    assert section["buffers_bytes"] == 20 * gib
    assert section["suggested_host_limit"] == ("99GiB" if "99GiB" in told else None)


def test_the_first_step_makes_moments_only_for_masters_the_cpus_would_step_there(monkeypatch):
    """Note [States made where the CPUs step them]: the first step makes moments for the
    masters wholly on the host that have none yet and that the CPUs can step, in batches of
    about STATE_BATCH_BYTES; none for a master with states, one on the device, a parameter
    that is not a master, or a group with amsgrad. The optimizer's state lists every
    parameter in param_groups' order, as AdamW's first step does. Nothing when turned
    off."""
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc.torch import _host_step

    def gradient(count):  # a whole bf16 gradient on the device, as the step reads it
        return types.SimpleNamespace(
            is_cuda=True, dtype=torch.bfloat16, is_contiguous=lambda: True,
            storage_offset=lambda: 0, numel=lambda: count, element_size=lambda: 2,
            untyped_storage=lambda: types.SimpleNamespace(nbytes=lambda: 2 * count))

    names = ("first", "stated", "on_device", "not_master", "second", "amsgrad")
    tensors = {name: torch.nn.Parameter(torch.zeros(1024)) for name in names}
    optimizer = torch.optim.AdamW([{"params": [tensors[n] for n in names[:5]]},
                                   {"params": [tensors["amsgrad"]], "amsgrad": True}])
    optimizer.state[tensors["stated"]]["step"] = torch.tensor(1.0)
    places = {id(t): "host" for t in tensors.values()}
    places[id(tensors["on_device"])] = "device"
    working = types.SimpleNamespace(dtype=torch.bfloat16, is_contiguous=lambda: True,
                                    is_cuda=True)  # a bf16 working copy on the device
    stepper = types.SimpleNamespace(
        optimizer=optimizer,
        masters=types.SimpleNamespace(
            working=lambda p: None if p is tensors["not_master"] else working,
            gradient=lambda p: gradient(p.numel())),
        gradient=lambda p: gradient(p.numel()),
        forget=lambda parameters: forgotten.extend(parameters))
    groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    batches, forgotten = [], []
    monkeypatch.setattr(_host_step, "residency_or_foreign", lambda t: places[id(t)])
    monkeypatch.setattr(_host_step, "STATE_BATCH_BYTES", 8 * 1024)  # one master's moments
    monkeypatch.setattr(_host_step.HostStep, "room_for_buffers", lambda *_: True)
    monkeypatch.setattr(_host_step.HostStep, "make_batch",
                        lambda self, stepper, batch, stream: batches.append(batch))
    host = _host_step.HostStep()
    host.make_states(stepper, [list(tensors.values())], groups, None)
    assert [[p is tensors[n] for p in batch] for batch, n in zip(batches, ("first", "second"))
            ] == [[True], [True]], batches
    assert {id(p) for p in forgotten} == {id(tensors["first"]), id(tensors["second"])}
    assert [id(p) for p in optimizer.state] == [id(tensors[n]) for n in (
        "stated", "first", "on_device", "not_master", "second", "amsgrad")]
    batches.clear()
    host.make_states_on_host = False
    host.make_states(stepper, [list(tensors.values())], groups, None)
    assert batches == []


def device_master(number: int, nbytes: int):
    """A stand-in for an fp32 master of `nbytes` on CUDA device 0, at address `number`."""
    storage = types.SimpleNamespace(nbytes=lambda: nbytes, data_ptr=lambda: number)
    return types.SimpleNamespace(is_cuda=True, device=types.SimpleNamespace(index=0),
                                 untyped_storage=lambda: storage, number=number)


@pytest.mark.parametrize("peak, before, limit, headroom, where, sent", [
    (700, 300, 1000, 0, {}, [2, 3]),  # moments 800: 500 over; one master saves 300, two 600
    (700, 300, 1000, 0, {3: "host"}, [2]),  # the last on the host: moments 600, 300 over
    (700, 300, 1000, 0, {3: "split"}, [2, 3]),  # partly on the host: the trade's, so sent
    (500, 300, 1000, 0, {}, [3]),  # 300 over: one master
    (500, 300, 1000, 100, {}, [2, 3]),  # the engine keeps 100 free: 400 over, two
    (200, 100, 1000, 0, {}, []),  # the moments fit
    (700, 700, 1000, 0, {}, []),  # the peak is not this step's: no estimate
    (700, None, 1000, 0, {}, []),  # no forward seen since offload(): no estimate
    (700, 300, 0, 0, {}, [])])  # no limit known
def test_the_first_step_sends_the_last_masters_its_moments_would_overflow_to_the_host(
        monkeypatch, peak, before, limit, headroom, where, sent):
    """Note [The first step's room]: the device's peak, when its own forward and backward
    reached it (above the peak as the first forward began), plus two moments for each master
    still on the device, over the limit less the engine's prefetch headroom: the last
    masters on the device (or split) go to the host, each worth three times its bytes, the
    fewest that cover it."""
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc.torch import _host_step
    masters = [device_master(number, 100) for number in range(4)]
    places = {id(m): where.get(m.number, "device") for m in masters}
    monkeypatch.setattr(_host_step._stats, "raw_stats", lambda device: {
        "limit_bytes": limit, "total": {"allocated_bytes": {"peak": peak}}})
    host = _host_step.HostStep()
    host.peak_before = before
    host.headroom_bytes = headroom
    assert [m.number for m in host.beyond_the_limit(masters, places)] == sent


def test_the_peak_is_noted_as_the_first_forward_begins_unless_turned_off(monkeypatch):
    """Note [The first step's room]: the device's peak as the first forward after offload()
    begins is what the first step's own peak must pass; turned off, none is noted, and so
    nothing is sent."""
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc.torch import _host_step
    masters = [device_master(0, 100)]
    optimizer = types.SimpleNamespace(param_groups=[{"params": masters}])
    stepper = types.SimpleNamespace(optimizer=optimizer,
                                    masters=types.SimpleNamespace(working=lambda p: p))
    monkeypatch.setattr(_host_step._stats, "raw_stats", lambda device: {
        "limit_bytes": 1000, "total": {"allocated_bytes": {"peak": 450}}})
    host = _host_step.HostStep()
    host.note_peak(stepper)
    assert host.peak_before == 450
    off = _host_step.HostStep()
    off.room_first = False
    off.note_peak(stepper)
    assert off.peak_before is None


def test_masters_sent_to_the_host_are_moved_together_and_a_refused_move_is_told(monkeypatch):
    """Note [The first step's room]: the masters' moves are all queued, then waited for;
    their residency is asked again, and the bytes that reached the host are counted. A move
    the host tier refuses warns, and leaves the masters not moved where they were."""
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc._library import ZeroallocError
    from zeroalloc.torch import _host_step
    masters = [device_master(number, 100) for number in range(3)]
    where = {m.number: "device" for m in masters}
    calls = []

    def offload(pointer, wait=True):
        calls.append((pointer, wait))
        if pointer == refuse:
            raise ZeroallocError("the host tier is full")
        if wait:
            where[pointer] = "host"

    monkeypatch.setattr(_host_step._offload, "offload_pointer", offload)
    monkeypatch.setattr(_host_step, "residency_or_foreign", lambda m: where[m.number])
    host = _host_step.HostStep()
    refuse, places = None, {}
    host.place_on_host(masters[1:], places)
    assert calls == [(1, False), (2, False), (1, True), (2, True)]
    assert [places[id(m)] for m in masters[1:]] == ["host", "host"]
    assert host.figures["host_placed_bytes"] == 200
    refuse, calls[:] = 0, []
    with pytest.warns(UserWarning, match="the optimizer makes their states on the device"):
        host.place_on_host(masters[:1], places)
    assert places[id(masters[0])] == "device" and host.figures["host_placed_bytes"] == 200


@pytest.mark.parametrize("refused", [False, True])
def test_the_masters_the_first_step_sends_to_the_host_get_their_moments_there(
        monkeypatch, refused):
    """Note [The first step's room]: the masters sent to the host have their moments made
    there, with those the host held already, and the step's cache forgets them. One whose
    move was refused stays on the device and gets none there. A neighbour a move took partly
    along stays so (the trade leaves it bounced). Nothing is sent without room for the host
    step's buffers, or once any master has states (a master added later)."""
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc.torch import _host_step
    names = ("first", "second", "third", "fourth")
    tensors = {name: torch.nn.Parameter(torch.zeros(1024)) for name in names}
    optimizer = torch.optim.AdamW(list(tensors.values()))
    places = {id(tensors["first"]): "host", id(tensors["second"]): "device",
              id(tensors["third"]): "device", id(tensors["fourth"]): "device"}
    stepper = types.SimpleNamespace(
        optimizer=optimizer, masters=types.SimpleNamespace(working=lambda p: p),
        gradient=lambda p: p, forget=lambda parameters: forgotten.extend(parameters))
    groups = {id(p): optimizer.param_groups[0] for p in tensors.values()}
    batches, forgotten, sent = [], [], []

    def place_on_host(self, masters, found):
        sent.extend(masters)
        for master in masters:  # a refused move leaves the last one on the device
            if not (refused and master is tensors["fourth"]):
                places[id(master)] = found[id(master)] = "host"
        places[id(tensors["second"])] = "split"  # shares a chunk with the third

    room = [True]
    monkeypatch.setattr(_host_step.HostStep, "gradient_steppable", lambda *_: True)
    monkeypatch.setattr(_host_step, "residency_or_foreign", lambda t: places[id(t)])
    monkeypatch.setattr(_host_step.HostStep, "room_for_buffers", lambda *_: room[0])
    monkeypatch.setattr(_host_step.HostStep, "beyond_the_limit",
                        lambda self, candidates, found: [tensors["third"], tensors["fourth"]])
    monkeypatch.setattr(_host_step.HostStep, "place_on_host", place_on_host)
    monkeypatch.setattr(_host_step.HostStep, "make_batch",
                        lambda self, stepper, batch, stream: batches.extend(batch))
    host = _host_step.HostStep()
    room[0] = False
    host.make_states(stepper, [list(tensors.values())], groups, None)
    assert sent == [] and batches == []
    room[0] = True
    host.make_states(stepper, [list(tensors.values())], groups, None)
    assert sent == [tensors["third"], tensors["fourth"]]
    made = ["first", "third"] if refused else ["first", "third", "fourth"]
    assert [id(p) for p in batches] == [id(tensors[n]) for n in made]
    assert {id(p) for p in forgotten} >= {id(tensors[n]) for n in made}
    assert host.returned == {id(tensors["second"])}
    # A later step: a master has states now, so a new one is not sent.
    optimizer.state[tensors["first"]]["step"] = torch.tensor(1.0)
    sent.clear()
    host.make_states(stepper, [[tensors["second"]]], groups, None)
    assert sent == []


@pytest.mark.parametrize("raised, told", [
    ("refused", True), ("out of memory", True), ("other", False)])
def test_moments_the_host_tier_or_the_device_cannot_take_are_left_to_adamw(
        monkeypatch, raised, told):
    """Note [States made where the CPUs step them]: a move the host tier refuses, or a batch
    the device has no room for, warns once and leaves the rest to AdamW from then on; any
    other error propagates. The step's cache forgets the masters either way."""
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc._library import ZeroallocError
    from zeroalloc.torch import _host_step
    errors = {"refused": ZeroallocError("the host tier cannot offload a chunk"),
              "out of memory": RuntimeError("zeroalloc_malloc: out of memory on sim:0"),
              "other": RuntimeError("an unrelated failure")}
    parameter = torch.nn.Parameter(torch.zeros(8))
    optimizer = torch.optim.AdamW([parameter])
    forgotten = []
    stepper = types.SimpleNamespace(
        optimizer=optimizer, masters=types.SimpleNamespace(working=lambda p: p),
        gradient=lambda p: p,
        forget=lambda parameters: forgotten.extend(parameters))

    def make_batch(self, stepper, batch, stream):
        raise errors[raised]

    monkeypatch.setattr(_host_step.HostStep, "gradient_steppable", lambda *_: True)
    monkeypatch.setattr(_host_step, "residency_or_foreign", lambda t: "host")
    monkeypatch.setattr(_host_step.HostStep, "room_for_buffers", lambda *_: True)
    monkeypatch.setattr(_host_step.HostStep, "make_batch", make_batch)
    host = _host_step.HostStep()
    groups = {id(parameter): optimizer.param_groups[0]}
    if told:
        with pytest.warns(UserWarning, match="the optimizer makes the rest on the device"):
            host.make_states(stepper, [[parameter]], groups, None)
        assert host.make_states_on_host is False
    else:
        with pytest.raises(RuntimeError, match="an unrelated failure"):
            host.make_states(stepper, [[parameter]], groups, None)
    assert forgotten == [parameter]


def test_a_step_boundary_waits_for_the_use_the_cpus_thread_holds_open(monkeypatch):
    """Note [A use the boundary waits for]: the host step's thread queues its copies back
    inside a held use. A step boundary on the main thread meanwhile waits until that use
    ends: closed under it, the engine could move the chunk while the copies were queued."""
    import threading
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc import _offload
    calls = []

    class Library:
        def __getattr__(self, name):
            return lambda *arguments: calls.append(name.replace("zeroalloc_", ""))

    monkeypatch.setattr(_offload, "library", lambda: Library())
    inside, release = threading.Event(), threading.Event()

    def copies_back():
        with _offload.use_held([4096], 7):
            inside.set()
            release.wait(10)

    cpus = threading.Thread(target=copies_back)
    cpus.start()
    assert inside.wait(10)
    boundary = threading.Thread(target=_offload.step_boundary)
    boundary.start()
    boundary.join(0.3)
    waited = boundary.is_alive()
    release.set()
    cpus.join(10)
    boundary.join(10)
    assert waited, calls
    assert calls == ["use_begins_many", "use_ends_many", "step_boundary"], calls


@pytest.mark.parametrize("value, expected", [(None, 512 << 20), ("64MiB", 64 << 20)])
def test_the_first_steps_estimate_counts_the_prefetch_headroom_the_variable_sets(
        monkeypatch, value, expected):
    """Note [The first step's room]: unless told otherwise, the estimate takes the headroom
    the engine keeps free from ZEROALLOC_PREFETCH_BYTES, or its default."""
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc.torch import _host_step
    if value is None:
        monkeypatch.delenv("ZEROALLOC_PREFETCH_BYTES", raising=False)
    else:
        monkeypatch.setenv("ZEROALLOC_PREFETCH_BYTES", value)
    masters = [device_master(number, 100 << 20) for number in range(4)]
    places = {id(m): "device" for m in masters}
    # Peak 202 MiB and 800 MiB of moments, under a limit of 1001 MiB and the headroom: the
    # device holds 1 MiB too few.
    monkeypatch.setattr(_host_step._stats, "raw_stats", lambda device: {
        "limit_bytes": (1001 << 20) + expected, "total": {"allocated_bytes": {"peak": 202 << 20}}})
    host = _host_step.HostStep()
    host.peak_before = 100 << 20
    assert [m.number for m in host.beyond_the_limit(masters, places)] == [3]
    host.headroom_bytes = 0  # without it, the moments fit
    assert host.beyond_the_limit(masters, places) == []


def test_a_use_on_the_default_stream_waits_there_for_the_cpus_copies(monkeypatch):
    """The forward runs on the default stream, whose handle is 0, and
    torch.cuda.ExternalStream(0) is a stream of PyTorch's pool, not the default one. The
    forward's wait for a window's copies landed there, and the forward read weights the CPUs'
    copies were still writing. The wait goes on the current stream; a handle of another
    stream is waited for on that stream."""
    sys.path.insert(0, str(PACKAGE))
    from zeroalloc.torch import _host_step

    current = types.SimpleNamespace(cuda_stream=0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    external = []
    monkeypatch.setattr(torch.cuda, "ExternalStream",
                        lambda handle, device=None: external.append(handle) or handle)
    assert _host_step.stream_of(0, 0) is current
    assert external == []
    assert _host_step.stream_of(0x5000, 0) == 0x5000 and external == [0x5000]
