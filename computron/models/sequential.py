from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .. import p2p
from .base import StageContext, StageRunner, parallelize, uniform_split


def linear_pair_plan(stage: nn.Sequential) -> dict:
    """Megatron-style plan: Linear layers alternate column- and row-parallel within a stage.

    A trailing unpaired Linear is column-parallel with its output gathered, so
    every stage hands on a full activation.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    names = [n for n, m in stage.named_children() if isinstance(m, nn.Linear)]
    plan = {}
    for i in range(0, len(names) - 1, 2):
        plan[names[i]] = ColwiseParallel()
        plan[names[i + 1]] = RowwiseParallel()
    if len(names) % 2:
        plan[names[-1]] = ColwiseParallel(output_layouts=Replicate())
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
        for name in plan:
            layer = self.module.get_submodule(name)
            if isinstance(layer, nn.Linear):
                for dim in (layer.in_features, layer.out_features):
                    if dim % self.ctx.tp and dim != 0:
                        raise ValueError(f"model {self.ctx.model_id!r}: layer {name} has a dimension of "
                                         f"{dim}, not divisible by tp_world_size={self.ctx.tp}")

    def run(self, batch: Any) -> Optional[Any]:
        ctx, g = self.ctx, self.ctx.groups
        x = None
        try:
            if ctx.is_first:
                if not isinstance(batch, torch.Tensor):
                    raise TypeError(f"model {ctx.model_id!r} takes a tensor batch, got {type(batch).__name__}")
                x = batch.to(ctx.device)
            else:
                x = p2p.recv_tensor(g.prev_rank(), g.data, ctx.device)
            y = self.module(x)
        except Exception:
            if not ctx.is_last:
                p2p.send_tensor(None, g.next_rank(), g.data, ctx.device)
            raise
        if not ctx.is_last:
            p2p.send_tensor(y, g.next_rank(), g.data, ctx.device)
            return None
        return y.cpu() if ctx.is_output_rank else None
