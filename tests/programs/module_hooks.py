"""Hooks a user adds to modules: a forward pre-hook that logs a weight's norm, a forward hook
that scales an output, a full backward hook that clips the gradient flowing out of a
layer, and a hook added mid-run and removed again."""
import torch
from _common import batches, emit, llama

model = llama()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
norms = []
first = model.model.layers[0]
first.self_attn.q_proj.register_forward_pre_hook(
    lambda module, inputs: norms.append(module.weight.norm().item()))
model.model.layers[1].mlp.register_forward_hook(lambda module, inputs, output: output * 0.5)
model.model.layers[2].register_full_backward_hook(
    lambda module, grad_input, grad_output: tuple(
        g.clamp(-1e-3, 1e-3) if g is not None else None for g in grad_input))
added = None
for step, tokens in enumerate(batches(4)):
    if step == 1:
        added = model.lm_head.register_forward_hook(
            lambda module, inputs, output: output + module.weight[0].sum())
    if step == 3:
        added.remove()
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item(), norms[-1])
