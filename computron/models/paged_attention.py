"""Owner: the ``paged`` attention backend: FlexAttention over the KV pool in place, through block tables.

A step's queries come as the pool's step layout gives them (``kv_pool.PagedKV.prepare``): a decode batch
``[B, H, 1, D]`` or one ragged row ``[1, H, T, D]``. ``build`` turns the step's block tables into, per group
of rows, a FlexAttention ``BlockMask`` whose key blocks are the pool's physical blocks (each query block
lists only its own sequence's blocks: those wholly before its first query as full blocks, which need no
mask, and the rest as partial ones), so that a query never meets another sequence's keys and the work is
the sum over rows of queries x keys. Rows of one query (decoding) form one group, each row of several
(a prompt, a chunk) a group of its own (inductor's CPU template does not compile several rows of several
queries with dynamic sizes, torch 2.13): a mixed step costs its decode step and its prefills, not a
``[T, S]`` product. The mask function maps a physical key slot to its position in its sequence
(``block_pos``: a block's index in its table, the same in every table holding it, for a shared prefix block
sits at the same place in every prompt that shares it) and keeps keys at or before the query (within the
sliding window, where the layer has one). The keys and values are the pool itself ``[1, KV, S, D]``:
FlexAttention broadcasts it over the rows and reads it in place, and ``enable_gqa`` shares each KV head
with its query heads without repeating it.

Outside a compiled graph FlexAttention runs through one ``torch.compile`` of it (dynamic shapes: one
graph for every batch size, query length and pool size, compiled on first use in the process, then cached
by inductor on disk); inside one (``decode_compile``) it is traced with the step. On a CPU the kernel is
inductor's C++ template, on CUDA Triton's: the same call. Every host-built tensor of a step is shipped to
the device in one copy (``ship``; pinned host memory on CUDA).
"""
from __future__ import annotations

import functools
import re
import types
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

Q_BLOCK = 64
"""Queries per block of a prefill group's mask (a decode group's are single queries)."""


def ship(tensors: Sequence[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
    """``tensors`` (host, int64) on ``device`` in ONE copy: concatenated into one host buffer (pinned where
    the device is CUDA, through torch's caching host allocator), copied without blocking, cut into views."""
    device = torch.device(device)
    if device.type == "cpu":
        return list(tensors)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if device.type == "cuda":
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)
    out, at = [], 0
    for t in tensors:
        out.append(flat[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


class Group(NamedTuple):
    """Rows of one query count class: ``tokens`` (ragged row index of each padded query, ``[R * Q]``, or None
    where the group is the whole decode batch in order), ``valid``/``dest`` (padded positions that are real
    queries, and their ragged index), per row the first query's position ``start`` and ``count``, and the
    mask's block lists per window: ``{window: (partial n, partial idx, full n, full idx)}``."""
    rows: int
    width: int
    tokens: Optional[torch.Tensor]
    valid: Optional[torch.Tensor]
    dest: Optional[torch.Tensor]
    start: torch.Tensor
    count: torch.Tensor
    blocks: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def _block_lists(tables: torch.Tensor, nblocks: torch.Tensor, start: torch.Tensor, count: torch.Tensor,
                 q_block: int, nq: int, block_size: int, window: int, width: int):
    """Each (row, query block)'s partial and full key blocks (physical ids, front-packed in ``[R, 1, nq,
    width]``) and their counts ``[R, 1, nq]``."""
    j = torch.arange(tables.shape[1])[None, None, :]                          # [1, 1, J]
    t = torch.arange(nq)[None, :, None]                                       # [1, nq, 1]
    lo = start[:, None, None] + t * q_block                                   # first query of the block
    hi = start[:, None, None] + torch.minimum((t + 1) * q_block, count[:, None, None]) - 1
    real = (t * q_block < count[:, None, None]) & (j < nblocks[:, None, None])
    k_lo, k_hi = j * block_size, j * block_size + block_size - 1
    near = (k_lo <= hi) & (lo - k_hi < window) if window else k_lo <= hi   # some query may see some key
    full = real & (k_hi <= lo) & ((hi - k_lo < window) if window else True)  # every query sees every key
    part = real & near & ~full
    out = []
    for m in (part, full):
        order = torch.sort(m.to(torch.int8), dim=-1, descending=True, stable=True).indices
        idx = torch.zeros(m.shape[0], 1, nq, width, dtype=torch.long)
        idx[:, 0, :, :m.shape[-1]] = torch.gather(tables[:, None, :].expand(-1, nq, -1), 2, order)
        out += [m.sum(-1)[:, None].long(), idx]
    return tuple(out)


def _group(rows: List[int], counts: Sequence[int], starts: Sequence[int], token_at: Sequence[int],
           tables: List[List[int]], block_size: int, windows: Sequence[int], width: int, decode_batch: bool):
    """One group's host tensors (``Group`` with host tensors)."""
    q = 1 if decode_batch else max(counts[r] for r in rows)
    q_block = 1 if q == 1 else Q_BLOCK
    q = -(-q // q_block) * q_block
    nq = q // q_block
    longest = max(len(tables[r]) for r in rows)
    tab = torch.tensor([tables[r] + [0] * (longest - len(tables[r])) for r in rows], dtype=torch.long)
    nblocks = torch.tensor([len(tables[r]) for r in rows], dtype=torch.long)
    start = torch.tensor([starts[r] for r in rows], dtype=torch.long)
    count = torch.tensor([counts[r] for r in rows], dtype=torch.long)
    blocks = {w: _block_lists(tab, nblocks, start, count, q_block, nq, block_size, w, width) for w in windows}
    tokens = valid = dest = None
    if not decode_batch:
        pad = [token_at[r] + i if i < counts[r] else 0 for r in rows for i in range(q)]
        tokens = torch.tensor(pad, dtype=torch.long)
        valid = torch.tensor([k * q + i for k, r in enumerate(rows) for i in range(counts[r])], dtype=torch.long)
        dest = torch.tensor([token_at[r] + i for r in rows for i in range(counts[r])], dtype=torch.long)
    return Group(len(rows), q, tokens, valid, dest, start, count, blocks)


def build(counts: Sequence[int], lengths: Sequence[int], tables: List[List[int]], num_blocks: int,
          block_size: int, windows: Sequence[int], batched: bool, device: torch.device) -> "PagedStep":
    """The step's ``PagedStep``: ``counts`` (queries per row this step), ``lengths`` (each row's tokens after
    it), ``tables`` (each row's physical blocks in order), the pool's ``num_blocks``, the windows its layers
    use (0: full attention), and whether the queries come as a decode batch (``batched``)."""
    starts = [n - c for n, c in zip(lengths, counts)]
    token_at, at = [], 0
    for c in counts:
        token_at.append(at)
        at += c
    decode = [r for r, c in enumerate(counts) if c == 1]
    other = [r for r, c in enumerate(counts) if c > 1]
    groups = []
    if batched:
        groups.append(_group(decode, counts, starts, token_at, tables, block_size, windows, num_blocks, True))
    else:
        for rows in ([decode] if decode else []) + [[r] for r in other]:
            groups.append(_group(rows, counts, starts, token_at, tables, block_size, windows, num_blocks, False))
    block_pos = torch.zeros(num_blocks, dtype=torch.long)
    for table in tables:
        block_pos[torch.tensor(table, dtype=torch.long)] = torch.arange(len(table))
    host = [block_pos]
    for g in groups:
        host += [t for t in (g.tokens, g.valid, g.dest, g.start, g.count) if t is not None]
        for lists in g.blocks.values():
            host += list(lists)
    shipped = iter(ship(host, device))
    block_pos = next(shipped)
    placed = []
    for g in groups:
        moved = [next(shipped) if t is not None else None for t in (g.tokens, g.valid, g.dest)]
        start, count = next(shipped), next(shipped)
        blocks = {w: tuple(next(shipped) for _ in range(4)) for w in g.blocks}
        placed.append(Group(g.rows, g.width, *moved, start, count, blocks))
    return PagedStep(placed, block_pos, block_size, at, batched)


def _mask(block_pos: torch.Tensor, start: torch.Tensor, count: torch.Tensor, block_size: int,
          window: Optional[torch.Tensor]) -> Callable:
    """The mask function; a window comes as a tensor (a Python int would be a symbolic size under dynamic
    shapes, which inductor's CPU template does not compile)."""
    def mask_mod(b, h, q_idx, kv_idx):
        kv_pos = block_pos[kv_idx // block_size] * block_size + kv_idx % block_size
        q_pos = start[b] + q_idx
        ok = (kv_pos <= q_pos) & (q_idx < count[b])
        return ok & (q_pos - kv_pos < window[b]) if window is not None else ok
    return mask_mod


@functools.lru_cache(maxsize=None)
def _softcap(cap: float) -> Callable:
    """Gemma-style soft-capping of the scores (the cap a tensor, as ``_mask``'s window)."""
    limit = torch.tensor(cap, dtype=torch.float32)

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / limit) * limit
    return score_mod


def _call(query, key, value, block_mask, scale, enable_gqa, score_mod):
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                          score_mod=score_mod)


@functools.lru_cache(maxsize=None)
def compiled(bucket: Tuple) -> Callable:
    """The compiled FlexAttention of one shape bucket (heads, KV heads, head size, dtype, device, whether
    there is a window, a soft cap, one row, one query per row): each its own function (a code object of its
    own), for dynamo keeps at most ``recompile_limit`` graphs per code object and specialises sizes 1 and
    head counts; within a bucket, sizes are dynamic (one graph for every batch, query length and pool)."""
    name = "paged_flex_" + re.sub(r"\W", "_", "_".join(map(str, bucket)))  # the same in every process:
    fn = types.FunctionType(_call.__code__.replace(co_name=name), _call.__globals__)  # inductor's disk cache hits
    return torch.compile(fn, dynamic=True, fullgraph=True)


def flex(query, key, value, block_mask, scale: float, softcap: Optional[float], window: bool = False):
    """FlexAttention of ``query`` [R, H, Q, D] over the pool ``key``/``value`` [1, KV, S, D]."""
    gqa = query.shape[1] != key.shape[1]
    score_mod = _softcap(float(softcap)) if softcap else None
    if torch.compiler.is_compiling():
        return _call(query, key, value, block_mask, scale, gqa, score_mod)
    bucket = (query.shape[1], key.shape[1], query.shape[3], query.dtype, query.device.type, window,
              score_mod is not None, query.shape[0] == 1, query.shape[2] == 1)
    return compiled(bucket)(query, key, value, block_mask, scale, gqa, score_mod)


class PagedStep:
    """One step's block masks, by group and window; ``attend`` runs a layer's attention with them."""

    def __init__(self, groups: List[Group], block_pos: torch.Tensor, block_size: int, tokens: int, batched: bool):
        self.groups, self.block_pos, self.block_size = groups, block_pos, block_size
        self.tokens, self.batched = tokens, batched
        self.window_of: Callable[[int], int] = lambda layer: 0
        """A layer's sliding window (0: none); ``kv_pool.PagedKV`` sets it."""
        self._masks: Dict[Tuple[int, int], object] = {}

    def block_mask(self, g: int, window: int, seq_kv: int):
        key = (g, window)
        if key not in self._masks:
            from torch.nn.attention.flex_attention import BlockMask
            group = self.groups[g]
            part_n, part_i, full_n, full_i = group.blocks[window]
            q_block = 1 if group.width == 1 else Q_BLOCK
            self._masks[key] = BlockMask.from_kv_blocks(
                part_n.int(), part_i.int(), full_n.int(), full_i.int(), BLOCK_SIZE=(q_block, self.block_size),
                mask_mod=_mask(self.block_pos, group.start, group.count, self.block_size,
                               torch.full_like(group.start, window) if window else None),
                seq_lengths=(group.width, seq_kv), compute_q_blocks=False)
        return self._masks[key]

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               softcap: Optional[float] = None) -> torch.Tensor:
        """``query`` [B, H, n, D] (the step's layout) against the pool ``key``/``value`` [1, KV, S, D];
        returns [B, n, H, D], as transformers' attention functions do."""
        window = self.window_of(layer)
        if self.batched:
            query = query.contiguous()  # the layers' is a transposed view (inductor's CPU template wants strides)
            out = flex(query, key, value, self.block_mask(0, window, key.shape[2]), scale, softcap, bool(window))
            return out.transpose(1, 2)
        heads, dim = query.shape[1], query.shape[3]
        flat = query[0]                                                        # [H, T, D]
        result = flat.new_empty(heads, self.tokens, value.shape[-1])
        for g, group in enumerate(self.groups):
            q = flat.index_select(1, group.tokens).view(heads, group.rows, group.width, dim).transpose(0, 1)
            q = q.contiguous()  # the strides of a decode batch's query (inductor's CPU template wants them)
            out = flex(q, key, value, self.block_mask(g, window, key.shape[2]), scale, softcap, bool(window))
            out = out.transpose(0, 1).reshape(heads, -1, out.shape[-1])
            result.index_copy_(1, group.dest, out.index_select(1, group.valid))
        return result.transpose(0, 1)[None]


__all__ = ["PagedStep", "Q_BLOCK", "build", "flex", "ship"]
