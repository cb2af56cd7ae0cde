"""Cutting a transformers decoder to this rank's pipeline stage and tensor-parallel shard.

Each rank keeps the transformers model object with only its stage's layers and calls the model's own
backbone forward on them (stage 0 with token ids, later stages with the previous stage's hidden states as
``inputs_embeds``). Where the backbone is and what a stage drops comes from the family: OPT from its table
entry, every other decoder from the plans its config class declares (``plans.decoder_plan``). A stage's
backbone gets a config of its own whose per-layer lists (``layer_types``) cover only its layers, and layer
indices are renumbered, so each stage's KV cache is its own.

Under TP a layer's Linears are split by the plan (column then row parallel); the splits DTensor cannot
express (fused projections, KV heads fewer than ranks, the vocabulary) are ``row_split``'s; a q/k norm
spanning the whole projection (OLMo-2) is computed over the shards with one all-reduce; the experts of a
mixture of experts stay whole on every rank.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .base import uniform_split
from .families import Family, has_submodule, shard_layers
from .local_tp import ColumnParallelLinear
from .plans import DecoderPlan, check_tp, decoder_plan, part_sizes
from .row_split import block, kv_head_pieces, packed_pieces, split_rows, split_vocab, tp_rank


@dataclass
class DecoderCut:
    base: nn.Module
    """The backbone whose forward this stage calls."""
    layers: nn.ModuleList
    """This stage's layers."""
    layer_ids: List[int]
    """The model-wide index of each of this stage's layers."""
    embedding: Optional[nn.Module]
    lm_head: Optional[nn.Module]
    vocab_parallel: bool
    vocab: int
    plan: Optional[DecoderPlan]


class _NoPositions(nn.Module):
    """Stands in for OPT's positional embedding after stage 0, where it was already added."""

    def forward(self, *args, **kwargs):
        return torch.zeros((), dtype=torch.float32)


class ShardedRMSNorm(nn.Module):
    """An RMS norm over a whole projection whose features are split over the TP ranks: the squares are
    summed over the group (``replicas`` ranks hold each feature) and the weight is this rank's slice."""

    full_width = 1
    replicas = 1
    tp_group = None

    def forward(self, x):
        x32 = x.float()
        ss = x32.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(ss, group=self.tp_group)
        eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
        y = x32 * torch.rsqrt(ss / (self.full_width * self.replicas) + eps)
        return (self.weight * y).to(x.dtype)


def _output_attr(model: nn.Module) -> str:
    head = model.get_output_embeddings()
    return next(name for name, mod in model.named_children() if mod is head)


def _set_path(root: nn.Module, path: str, value) -> None:
    owner, _, attr = path.rpartition(".")
    setattr(root.get_submodule(owner) if owner else root, attr, value)


def _renumber(layers) -> None:
    for local_idx, layer in enumerate(layers):
        for mod in layer.modules():
            if isinstance(getattr(mod, "layer_idx", None), int):
                mod.layer_idx = local_idx


def _stage_config(config, part: range):
    """The backbone's config for a stage holding layers ``part``: per-layer lists cut to them."""
    stage = copy.copy(config)
    for name in ("layer_types", "no_rope_layers"):
        values = getattr(config, name, None)
        if isinstance(values, (list, tuple)) and len(values) == config.num_hidden_layers:
            setattr(stage, name, [values[i] for i in part])
    stage.num_hidden_layers = len(part)
    return stage


def cut_decoder(model: nn.Module, family: Family, ctx) -> DecoderCut:
    """Cut ``model`` to this rank's stage and TP shard (in place)."""
    if family.name == "opt":
        return _cut_opt(model, family, ctx)
    config = model.config
    plan = decoder_plan(config)
    base = model.base_model
    layers = list(base.get_submodule(plan.layers))
    part = uniform_split(len(layers), ctx.pp)[ctx.stage]
    _set_path(base, plan.layers, nn.ModuleList([layers[i] for i in part]))
    _renumber(base.get_submodule(plan.layers))
    base.config = _stage_config(config, part)
    head_attr = _output_attr(model)
    if not ctx.is_first:
        _set_path(base, plan.embeddings, None)
        for attr in plan.fix.later_stage_scale:
            setattr(base, attr, 1.0)
    if not ctx.is_last:
        setattr(model, head_attr, None)
        if plan.final_norm:
            _set_path(base, plan.final_norm, nn.Identity())
    embedding = base.get_submodule(plan.embeddings) if ctx.is_first else None
    lm_head = getattr(model, head_attr) if ctx.is_last else None
    vocab = model.get_output_embeddings().out_features if lm_head is not None else config.vocab_size
    if ctx.tp > 1:
        check_tp(config, ctx.tp, ctx.model_id)
        attn_config = _tp_attention_config(config, ctx.tp)
        for layer in base.get_submodule(plan.layers):
            _split_layer(layer, plan, config, attn_config, family, ctx)
        split_vocab(embedding, lm_head, ctx)
    return DecoderCut(base, base.get_submodule(plan.layers), list(part), embedding, lm_head, ctx.tp > 1, vocab,
                      plan)


def _cut_opt(model, family: Family, ctx) -> DecoderCut:
    from .families import check_tp_divisible
    base = model.model.decoder
    layers = list(base.layers)
    part = uniform_split(len(layers), ctx.pp)[ctx.stage]
    base.layers = nn.ModuleList([layers[i] for i in part])
    _renumber(base.layers)
    if not ctx.is_first:
        base.embed_tokens, base.embed_positions, base.project_in = None, _NoPositions(), None
    if not ctx.is_last:
        model.lm_head, base.final_layer_norm, base.project_out = None, None, None
    if ctx.tp > 1:
        check_tp_divisible(model.config, family.tp_fields, ctx.tp, ctx.model_id)
        shard_layers(base.layers, family, family.tp_plan(), ctx, model.config, what="decoder layer")
    return DecoderCut(base, base.layers, list(part), base.embed_tokens, model.lm_head, False,
                      model.config.vocab_size, None)


def _dims(config):
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv, head_dim


def _tp_attention_config(config, tp: int):
    """The config an attention module of one TP rank reads head counts from (Phi-3 slices its fused
    output with ``config.num_attention_heads``)."""
    heads, kv, _ = _dims(config)
    local = copy.copy(config)
    local.num_attention_heads = heads // tp
    if getattr(config, "num_key_value_heads", None):
        local.num_key_value_heads = max(1, kv // tp)
    return local


def _split_layer(layer: nn.Module, plan: DecoderPlan, config, attn_config, family: Family, ctx) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    tp, rank = ctx.tp, tp_rank(ctx)
    heads, kv, head_dim = _dims(config)
    kv_rows = kv_head_pieces(kv, head_dim, tp, rank)
    q_rows = (block(heads * head_dim, tp, rank),)
    manual = {}
    for path in plan.colwise:
        if not has_submodule(layer, path):
            continue
        lin = layer.get_submodule(path)
        if kv < tp and getattr(lin, "out_features", None) == kv * head_dim:
            manual[path] = kv_rows  # fewer KV heads than ranks: this rank's query heads' KV head
    for path, parts in plan.packed:
        if has_submodule(layer, path):
            manual[path] = packed_pieces([(n, kv_rows if part == "kv" else (block(n, tp, rank),))
                                          for part, n in zip(parts, part_sizes(parts, config))])
    tp_plan = {p: ColwiseParallel() for p in plan.colwise if p not in manual and has_submodule(layer, p)}
    tp_plan.update({p: RowwiseParallel() for p in plan.rowwise if has_submodule(layer, p)})
    shard_layers([layer], family, tp_plan, ctx, config, what="decoder layer")
    for path, pieces in manual.items():
        lin = layer.get_submodule(path)
        split_rows([(lin, "weight")], pieces, ctx)
        if lin.bias is not None:
            split_rows([(lin, "bias")], pieces, ctx)
        lin.__class__ = ColumnParallelLinear
    _shard_norms(layer, heads, kv, head_dim, q_rows, kv_rows, ctx)
    local_heads, local_kv = heads // tp, max(1, kv // tp)
    for mod in layer.modules():
        if hasattr(mod, "num_key_value_groups"):
            mod.num_key_value_groups = local_heads // local_kv
            for attr, value in (("num_heads", local_heads), ("num_attention_heads", local_heads),
                                ("num_key_value_heads", local_kv)):
                if isinstance(getattr(mod, attr, None), int):
                    setattr(mod, attr, value)
            if getattr(mod, "config", None) is config:
                mod.config = attn_config


def _shard_norms(layer, heads: int, kv: int, head_dim: int, q_rows, kv_rows, ctx) -> None:
    """Norms over a whole q or k projection (OLMo-2's ``q_norm``/``k_norm``): their weight split like the
    projection, their statistics summed over the TP group."""
    for name, mod in list(layer.named_modules()):
        weight = getattr(mod, "weight", None)
        leaf = name.rpartition(".")[2]
        if leaf not in ("q_norm", "k_norm") or weight is None or weight.dim() != 1:
            continue
        width = weight.shape[0]
        if width == head_dim:
            continue  # per head: whole on every rank
        is_q = leaf == "q_norm"
        if width != (heads if is_q else kv) * head_dim:
            raise ValueError(f"model {ctx.model_id!r}: {name} normalizes {width} features, neither one head "
                             f"nor the whole projection: it cannot be split by tensor parallelism")
        split_rows([(mod, "weight")], q_rows if is_q else kv_rows, ctx)
        mod.__class__ = ShardedRMSNorm
        mod.full_width, mod.tp_group = width, ctx.groups.tp_group
        mod.replicas = 1 if is_q or kv >= ctx.tp else ctx.tp // kv


__all__ = ["DecoderCut", "cut_decoder", "ShardedRMSNorm"]
