"""Random PEFT LoRA adapters for the zoo's causal-LM checkpoints.

PEFT initialises lora_B to zero, so a freshly made adapter changes nothing and a test against it would
prove nothing. ``save_random_lora`` fills both factors with seeded normal values sized so that the
adapter's update is as large as the base projection's own output (the zoo's weights are N(0, 0.02)):
greedy continuations of the tiny models change.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ..loading import load_causal_lm


def default_targets(family) -> list:
    """Every attention and MLP projection of a ``models.families`` family, by the names PEFT matches."""
    return sorted({p.rsplit(".", 1)[-1] for p in family.colwise + family.rowwise})


def save_random_lora(base_path: str, out: str, seed: int, r: int = 8, alpha: int = 16,
                     targets: Optional[Sequence[str]] = None, use_rslora: bool = False,
                     strength: float = 1.0) -> str:
    """Write a PEFT LoRA adapter for the checkpoint at ``base_path`` to ``out``; return ``out``.

    ``targets``: module names (``q_proj``; default every projection of the family); ``strength``: the
    update's size relative to the base projection's output (about), whatever ``r`` and the scaling.
    """
    from peft import LoraConfig, get_peft_model

    from ..models.families import decoder_family
    base = load_causal_lm(base_path)
    family = decoder_family(base)
    if family is None:
        raise ValueError(f"save_random_lora: {base_path!r} is not a causal LM of a served family")
    targets = list(targets) if targets is not None else default_targets(family)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora, lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
    # |scaling * B A x| ~ scaling * sqrt(r) * std^2 * |W x| / 0.02 per element: solve for std
    std = math.sqrt(strength * 0.02 / (scaling * math.sqrt(r)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * std)
    model.save_pretrained(out)
    return out


__all__ = ["save_random_lora", "default_targets"]
