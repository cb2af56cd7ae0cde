"""Owner: how a paged model's attention layers read the KV pool: the one seam, chosen once per model at load.

``EngineConfig.attention_backend`` names the backend; ``choose`` resolves it for a model and a device, and
``install`` puts it in the model through transformers' public attention interface (``AttentionInterface``
and the model's own ``set_attn_implementation``): nothing process-wide is replaced, and other models of the
process keep their own attention. Each step's metadata reaches the attention function as a keyword of the
backbone's forward (``PagedKV.forward_kwargs``: ``paged_step``), which transformers' decoder layers pass down
to their attention function; a forward without it (a request-level batch on transformers' DynamicCache)
runs the model's original implementation.

- ``gathered``: the model's own attention (SDPA, eager with soft-capping, ...) over each row's keys and values
  gathered out of the pool under an additive mask (``kv_pool.PagedKV.prepare``): the reference.
- ``paged``: FlexAttention over the pool in place through block tables (``paged_attention``): no gather, GQA
  without repeating K/V, each query against its own sequence's blocks only. The same code on CPU (inductor)
  and CUDA (Triton).
- ``cpu_paged``: decode steps through the CPU C kernel (``kernels/cpu/attention.py``), reading the pool in place;
  other steps gathered.
- ``auto``: ``paged`` on CUDA, else ``cpu_paged`` where it fits (``direct_fits``), else ``gathered``
  (``benchmarks/attention.py``: on this project's CPU ``paged`` costs a compilation of tens of seconds per
  process and wins only at long contexts, docs/performance.md).
"""
from __future__ import annotations

import sys
from typing import NamedTuple, Optional

import torch

BACKENDS = ("auto", "paged", "gathered", "cpu_paged")

SEAM_FAMILIES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "smollm3", "gemma3_text",
                           "granite", "olmo2", "phi3"})
"""Model types whose attention layers hand the cache's keys and values and the forward's keywords to the
attention function as they came, with nothing but the query, the scaling, a sliding window and a soft cap to
apply: those ``paged`` and ``cpu_paged`` serve (each checked token for token against HF generate:
``tests/unit/test_paged_batch.py``, ``tests/engine/test_paged_attention_engine.py``)."""
DIRECT_FAMILIES = SEAM_FAMILIES

NAMES = {"paged": "computron_paged", "cpu_paged": "computron_cpu_paged"}
"""The names the backends are registered under in transformers' ``AttentionInterface``."""
FALLBACK_ATTR = "computron_attention_fallback"
"""The config attribute keeping the model's original implementation (forwards without a paged step)."""


def check_backend(value) -> str:
    if value not in BACKENDS:
        raise ValueError(f"attention_backend={value!r}: must be one of {BACKENDS}")
    return value


def direct_fits(config, device: torch.device, enabled: bool = True) -> bool:
    """Whether a model's paged decode steps can go through the CPU kernel here: a CPU computing on one
    intra-op thread, SDPA attention, a family of ``DIRECT_FAMILIES``, the kernel built (the pool float32)."""
    if not enabled or torch.device(device).type != "cpu" or torch.get_num_threads() != 1:
        return False
    if getattr(config, "model_type", None) not in DIRECT_FAMILIES \
            or _original(config) != "sdpa":
        return False
    from ..kernels.cpu import attention as cpu_attention
    return cpu_attention.available()


def _original(config) -> Optional[str]:
    return getattr(config, FALLBACK_ATTR, None) or getattr(config, "_attn_implementation", None)


def choose(setting: str, config, device: torch.device, cpu_attention: bool = True) -> str:
    """The backend ``setting`` means for a model of this config on this device; a clear error where an
    explicit one cannot serve it."""
    check_backend(setting)
    model_type = getattr(config, "model_type", None)
    device_type = torch.device(device).type
    if setting == "auto":
        if device_type == "cuda" and model_type in SEAM_FAMILIES:
            return "paged"
        return "cpu_paged" if direct_fits(config, device, cpu_attention) else "gathered"
    if setting in NAMES and model_type not in SEAM_FAMILIES:
        raise ValueError(f"attention_backend={setting!r} does not serve model type {model_type!r} (it serves "
                         f"{sorted(SEAM_FAMILIES)}); use 'gathered' or 'auto'")
    if setting == "cpu_paged" and not direct_fits(config, device):
        raise ValueError("attention_backend='cpu_paged' needs a CPU worker on one intra-op thread "
                         "(worker_threads=1), SDPA attention and the C kernel built; use 'auto' or 'gathered'")
    return setting


def install(model: torch.nn.Module, backend: str) -> None:
    """Route ``model``'s attention through ``backend`` (``gathered`` leaves it as it is)."""
    if backend not in NAMES:
        return
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    configs = {id(c): c for c in [model.config] + [getattr(m, "config", None) for m in model.modules()]
               if c is not None and hasattr(c, "_attn_implementation")}  # a TP split may copy layers' configs
    for config in configs.values():
        current = getattr(config, "_attn_implementation", None)
        if current is not None and current.startswith(NAMES[backend]):
            continue
        fallback = getattr(config, FALLBACK_ATTR, None) if current is not None and current.startswith("computron_") \
            else current
        fallback = fallback or "sdpa"
        name = NAMES[backend] + ("" if fallback == "sdpa" else f"_{fallback}")  # without a step: that one's mask
        AttentionInterface.register(name, _paged if backend == "paged" else _cpu_paged)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[fallback]
                                        if fallback in ALL_MASK_ATTENTION_FUNCTIONS else sdpa_mask)
        setattr(config, FALLBACK_ATTR, fallback)
        config._attn_implementation = name


def _fallback(module, *args, **kwargs):
    """The model's original attention: a registered one, or "eager", which is the model's own module-level
    ``eager_attention_forward`` (what its layers fall back to)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    name = getattr(module.config, FALLBACK_ATTR, "sdpa")
    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name](module, *args, **kwargs)
    return sys.modules[type(module).__module__].eager_attention_forward(module, *args, **kwargs)


def _paged(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
           paged_step=None, **kwargs):
    if paged_step is None:
        return _fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         softcap=softcap, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return paged_step.attend(module.layer_idx, query, key, value, float(scale), softcap), None


class DirectStep(NamedTuple):
    """A decode step through the CPU kernel: each row's slots ``[B, W]`` and length; ``window`` gives a
    layer's sliding window (0: none)."""
    slots: torch.Tensor
    lengths: torch.Tensor
    window: object


def _cpu_paged(module, query, key, value, attention_mask, dropout=0.0, scaling=None, paged_step=None, **kwargs):
    if not isinstance(paged_step, DirectStep) or key.dtype != torch.float32:  # not a direct decode step
        return _fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    from ..kernels.cpu.attention import decode, paged_decode
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    run = paged_decode if torch.compiler.is_compiling() else decode
    window = paged_step.window(module.layer_idx)
    return run(query, key[0], value[0], paged_step.slots, paged_step.lengths, float(scale), window), None


__all__ = ["BACKENDS", "DIRECT_FAMILIES", "DirectStep", "SEAM_FAMILIES", "check_backend", "choose",
           "direct_fits", "install"]
