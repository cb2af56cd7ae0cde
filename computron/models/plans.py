"""How a transformers decoder is split, read from the plans its config class declares (no torch).

transformers declares, on each causal LM's config class, a ``base_model_pp_plan`` (the backbone's modules
in order: the embedding taking ``input_ids``, the ``layers`` list, the final norm) and a
``base_model_tp_plan`` (``layers.*.<path>``: a style per Linear). ``decoder_plan`` turns those into a
``DecoderPlan``: what pipeline stages cut, and which of a layer's modules TP splits how. The styles map as
follows (the styles transformers names with "gather"/"split" only say where its own DTensor path
re-gathers; this engine keeps every rank on its local heads):

- ``colwise``, ``colwise_gather_output`` -> split by output features; ``rowwise``,
  ``rowwise_split_input`` -> split by input features (outputs all-reduced);
- ``replicated_with_grad_allreduce`` (per-head q/k norms) -> kept whole;
- the experts of a mixture of experts (``mlp.experts``, ``packed_colwise``, ``moe_tp_experts``) -> kept
  whole on every TP rank (replicated: attention is split, each rank runs every expert);
- ``embedding_rowwise`` -> the vocabulary-parallel embedding every family gets;
- any other style -> TP refused, naming the style (TP=1 and PP still serve the model).

What a plan cannot say is in ``FIXES``: fused projections split per part, and a model forward that
scales ``inputs_embeds`` again on later pipeline stages.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

_COLWISE = {"colwise", "colwise_gather_output"}
_ROWWISE = {"rowwise", "rowwise_split_input"}
_REPLICATED = {"replicated_with_grad_allreduce"}
_EXPERT_STYLES = {"packed_colwise", "moe_tp_experts", "grouped_gemm", "ep_router"}
_EMBEDDING = {"embedding_rowwise"}


@dataclass(frozen=True)
class Fix:
    """Per-family facts no plan says."""
    packed: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()
    """Layer-relative fused Linears and the config-derived parts they concatenate by output features, each
    split on its own (``"q"``, ``"kv"``: heads times head_dim; ``"ffn"``: intermediate size)."""
    later_stage_scale: Tuple[str, ...] = ()
    """Backbone attributes multiplying ``inputs_embeds`` in the model's forward: set to 1 after stage 0."""


FIXES: Dict[str, Fix] = {
    "phi3": Fix(packed=(("self_attn.qkv_proj", ("q", "kv", "kv")), ("mlp.gate_up_proj", ("ffn", "ffn")))),
    "granite": Fix(later_stage_scale=("embedding_multiplier",)),
    "granitemoe": Fix(later_stage_scale=("embedding_multiplier",)),
    "granitemoeshared": Fix(later_stage_scale=("embedding_multiplier",)),
}


@dataclass(frozen=True)
class DecoderPlan:
    model_type: str
    embeddings: str
    """Backbone path of the token embedding (the pp plan's module taking ``input_ids``)."""
    layers: str
    final_norm: Optional[str]
    colwise: Tuple[str, ...]
    rowwise: Tuple[str, ...]
    packed: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()
    replicated: Tuple[str, ...] = ()
    experts: Tuple[str, ...] = ()
    """Layer-relative modules kept whole under TP (a mixture of experts)."""
    refused: Dict[str, str] = field(default_factory=dict)
    """Plan entries with a style this engine cannot split: path -> style."""
    fix: Fix = Fix()

    def tp_refusal(self) -> Optional[str]:
        """Why TP>1 is refused for this family, or None."""
        if not self.refused:
            return None
        path, style = next(iter(self.refused.items()))
        return f"its tensor-parallel plan splits {path!r} as {style!r}, a style this engine does not split"


def _config_class(model_type: str):
    from transformers import CONFIG_MAPPING
    try:
        return CONFIG_MAPPING[model_type]
    except KeyError:
        return None


def plans_of(config: Any) -> Tuple[Optional[dict], Optional[dict]]:
    """``(base_model_tp_plan, base_model_pp_plan)`` of a transformers config object, or of a config.json dict
    (through its model type's config class); None where absent."""
    if isinstance(config, dict):
        cls = _config_class(config.get("model_type", ""))
        if cls is None:
            return None, None
        config = cls
    return getattr(config, "base_model_tp_plan", None) or None, getattr(config, "base_model_pp_plan", None) or None


def decoder_plan(config: Any) -> Optional[DecoderPlan]:
    """The split of a causal LM whose config declares a pp plan, else None (a dict is a config.json)."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    tp_plan, pp_plan = plans_of(config)
    if not model_type or not pp_plan or "layers" not in pp_plan:
        return None
    keys = list(pp_plan)
    embeddings = next((k for k in keys if "input_ids" in pp_plan[k][0]), None)
    if embeddings is None:
        return None
    after = keys[keys.index("layers") + 1:]
    fix = FIXES.get(model_type, Fix())
    packed = dict(fix.packed)
    colwise: List[str] = []
    rowwise: List[str] = []
    replicated: List[str] = []
    experts: List[str] = []
    refused: Dict[str, str] = {}
    for key, style in (tp_plan or {}).items():
        if not key.startswith("layers.*."):
            if style not in _EMBEDDING and style not in _COLWISE | _ROWWISE | _REPLICATED:
                refused[key] = style
            continue
        path = key[len("layers.*."):]
        if ".experts" in f".{path}" or style in _EXPERT_STYLES:
            head = path.split(".experts")[0] + ".experts" if ".experts" in f".{path}" else path
            if head not in experts:
                experts.append(head)
        elif path in packed:
            continue
        elif style in _COLWISE:
            colwise.append(path)
        elif style in _ROWWISE:
            rowwise.append(path)
        elif style in _REPLICATED:
            replicated.append(path)
        else:
            refused[path] = style
    return DecoderPlan(model_type, embeddings, "layers", after[-1] if after else None, tuple(colwise),
                       tuple(rowwise), tuple(fix.packed), tuple(replicated), tuple(experts), refused, fix)


def part_sizes(parts: Sequence[str], config: Any) -> List[int]:
    """Output features of each part of a fused Linear (``Fix.packed``) in ``config``."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    heads, hidden = get("num_attention_heads"), get("hidden_size")
    head_dim = get("head_dim") or hidden // heads
    sizes = {"q": heads * head_dim, "kv": (get("num_key_value_heads") or heads) * head_dim,
             "ffn": get("intermediate_size")}
    return [sizes[p] for p in parts]


def tp_sizes_that_work(config: Any, up_to: int = 64) -> List[int]:
    """The TP sizes that split this decoder: each divides the query heads, the intermediate size and
    the KV heads, or is a multiple of the KV heads (each KV head then kept by several ranks)."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    heads = get("num_attention_heads") or 1
    kv = get("num_key_value_heads") or heads
    ffn = get("intermediate_size") or get("ffn_dim")
    out = []
    for tp in range(1, up_to + 1):
        if heads % tp or (isinstance(ffn, int) and ffn % tp):
            continue
        if kv % tp and tp % kv:
            continue
        out.append(tp)
    return out


def check_tp(config: Any, tp: int, model_id: str, source: str = "") -> None:
    """Raise ValueError when ``tp`` cannot split this decoder, naming why and the TP sizes that can."""
    if tp == 1:
        return
    what = source or f"{getattr(config, 'model_type', None) or config.get('model_type')!r} model"
    plan = decoder_plan(config)
    if plan is not None and plan.tp_refusal() is not None:
        raise ValueError(f"model {model_id!r}: {what}: {plan.tp_refusal()}; serve it with tp_world_size=1 "
                         "(pipeline stages split it)")
    ok = tp_sizes_that_work(config)
    if tp not in ok:
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        heads, kv = get("num_attention_heads"), get("num_key_value_heads") or get("num_attention_heads")
        ffn = get("intermediate_size")
        raise ValueError(f"model {model_id!r}: {what} has {heads} attention heads, {kv} KV heads and "
                         f"intermediate_size={ffn}, which tp_world_size={tp} cannot split; TP sizes that work: "
                         f"{', '.join(map(str, ok[:8]))}")


__all__ = ["DecoderPlan", "Fix", "FIXES", "decoder_plan", "plans_of", "part_sizes", "tp_sizes_that_work",
           "check_tp"]
