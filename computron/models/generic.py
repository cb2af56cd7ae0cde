from __future__ import annotations

from typing import Any, Optional

import torch

from .base import StageContext, StageRunner, parallelize


class ModuleRunner(StageRunner):
    """Any module, whole on every stage-0 rank: TP only through ``ModelConfig.tp_plan``."""

    def __init__(self, module, model_config, ctx: StageContext):
        if ctx.pp > 1:
            raise ValueError(f"model {model_config.model_id!r}: {type(module).__name__} cannot be split "
                             f"into {ctx.pp} pipeline stages; use pp_world_size=1, an nn.Sequential, or "
                             "an OPT/Llama model")
        self.ctx = ctx
        self.module = module
        parallelize(self.module, model_config.tp_plan or {}, ctx)
        self.segments = []

    def run(self, batch: Any, weights_ready) -> Optional[Any]:
        weights_ready()
        if isinstance(batch, torch.Tensor):
            batch = batch.to(self.ctx.device)
        out = self.module(batch)
        if not self.ctx.is_output_rank:
            return None
        return out.cpu() if isinstance(out, torch.Tensor) else out
