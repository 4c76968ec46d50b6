"""How far under its peak a Hugging Face Trainer run trains through offload: the model of
tests/python/test_offload_trainer.py, first without zeroalloc (its peak of reserved device
memory), then under ZEROALLOC_MEMORY_LIMIT = that peak minus each margin, with overlap_bytes
0 and 2 GiB and gradient_class off and on (four runs at a time). Prints, per run, whether
it trained, what moved, and how far its losses are from the plain run's.

    python3 bench/python/trainer_limit_bench.py 48,96 [path/to/libzeroalloc.so]
"""
import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

PROGRAM = textwrap.dedent("""
    import json, os, sys, torch
    mode = sys.argv[2]
    if mode != "plain":
        import zeroalloc.torch as zt
        zt.install()
        zt.enable_automatic_offload(overlap_bytes=int(sys.argv[3]), gradient_class=sys.argv[4] == "1")
    from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=8000,
                         max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, 8000, (64, 256), generator=generator)]
    arguments = TrainingArguments(output_dir=sys.argv[1], max_steps=12,
                                  per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                  learning_rate=1e-3, max_grad_norm=1.0, bf16=True,
                                  logging_steps=1, report_to=[], save_strategy="no",
                                  dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=arguments, train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print("losses " + json.dumps(losses))
    if mode == "plain":
        print("peak " + str(torch.cuda.max_memory_reserved()) + " " + str(torch.cuda.max_memory_allocated()))
    else:
        import zeroalloc
        print("stats " + json.dumps(zeroalloc.raw_stats(0)))
""")


def run(library, name, mode, limit=None, overlap=2 << 30, gradient_class=False):
    """One training run in a fresh Python; mode "plain" runs without zeroalloc."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROALLOC_")}
    env["PYTHONPATH"] = os.path.join(ROOT, "bindings", "python")
    if mode != "plain":
        env.update(LD_PRELOAD=library, ZEROALLOC_OFFLOAD="host", ZEROALLOC_HOST_LIMIT="8GiB",
                   ZEROALLOC_DEVICE="cuda", ZEROALLOC_MEMORY_LIMIT=str(limit))
    command = [sys.executable, "-c", PROGRAM, f"/tmp/trainer-limit-{name}", mode, str(overlap),
               "1" if gradient_class else "0"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=500)


def printed(result, prefix):
    """What the run printed after `prefix`, or None."""
    for line in result.stdout.splitlines():
        if line.startswith(prefix + " "):
            return line[len(prefix) + 1:]
    return None


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    margins = [int(each) for each in sys.argv[1].split(",")]
    library = os.path.abspath(sys.argv[2] if len(sys.argv) > 2
                              else os.path.join(ROOT, "build", "libzeroalloc.so"))
    plain = run(library, "plain", "plain")
    if plain.returncode != 0:
        print(plain.stderr[-2000:], file=sys.stderr)
        return 1
    peak_reserved, peak_allocated = map(int, printed(plain, "peak").split())
    expected = json.loads(printed(plain, "losses"))
    print(f"plain: peak reserved {peak_reserved / 2**20:.1f} MiB, "
          f"allocated {peak_allocated / 2**20:.1f} MiB")
    cases = [(f"m{margin}-o{overlap >> 20}-g{int(gradients)}", peak_reserved - (margin << 20),
              overlap, gradients)
             for margin in margins for overlap in (0, 2 << 30) for gradients in (False, True)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda case: run(library, case[0], "limited", *case[1:]), cases))
    for (name, limit, _, _), result in zip(cases, results):
        if result.returncode != 0:
            why = [line for line in (result.stdout + result.stderr).splitlines()
                   if "out of memory" in line]
            print(f"{name}: limit {limit / 2**20:.1f} MiB: failed (exit {result.returncode}): "
                  + (why[-1] if why else result.stderr[-800:]))
            continue
        got = json.loads(printed(result, "losses"))
        moved = json.loads(printed(result, "stats"))["offload"]
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, expected))
        print(f"{name}: limit {limit / 2**20:.1f} MiB: trained; "
              f"{moved['bytes_to_host'] / 2**20:.1f} MiB to the host, "
              f"{moved['bytes_to_device'] / 2**20:.1f} MiB back, "
              f"{moved['pressure_evictions']} pressure evictions, "
              f"hit rate {moved['prefetch_hit_rate']:.3f}, "
              f"largest relative loss difference {worst:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
