"""Turning the Linears of a shard built on the meta device into ``QuantLinear``s, and where their bytes come from.

``quantize_shard`` runs after the runner has cut the model to its stage and split it for tensor parallelism
and after the checkpoint source has mapped every tensor to its slice (all still on meta): each Linear of
the decoder layers (the runner's segments) loses its float weight for a ``qdata`` buffer of this rank's
rows and input blocks, and the source's read of that weight becomes a read that produces the bytes:

- a float checkpoint and ``quantization: int8 | int4-gG``: this rank's rows read whole (float32), quantized
  (``formats.quantize``: an int8 scale is its whole row's, at any TP split), and cut to its input blocks;
- a GGUF file: the rows' block bytes as the file holds them (``storage.gguf_native``).

A split that would cut a block (input features per TP rank not a multiple of the block) is refused with the
numbers. Embeddings, the LM head and norms stay in the model's float dtype.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, Optional

import torch
from torch import nn

from .._torch_compat import local_tensor
from ..models.local_tp import RowParallelLinear
from .formats import Format, quantize
from .linear import MODES, QuantLinear

log = logging.getLogger("computron.quant")

RowBytes = Callable[[object, int, int], torch.Tensor]
"""``(reader, first row, rows) -> uint8 [rows, row_bytes(full input features)]``: a weight's rows in its format."""


def default_mode(device: torch.device) -> str:
    """What the device computes with unless the model says: ``expand`` everywhere (``benchmarks/compressed.py``
    measured it faster than ``packed`` on the CPU: the float path's packed oneDNN/blocked products beat
    torch's int8/int4 CPU matmuls; no GPU measurement yet)."""
    return "expand"


def _linears(runner) -> Dict[int, tuple]:
    """The Linears of the runner's segments but its LM head (tied to the embeddings in many families)."""
    out = {}
    head = getattr(runner, "lm_head", None)
    for seg in runner.segments:
        if seg is head:
            continue
        for name, mod in seg.named_modules():
            if isinstance(mod, nn.Linear) and not isinstance(mod, QuantLinear):
                out[id(mod)] = (name, mod)
    return out


def weight_format(counts: Dict[str, int], fallback: str) -> str:
    """How a model's weights are named in its accounting: its quantized Linears' most common format
    (``gguf:Q4_1``), or ``fallback`` when none is."""
    return max(counts, key=lambda f: counts[f]) if counts else fallback


def slice_columns(rows: torch.Tensor, fmt: Format, n_in: int, first: int, count: int) -> torch.Tensor:
    """The bytes of input features ``[first, first + count)`` of full rows in ``fmt``."""
    if first == 0 and count == n_in:
        return rows
    if fmt.block == 0:
        return torch.cat([rows[:, first:first + count], rows[:, n_in:n_in + 4]], dim=1)
    a, b = first // fmt.block * fmt.block_bytes, (first + count) // fmt.block * fmt.block_bytes
    return rows[:, a:b]


def float_rows(fmt: Format, key: str, n_in: int, Read) -> RowBytes:
    """Rows of a float checkpoint tensor ``key``, quantized to ``fmt`` (``Read``: ``storage.checkpoint.Read``)."""

    def read(reader, first: int, rows: int) -> torch.Tensor:
        w = torch.empty(rows, n_in, dtype=torch.float32)
        reader.read_converting(Read(key, (first, 0), (rows, n_in)), w.view(-1), key)
        return quantize(w, fmt)
    return read


def quantize_shard(runner, source, mid: str, tp: int, device: torch.device, formats: Callable[[str], Optional[tuple]],
                   mode: Optional[str] = None) -> Dict[str, int]:
    """Replace the Linears of ``runner.segments`` whose checkpoint tensor ``formats(key)`` names a
    ``(Format, RowBytes, n_in)`` by ``QuantLinear``s computing in their float weight's dtype, in ``mode``
    (None: ``default_mode``); returns ``{format name: Linears}``. ValueError names a
    Linear whose split would cut a block."""
    mode = mode or default_mode(device)
    if mode not in MODES:
        raise ValueError(f"model {mid!r}: quantized compute mode {mode!r}: must be one of {MODES}")
    counts: Dict[str, int] = {}
    for name, mod in _linears(runner).values():
        weight = local_tensor(mod.weight)
        read = source.reads.get(id(weight))
        if read is None or read.key is None:
            continue
        found = formats(read.key)
        if found is None:
            continue
        fmt, rows_of, n_in_full = found
        row_parallel = isinstance(mod, RowParallelLinear)
        fmt.check_split(n_in_full, tp if row_parallel else 1, f"model {mid!r}: {read.key} ({name})")
        pieces = read.pieces()
        col0 = pieces[0].offsets[1] if len(pieces[0].offsets) > 1 else 0
        n_in = weight.shape[1]
        n_rows = weight.shape[0]
        qdata = torch.empty(n_rows, fmt.row_bytes(n_in), dtype=torch.uint8)

        def produce(reader, pieces=pieces, rows_of=rows_of, fmt=fmt, n_full=n_in_full, col0=col0, n_in=n_in):
            parts = [rows_of(reader, p.offsets[0] if p.offsets else 0, p.shape[0]) for p in pieces]
            return slice_columns(torch.cat(parts) if len(parts) > 1 else parts[0], fmt, n_full, col0, n_in)

        del mod._parameters["weight"]
        source.reads.pop(id(weight))
        mod.__class__ = QuantLinear
        mod.register_buffer("qdata", qdata)
        mod.fmt, mod.n_in, mod.mode, mod.compute_dtype = fmt, n_in, mode, weight.dtype
        mod.tp_group = mod.__dict__.get("tp_group") if row_parallel else None
        source.reads[id(qdata)] = type(read)(None, produce=produce)
        counts[fmt.name] = counts.get(fmt.name, 0) + 1
    return counts


__all__ = ["quantize_shard", "weight_format", "float_rows", "slice_columns", "default_mode", "RowBytes"]
