"""Inference alone, under torch.inference_mode, on a model larger than the limit: its
weights move in and out of the device as each layer runs."""
import torch
from _common import batches, emit, llama

model = llama(layers=24).eval()  # 325 MB of weights under a 256 MiB limit
with torch.inference_mode():
    for step, tokens in enumerate(batches(3)):
        logits = model(tokens).logits
        emit(f"batch{step}", logits.float().sum().item(), logits.argmax(-1)[0, :8].tolist())
