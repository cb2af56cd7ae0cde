"""Turning a full module into this rank's shard and the code that runs it.

``make_runner`` picks a runner by the module's kind: a transformers causal LM
of the OPT or Llama family (``CausalLMRunner``: generation with a KV cache),
a BERT/RoBERTa-style encoder or ViT with any task head (``EncoderRunner``,
found through the family registry of ``registry.py``), an ``nn.Sequential``
(``SequentialRunner``), or any other module (``ModuleRunner``, no pipeline split).
"""
from .base import StageContext, StageRunner, uniform_split
from .causal_lm import CausalLMRunner, causal_lm_family
from .encoder import EncoderRunner
from .generic import ModuleRunner
from .registry import FAMILIES, encoder_family, family_of
from .sequential import SequentialRunner


def make_runner(module, model_config, ctx: StageContext) -> StageRunner:
    if ctx.pp > 1 and not model_config.pipelinable:
        raise ValueError(f"model {model_config.model_id!r} has pipelinable=False but pp_world_size={ctx.pp}")
    if causal_lm_family(module) is not None:
        return CausalLMRunner(module, model_config, ctx)
    if encoder_family(module) is not None:
        return EncoderRunner(module, model_config, ctx)
    import torch.nn as nn
    if isinstance(module, nn.Sequential):
        return SequentialRunner(module, model_config, ctx)
    return ModuleRunner(module, model_config, ctx)


__all__ = ["StageContext", "StageRunner", "make_runner", "uniform_split", "CausalLMRunner",
           "SequentialRunner", "ModuleRunner", "causal_lm_family", "EncoderRunner", "FAMILIES", "encoder_family",
           "family_of"]
