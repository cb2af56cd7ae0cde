"""Which transformers architectures can be sharded, and how: one entry per family.

An entry names, relative to the family's backbone (``model.base_model``), the
module that turns inputs into hidden states (``embeddings``), the list of
layers split over pipeline stages (``layers``), what runs after the last layer
(``final_norm``, ``pooler``), the tensor-parallel plan of one layer
(column-parallel then row-parallel Linear paths) and the per-layer attributes
that hold head counts or widths transformers reshapes with (divided by the TP
size). Supporting a new encoder family is one more entry here; the task heads
on top (sequence/token/image classification) run through the model's own
forward, so they need no entry at all.

Causal LMs (OPT, Llama) are listed for reference only: they keep their own
runner, ``causal_lm.CausalLMRunner``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from torch import nn


@dataclass(frozen=True)
class Family:
    name: str
    model_types: Tuple[str, ...]
    """transformers ``config.model_type`` values laid out this way."""
    inputs: str
    """'text' (input_ids, attention_mask, token_type_ids) or 'image' (pixel_values)."""
    embeddings: str
    """Backbone path of the embedding module; called with ``embed_inputs`` as keywords."""
    embed_inputs: Tuple[str, ...]
    layers: str
    """Backbone path of the nn.ModuleList of layers that pipeline stages split."""
    colwise: Tuple[str, ...]
    """Layer-relative paths of Linear modules split by output features."""
    rowwise: Tuple[str, ...]
    """Layer-relative paths of Linear modules split by input features (their outputs are all-reduced)."""
    divide: Tuple[str, ...] = ()
    """Layer-relative 'module.attribute' paths of head counts / widths to divide by the TP size."""
    tp_fields: Tuple[str, ...] = ("num_attention_heads", "intermediate_size")
    """Config fields that must be divisible by the TP size."""
    final_norm: Optional[str] = None
    """Backbone path of a norm applied after the last layer (ViT's ``layernorm``)."""
    pooler: Optional[str] = "pooler"
    """Backbone path of the pooler (may be absent on a given model)."""
    runner: str = "encoder"
    """Which runner serves it: 'encoder' (models/encoder.py) or 'causal_lm' (reference only)."""
    extra: Dict[str, str] = field(default_factory=dict)

    def tp_plan(self) -> dict:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        plan = {p: ColwiseParallel() for p in self.colwise}
        plan.update({p: RowwiseParallel() for p in self.rowwise})
        return plan


_BERT_LIKE = dict(
    inputs="text", embeddings="embeddings", embed_inputs=("input_ids", "token_type_ids"), layers="encoder.layer",
    colwise=("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"),
    rowwise=("attention.output.dense", "output.dense"),
    divide=("attention.self.num_attention_heads", "attention.self.all_head_size"),
)

FAMILIES: Tuple[Family, ...] = (
    Family("bert", ("bert",), **_BERT_LIKE),
    Family("roberta", ("roberta", "xlm-roberta"), **_BERT_LIKE),
    Family("vit", ("vit",), inputs="image", embeddings="embeddings", embed_inputs=("pixel_values",),
           layers="layers", colwise=("attention.q_proj", "attention.k_proj", "attention.v_proj", "mlp.fc1"),
           rowwise=("attention.o_proj", "mlp.fc2"), divide=("attention.num_attention_heads",),
           final_norm="layernorm"),
    # reference only: served by causal_lm.CausalLMRunner, whose plans live there
    Family("opt", ("opt",), inputs="text", embeddings="decoder.embed_tokens", embed_inputs=("input_ids",),
           layers="decoder.layers", colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1"),
           rowwise=("self_attn.out_proj", "fc2"), divide=("self_attn.num_heads", "self_attn.embed_dim"),
           tp_fields=("num_attention_heads", "ffn_dim"), final_norm="decoder.final_layer_norm", pooler=None,
           runner="causal_lm"),
    Family("llama", ("llama", "mistral", "qwen2"), inputs="text", embeddings="embed_tokens",
           embed_inputs=("input_ids",), layers="layers",
           colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
           rowwise=("self_attn.o_proj", "mlp.down_proj"),
           tp_fields=("num_attention_heads", "num_key_value_heads", "intermediate_size"), final_norm="norm",
           pooler=None, runner="causal_lm"),
)

_BY_TYPE: Dict[str, Family] = {t: f for f in FAMILIES for t in f.model_types}


def family_of(module) -> Optional[Family]:
    """The family entry of a transformers model, or None (not a transformers model, or not listed)."""
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None or not isinstance(module, nn.Module):
        return None
    return _BY_TYPE.get(model_type)


def encoder_family(module) -> Optional[Family]:
    """The family entry when ``models/encoder.py`` serves this module, else None."""
    fam = family_of(module)
    if fam is None or fam.runner != "encoder":
        return None
    base = getattr(module, "base_model", None)
    if not isinstance(base, nn.Module) or not _has(base, fam.layers) or not _has(base, fam.embeddings):
        return None
    return fam


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


__all__ = ["Family", "FAMILIES", "family_of", "encoder_family"]
