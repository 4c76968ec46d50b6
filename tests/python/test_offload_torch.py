"""Offload with PyTorch on the GPU (ZEROALLOC_OFFLOAD=host): kernels read and write a tensor
whose memory is on the host; a training run whose parameters and optimizer states go to the
host after every step computes the same losses, bit for bit, as one that keeps them on the
device; state_dict saving and loading round-trip while everything is offloaded.

    python3 -m pytest -s tests/python/test_offload_torch.py
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
SCRIPT = Path(__file__).with_name("train_small_transformer.py")
LIBRARY = Path(os.environ.get("ZEROALLOC_LIBRARY", ROOT / "build" / "libzeroalloc.so")).resolve()
STEPS = 30

torch = pytest.importorskip("torch", reason="skipped: PyTorch is not installed")
if not torch.cuda.is_available():
    pytest.skip("skipped: no CUDA GPU", allow_module_level=True)
if not LIBRARY.is_file():
    pytest.skip(f"skipped: {LIBRARY} is not built", allow_module_level=True)


def environment(**extra):
    env = {key: value for key, value in os.environ.items() if not key.startswith("ZEROALLOC_")}
    env.update({"ZEROALLOC_DEVICE": "cuda", "ZEROALLOC_OFFLOAD": "host",
                "ZEROALLOC_HOST_LIMIT": "16GiB", "ZEROALLOC_LIBRARY": str(LIBRARY),
                "PYTHONPATH": str(PACKAGE)})
    env.update(extra)
    return env


def run_python(code: str, **extra) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environment(**extra),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return result.stdout


def test_kernels_read_and_write_a_host_resident_tensor():
    out = run_python("""
        import torch, zeroalloc, zeroalloc.torch as zt
        zt.install()
        n = 16 << 20  # 64 MiB of float32
        with zeroalloc.allocation_class("parameter"):
            x = torch.arange(n, device="cuda", dtype=torch.float32)
        expected = torch.arange(n, device="cuda", dtype=torch.float32)
        zt.offload_tensor(x)
        assert zt.residency(x) == "host", zt.residency(x)
        doubled = x * 2                 # a kernel reading pinned host memory
        x.add_(1)                       # a kernel writing it
        x[:1000].mul_(3)                # and a view of it
        torch.cuda.synchronize()
        assert zt.residency(x) == "host"
        assert torch.equal(doubled, expected * 2)
        zt.fetch_tensor(x)
        assert zt.residency(x) == "device"
        want = expected + 1
        want[:1000] *= 3
        assert torch.equal(x, want)
        stats = zeroalloc.raw_stats()["offload"]
        print("moved", stats["bytes_to_host"], stats["bytes_to_device"])
    """)
    moved = out.split("moved")[1].split()
    assert int(moved[0]) >= 64 << 20 and int(moved[1]) >= 64 << 20


def test_state_dict_round_trip_while_offloaded(tmp_path):
    path = tmp_path / "checkpoint.pt"
    run_python(f"""
        import torch, zeroalloc.torch as zt
        zt.install()
        torch.manual_seed(0)
        def make():
            return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                       torch.nn.Linear(4096, 1024)).cuda()
        model = make()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(8, 1024, device="cuda")).sum().backward()
        optimizer.step()
        zt.offload(model, optimizer)
        reference = {{k: v.detach().clone() for k, v in model.state_dict().items()}}
        moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
        for p in model.parameters():
            zt.offload_tensor(p)
        for s in optimizer.state.values():
            zt.offload_tensor(s["exp_avg"]); zt.offload_tensor(s["exp_avg_sq"])
        # Parameters are parked (ZEROALLOC_PARK_PARAMETERS, on by default): on the host
        # behind unmapped addresses, which model.state_dict() copies to the CPU.
        assert all(zt.residency(p) in ("host", "host_unmapped") for p in model.parameters())
        torch.save({{"model": model.state_dict(), "optimizer": optimizer.state_dict()}},
                   "{path}")
        loaded = torch.load("{path}")
        fresh = make()
        fresh.load_state_dict(loaded["model"])
        for key, value in fresh.state_dict().items():
            assert torch.equal(value.cpu(), reference[key].cpu()), key
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        fresh_optimizer.load_state_dict(loaded["optimizer"])
        for got, want in zip([s["exp_avg"] for s in fresh_optimizer.state.values()], moments):
            assert torch.equal(got, want)
        # Loading into the offloaded model writes through to host memory.
        model.load_state_dict({{k: v + 1 for k, v in reference.items()}})
        for key, value in model.state_dict().items():
            assert torch.equal(value.cpu(), reference[key].cpu() + 1), key
        print("round trip ok")
    """)


# Two Linear(256, 256) in a block, and `begun`: how many allocations each use-begins call
# into the library carries (the hint groups' tests).
BLOCK_AND_COUNTER = """
        class Block(torch.nn.Module):  # two Linear(256, 256): 526,336 bytes
            def __init__(self):
                super().__init__()
                self.a, self.b = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)

            def forward(self, x):
                return self.b(torch.relu(self.a(x)))

        begun = []
        counting = _offload.use_begins_many
        _offload.use_begins_many = lambda pointers, stream=0: (
            begun.append(len(pointers)), counting(pointers, stream))[1]
"""


def test_a_layer_is_hinted_in_one_call_and_its_parts_called_alone_still_are():
    out = run_python("""
        import torch, zeroalloc, zeroalloc.torch as zt
        from zeroalloc import _offload
        zt.install()
""" + BLOCK_AND_COUNTER + """

        def hints(model, optimizer, **options):
            zt.offload(model, optimizer, **options)
            # An input that needs its gradient: every Linear's backward then reads its
            # weight (saved by autograd), never its bias, and only what autograd saved is
            # brought back for the backward (ZEROALLOC_BACKWARD_USES=saved, the default).
            x = torch.randn(4, 256, device="cuda", requires_grad=True)
            begun.clear()
            loss = model(x).sum()
            forward = list(begun)
            begun.clear()
            model[0].a(x)  # a part called outside its layer's forward
            alone = list(begun)
            begun.clear()
            loss.backward()
            backward = list(begun)
            optimizer.step()
            optimizer.zero_grad()
            in_use = zeroalloc.raw_stats(0)["offload"]["chunks_in_use"]
            return forward, alone, backward, in_use

        torch.manual_seed(0)
        model = torch.nn.Sequential(Block(), Block()).cuda()  # 1,052,672 bytes: two groups
        grouped = hints(model, torch.optim.AdamW(model.parameters()), hint_group_bytes=1 << 20)
        assert grouped == ([4, 4], [2], [2, 2], 0), grouped
        model = torch.nn.Sequential(Block(), Block()).cuda()
        leaves = hints(model, torch.optim.AdamW(model.parameters()), hint_group_bytes=0)
        assert leaves == ([2, 2, 2, 2], [2], [1, 1, 1, 1], 0), leaves
        print("hint groups ok")
    """)
    assert "hint groups ok" in out


def test_the_automatic_mode_groups_hints_the_same_way():
    out = run_python("""
        import torch, zeroalloc, zeroalloc.torch as zt
        from zeroalloc import _offload
        zt.install()
        zt.enable_automatic_offload(hint_group_bytes=1 << 20)
""" + BLOCK_AND_COUNTER + """
        torch.manual_seed(0)
        model = torch.nn.Sequential(Block(), Block()).cuda()
        # The backward reads each Linear's weight, saved by autograd (the input needs its
        # gradient), never its bias: only those come back for it.
        x = torch.randn(4, 256, device="cuda", requires_grad=True)
        model(x).sum().backward()  # before the optimizer: nothing adopted, nothing hinted
        assert begun == [], begun
        optimizer = torch.optim.AdamW(model.parameters())  # adopts
        model.zero_grad()
        loss = model(x).sum()
        forward = list(begun)
        begun.clear()
        model[0].a(x)
        alone = list(begun)
        begun.clear()
        loss.backward()
        backward = list(begun)
        optimizer.step()
        try:
            model(torch.randn(4, 3, device="cuda"))  # a forward that fails part-way
        except RuntimeError:
            pass
        begun.clear()
        model[0].a(x)  # the failed forward's group is over: a part alone hints itself
        after_failure = list(begun)
        begun.clear()
        with torch.no_grad():
            model(x)
        again = list(begun)
        in_use = zeroalloc.raw_stats(0)["offload"]["chunks_in_use"]
        assert (forward, alone, backward, after_failure, again, in_use) == (
            [4, 4], [2], [2, 2], [2], [4, 4], 0), (
            forward, alone, backward, after_failure, again, in_use)
        print("automatic hint groups ok")
    """)
    assert "automatic hint groups ok" in out


def train(offload: str, *extra: str) -> list:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--allocator", "zeroalloc", "--steps", str(STEPS),
         "--library", str(LIBRARY), "--offload", offload, *extra],
        env=environment(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    stats = [line for line in result.stdout.splitlines() if line.startswith("stats ")]
    return ([line for line in result.stdout.splitlines() if line.startswith("loss ")],
            json.loads(stats[0][len("stats "):]) if stats else {})


def test_losses_with_everything_offloaded_after_each_step_equal_the_device_run():
    on_device, _ = train("off")
    hooked, hooked_stats = train("hooks")
    offloaded, stats = train("every-step")
    assert len(on_device) == STEPS
    assert hooked == on_device, "offload hooks changed the numbers"
    assert offloaded == on_device, "offloading changed the numbers"
    figures = stats["offload"]
    print(f"every-step offload over {STEPS} steps: {figures['bytes_to_host'] >> 20} MiB to "
          f"the host, {figures['bytes_to_device'] >> 20} MiB back; uses {figures['uses']}, "
          f"prefetch hit rate {figures['prefetch_hit_rate']:.2f}, device waited "
          f"{figures['device_waited_ns'] / 1e6:.1f} ms, host waited "
          f"{figures['host_waited_ns'] / 1e6:.1f} ms")
    assert figures["bytes_to_host"] > 0 and figures["bytes_to_device"] > 0
    assert figures["steps"] == STEPS
    assert hooked_stats["offload"]["uses"] > 0


def test_gradients_in_their_class_train_bit_for_bit(tmp_path):
    """Note [Gradients' class]: with gradient_class=True each parameter's gradient lives in
    the gradient class (copied there once a step); the numbers are those of the run on the
    device, also with everything offloaded after each step."""
    on_device, _ = train("off")
    hooked, stats = train("every-step", "--gradient-class")
    assert hooked == on_device, "gradients in their class changed the numbers"
    gradients = stats["classes"]["gradient"]["allocated_bytes"]["peak"]
    print(f"gradient class: peak {gradients >> 20} MiB allocated")
    assert gradients > 0


def test_environment_alone_offloads_an_unmodified_script(tmp_path):
    """ZEROALLOC_OFFLOAD=host with the package installed (its start-up hook in site-packages)
    and the library preloaded: the unmodified script (PyTorch's own allocator as far as it
    knows) trains with zeroalloc as its allocator, its optimizer's parameters and states
    managed by the offload engine and hinted by global module hooks; same losses."""
    import shutil
    shutil.copy(PACKAGE / "zeroalloc-startup.pth", tmp_path)
    shutil.copytree(PACKAGE / "zeroalloc", tmp_path / "zeroalloc",
                    ignore=shutil.ignore_patterns("__pycache__"))
    arguments = [str(SCRIPT), "--allocator", "native", "--steps", str(STEPS)]
    plain = subprocess.run([sys.executable, *arguments], capture_output=True, text=True,
                           timeout=900, env={k: v for k, v in os.environ.items()
                                             if not k.startswith("ZEROALLOC_")})
    assert plain.returncode == 0, plain.stderr[-3000:]
    env = environment(LD_PRELOAD=str(LIBRARY))
    env.pop("PYTHONPATH")  # the package comes from the site directory, as when installed
    offloaded = subprocess.run(
        [sys.executable, "-c",
         "import runpy, site, sys; site.addsitedir(sys.argv[1]); sys.argv = sys.argv[2:]; "
         "runpy.run_path(sys.argv[0], run_name='__main__')", str(tmp_path), *arguments],
        env=env, capture_output=True, text=True, timeout=900)
    assert offloaded.returncode == 0, offloaded.stdout[-2000:] + offloaded.stderr[-3000:]
    losses = [line for line in plain.stdout.splitlines() if line.startswith("loss ")]
    assert len(losses) == STEPS
    assert [line for line in offloaded.stdout.splitlines() if line.startswith("loss ")] == losses
    stats = json.loads([line for line in offloaded.stdout.splitlines()
                        if line.startswith("stats ")][0][len("stats "):])
    assert stats["classes"]["parameter"]["allocated_bytes"]["peak"] > 0, "parameters not adopted"
    assert stats["classes"]["optimizer_state"]["allocated_bytes"]["peak"] > 0
    assert stats["offload"]["uses"] > 0 and stats["offload"]["steps"] == STEPS
