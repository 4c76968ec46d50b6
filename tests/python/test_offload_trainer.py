"""Offload under a Hugging Face Trainer, with no line of the training script changed
(ZEROALLOC_OFFLOAD=host and the package's start-up hook), and with autocast, gradient
accumulation and gradient clipping as the Trainer does them: the losses follow those of
a run without zeroalloc (within a tolerance: the Trainer's kernels are not all
deterministic), and the offload engine saw the steps; and the same under a
ZEROALLOC_MEMORY_LIMIT below the plain run's peak, where states must move to the host.

    python3 -m pytest -s tests/python/test_offload_trainer.py
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "python"
LIBRARY = Path(os.environ.get("ZEROALLOC_LIBRARY", ROOT / "build" / "libzeroalloc.so")).resolve()
STEPS = 12

torch = pytest.importorskip("torch", reason="skipped: PyTorch is not installed")
pytest.importorskip("transformers", reason="skipped: transformers is not installed")
if not torch.cuda.is_available():
    pytest.skip("skipped: no CUDA GPU", allow_module_level=True)
if not LIBRARY.is_file():
    pytest.skip(f"skipped: {LIBRARY} is not built", allow_module_level=True)

TRAINING = textwrap.dedent(f"""
    import json, sys, torch
    from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=8000,
                         max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    data = [{{"input_ids": ids, "labels": ids}}
            for ids in torch.randint(0, 8000, (64, 256), generator=generator)]
    arguments = TrainingArguments(output_dir=sys.argv[1], max_steps={STEPS},
                                  per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                  learning_rate=1e-3, max_grad_norm=1.0, bf16=True,
                                  logging_steps=1, report_to=[], save_strategy="no",
                                  dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=arguments, train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print("losses " + json.dumps(losses))
    import ctypes
    preloaded = ctypes.CDLL(None)
    if hasattr(preloaded, "zeroalloc_stats_json"):
        import zeroalloc
        print("stats " + json.dumps(zeroalloc.raw_stats(0)))
    else:
        print("peak " + json.dumps(torch.cuda.max_memory_reserved()))
""")


def train(tmp_path, name: str, **environment) -> subprocess.CompletedProcess:
    """Runs TRAINING in a fresh Python with the package's start-up hook on its path and no
    ZEROALLOC_* variable but those given."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("ZEROALLOC_")}
    env.pop("PYTHONPATH", None)
    env.update(environment)
    site = tmp_path / "site"
    if not site.exists():
        site.mkdir()
        shutil.copy(PACKAGE / "zeroalloc-startup.pth", site)
        shutil.copytree(PACKAGE / "zeroalloc", site / "zeroalloc",
                        ignore=shutil.ignore_patterns("__pycache__"))
    program = ("import runpy, site, sys; site.addsitedir(sys.argv[1]); "
               "exec(compile(sys.argv[3], 'train', 'exec'))")
    result = subprocess.run([sys.executable, "-c", program, str(site), str(tmp_path / name),
                             TRAINING], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def figures(result, prefix):
    line = [line for line in result.stdout.splitlines() if line.startswith(prefix + " ")][0]
    return json.loads(line[len(prefix) + 1:])


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The run without zeroalloc: its losses and its peak of reserved device memory."""
    return train(tmp_path_factory.mktemp("plain"), "plain")


def check_losses(got, expected):
    assert len(got) == len(expected) == STEPS
    for step, (a, b) in enumerate(zip(got, expected)):
        assert abs(a - b) <= 2e-2 * abs(b) + 1e-3, f"step {step}: {a} vs {b}"


def test_trainer_with_offload_from_the_environment_alone(tmp_path, plain):
    offloaded = train(tmp_path, "offloaded", LD_PRELOAD=str(LIBRARY), ZEROALLOC_OFFLOAD="host",
                      ZEROALLOC_HOST_LIMIT="8GiB", ZEROALLOC_DEVICE="cuda")
    got = figures(offloaded, "losses")
    check_losses(got, figures(plain, "losses"))
    stats = figures(offloaded, "stats")
    print(f"Trainer under offload: {stats['offload']['uses']} use hints, "
          f"{stats['offload']['steps']} steps; losses {got[0]:.4f} -> {got[-1]:.4f}")
    assert stats["offload"]["steps"] == STEPS
    assert stats["classes"]["optimizer_state"]["allocated_bytes"]["peak"] > 0


def test_trainer_under_a_limit_below_its_peak_moves_states_and_keeps_its_losses(tmp_path, plain):
    # 48 MiB under the plain run's 672 MiB (on an H200): the states of this small model
    # (168 MB) must go to the host in part. Far lower, the optimizer states no longer make
    # room alone: gradients in their class, then idle activations, move as last resorts.
    limit = figures(plain, "peak") - (48 << 20)
    offloaded = train(tmp_path, "limited", LD_PRELOAD=str(LIBRARY), ZEROALLOC_OFFLOAD="host",
                      ZEROALLOC_HOST_LIMIT="8GiB", ZEROALLOC_DEVICE="cuda",
                      ZEROALLOC_MEMORY_LIMIT=str(limit))
    got = figures(offloaded, "losses")
    check_losses(got, figures(plain, "losses"))
    stats = figures(offloaded, "stats")
    moved = stats["offload"]
    print(f"Trainer under a limit of {limit / 2**20:.0f} MiB: {moved['bytes_to_host'] / 2**20:.0f} "
          f"MiB to the host, {moved['bytes_to_device'] / 2**20:.0f} MiB back, prefetch hit rate "
          f"{moved['prefetch_hit_rate']:.3f}; losses {got[0]:.4f} -> {got[-1]:.4f}")
    assert stats["offload"]["steps"] == STEPS
    assert moved["bytes_to_host"] > 0 and moved["bytes_to_device"] > 0
    assert stats["limit_bytes"] == limit  # the limit was in force
