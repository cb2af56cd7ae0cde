"""An ``nn.Sequential`` split by pipeline stage (contiguous layers) and by TP (each Linear pair made
column- then row-parallel where only element-wise modules sit between them)."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..comm import p2p
from .base import StageContext, StageRunner, parallelize, uniform_split


# modules that act on each element alone, so they may sit between a column- and a row-parallel Linear
_ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.Dropout, nn.Identity)


def linear_pair_plan(stage: nn.Sequential) -> dict:
    """Megatron-style plan: a Linear followed (through elementwise modules only) by another Linear
    becomes a column-parallel/row-parallel pair; any other Linear is column-parallel with its
    output gathered, so every module outside a pair sees full activations.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    children = list(stage.named_children())
    plan, i = {}, 0
    while i < len(children):
        name, mod = children[i]
        if not isinstance(mod, nn.Linear):
            i += 1
            continue
        j = i + 1
        while j < len(children) and isinstance(children[j][1], _ELEMENTWISE):
            j += 1
        if j < len(children) and isinstance(children[j][1], nn.Linear):
            plan[name] = ColwiseParallel()
            plan[children[j][0]] = RowwiseParallel()
            i = j + 1
        else:
            plan[name] = ColwiseParallel(output_layouts=Replicate())
            i += 1
    return plan


class SequentialRunner(StageRunner):
    """An ``nn.Sequential`` split into ``pp`` stages of its children; TP over its Linear layers."""

    def __init__(self, module: nn.Sequential, model_config, ctx: StageContext):
        self.ctx = ctx
        children = list(module.children())
        part = uniform_split(len(children), ctx.pp)[ctx.stage]
        self.module = nn.Sequential(*[children[i] for i in part])
        plan = model_config.tp_plan if model_config.tp_plan is not None else linear_pair_plan(self.module)
        if ctx.tp > 1:
            self._check_divisible(plan)
        parallelize(self.module, plan, ctx)
        self.segments = list(self.module.children())

    def _check_divisible(self, plan):
        from torch.distributed.tensor.parallel import RowwiseParallel
        for name, style in plan.items():
            layer = self.module.get_submodule(name)
            if not isinstance(layer, nn.Linear):
                continue
            rowwise = isinstance(style, RowwiseParallel)
            dim, what = (layer.in_features, "in") if rowwise else (layer.out_features, "out")
            if dim % self.ctx.tp:
                raise ValueError(f"model {self.ctx.model_id!r}: layer {name} has {what}_features={dim}, "
                                 f"not divisible by tp_world_size={self.ctx.tp}")

    def run(self, batch: Any, weights_ready) -> Optional[Any]:
        ctx, g = self.ctx, self.ctx.groups
        x = None
        try:
            weights_ready()
            if ctx.is_first:
                if not isinstance(batch, torch.Tensor):
                    raise TypeError(f"model {ctx.model_id!r} takes a tensor batch, got {type(batch).__name__}")
                x = batch.to(ctx.device)
            else:
                x = p2p.recv_tensor(g.prev_rank(), g.data, ctx.device)
            y = self.module(x)
        except Exception:  # any failure: the next stage is told, then it re-raises
            if not ctx.is_last:
                p2p.send_tensor(None, g.next_rank(), g.data, ctx.device)
            raise
        if not ctx.is_last:
            p2p.send_tensor(y, g.next_rank(), g.data, ctx.device)
            return None
        return y.cpu() if ctx.is_output_rank else None
