"""What the user programs share: a small transformers Llama built the same way in every run,
batches of tokens, and the lines a program prints for the comparison (each value exact: a
float's repr, a tensor's bytes hashed)."""

import hashlib
import os
import socket

import torch

torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

VOCAB = 4096
#: Where the programs run: cuda, or cpu to check a program's own logic on a machine without
#: a GPU (PROGRAMS_DEVICE=cpu; the comparison under offload needs cuda).
DEVICE = os.environ.get("PROGRAMS_DEVICE", "cuda")


def llama(layers: int = 4, hidden: int = 512, tie: bool = False, seed: int = 0, **overrides):
    """A Llama from transformers with eager attention (its backward is deterministic)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=512, tie_word_embeddings=tie,
                         attn_implementation="eager", **overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(DEVICE)


def batches(count: int, batch: int = 4, length: int = 128, seed: int = 1) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, length), generator=generator).to(DEVICE)
            for _ in range(count)]


def digest(tensor: "torch.Tensor") -> str:
    """The tensor's bytes, hashed (its device and dtype beside them)."""
    data = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
    return f"{tensor.device.type}:{tensor.dtype}:{hashlib.sha256(data).hexdigest()[:16]}"


def emit(name: str, *values) -> None:
    """One line of the comparison: `name` and the exact values."""
    shown = [digest(v) if torch.is_tensor(v) else repr(v) for v in values]
    print(name, " ".join(shown), flush=True)


def model_digest(model) -> str:
    return hashlib.sha256("".join(digest(p) for p in model.parameters()).encode()).hexdigest()[:16]


def one_rank_group() -> None:
    """A process group of this process alone, on a free local port (NCCL on the GPU, gloo
    on the CPU), as a script run without torchrun sets one up."""
    import torch.distributed as dist
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
