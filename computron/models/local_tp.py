"""Column- and row-parallel Linears that run on their local shards, outside DTensor's dispatch.

``parallelize_module`` does two things: it splits the weights into DTensor parameters (whose layouts the
checkpoint reader, the shard store and the LoRA slices read), and it wraps every split module's forward
in hooks that turn its input and output into DTensors, so that each call goes through DTensor's
dispatch: placement checks, sharding propagation, a redistribution per output. For a Linear that is
pure overhead: a column-parallel one is a matmul on its local rows, a row-parallel one a matmul on its
local columns and one all-reduce. On this 2-core CPU a TP=2 decode step of opt-125m took 1.37x as long
through DTensor's dispatch as on local shards, 4x under ``inference_mode`` (``benchmarks/tp_forward.py``);
on a GPU it is host time per Linear that a decode step of milliseconds cannot hide.

``split_linears`` keeps the split and replaces the wrapping: the plan entries that are plain
``ColwiseParallel()`` / ``RowwiseParallel()`` on an ``nn.Linear`` (default layouts, local outputs) lose the
hooks ``parallelize_module`` added and become a ``ColumnParallelLinear`` / ``RowParallelLinear`` (a class
swap: the same module object, parameters and all, so nothing that holds it or its tensors notices), whose
forward reads ``local_tensor(weight)`` at each call (the store rebinds that very tensor's data on each
load). Entries of any other kind, a pattern, or a module that is no plain Linear keep DTensor's path, and
so does the whole plan where one of its entries may hand a DTensor on.
Inputs and outputs are what the hooks made of them: a column-parallel Linear takes the whole input and
returns its slice of the output features, a row-parallel one takes its slice of the input features and
returns the whole output. Their matmul is ``kernels.cpu.linear.linear``'s (``F.linear``, but on a packed weight or,
for a few rows on a multi-threaded CPU, weight-first).
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch.distributed as dist
from torch import nn

from .._torch_compat import forward_hook_ids, local_tensor, remove_forward_hooks_since
from ..kernels.cpu import linear as cpu_linear


class ColumnParallelLinear(nn.Linear):
    """A Linear whose weight (and bias) are split by output features: its slice of the outputs."""

    uses_cpu_linear = True
    pack_weights = False

    def forward(self, x):
        bias = self.bias
        return cpu_linear.linear(x, local_tensor(self.weight), None if bias is None else local_tensor(bias), self)


class RowParallelLinear(nn.Linear):
    """A Linear whose weight is split by input features: its slice of the inputs in, the whole output out
    (the partial products summed over ``tp_group``, the bias, whole on every rank, added once)."""

    tp_group = None
    uses_cpu_linear = True
    pack_weights = False

    def forward(self, x):
        y = cpu_linear.linear(x, local_tensor(self.weight), holder=self)
        dist.all_reduce(y, group=self.tp_group)
        if self.bias is not None:
            y = y + local_tensor(self.bias)
        return y


def _local_class(style):
    """The class a plain Linear split by ``style`` becomes, or None where DTensor's path stays."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    if not getattr(style, "use_local_output", False):
        return None
    layouts = (tuple(style.input_layouts), tuple(style.output_layouts))
    if type(style) is ColwiseParallel and layouts == ((Replicate(),), (Shard(-1),)):
        return ColumnParallelLinear
    if type(style) is RowwiseParallel and layouts == ((Shard(-1),), (Replicate(),)):
        return RowParallelLinear
    return None


def _targets(module: nn.Module, plan: dict) -> Dict[str, Tuple[nn.Module, type]]:
    """The Linears to swap: none where some entry may hand its neighbour a DTensor (a style other than
    column- or row-parallel, or one that keeps DTensor outputs), which a swapped Linear cannot take."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    if not all(isinstance(s, (ColwiseParallel, RowwiseParallel)) and s.use_local_output for s in plan.values()):
        return {}
    out = {}
    for path, style in plan.items():
        cls = _local_class(style)
        if cls is None:
            continue
        try:
            sub = module.get_submodule(path)
        except AttributeError:
            continue
        if type(sub) is nn.Linear:
            out[path] = (sub, cls)
    return out


def split_linears(module: nn.Module, plan: dict, mesh, tp_group, src_data_rank) -> None:
    """``parallelize_module(module, mesh, plan, src_data_rank=...)``, then the plain column- and
    row-parallel Linears run on their local shards."""
    from torch.distributed.tensor.parallel import parallelize_module
    targets = _targets(module, plan)
    before = {path: forward_hook_ids(linear) for path, (linear, _) in targets.items()}
    parallelize_module(module, mesh, plan, src_data_rank=src_data_rank)
    for path, (linear, cls) in targets.items():
        remove_forward_hooks_since(linear, before[path])
        linear.__class__ = cls
        if cls is RowParallelLinear:
            linear.tp_group = tp_group


__all__ = ["split_linears", "ColumnParallelLinear", "RowParallelLinear"]
