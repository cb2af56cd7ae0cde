"""A model's running sequences on one rank with their KV in a paged pool (``EngineConfig.kv_cache='paged'``).

The same interface as ``running.RunningBatch`` (what ``causal_lm.CausalLMRunner.step`` calls), but nothing is
padded: a step is one ragged row of tokens (each running sequence's newest token, then each joining prompt
whole), every sequence's keys and values sit in blocks of one ``kv_pool.PagedKV`` per model, a sequence that
leaves gives its blocks back (no row selection, no column cut), and a joining one takes blocks (no
compaction); a joining prompt may start with blocks that earlier prompts cached (prefix caching: it
computes only the rest). ``step_inputs`` returns the step's ``(input_ids, attention masks, new columns)``:
``[B, 1]`` for a decode step (every row one token), else one ragged row ``[1, T]``
(``kv_pool.PagedKV.prepare``); the cache then carries the step's positions (``position_ids``) and, for a
ragged row, where each sequence's last token is (``last_index``).
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple

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

    @property
    def parked(self) -> bool:
        return self.cache.parked is not None

    def clear(self) -> None:
        """Forget every sequence; the pool's tensors stay allocated (reused by the next sequences)."""
        self.cache.clear()
        if self.cache.parked is not None:
            self.cache.parked = None
        self.sids, self.specs, self.counts, self.generators, self.last = [], {}, {}, {}, None
        self.samplers = {}

    def forget_prefixes(self) -> None:
        """No cached prompt block may be used again (an adapter was removed: its name may come back with
        other weights)."""
        self.cache.tables.forget_cache()

    def kv_bytes(self) -> int:
        return self.cache.kv_bytes()

    # ---- preemption ------------------------------------------------------------
    def park(self, copy=None) -> int:
        """Park the KV blocks in use (``kv_pool.PagedKV.park``); return their bytes."""
        if not len(self) or self.parked:
            return 0
        return self.cache.park(copy)

    def unpark(self, device: torch.device) -> int:
        return self.cache.unpark(device) if self.parked else 0

    # ---- leaving -------------------------------------------------------------
    def drop(self, sids: Iterable[int]) -> None:
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
    def step_inputs(self, prompts: List[List[int]], sids: Sequence[int], device: torch.device,
                    dtype: torch.dtype, seeds: Optional[Sequence[Optional[str]]] = None):
        """``(input_ids [1, T], mask(s), T)``: the running rows' newest tokens, then the prompts of the
        sequences ``sids`` (joining), in one row; their slots reserved in the pool. With the prefix cache on,
        a prompt computes only what follows its cached prefix (``seeds``: its adapter name, "" for the bare
        model, None for no cache; all "" by default); ``prefilled`` is the prompt tokens computed."""
        if seeds is None:
            seeds = [""] * len(prompts)
        joins = {sid: (p, seed) for sid, p, seed in zip(sids, prompts, seeds)} if self.prefix_cache else None
        mask = self.cache.prepare(list(zip(list(self.sids) + list(sids), [1] * len(self) + [len(p) for p in prompts])),
                                  device, dtype, joins)
        self._new = self.cache.counts
        self.prefilled = sum(self._new[len(self):])
        parts = [self.last] if len(self) else []
        parts += [torch.tensor(p[len(p) - n:], dtype=torch.int64, device=device)
                  for p, n in zip(prompts, self._new[len(self):])]
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
