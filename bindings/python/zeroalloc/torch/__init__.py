"""zeroalloc for PyTorch.

``install()`` makes zeroalloc PyTorch's CUDA allocator for the whole process (two lines in a
script); ``mem_pool()`` routes only the allocations made inside ``torch.cuda.use_mem_pool``
through zeroalloc and leaves PyTorch's own allocator, statistics and cudnn for the rest.
``offload(model, optimizer)`` lets zeroalloc page parameters and optimizer states between
device and pinned host memory; ``enable_automatic_offload()`` does it for every optimizer.

One concept per module:

- ``_swap``: the allocator swap (install, installed, mem_pool);
- ``_tensors``: one tensor's storage moved, or asked where it is;
- ``_model_offload``: offload(), the automatic mode and OffloadHandle, which put together
  ``_adoption`` (parameters, gradients and states moved into their allocation classes),
  ``_master_weights`` (bf16 working copies and their fp32 masters),
  ``_module_hints`` and ``_backward_uses`` (the hooks that send use hints through
  ``_use_hints`` and tell the windowed steps, ``_step_listeners``, how the loop goes),
  ``_optimizer_step`` (the optimizer's step in windows, over ``_step_records``) and
  ``_state_dict`` (its state_dict and load_state_dict), wrapped without a cycle by
  ``_weak_methods``;
- ``_settings``: the library's settings these read;
- ``_zero``: partition(), ZeRO stage 1 across a torchrun job's ranks, over the library's
  group (``zeroalloc._group``).

Design notes: Notes [Stepping states where they are], [Windows and buffers], [Overlapping
the step] and [Steps that follow param_groups] (_optimizer_step.py), Note [Host windows]
(_host_step.py), Note [Master weights] (_master_weights.py),
Note [Hint groups] (_module_hints.py), Notes [Backward uses] and [The backward reads what
autograd saved] (_backward_uses.py), Note [Gradients' class] (_adoption.py), Note [No
cycles through the optimizer] (_weak_methods.py), Note [Stage 1 by whole parameters]
(_zero.py).
"""

from __future__ import annotations

from zeroalloc._library import ZeroallocError, function_address, library_path
from zeroalloc._stats import allocation_class, raw_stats, room
from zeroalloc.torch._model_offload import OffloadHandle, enable_automatic_offload, offload
from zeroalloc.torch._optimizer_step import step_figures
from zeroalloc.torch._settings import gradient_class_default
from zeroalloc.torch._swap import install, installed, mem_pool
from zeroalloc.torch._tensors import fetch_tensor, offload_tensor, residency
from zeroalloc.torch._use_hints import using
from zeroalloc.torch._zero import Partition, partition

# The pieces under the names tests and benchmarks use to put them together by hand.
from zeroalloc import _offload
from zeroalloc.torch._adoption import adopt as _adopt
from zeroalloc.torch._adoption import adoptions as _adoptions
from zeroalloc.torch._adoption import gradient_into_class as _gradient_into_class
from zeroalloc.torch._adoption import is_paged_state as _is_paged_state
from zeroalloc.torch._adoption import move_into_class as _move_into_class
from zeroalloc.torch._backward_uses import backward_uses as _backward_uses
from zeroalloc.torch._module_hints import AutomaticHints as _AutomaticHints
from zeroalloc.torch._module_hints import install_hint_hooks as _install_hint_hooks
from zeroalloc.torch._optimizer_step import windowed_step as _windowed_step
from zeroalloc.torch._state_dict import readopt_after_load as _readopt_after_load
from zeroalloc.torch._step_listeners import windowed_steps as _windowed_steps
from zeroalloc.torch._use_hints import begin as _begin
from zeroalloc.torch._use_hints import end as _end
from zeroalloc.torch._use_hints import hint as _hint
from zeroalloc.torch._use_hints import pointers as _pointers
from zeroalloc.torch._weak_methods import original_of as _original_of

#: The post-accumulate-grad hook that ends a parameter's backward use (Note [Backward uses]).
_end_backward = _backward_uses.end

__all__ = [
    "OffloadHandle",
    "Partition",
    "ZeroallocError",
    "allocation_class",
    "enable_automatic_offload",
    "fetch_tensor",
    "function_address",
    "gradient_class_default",
    "install",
    "installed",
    "library_path",
    "mem_pool",
    "offload",
    "offload_tensor",
    "partition",
    "raw_stats",
    "residency",
    "room",
    "step_figures",
    "using",
]
