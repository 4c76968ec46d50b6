"""The start-up hook (zeroalloc-startup.pth): installed into site-packages, it lets
environment variables alone switch an unmodified script to zeroalloc. Here a stand-in
`torch` records what is done to it, so the test needs neither PyTorch nor a GPU; the real
thing runs on the GPU machine in test_preload_torch.py."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "python"
LIBRARY = Path(os.environ.get("ZEROALLOC_LIBRARY", ROOT / "build" / "libzeroalloc.so"))

if not LIBRARY.is_file():
    pytest.skip(f"skipped: {LIBRARY} is not built", allow_module_level=True)

# A stand-in for torch with the pluggable-allocator API that zeroalloc.torch.install() uses.
FAKE_TORCH = textwrap.dedent('''
    import types
    calls = []

    class _Hooks:
        def __getattr__(self, name):
            return lambda address: calls.append((name, address))

    class CUDAPluggableAllocator:
        def __init__(self, path, alloc, free):
            calls.append(("CUDAPluggableAllocator", path, alloc, free))
            self._hooks = _Hooks()
        def allocator(self):
            return self._hooks

    def change_current_allocator(allocator):
        calls.append(("change_current_allocator",))

    cuda = types.SimpleNamespace(
        is_initialized=lambda: False,
        memory=types.SimpleNamespace(CUDAPluggableAllocator=CUDAPluggableAllocator,
                                     change_current_allocator=change_current_allocator))

    def _global_hook(kind):
        return lambda hook, **options: calls.append((kind,))

    class Optimizer:
        def __init__(self, params, defaults):
            self.param_groups, self.state = [], {}

    class Module:
        def state_dict(self, *args, **kwargs):
            return {}

    nn = types.SimpleNamespace(Module=Module, modules=types.SimpleNamespace(
        module=types.SimpleNamespace(
            register_module_forward_pre_hook=_global_hook("register_module_forward_pre_hook"),
            register_module_forward_hook=_global_hook("register_module_forward_hook"))))
    optim = types.SimpleNamespace(Optimizer=Optimizer)
''')

PROGRAM = textwrap.dedent('''
    import site, sys
    site.addsitedir(sys.argv[1])  # what Python does for site-packages at start-up
    sys.path.insert(0, sys.argv[2])  # the stand-in torch, ahead of any real one
    started = "zeroalloc._startup" in sys.modules
    import torch
    print("startup", started)
    print("optimizer init", torch.optim.Optimizer.__init__.__qualname__ if hasattr(torch, "optim")
          else "-")
    print("state_dict copies off disk", hasattr(torch, "nn") and
          getattr(torch.nn.Module.state_dict, "_zeroalloc_copies_off_disk", False))
    for call in torch.calls:
        print("call", *call)
''')


# What transformers does before it imports torch: asks whether torch is there.
PROBING = PROGRAM.replace("import torch\n",
                          "import importlib.util\n"
                          "assert importlib.util.find_spec('torch') is not None\n"
                          "import torch\n", 1)


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory):
    """A site directory as pip leaves it: the .pth file and the package, plus fake torch."""
    root = tmp_path_factory.mktemp("site")
    shutil.copy(PACKAGE / "zeroalloc-startup.pth", root)
    shutil.copytree(PACKAGE / "zeroalloc", root / "zeroalloc",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "fake" / "torch").mkdir(parents=True)
    (root / "fake" / "torch" / "__init__.py").write_text(FAKE_TORCH)
    return root


def run(site_dir, program=PROGRAM, **environment):
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("ZEROALLOC_") and key != "LD_PRELOAD"}
    env.update({"ZEROALLOC_LIBRARY": str(LIBRARY), "ZEROALLOC_DEVICE": "sim", **environment})
    result = subprocess.run([sys.executable, "-c", program, str(site_dir), str(site_dir / "fake")],
                            env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result


def test_zeroalloc_torch_makes_zeroalloc_pytorchs_allocator_at_import(site_dir):
    result = run(site_dir, ZEROALLOC_TORCH="zeroalloc")
    lines = result.stdout.splitlines()
    assert "startup True" in lines
    assert f"call CUDAPluggableAllocator {LIBRARY} zeroalloc_torch_malloc zeroalloc_free" in lines
    setters = sorted(line.split()[1] for line in lines if line.startswith("call set_"))
    assert setters == ["set_init_fn", "set_memory_fraction_fn", "set_record_stream_fn",
                       "set_reset_fn"]
    assert all(int(line.split()[2]) != 0 for line in lines if line.startswith("call set_"))
    assert lines[-1] == "call change_current_allocator"


def test_a_lookup_of_torch_that_imports_nothing_does_not_use_the_hook_up(site_dir):
    assert PROBING != PROGRAM
    result = run(site_dir, program=PROBING, ZEROALLOC_TORCH="zeroalloc")
    assert result.stdout.splitlines()[-1] == "call change_current_allocator", result.stdout


def test_preloaded_library_is_the_one_pytorch_gets(site_dir):
    result = run(site_dir, ZEROALLOC_TORCH="zeroalloc", LD_PRELOAD=str(LIBRARY),
                 ZEROALLOC_LIBRARY="/nonexistent/libzeroalloc.so")
    assert f"call CUDAPluggableAllocator {LIBRARY} zeroalloc_torch_malloc zeroalloc_free" in \
        result.stdout.splitlines()


def test_preload_alone_keeps_pytorchs_allocator_on_top(site_dir):
    result = run(site_dir, LD_PRELOAD=str(LIBRARY))
    assert "startup True" in result.stdout.splitlines()
    assert "change_current_allocator" not in result.stdout


def test_nothing_happens_without_preload_or_variable(site_dir):
    result = run(site_dir)
    assert "startup False" in result.stdout.splitlines()
    assert "call" not in result.stdout


def test_disable_turns_the_hook_off(site_dir):
    result = run(site_dir, ZEROALLOC_TORCH="zeroalloc", ZEROALLOC_DISABLE="1")
    assert "startup False" in result.stdout.splitlines()
    assert "change_current_allocator" not in result.stdout


def test_a_bad_value_is_named_and_python_still_starts(site_dir):
    result = run(site_dir, ZEROALLOC_TORCH="zeroaloc")
    assert "ZEROALLOC_TORCH='zeroaloc' is not valid: use one of native|zeroalloc" in result.stderr
    assert "change_current_allocator" not in result.stdout


def test_zeroalloc_offload_alone_installs_and_hooks_every_module_and_optimizer(site_dir):
    result = run(site_dir, ZEROALLOC_OFFLOAD="host", ZEROALLOC_HOST_LIMIT="64MiB")
    lines = result.stdout.splitlines()
    assert "call change_current_allocator" in lines  # offload needs zeroalloc under PyTorch
    assert "call register_module_forward_pre_hook" in lines
    assert "call register_module_forward_hook" in lines
    # Parameters on the NVMe tier come out of every model's state_dict as CPU copies.
    assert "state_dict copies off disk True" in lines
    # Optimizers created from now on are adopted by the offload engine.
    assert any(line.startswith("optimizer init enable_automatic_offload") for line in lines), lines
