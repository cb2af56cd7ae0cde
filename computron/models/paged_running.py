"""A model's running sequences on one rank with their KV in a paged pool (``EngineConfig.kv_cache='paged'``).

The same interface as ``running.RunningBatch`` (what ``causal_lm.CausalLMRunner.step`` calls), but nothing is
padded: a step is one ragged row of tokens (each running sequence's newest token, then each joining prompt,
whole or a chunk of it under chunked prefill), every sequence's keys and values sit in blocks of one
``kv_pool.PagedKV`` per model, a sequence that leaves gives its blocks back (no row selection, no column cut),
and a joining one takes blocks (no compaction); a joining prompt may start with blocks that earlier prompts
cached (prefix caching: it computes only the rest). ``step_inputs`` returns the step's ``(input_ids, attention
masks, new columns)``: ``[B, 1]`` for a decode step (every row one token), else one ragged row ``[1, T]``
(``kv_pool.PagedKV.prepare``); the cache then carries the step's positions (``position_ids``) and, for a
ragged row, where each sequence's last token is (``last_index``).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .kv_pool import PagedKV
from .running import SequenceBook


class PagedBatch(SequenceBook):
    paged = True

    def __init__(self, config, block_size: int = 16, initial_blocks: int = 64, prefix_cache: bool = True):
        super().__init__()
        self._args = (config, block_size, initial_blocks)
        self.cache = PagedKV(config, block_size, initial_blocks)
        self.prefix_cache = prefix_cache
        """Joining prompts start with the blocks earlier prompts cached (``EngineConfig.prefix_cache``)."""
        self._new: List[int] = []                  # tokens per row of the current step
        self.prefilled = 0                         # prompt tokens the current step computes
        self.filling: Dict[int, Tuple[object, int]] = {}
        """Chunked prefill: sequences part-way through their prompt, apart from the running (decoding) ones:
        sid -> (spec, prompt tokens sent). They have blocks but no row, token or sampler yet."""

    @property
    def parked(self) -> bool:
        return self.cache.parked is not None

    def clear(self) -> None:
        """Forget every sequence; the pool's tensors stay allocated (reused by the next sequences)."""
        self.cache.clear()
        if self.cache.parked is not None:
            self.cache.parked = None
        self.sids, self.specs, self.counts, self.generators, self.last = [], {}, {}, {}, None
        self.samplers, self.filling = {}, {}

    def forget_prefixes(self) -> None:
        """No cached prompt block may be used again (an adapter was removed: its name may come back with
        other weights)."""
        self.cache.tables.forget_cache()

    def kv_bytes(self) -> int:
        return self.cache.kv_bytes()

    # ---- preemption ------------------------------------------------------------
    def park(self, copy=None) -> int:
        """Park the KV blocks in use (``kv_pool.PagedKV.park``); return their bytes."""
        if not (len(self) or self.filling) or self.parked:
            return 0
        return self.cache.park(copy)

    def unpark(self, device: torch.device) -> int:
        return self.cache.unpark(device) if self.parked else 0

    # ---- leaving -------------------------------------------------------------
    def drop(self, sids: Iterable[int]) -> None:
        sids = set(sids)
        filling = sids & set(self.filling)
        for s in filling:
            del self.filling[s]
        self.cache.free(filling)
        gone, keep = self._forget(sids)
        if not gone:
            return
        self.cache.free(gone)
        if not keep:
            self.sids, self.last = [], None
            return
        self.sids = [self.sids[i] for i in keep]
        self.last = self.last.index_select(0, torch.tensor(keep, dtype=torch.long, device=self.last.device))

    # ---- one forward for every row ------------------------------------------
    def pieces(self, admit: Sequence[object], fill: Sequence[Tuple[int, int]]):
        """The step's prefill rows under chunked prefill: ``(specs, ends, complete, rows)``: one spec per row
        (the ``fill`` chunks of sequences mid-prefill, then the joining ones: whole, or their first
        ``spec.chunk`` tokens) and how far into its prompt the row's chunk ends, the specs whose prompt
        completes in this step (sampled, they join the running rows) and each one's row. Sequences left
        mid-prefill wait in ``filling``."""
        specs, ends, complete, rows = [], [], [], []
        steps = [(self.filling[sid][0], self.filling[sid][1] + n) for sid, n in fill]
        steps += [(a, a.chunk or len(a.prompt)) for a in admit]
        for spec, end in steps:
            specs.append(spec)
            ends.append(end)
            if end < len(spec.prompt):
                self.filling[spec.sid] = (spec, end)
                continue
            self.filling.pop(spec.sid, None)
            complete.append(spec)
            rows.append(len(specs) - 1)
        return specs, ends, complete, rows

    def step_inputs(self, prompts: List[List[int]], sids: Sequence[int], device: torch.device,
                    dtype: torch.dtype, seeds: Optional[Sequence[Optional[str]]] = None,
                    ends: Optional[Sequence[int]] = None):
        """``(input_ids [1, T], mask(s), T)``: the running rows' newest tokens, then the prompts of the
        sequences ``sids`` (joining, or mid-prefill), in one row; their slots reserved in the pool. ``ends``
        (chunked prefill; whole prompts by default): each prompt's tokens up to there are in the pool after
        this step. With the prefix cache on, a joining prompt starts with its cached prefix (``seeds``: its
        adapter name, "" for the bare model, None for no cache; all "" by default) and every prompt computes
        only the tokens its sequence does not hold yet; ``prefilled`` is the prompt tokens computed."""
        seeds = [""] * len(prompts) if seeds is None else seeds
        ends = [len(p) for p in prompts] if ends is None else ends
        held = self.cache.tables.lengths
        joins = {sid: (p, seed) for sid, p, seed in zip(sids, prompts, seeds)} if self.prefix_cache else None
        counts = [1] * len(self) + [max(0, e - held.get(sid, 0)) for sid, e in zip(sids, ends)]
        mask = self.cache.prepare(list(zip(list(self.sids) + list(sids), counts)), device, dtype, joins)
        self._new = self.cache.counts
        self.prefilled = sum(self._new[len(self):])
        parts = [self.last] if len(self) else []
        parts += [torch.tensor(p[e - n:e], dtype=torch.int64, device=device)
                  for p, e, n in zip(prompts, ends, self._new[len(self):])]
        ids = torch.cat(parts)
        ids = ids[:, None] if self.cache.batched else ids[None]  # a decode step's batch, else one ragged row
        return ids, mask, ids.shape[1]

    @staticmethod
    def cache_seed(spec) -> Optional[str]:
        """What a joining sequence's prompt blocks are cached under: its adapter's name ("" for none), or
        None where it scores its prompt (every position's logits: nothing may come from the cache)."""
        return None if spec.prompt_logprobs is not None else (spec.adapter or "")

    def token_rows(self, rows: Sequence[object]) -> List[object]:
        """Per-row values (an adapter per sequence) repeated for each of the row's tokens in this step."""
        return [r for r, n in zip(rows, self._new) for _ in range(n)]

    @staticmethod
    def shared_prefill(specs: Sequence[object]) -> Tuple[List[int], List[int]]:
        """Every admitted sequence has its own row here (``RunningBatch.shared_prefill``'s shape): copies of
        one prompt share its cached blocks instead (``step_inputs``), with the prefix cache on."""
        return list(range(len(specs))), list(range(len(specs)))


__all__ = ["PagedBatch"]
