"""Any other module: served whole on every rank (no pipeline split), its forward called with each
request as the batch manager makes it; under TP>1 split only by ``ModelConfig.tp_plan``."""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from .base import StageContext, StageRunner, parallelize
from .families import CAUSAL_LM, GENERIC_HINT, PLAN_DECODERS, model_types

_log = logging.getLogger("computron.models")


class ModuleRunner(StageRunner):
    """Any module, whole on every stage-0 rank: TP only through ``ModelConfig.tp_plan``."""

    def __init__(self, module, model_config, ctx: StageContext):
        if ctx.pp > 1:
            raise ValueError(f"model {model_config.model_id!r}: {type(module).__name__} cannot be split "
                             f"into {ctx.pp} pipeline stages; use pp_world_size=1, an nn.Sequential, or "
                             "a transformers causal LM")
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        can_generate = getattr(module, "can_generate", None)  # a transformers generative model (GPT-2, ...)
        if model_type is not None and callable(can_generate) and can_generate():
            raise ValueError(f"model {model_config.model_id!r}: {type(module).__name__} ({model_type!r}) is a causal "
                             f"LM the engine cannot shard (supported: model_type "
                             f"{', '.join(sorted(model_types(CAUSAL_LM)))} and {PLAN_DECODERS}); {GENERIC_HINT}")
        if ctx.tp > 1 and model_config.tp_plan is None and any(True for _ in module.parameters()):
            # not split: every TP rank holds (and loads) the whole module. Refused would break modules
            # users replicate on purpose; said loudly instead, once per model (by its first rank).
            if ctx.layout.tp_rank_of(ctx.groups.rank) == 0:
                _log.warning("model %r: %s cannot be split by tensor parallelism without ModelConfig.tp_plan: "
                             "each of the %d TP ranks holds the WHOLE module (replicated, not split)",
                             model_config.model_id, type(module).__name__, ctx.tp)
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
