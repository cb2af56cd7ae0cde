"""Which transformers architectures can be sharded, and how: the one family table.

An entry names, relative to the family's backbone (``model.base_model``), the
module that turns inputs into hidden states (``embeddings``), the list of
layers split over pipeline stages (``layers``), what runs after the last layer
(``final_norm``, ``pooler``), the tensor-parallel plan of one layer
(column-parallel then row-parallel Linear paths), the per-layer attributes that
hold head counts or widths transformers reshapes with (divided by the TP size)
and the config fields the TP size must divide. ``runner`` says which runner
serves the family: ``encoder.EncoderRunner`` (BERT, RoBERTa, ViT: supporting a
new encoder family is one more entry here; task heads run through the model's
own forward and need no entry) or ``causal_lm.CausalLMRunner`` (OPT- and
Llama-shaped decoders, whose TP plans and checks come from here too).

Everything else that knows families asks this table: ``preflight`` (which
causal LMs can be sharded, which config fields a TP size must divide),
``checkpoint.meta_model`` (whether a checkpoint can be read slice by slice) and
the server (which checkpoints are encoders).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, Optional, Sequence, Tuple

if TYPE_CHECKING:  # the table itself imports no torch: a YAML config is checked against it without one
    from torch import nn

    from .base import StageContext

ENCODER, CAUSAL_LM = "encoder", "causal_lm"


@dataclass(frozen=True)
class Family:
    name: str
    model_types: Tuple[str, ...]
    """transformers ``config.model_type`` values laid out this way."""
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
    """Config fields that must be divisible by the TP size (checked in this order)."""
    final_norm: Optional[str] = None
    """Backbone path of a norm applied after the last layer (ViT's ``layernorm``)."""
    pooler: Optional[str] = "pooler"
    """Backbone path of the pooler (may be absent on a given model)."""
    runner: str = ENCODER
    """Which runner serves it: ``ENCODER`` (models/encoder.py) or ``CAUSAL_LM`` (models/causal_lm.py)."""

    def tp_plan(self) -> dict:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        plan = {p: ColwiseParallel() for p in self.colwise}
        plan.update({p: RowwiseParallel() for p in self.rowwise})
        return plan


_BERT_LIKE = dict(
    embeddings="embeddings", embed_inputs=("input_ids", "token_type_ids"), layers="encoder.layer",
    colwise=("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"),
    rowwise=("attention.output.dense", "output.dense"),
    divide=("attention.self.num_attention_heads", "attention.self.all_head_size"),
)

FAMILIES: Tuple[Family, ...] = (
    Family("bert", ("bert",), **_BERT_LIKE),
    Family("roberta", ("roberta", "xlm-roberta"), **_BERT_LIKE),
    Family("vit", ("vit",), embeddings="embeddings", embed_inputs=("pixel_values",),
           layers="layers", colwise=("attention.q_proj", "attention.k_proj", "attention.v_proj", "mlp.fc1"),
           rowwise=("attention.o_proj", "mlp.fc2"), divide=("attention.num_attention_heads",),
           final_norm="layernorm"),
    # OPT reshapes with its head count and width, not -1: both are divided
    Family("opt", ("opt",), embeddings="decoder.embed_tokens", embed_inputs=("input_ids",),
           layers="decoder.layers", colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1"),
           rowwise=("self_attn.out_proj", "fc2"), divide=("self_attn.num_heads", "self_attn.embed_dim"),
           tp_fields=("num_attention_heads", "ffn_dim"), final_norm="decoder.final_layer_norm", pooler=None,
           runner=CAUSAL_LM),
    # separate q/k/v and gate/up projections: the layout LoRA adapters are served on (the runner splits these
    # and every other decoder by the plans transformers declares: ``plans.py``)
    Family("llama", ("llama", "mistral", "qwen2"), embeddings="embed_tokens",
           embed_inputs=("input_ids",), layers="layers",
           colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
           rowwise=("self_attn.o_proj", "mlp.down_proj"),
           tp_fields=("num_attention_heads", "intermediate_size"), final_norm="norm",
           pooler=None, runner=CAUSAL_LM),
)

_BY_TYPE: Dict[str, Family] = {t: f for f in FAMILIES for t in f.model_types}

GENERIC_HINT = ("to serve another module, give ModelConfig a model_fn that returns an nn.Module whose forward "
                "takes the request as your batch manager makes it (served as a generic module: pp_world_size=1, "
                "split under TP only by ModelConfig.tp_plan)")
"""What to do with a model no family fits; said by every error that refuses one."""


PLAN_DECODERS = "any transformers decoder whose config declares base_model_pp_plan"
"""How messages name the causal LMs served beside the table's."""


def model_types(runner: str) -> FrozenSet[str]:
    """The transformers ``model_type`` values that ``runner`` (``ENCODER`` or ``CAUSAL_LM``) serves from
    this table (causal LMs: also ``serves_causal_lm``)."""
    return frozenset(t for f in FAMILIES if f.runner == runner for t in f.model_types)


def serves_causal_lm(config: Any) -> bool:
    """Whether a causal LM of this config (object or config.json dict) can be split by the engine."""
    from .plans import decoder_plan
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    return model_type in model_types(CAUSAL_LM) or decoder_plan(config) is not None


def tp_fields_of_any_family() -> Tuple[str, ...]:
    """Every config field some family needs divisible by the TP size, then ``hidden_size``: what a
    config.json is checked for before it is known which runner will serve it."""
    fields = dict.fromkeys(f for fam in FAMILIES for f in fam.tp_fields)
    return tuple(fields) + ("hidden_size",)


def family_of(module) -> Optional[Family]:
    """The family entry of a transformers model, or None (not a transformers model, or not listed)."""
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None or not hasattr(module, "get_submodule"):
        return None
    return _BY_TYPE.get(model_type)


def encoder_family(module) -> Optional[Family]:
    """The family entry when ``models/encoder.py`` serves this module, else None."""
    fam = family_of(module)
    if fam is None or fam.runner != ENCODER:
        return None
    base = getattr(module, "base_model", None)
    if not hasattr(base, "get_submodule") or not has_submodule(base, fam.layers) or \
            not has_submodule(base, fam.embeddings):
        return None
    return fam


def decoder_family(module) -> Optional[Family]:
    """The family entry when ``models/causal_lm.py`` serves this module (a transformers causal LM with an
    output embedding: the table's entry, or one made from the plans its config declares), else None."""
    get_head = getattr(module, "get_output_embeddings", None)
    if not callable(get_head) or not hasattr(module, "base_model") or get_head() is None:
        return None
    fam = family_of(module)
    if fam is not None:
        return fam if fam.runner == CAUSAL_LM else None
    from .plans import decoder_plan
    plan = decoder_plan(module.config)
    if plan is None:
        return None
    return Family(plan.model_type, (plan.model_type,), embeddings=plan.embeddings, embed_inputs=("input_ids",),
                  layers=plan.layers, colwise=plan.colwise, rowwise=plan.rowwise, tp_fields=("num_attention_heads",),
                  final_norm=plan.final_norm, pooler=None, runner=CAUSAL_LM)


def has_submodule(module: "nn.Module", path: str) -> bool:
    """Whether ``module.get_submodule(path)`` finds a module (not None, not a plain attribute)."""
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def check_tp_divisible(config: Any, fields: Sequence[str], tp: int, model_id: str,
                       source: Optional[str] = None) -> None:
    """Raise ValueError naming the model and the first of ``fields`` that ``tp`` does not divide.

    ``config`` is a transformers config (fields as attributes) or a config.json dict; ``source`` names
    where a dict came from in the message (``checkpoint 'path'``), else the field is named ``config.X``.
    Fields the config lacks are skipped.
    """
    for f in fields:
        v = config.get(f) if isinstance(config, dict) else getattr(config, f, None)
        if isinstance(v, int) and v % tp:
            what = f"{source} has {f}={v}, not" if source else f"config.{f}={v} is not"
            raise ValueError(f"model {model_id!r}: {what} divisible by tp_world_size={tp}")


def shard_layers(layers: Sequence["nn.Module"], family: Family, plan: dict, ctx: "StageContext", config,
                 what: str = "layer") -> None:
    """Split each of ``layers`` by the TP ``plan`` and divide the family's head counts and widths by the TP
    size. A layer that lacks a module the plan names fails (``parallelize_module`` would only warn, and
    the shards would not add up); ``what`` names the layer in that message."""
    from .base import parallelize
    for layer in layers:
        missing = [p for p in plan if not has_submodule(layer, p)]
        if missing:
            raise ValueError(f"model {ctx.model_id!r}: {what} has no {missing}; its {config.model_type} "
                             f"layout does not fit the {family.name} TP plan")
        parallelize(layer, plan, ctx)
        divide_widths(layer, family, ctx.tp)


def divide_widths(layer: "nn.Module", family: Family, tp: int) -> None:
    """Divide the head counts and widths transformers may reshape with (``family.divide``) by the TP size:
    this rank's share, once its Linears are split."""
    for path in family.divide:
        mod_path, _, attr = path.rpartition(".")
        mod = layer.get_submodule(mod_path) if mod_path else layer
        if hasattr(mod, attr):
            setattr(mod, attr, getattr(mod, attr) // tp)


__all__ = ["Family", "FAMILIES", "ENCODER", "CAUSAL_LM", "GENERIC_HINT", "PLAN_DECODERS", "model_types",
           "serves_causal_lm", "tp_fields_of_any_family",
           "family_of", "encoder_family", "decoder_family", "has_submodule", "check_tp_divisible", "shard_layers",
           "divide_widths"]
