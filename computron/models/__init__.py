"""Turning a full module into this rank's shard and the code that runs it.

``make_runner`` picks a runner by the module's kind: a transformers causal LM
of the OPT or Llama family (``CausalLMRunner``: generation with a KV cache),
a BERT/RoBERTa-style encoder or ViT with any task head (``EncoderRunner``,
found through the family table of ``families.py``), an ``nn.Sequential``
(``SequentialRunner``), or any other module (``ModuleRunner``, no pipeline split).
"""
import importlib

_WHERE = {"StageContext": "base", "StageRunner": "base", "GenerativeRunner": "base", "uniform_split": "base",
          "CausalLMRunner": "causal_lm", "causal_lm_family": "causal_lm", "EncoderRunner": "encoder",
          "ModuleRunner": "generic", "SequentialRunner": "sequential", "FAMILIES": "families",
          "encoder_family": "families", "family_of": "families"}
"""Names imported on first use: ``computron.models.families`` is read (for the served model types)
without importing torch and the runners."""


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)


def make_runner(module, model_config, ctx):
    """The runner of ``module``'s kind, holding this rank's shard of it (on a CPU, its Linears on packed
    weights where ``ctx.pack_linears``, else computing few rows weight-first: ``kernels.cpu.linear``)."""
    runner = _runner_of_kind(module, model_config, ctx)
    if ctx.device.type == "cpu":
        from ..kernels.cpu.linear import use_cpu_kernels
        use_cpu_kernels(module, pack=ctx.pack_linears)
    return runner


def _runner_of_kind(module, model_config, ctx):
    from .causal_lm import CausalLMRunner, causal_lm_family
    from .encoder import EncoderRunner
    from .generic import ModuleRunner
    from .families import encoder_family
    from .sequential import SequentialRunner
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


__all__ = ["make_runner", *_WHERE]
