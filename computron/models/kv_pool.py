"""A paged KV pool: one preallocated key tensor and one value tensor per layer, cut into fixed-size blocks.

Each layer's pool is ``[kv_heads, num_blocks * block_size, head_dim]``; which slots hold which sequence's
tokens is ``sched.kv_blocks.BlockTables``' business. A step's tokens run as ONE ragged row (``[1, T]``: the
running sequences' newest tokens and the joining prompts, concatenated, no padding): ``prepare`` reserves
their slots and builds, once per step, the slot indices to write and to read, each token's position and the
attention mask; the model's attention layers then call ``update`` (transformers' cache interface), which
writes the step's keys and values into their slots (``index_copy_``, nothing else is copied into the pool).
What it returns is the attention backend's business (``attention``, ``backend``): ``gathered`` returns every
sequence's keys and values gathered in order, under a mask (block diagonal, causal, and windowed for
sliding-window layers) that keeps each token to its own sequence's past, for the model's own attention;
``paged`` returns the pool itself, which ``paged_attention`` reads through the step's block tables
(``forward_kwargs``: the step's metadata, a keyword of the backbone's forward); ``cpu_paged`` does so for
decode steps (the C kernel) and gathers for the others.

The pool grows (doubling, one copy per layer) when a step needs more blocks than are free; it starts at
``initial_blocks``. Prompts may start with blocks cached by earlier ones (``prepare``'s ``joins``; the
policy is ``BlockTables``'). ``park`` copies the blocks in use only (renumbered to the front of the pool) to host
memory and frees the device pool; ``unpark`` brings them back.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..sched.kv_blocks import BlockTables
from .paged_attention import ship

SLIDING = "sliding_attention"
FULL = "full_attention"


def layer_types(config) -> Optional[Tuple[str, ...]]:
    types = getattr(config, "layer_types", None)
    return tuple(types) if types else None


def mask_kinds(config) -> Tuple[str, ...]:
    """The attention masks this config's layers use: full, sliding, or both (a mapping then)."""
    types = layer_types(config)
    if types:
        return tuple(k for k in (FULL, SLIDING) if k in types)
    window = getattr(config, "sliding_window", None)
    return (SLIDING,) if window and getattr(config, "use_sliding_window", True) else (FULL,)


def token_kv_bytes(config, tp: int = 1, layers: Optional[int] = None) -> int:
    """The model's formula: KV bytes of one token over ``layers`` layers (all by default) of a rank holding
    1/``tp`` of the KV heads, 2 (K and V) x kv_heads x head_dim x the config's element size per layer."""
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", 1)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    size = torch.empty((), dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32).element_size()
    layers = config.num_hidden_layers if layers is None else layers
    return 2 * max(1, heads // max(1, tp)) * dim * size * max(1, layers)


def initial_blocks(config, tp: int, layers: int, block_size: int, budget_bytes: float, floor: int = 16) -> int:
    """Blocks of ``block_size`` tokens that ``budget_bytes`` hold over ``layers`` layers of a rank holding
    1/``tp`` of the KV heads (``token_kv_bytes``), at least ``floor``."""
    return max(floor, int(budget_bytes // (token_kv_bytes(config, tp, layers) * block_size)))


class PagedKV:
    """The cache object a stage's forward gets in paged mode (duck-typed as transformers' ``Cache``)."""

    is_compileable = False

    def __init__(self, config, block_size: int = 16, initial_blocks: int = 64):
        self.config = config
        self.tables = BlockTables(initial_blocks, block_size)
        self.keys: Dict[int, torch.Tensor] = {}    # layer_idx -> [kv_heads, slots, head_dim]
        self.values: Dict[int, torch.Tensor] = {}
        self.kinds = mask_kinds(config)
        self.window = getattr(config, "sliding_window", None)
        self.parked: Optional[Dict[int, Tuple[torch.Tensor, torch.Tensor]]] = None
        # one step's indices (prepare)
        self._write: Optional[torch.Tensor] = None
        self._read: Optional[torch.Tensor] = None
        self._shape: Optional[Tuple[int, int]] = None  # (rows, keys per row) of a decode step's gather
        self.batched = False
        self.pow2_width = False
        """Decode gathers as wide as the next power of two (>= 16): few distinct shapes, one CUDA graph each
        (``decode_compile``); the extra columns are masked. The pools are then marked static addresses."""
        self.backend = "gathered"
        """How the layers read the pool (``attention.BACKENDS``, resolved; set at load by the runner)."""
        self.step = None
        """The step's metadata for a backend reading the pool in place (``paged_attention.PagedStep`` or
        ``attention.DirectStep``), None where ``update`` gathers."""
        self.position_ids: Optional[torch.Tensor] = None
        self.last_index: Optional[torch.Tensor] = None
        self.counts: List[int] = []  # the step's computed tokens per row (a cached prefix is not)
        self._lengths: Optional[torch.Tensor] = None  # a decode step's keys per row

    # ---- transformers' Cache interface, as the models use it ------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions always come with the step (``position_ids``)

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs=None, kwargs=None):
        # [B, kv_heads, n, head_dim] -> [kv_heads, B * n, head_dim]: the step's tokens in row order
        k, v = (t.transpose(0, 1).reshape(t.shape[1], -1, t.shape[3]) for t in (key_states, value_states))
        pool_k = self.keys.get(layer_idx)
        if pool_k is None or pool_k.shape[1] < self.tables.num_blocks * self.tables.block_size:
            pool_k, pool_v = self._allocate(layer_idx, k)
        else:
            pool_v = self.values[layer_idx]
        pool_k.index_copy_(1, self._write, k.to(pool_k.dtype))
        pool_v.index_copy_(1, self._write, v.to(pool_v.dtype))
        if self.step is not None:  # the backend reads the pool in place
            return pool_k[None], pool_v[None]
        if self._shape is None:
            return pool_k.index_select(1, self._read)[None], pool_v.index_select(1, self._read)[None]
        b, width = self._shape
        return tuple(p.index_select(1, self._read).view(p.shape[0], b, width, p.shape[2]).transpose(0, 1)
                     for p in (pool_k, pool_v))

    def forward_kwargs(self) -> dict:
        """The keywords the backbone's forward passes down to its attention function this step."""
        return {"paged_step": self.step} if self.step is not None else {}

    def _window(self, layer_idx: int) -> int:
        """The sliding window of this layer's mask (as ``prepare`` builds them), 0 for full attention."""
        types = layer_types(self.config)
        kind = types[layer_idx] if types else self.kinds[0]
        return int(self.window) if kind == SLIDING and self.window else 0

    def _allocate(self, layer_idx: int, like: torch.Tensor):
        """The layer's pool at the table's current size (a first allocation, or a grown copy)."""
        slots = self.tables.num_blocks * self.tables.block_size
        heads, _, dim = like.shape
        new = [self._pool((heads, slots, dim), like.dtype, like.device) for _ in range(2)]
        old = (self.keys.get(layer_idx), self.values.get(layer_idx))
        for n, o in zip(new, old):
            if o is not None:
                n[:, :o.shape[1]].copy_(o)
        self.keys[layer_idx], self.values[layer_idx] = new
        return new

    def _pool(self, shape, dtype, device) -> torch.Tensor:
        """Zeros, not empty memory: a backend reading the pool in place weighs a block's unwritten slots by 0,
        and 0 x NaN (whatever the memory held) would be NaN."""
        t = torch.zeros(shape, dtype=dtype, device=device)
        if self.pow2_width:  # written in place by a CUDA graph: a static input, or inductor skips the graph
            torch._dynamo.mark_static_address(t)
        return t

    # ---- one step ------------------------------------------------------------------
    def prepare(self, new_tokens: Sequence[Tuple[int, int]], device: torch.device, dtype: torch.dtype,
                joins: Optional[Dict[int, Tuple[Sequence[int], Optional[str]]]] = None):
        """Reserve the step's slots: ``new_tokens`` is ``(sid, count)`` per sequence in row order (running
        ones with 1, joining ones with their prompt length). ``joins`` (prefix caching): ``{sid: (prompt,
        adapter name or "", or None for no cache)}`` of joining sequences, each of which starts with its
        prompt's cached prefix and counts only the rest (``self.counts``: each row's count, as computed), in
        row order, then registers its full prompt blocks, so that a later row of this very step may share
        them (each layer writes the step's keys before it reads). Returns the attention mask (a 4D additive
        mask, or a mapping of them by layer type where the model has several) for one of two layouts:

        - a decode step (every count 1): a batch of rows ``[B, 1]``, each row's keys gathered from its
          blocks into ``[B, kv_heads, L, head_dim]`` (``L`` the longest; the mask ``[B, 1, 1, L]`` hides
          the rest), so attention costs what each row attends, as in a batch of the dynamic cache;
        - any other step: ONE ragged row ``[1, T]`` of every sequence's new tokens, attending to every
          sequence's keys concatenated ``[1, kv_heads, S, head_dim]`` through a block-diagonal causal mask
          ``[1, 1, T, S]``.

        ``self.batched`` says which; ``position_ids`` ([B, 1] or [1, T]) and ``last_index`` (None, or the
        ragged row's index of each sequence's last token) go with it.

        Chunked prefill: a sequence part-way through its prompt is in ``joins`` too (its newly full blocks
        are registered) but attaches nothing; a row may then compute no token at all (its chunk was cached)."""
        joins, write, counts = joins or {}, [], []
        new = {sid for sid, _ in new_tokens if sid in joins and sid not in self.tables.tables}  # they attach
        bs = self.tables.block_size
        need = sum(self.tables.blocks_needed(sid, max(0, n - bs * len(self.tables.cached_prefix(*joins[sid])))
                                             if sid in new else n) for sid, n in new_tokens)
        if need > self.tables.free_blocks:  # one growth for the step, as far as the cache can tell
            self.tables.grow(max(2 * self.tables.num_blocks, self.tables.used_blocks + need))
        for sid, n in new_tokens:
            prompt, seed = joins.get(sid, ((), None))
            if sid in new:  # a first chunk may end inside the cached prefix: it then computes nothing
                n = max(0, n - self.tables.attach(sid, prompt, seed))
            need = self.tables.blocks_needed(sid, n)
            if need > self.tables.free_blocks:  # so that the append below cannot raise PoolFull
                self.tables.grow(max(2 * self.tables.num_blocks, self.tables.used_blocks + need))
            write += self.tables.append(sid, n)
            self.tables.register(sid, prompt, seed)
            counts.append(n)
        new_tokens, self.counts = list(zip([sid for sid, _ in new_tokens], counts)), counts
        self.batched = all(n == 1 for _, n in new_tokens)
        lengths = [self.tables.lengths[sid] for sid, _ in new_tokens]
        self.step = None
        if self.backend == "paged":
            return self._prepare_paged(new_tokens, lengths, write, device, dtype)
        if self.batched:
            width = max(lengths)
            if self.pow2_width:
                width = max(16, 1 << (width - 1).bit_length())
            read: List[int] = []
            for sid, _ in new_tokens:
                own = self.tables.slots(sid)
                read += own + [own[0]] * (width - len(own))  # padding reads a real slot, masked below
            self._write, self._read, self._lengths = ship([_long(write), _long(read), _long(lengths)], device)
            self._shape = (len(new_tokens), width)
            qp = self._lengths[:, None] - 1                  # [B, 1]
            kp = torch.arange(width, device=device)[None]    # [1, L]
            allowed = kp <= qp                               # its own keys only: beyond its length is padding
            self.position_ids, self.last_index = qp, None
            if self.backend == "cpu_paged" and dtype == torch.float32:
                from .attention import DirectStep
                self.step = DirectStep(self._read.view(len(new_tokens), width), self._lengths, self._window)
        else:
            read, q_seq, q_pos, k_seq, k_pos, last = [], [], [], [], [], []
            for i, ((sid, n), total) in enumerate(zip(new_tokens, lengths)):
                read += self.tables.slots(sid)
                q_seq += [i] * n
                q_pos += range(total - n, total)
                k_seq += [i] * total
                k_pos += range(total)
                last.append(len(q_pos) - 1)
            self._write, self._read, pos, self.last_index, qs, ks, kp = ship(
                [_long(x) for x in (write, read, q_pos, last, q_seq, k_seq, k_pos)], device)
            self._shape = None
            self.position_ids = pos[None]
            kp = kp[None]
            qp = self.position_ids[0][:, None]
            allowed = (qs[:, None] == ks[None, :]) & (kp <= qp)
        masks = {}
        for kind in self.kinds:
            ok = allowed & (qp - kp < int(self.window)) if kind == SLIDING and self.window else allowed
            m = torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, torch.finfo(dtype).min)
            masks[kind] = m[:, None, None] if self.batched else m[None, None]
        return masks if layer_types(self.config) else masks[self.kinds[0]]

    def _prepare_paged(self, new_tokens, lengths, write, device, dtype):
        """``prepare`` for the ``paged`` backend: no gather indices and no dense mask, the step's block masks
        instead (``paged_attention.build``); the mask handed to the model is a placeholder it passes on."""
        from .paged_attention import build
        counts = [n for _, n in new_tokens]
        q_pos, last = [], []
        for n, total in zip(counts, lengths):
            q_pos += range(total - n, total)
            last.append(len(q_pos) - 1)
        self._write, pos, last_index = ship([_long(write), _long(q_pos), _long(last)], device)
        self._read, self._shape, self._lengths = None, None, None
        if self.batched:
            self.position_ids, self.last_index = pos[:, None], None
        else:
            self.position_ids, self.last_index = pos[None], last_index
        windows = sorted({int(self.window) if kind == SLIDING and self.window else 0 for kind in self.kinds})
        self.step = build(counts, lengths, [self.tables.tables[sid] for sid, _ in new_tokens],
                          self.tables.num_blocks, self.tables.block_size, windows, self.batched, device)
        self.step.window_of = self._window
        placeholder = torch.zeros((1, 1, 1, 1), dtype=dtype, device=device)
        return {kind: placeholder for kind in self.kinds} if layer_types(self.config) else placeholder

    # ---- sequences and accounting --------------------------------------------------------
    def free(self, sids) -> None:
        self.tables.free(sids)

    def clear(self) -> None:
        self.tables.clear()

    def token_bytes(self) -> int:
        """KV bytes of one token over this rank's layers: 2 (K and V) x kv_heads x head_dim x element size."""
        src = self.keys if self.keys or not self.parked else {i: kv[0] for i, kv in self.parked.items()}
        return sum(2 * t.shape[0] * t.shape[2] * t.element_size() for t in src.values())

    def kv_bytes(self) -> int:
        """Bytes of the tokens held (the model's formula times the tokens), wherever they are."""
        return self.tables.used_tokens * self.token_bytes()

    def block_bytes(self) -> int:
        return self.tables.block_size * self.token_bytes()

    # ---- preemption --------------------------------------------------------------------
    def park(self, copy: Optional[bool] = None) -> int:
        """The model leaves its device: copy the blocks in use (only those, renumbered to the front) to host
        memory (pinned) and let the device pool go. Where the pool already is in host memory (a CPU
        "device") nothing is copied; either way the bytes of the blocks in use are returned (what a
        device's park moves). ``copy`` forces the copy (True) or not (False) whatever the device."""
        if self.parked is not None:
            return 0
        in_use = self.tables.used_blocks * self.block_bytes()
        if copy is None:
            copy = any(t.device.type != "cpu" for t in self.keys.values())
        if not copy or not self.keys:
            self.parked = {}
            return in_use
        order = self.tables.renumber()
        idx = _slot_index(order, self.tables.block_size, next(iter(self.keys.values())).device)
        cuda = idx.device.type == "cuda"
        self.parked, moved = {}, 0
        for layer in list(self.keys):
            host = []
            for t in (self.keys.pop(layer), self.values.pop(layer)):
                h = torch.empty((t.shape[0], len(idx), t.shape[2]), dtype=t.dtype, device="cpu", pin_memory=cuda)
                h.copy_(t.index_select(1, idx), non_blocking=cuda)
                host.append(h)
                moved += h.numel() * h.element_size()
            self.parked[layer] = tuple(host)
        if cuda:
            torch.cuda.current_stream().synchronize()
        return moved

    def unpark(self, device: torch.device) -> int:
        """Bring parked blocks back into a fresh device pool (at its front); return the bytes of the blocks
        in use (nothing is copied where the pool stayed in host memory)."""
        if self.parked is None:
            return 0
        in_use = self.tables.used_blocks * self.block_bytes()
        slots = self.tables.num_blocks * self.tables.block_size
        for layer, (k, v) in self.parked.items():
            new = []
            for t in (k, v):
                d = self._pool((t.shape[0], slots, t.shape[2]), t.dtype, device)
                d[:, :t.shape[1]].copy_(t, non_blocking=True)
                new.append(d)
            self.keys[layer], self.values[layer] = new
        self.parked = None
        return in_use


def _slot_index(blocks: List[int], block_size: int, device) -> torch.Tensor:
    b = torch.tensor(blocks, dtype=torch.long, device=device)
    return (b[:, None] * block_size + torch.arange(block_size, device=device)[None]).reshape(-1)


def _long(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


__all__ = ["PagedKV", "initial_blocks", "mask_kinds", "token_kv_bytes"]
