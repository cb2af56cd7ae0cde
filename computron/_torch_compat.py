"""The torch internals Computron relies on, each behind one small named function.

torch offers no public API for these, and each has held across the releases
Computron supports (``setup.py``: torch>=2.11). A torch upgrade that moves one
of them is fixed here, in one file.

- ``local_tensor``: a DTensor's local shard (``DTensor._local_tensor``); ``to_local()`` returns a new
  view through autograd, while the store rebinds, and the checkpoint reader finds, the very tensor
  object that holds the data.
- ``direct_tensors``, ``direct_tensor``, ``set_parameter``: a module's own parameters and buffers by
  attribute (``Module._parameters`` / ``_buffers``), including replacing a parameter without
  ``register_parameter``, which ``checkpoint.params_on_meta`` patches.
- ``map_tensors``: ``Module._apply``, what ``Module.to`` runs: a function over every parameter and
  buffer that keeps the ``Parameter`` objects and their ties.
- ``local_shape_and_offset``: a DTensor slice's shape and offset on any device mesh
  (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``).
- ``forward_hook_ids``, ``remove_forward_hooks_since``: removing the forward hooks some library registered
  on a module without handing out their handles (``parallelize_module``'s), by the ids in
  ``Module._forward_pre_hooks`` / ``_forward_hooks``.
- ``mark_loaded``: transformers' private ``_is_hf_initialized`` flag, which makes its weight initialisation
  skip a tensor (what ``from_pretrained`` sets on the weights it loaded).
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

import torch
from torch import nn


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds a parameter's data: the local shard of a DTensor, else ``t`` itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if inner is not None else t


def direct_tensors(module: nn.Module) -> Iterator[Tuple[str, torch.Tensor, bool]]:
    """``(attribute, tensor, is_parameter)`` of the parameters, then buffers, that ``module`` itself holds
    (not its children's; an attribute set to None is left out)."""
    for attr, t in list(module._parameters.items()):
        if t is not None:
            yield attr, t, True
    for attr, t in list(module._buffers.items()):
        if t is not None:
            yield attr, t, False


def direct_tensor(module: nn.Module, attr: str) -> Optional[torch.Tensor]:
    """The parameter, else the buffer, that ``module`` holds as ``attr`` (None when neither)."""
    if attr in module._parameters:
        return module._parameters[attr]
    return module._buffers.get(attr)


def set_parameter(module: nn.Module, attr: str, param: Optional[nn.Parameter]) -> None:
    """Make ``param`` the parameter ``module`` holds as ``attr``, bypassing ``register_parameter``."""
    module._parameters[attr] = param


def mark_loaded(t: torch.Tensor) -> torch.Tensor:
    """Flag ``t`` as loaded, so that transformers' weight initialisation leaves it alone."""
    t._is_hf_initialized = True
    return t


def map_tensors(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace every parameter's and buffer's data in ``module``'s tree by ``fn(tensor)``, as ``Module.to``
    does (parameters stay ``Parameter`` objects, tied ones stay one object where torch can keep them)."""
    module._apply(fn)


def local_shape_and_offset(t) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(local shape, global offset) of this rank's slice of the DTensor ``t``, on a mesh of any rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(shape), tuple(offset)


def forward_hook_ids(module: nn.Module) -> Tuple[frozenset, frozenset]:
    """The ids of the forward pre-hooks and forward hooks registered on ``module`` now."""
    return frozenset(module._forward_pre_hooks), frozenset(module._forward_hooks)


def remove_forward_hooks_since(module: nn.Module, before: Tuple[frozenset, frozenset]) -> None:
    """Remove the forward pre-hooks and hooks registered on ``module`` since ``before = forward_hook_ids(module)``."""
    for hooks, old in ((module._forward_pre_hooks, before[0]), (module._forward_hooks, before[1])):
        for hook_id in [h for h in hooks if h not in old]:
            del hooks[hook_id]
            for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                          "_forward_hooks_always_called"):
                getattr(module, extra, {}).pop(hook_id, None)


__all__ = ["local_tensor", "direct_tensors", "direct_tensor", "set_parameter", "map_tensors",
           "local_shape_and_offset", "forward_hook_ids", "remove_forward_hooks_since"]
