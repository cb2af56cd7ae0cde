"""Tensor-parallel splits DTensor cannot express, made on plain tensors: each rank keeps chosen row ranges.

A DTensor ``Shard(0)`` gives rank ``r`` the ``r``-th of ``tp`` equal row blocks. Three splits need other
rows, so they are made here on plain parameters that hold only this rank's rows:

- a fused projection (Phi-3's ``qkv_proj``, ``gate_up_proj``): rank ``r`` keeps its block of each part;
- KV heads fewer than TP ranks: rank ``r`` keeps the one KV head its query heads use (several ranks hold
  the same head, as vLLM does);
- the vocabulary-parallel embedding and LM head: rank ``r`` keeps its block of the vocabulary.

The rows a parameter keeps are recorded on its module (``ROW_PIECES``: attribute -> ``(full shape,
((first row, rows), ...))``), where the checkpoint reader finds them and reads only those rows.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .._torch_compat import direct_tensor, set_parameter

ROW_PIECES = "_computron_row_pieces"

Pieces = Tuple[Tuple[int, int], ...]


def pieces_of(module: nn.Module, attr: str):
    """``(full shape, pieces)`` of a parameter split here, else None."""
    return module.__dict__.get(ROW_PIECES, {}).get(attr)


def block(n: int, tp: int, rank: int) -> Tuple[int, int]:
    """``(first, count)`` of rank ``rank``'s block of ``n`` rows in ``tp`` blocks (``torch.chunk`` sizes)."""
    chunk = -(-n // tp)
    first = min(rank * chunk, n)
    return first, max(0, min(n, first + chunk) - first)


def packed_pieces(parts: Sequence[Tuple[int, Pieces]]) -> Pieces:
    """Rows of a fused Linear whose parts (``(rows, this rank's pieces of them)``) are stacked in order."""
    out, start = [], 0
    for size, local in parts:
        out.extend((start + a, n) for a, n in local)
        start += size
    return tuple(out)


def kv_head_pieces(kv_heads: int, head_dim: int, tp: int, rank: int) -> Pieces:
    """Rows of the KV heads rank ``rank`` keeps: its block of them, or, where TP exceeds them, the one
    head its query heads use (``tp`` a multiple of ``kv_heads``)."""
    if kv_heads >= tp:
        first, count = block(kv_heads, tp, rank)
        return ((first * head_dim, count * head_dim),)
    head = rank // (tp // kv_heads)
    return ((head * head_dim, head_dim),)


def split_rows(holders: List[Tuple[nn.Module, str]], pieces: Pieces, ctx) -> None:
    """Give every ``(module, attr)`` in ``holders`` (one parameter, tied where several) a parameter of only
    ``pieces`` of its rows. Real weights come from TP rank ``ctx.scatter_from`` (broadcast first: ranks may
    have built different random weights) unless it is None (each rank cuts its own identical copy)."""
    full = direct_tensor(*holders[0])
    shape = tuple(full.shape)
    rows = sum(n for _, n in pieces)
    if full.is_meta:
        local = torch.empty((rows, *shape[1:]), dtype=full.dtype, device="meta")
    else:
        data = full.detach()
        if ctx.scatter_from is not None and ctx.tp > 1:
            data = data.contiguous()
            dist.broadcast(data, dist.get_global_rank(ctx.groups.tp_group, ctx.scatter_from),
                           group=ctx.groups.tp_group)
        local = torch.cat([data[a:a + n] for a, n in pieces]).clone()
    param = nn.Parameter(local, requires_grad=False)
    for mod, attr in holders:
        set_parameter(mod, attr, param)
        mod.__dict__.setdefault(ROW_PIECES, {})[attr] = (shape, tuple(pieces))


def tp_rank(ctx) -> int:
    return ctx.layout.tp_rank_of(ctx.groups.rank)


class VocabParallelEmbedding(nn.Embedding):
    """An embedding holding rows ``[vocab_start, vocab_start + rows)``: ids outside give zeros, and the
    partial embeddings are summed over the TP group."""

    vocab_start = 0
    tp_group = None

    def forward(self, ids):
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx)
        out = out.masked_fill(outside[..., None], 0)
        dist.all_reduce(out, group=self.tp_group)
        return out


def gather_vocab(logits: torch.Tensor, vocab: int, tp: int, group) -> torch.Tensor:
    """The whole ``[..., vocab]`` logits from each TP rank's block (blocks padded to equal size)."""
    chunk = -(-vocab // tp)
    if logits.shape[-1] < chunk:
        logits = F.pad(logits, (0, chunk - logits.shape[-1]))
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)[..., :vocab]


def split_vocab(embedding: nn.Module, lm_head: nn.Module, ctx) -> None:
    """Split the embedding and the LM head (either may be None: not on this stage) by vocabulary blocks,
    keeping them tied where they share one weight."""
    tp, rank = ctx.tp, tp_rank(ctx)
    done = set()
    for mod in (embedding, lm_head):
        if mod is None or id(mod.weight) in done:
            continue
        vocab = mod.weight.shape[0]
        first, count = block(vocab, tp, rank)
        holders = [(m, "weight") for m in (embedding, lm_head) if m is not None and m.weight is mod.weight]
        split_rows(holders, ((first, count),), ctx)
        done.add(id(mod.weight))
        if getattr(mod, "bias", None) is not None:
            split_rows([(mod, "bias")], ((first, count),), ctx)
    if embedding is not None:
        first, _ = block(embedding.num_embeddings, tp, rank)
        embedding.__class__ = _vocab_parallel_class(type(embedding))
        embedding.vocab_start, embedding.tp_group = first, ctx.groups.tp_group


_CLASSES = {}


def _vocab_parallel_class(cls: type) -> type:
    """``VocabParallelEmbedding`` for a plain embedding; for a subclass (Gemma's scaled embedding), the
    subclass with the vocabulary-parallel lookup beneath its own forward (what its ``super().forward`` calls)."""
    if cls is nn.Embedding or issubclass(cls, VocabParallelEmbedding):
        return VocabParallelEmbedding if cls is nn.Embedding else cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"VocabParallel{cls.__name__}", (cls, VocabParallelEmbedding), {})
    return _CLASSES[cls]


__all__ = ["ROW_PIECES", "pieces_of", "block", "packed_pieces", "kv_head_pieces", "split_rows", "tp_rank",
           "VocabParallelEmbedding", "gather_vocab", "split_vocab"]
