#!/usr/bin/env python3
"""Train a small decoder-only transformer deterministically on one GPU.

Run it once with PyTorch's native allocator and once with zeroalloc swapped in: the loss
lines (`loss <step> <float.hex>`) must be identical bit for bit, because an allocator may
change where tensors live but never what the kernels compute. With zeroalloc the library's
statistics are printed last, on one line prefixed "stats ".

    python3 tests/python/train_small_transformer.py --allocator zeroalloc --steps 50 \
        --library build/libzeroalloc.so
"""

import argparse
import ctypes
import math
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

VOCAB = 8192
LAYERS = 4
D_MODEL = 512
HEADS = 8
SEQ_LEN = 256
BATCH = 8
EMPTY_CACHE_STEP_FRACTION = 0.5


def default_library() -> str:
    return os.environ.get("ZEROALLOC_LIBRARY") or str(REPO_ROOT / "build" / "libzeroalloc.so")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocator", choices=("native", "zeroalloc"), required=True)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--offload", choices=("off", "hooks", "every-step"), default="off",
                        help="hooks: zeroalloc.torch.offload(model, optimizer); every-step: "
                             "also move every parameter and optimizer state to the host "
                             "after each step (needs ZEROALLOC_OFFLOAD=host)")
    parser.add_argument("--gradient-class", action="store_true",
                        help="with --offload: zt.offload(..., gradient_class=True)")
    parser.add_argument("--library", default=default_library(),
                        help="path of libzeroalloc.so (default: $ZEROALLOC_LIBRARY or "
                             "<repo>/build/libzeroalloc.so)")
    return parser.parse_args()


def install_zeroalloc(library_path: str) -> ctypes.CDLL:
    """Makes zeroalloc, loaded from `library_path`, serve every CUDA allocation of this
    process, through the package's installer (zeroalloc.torch.install): PyTorch allows the
    swap only before CUDA is initialised, and only once per process. Returns the library."""
    sys.path.insert(0, str(REPO_ROOT / "bindings" / "python"))
    os.environ["ZEROALLOC_LIBRARY"] = library_path  # the library this process runs on
    import zeroalloc
    import zeroalloc.torch as zt
    zt.install()
    return zeroalloc.library()


def stats_json(library: ctypes.CDLL, device: int) -> str:
    library.zeroalloc_stats_json.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    library.zeroalloc_stats_json.restype = ctypes.c_int
    library.zeroalloc_last_error.restype = ctypes.c_char_p
    length = library.zeroalloc_stats_json(device, None, 0)
    if length < 0:
        raise RuntimeError("zeroalloc_stats_json failed: "
                           + library.zeroalloc_last_error().decode(errors="replace"))
    buffer = ctypes.create_string_buffer(length + 1)
    library.zeroalloc_stats_json(device, buffer, length + 1)
    # One line, so that a reader can pick it out of the output by its prefix.
    return buffer.value.decode(errors="replace").replace("\n", " ")


def build_model(torch):
    nn = torch.nn
    functional = torch.nn.functional

    class CausalSelfAttention(nn.Module):
        # Written out rather than through scaled_dot_product_attention: the fused kernels'
        # backward passes are not all deterministic, and this test needs bit-exact runs.
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
            self.out = nn.Linear(D_MODEL, D_MODEL)
            mask = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool).triu(1)
            self.register_buffer("future", mask, persistent=False)

        def forward(self, x):
            batch, length, _ = x.shape
            head_dim = D_MODEL // HEADS
            q, k, v = (self.qkv(x).view(batch, length, 3, HEADS, head_dim)
                       .permute(2, 0, 3, 1, 4).unbind(0))
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
            scores = scores.masked_fill(self.future[:length, :length], float("-inf"))
            context = scores.softmax(dim=-1) @ v
            return self.out(context.transpose(1, 2).reshape(batch, length, D_MODEL))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm_attention = nn.LayerNorm(D_MODEL)
            self.attention = CausalSelfAttention()
            self.norm_mlp = nn.LayerNorm(D_MODEL)
            self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(),
                                     nn.Linear(4 * D_MODEL, D_MODEL))

        def forward(self, x):
            x = x + self.attention(self.norm_attention(x))
            return x + self.mlp(self.norm_mlp(x))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(VOCAB, D_MODEL)
            self.positions = nn.Embedding(SEQ_LEN, D_MODEL)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.norm = nn.LayerNorm(D_MODEL)
            self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

        def forward(self, tokens):
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.tokens(tokens) + self.positions(positions)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    def loss_of(model, batch):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = model(inputs)
        return functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    return Decoder(), loss_of


def synthetic_batch(torch, generator):
    """Arithmetic token sequences with 10% noise: learnable, so the loss falls."""
    starts = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
    strides = torch.randint(1, 17, (BATCH, 1), generator=generator)
    sequence = (starts + strides * torch.arange(SEQ_LEN + 1)) % VOCAB
    noise = torch.randint(0, VOCAB, sequence.shape, generator=generator)
    noisy = torch.rand(sequence.shape, generator=generator) < 0.1
    return torch.where(noisy, noise, sequence).pin_memory()


def main() -> int:
    args = parse_args()
    # cuBLAS reads this when it creates its handle; it must be set before any CUDA work.
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    # Our own variable, not the library's: the library may reject ZEROALLOC_* names it
    # does not know, so it must not see this one.
    os.environ.pop("ZEROALLOC_LIBRARY", None)

    import torch

    library = None
    if args.allocator == "zeroalloc":
        library_path = str(Path(args.library).resolve())
        if not Path(library_path).is_file():
            print(f"error: {library_path} does not exist", file=sys.stderr)
            return 2
        library = install_zeroalloc(library_path)

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    # Exercises the memory-fraction hook; far above what this model needs.
    torch.cuda.set_per_process_memory_fraction(0.9, device)

    # Built on the CPU so that the initial weights come from the CPU generator alone.
    model, loss_of = build_model(torch)
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    zt = None
    if args.offload != "off":
        import zeroalloc.torch as zt  # installed by install_zeroalloc
        zt.offload(model, optimizer, gradient_class=args.gradient_class)

    def offload_everything():
        for parameter in model.parameters():
            zt.offload_tensor(parameter, wait=False)
        for state in optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.is_cuda:
                    zt.offload_tensor(value, wait=False)

    generator = torch.Generator(device="cpu").manual_seed(1234)
    compute_stream = torch.cuda.current_stream(device)
    copy_stream = torch.cuda.Stream(device)

    def prefetch():
        # The batch is allocated on the copy stream and used on the compute stream, as a
        # data loader with a side stream does: record_stream keeps its memory from being
        # reused until the compute stream has finished with it.
        host_batch = synthetic_batch(torch, generator)
        with torch.cuda.stream(copy_stream):
            return host_batch.to(device, non_blocking=True)

    empty_cache_step = max(1, int(args.steps * EMPTY_CACHE_STEP_FRACTION))
    started = time.perf_counter()
    next_batch = prefetch()
    last_loss = float("nan")
    for step in range(args.steps):
        compute_stream.wait_stream(copy_stream)
        batch = next_batch
        batch.record_stream(compute_stream)
        if step + 1 < args.steps:
            next_batch = prefetch()  # overlaps this step's compute

        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if args.offload == "every-step":
            offload_everything()
        del batch

        last_loss = loss.item()
        print(f"loss {step} {float.hex(last_loss)}", flush=True)
        if step == empty_cache_step:
            torch.cuda.empty_cache()

    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    summary = (f"summary allocator={args.allocator} steps={args.steps} "
               f"seconds={seconds:.3f} final_loss={last_loss:.6f}")
    if library is None:
        try:
            summary += (f" peak_allocated_bytes={torch.cuda.max_memory_allocated(device)}"
                        f" peak_reserved_bytes={torch.cuda.max_memory_reserved(device)}")
        except RuntimeError:
            # PyTorch's statistics raise under a swapped allocator (ZEROALLOC_TORCH=zeroalloc
            # swaps it behind this script's back), which is why zeroalloc has its own.
            pass
    print(summary, flush=True)
    if library is not None:
        print("stats " + stats_json(library, device.index), flush=True)
    else:
        # Under LD_PRELOAD=libzeroalloc.so the library is in the process without a line of
        # this script knowing it: PyTorch's allocator then takes its segments from zeroalloc.
        preloaded = ctypes.CDLL(None)
        if hasattr(preloaded, "zeroalloc_stats_json"):
            print("stats " + stats_json(preloaded, device.index), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
