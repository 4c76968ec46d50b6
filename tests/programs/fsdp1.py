"""FSDP1 on one rank: FullyShardedDataParallel wrapping each decoder layer, which frees and
resizes its parameters' storage around every forward and backward, three steps."""
import functools

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from _common import DEVICE, batches, emit, llama, one_rank_group

one_rank_group()
policy = functools.partial(transformer_auto_wrap_policy,
                           transformer_layer_cls={LlamaDecoderLayer})
model = FullyShardedDataParallel(llama(), auto_wrap_policy=policy,
                                 device_id=torch.device(DEVICE, 0) if DEVICE == "cuda" else None)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, tokens in enumerate(batches(3)):
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item())
with FullyShardedDataParallel.summon_full_params(model):
    emit("weights", torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
dist.destroy_process_group()
