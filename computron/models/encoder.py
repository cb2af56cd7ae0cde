"""Encoders (BERT, RoBERTa) and ViT, split by TP and PP, with any task head on top.

Each rank keeps its stage of the backbone (``model.base_model``): stage 0 the
embeddings, every stage its slice of the layer list, the last stage the final
norm, the pooler and the task head. Activations cross stages with
``p2p.send_tensor``/``recv_tensor``, which pass a failure downstream; every
stage has the batch's attention mask and builds the attention bias itself with
transformers' ``create_bidirectional_mask``, as the backbone's own forward does.
TP splits each layer's attention and MLP Linears Megatron-style (plans in
``families.py``); embeddings and heads are replicated.

The task head runs through the task model's own forward: on the last stage the
backbone inside the task model is replaced by ``_StageOutput``, which returns
the hidden states the stages computed, so sequence, token and image
classification heads (and any other head on a listed backbone) need no code
here.

A batch is a dict of tensors (what the batch managers of ``batching/text.py``
make): ``input_ids``, ``attention_mask``, ``token_type_ids`` or
``pixel_values``; with ``pooling`` ('mean' or 'cls') the answer is
``{"embeddings": [B, H]}`` taken from the backbone (the head is skipped),
otherwise the head's output tensors by name (``{"logits": ...}`` for
classifiers), or ``{"last_hidden_state": ...}`` (and ``pooler_output``) for a
bare backbone. Embeddings and heads are whole on every TP rank of their stage.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import nn

from ..comm import p2p
from ..comm.validation import POOLINGS
from .base import StageContext, StageRunner, uniform_split
from .families import check_tp_divisible, encoder_family, shard_layers


def _parent(root: nn.Module, path: str):
    parent_path, _, name = path.rpartition(".")
    return (root.get_submodule(parent_path) if parent_path else root), name


def _get(root: nn.Module, path: Optional[str]) -> Optional[nn.Module]:
    if not path:
        return None
    try:
        parent, name = _parent(root, path)
    except AttributeError:
        return None
    return getattr(parent, name, None)


def _drop(root: nn.Module, path: Optional[str]) -> None:
    if path and _get(root, path) is not None:
        parent, name = _parent(root, path)
        setattr(parent, name, None)


class _StageOutput(nn.Module):
    """Stands in for the backbone inside the task model on the last stage: the task model's forward
    gets the hidden states the pipeline computed, and its head runs as transformers wrote it."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone  # keeps the stage's weights inside the task model's module tree
        self.output = None

    def forward(self, *args, **kwargs):
        out, self.output = self.output, None
        if out is None:
            raise RuntimeError("the task head ran without the pipeline's hidden states")
        return out


def pool(hidden: torch.Tensor, mask: Optional[torch.Tensor], how: str) -> torch.Tensor:
    """Sentence embeddings: 'cls' takes the first token, 'mean' averages the tokens the mask keeps."""
    if how == "cls":
        return hidden[:, 0]
    if how != "mean":
        raise ValueError(f"pooling={how!r}: must be one of {POOLINGS}")
    if mask is None:
        return hidden.mean(dim=1)
    m = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)


class EncoderRunner(StageRunner):
    def __init__(self, model, model_config, ctx: StageContext):
        family = encoder_family(model)
        if family is None:
            raise ValueError(f"model {ctx.model_id!r}: {type(model).__name__} is no encoder the family table lists")
        config = model.config
        if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
            raise ValueError(f"model {ctx.model_id!r}: config.is_decoder/add_cross_attention is set; only "
                             "bidirectional encoders are served by EncoderRunner")
        self.ctx, self.family, self.config = ctx, family, config
        backbone = model.base_model
        self.has_head = backbone is not model
        parent, name = _parent(backbone, family.layers)
        layers = list(getattr(parent, name))
        part = uniform_split(len(layers), ctx.pp)[ctx.stage]
        self.layers = nn.ModuleList([layers[i] for i in part])
        setattr(parent, name, self.layers)
        self.embeddings = _get(backbone, family.embeddings) if ctx.is_first else None
        self.final_norm = _get(backbone, family.final_norm) if ctx.is_last else None
        self.pooler = _get(backbone, family.pooler) if ctx.is_last else None
        if not ctx.is_first:
            _drop(backbone, family.embeddings)
        if not ctx.is_last:
            _drop(backbone, family.final_norm)
            _drop(backbone, family.pooler)
        if ctx.tp > 1:
            check_tp_divisible(config, family.tp_fields, ctx.tp, ctx.model_id)
            plan = model_config.tp_plan if model_config.tp_plan is not None else family.tp_plan()
            shard_layers(self.layers, family, plan, ctx, config)
        self.stage_output = None
        if ctx.is_last and self.has_head:
            self.stage_output = _StageOutput(backbone)
            setattr(model, model.base_model_prefix, self.stage_output)
            self.module = model
        else:
            self.module = backbone
        self.model = model if self.stage_output is not None else None  # other stages let the head go
        tail = [m for m in (self.final_norm, self.pooler) if m is not None]
        head = [model] if self.stage_output is not None else []
        self.segments = ([self.embeddings] if self.embeddings is not None else []) + list(self.layers) + tail + head

    # ---- one forward of this stage ------------------------------------------
    def _embed(self, batch: Dict[str, Any]) -> torch.Tensor:
        dev = self.ctx.device
        kwargs = {}
        for k in self.family.embed_inputs:
            v = batch.get(k)
            if v is None:
                continue
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"model {self.ctx.model_id!r}: batch field {k!r} must be a tensor")
            if v.dtype.is_floating_point:  # pixel values in the weights' dtype, as the model's forward does
                v = v.to(next(self.embeddings.parameters()).dtype)
            kwargs[k] = v.to(dev)
        if self.family.embed_inputs[0] not in kwargs:
            raise ValueError(f"model {self.ctx.model_id!r}: batch has no {self.family.embed_inputs[0]!r}")
        return self.embeddings(**kwargs)

    def _finish(self, hidden: torch.Tensor, mask: Optional[torch.Tensor], batch: Dict[str, Any]) -> Dict[str, Any]:
        seq = self.final_norm(hidden) if self.final_norm is not None else hidden
        how = batch.get("pooling")
        if how is not None:
            return {"embeddings": pool(seq, mask, how).float().cpu()}
        pooled = self.pooler(seq) if self.pooler is not None else None
        if not self.has_head:
            out = {"last_hidden_state": seq.float().cpu()}
            if pooled is not None:
                out["pooler_output"] = pooled.float().cpu()
            return out
        from transformers.modeling_outputs import BaseModelOutputWithPooling
        self.stage_output.output = BaseModelOutputWithPooling(last_hidden_state=seq, pooler_output=pooled)
        try:
            out = self.model()
        finally:
            self.stage_output.output = None
        # every tensor the head returns: {"logits"} for classifiers, start/end logits for QA heads, ...
        return {k: v.float().cpu() for k, v in out.items() if isinstance(v, torch.Tensor)}

    def run(self, batch: Dict[str, Any], weights_ready) -> Optional[Dict[str, Any]]:
        from transformers.masking_utils import create_bidirectional_mask
        ctx, g, dev = self.ctx, self.ctx.groups, self.ctx.device
        hidden, out = None, None
        try:
            weights_ready()
            if not isinstance(batch, dict):
                raise TypeError(f"model {ctx.model_id!r} takes a dict of tensors, got {type(batch).__name__}")
            mask = batch.get("attention_mask")
            mask = mask.to(dev) if mask is not None else None
            hidden = self._embed(batch) if ctx.is_first else p2p.recv_tensor(g.prev_rank(), g.data, dev)
            bias = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=mask)
            for layer in self.layers:
                hidden = layer(hidden, bias)
                if isinstance(hidden, tuple):
                    hidden = hidden[0]
            if ctx.is_last:
                out = self._finish(hidden, mask, batch)
        except Exception:  # any failure: the next stage is told, then it re-raises
            if not ctx.is_last:  # the next stage raises instead of waiting for activations
                p2p.send_tensor(None, g.next_rank(), g.data, dev)
            raise
        if not ctx.is_last:
            p2p.send_tensor(hidden, g.next_rank(), g.data, dev)
            return None
        return out if ctx.is_output_rank else None


__all__ = ["EncoderRunner", "pool", "POOLINGS"]
