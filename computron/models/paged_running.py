"""A model's running sequences on one rank with their KV in a paged pool (``EngineConfig.kv_cache='paged'``).

The same interface as ``running.RunningBatch`` (what ``causal_lm.CausalLMRunner.step`` calls), but nothing is
padded: a step is one ragged row of tokens (each running sequence's newest token, then each joining prompt
whole), every sequence's keys and values sit in blocks of one ``kv_pool.PagedKV`` per model, a sequence that
leaves gives its blocks back (no row selection, no column cut), and a joining one takes blocks (no
compaction). ``step_inputs`` returns the step's ``(input_ids, attention masks, new columns)``: ``[B, 1]`` for
a decode step (every row one token), else one ragged row ``[1, T]`` (``kv_pool.PagedKV.prepare``); the cache
then carries the step's positions (``position_ids``) and, for a ragged row, where each sequence's last token
is (``last_index``).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Sequence, Tuple

import torch

from .kv_pool import PagedKV
from .running import SequenceBook


class PagedBatch(SequenceBook):
    paged = True

    def __init__(self, config, block_size: int = 16, initial_blocks: int = 64):
        super().__init__()
        self._args = (config, block_size, initial_blocks)
        self.cache = PagedKV(config, block_size, initial_blocks)
        self._new: List[int] = []                  # tokens per row of the current step
        self.filling: Dict[int, Tuple[object, int]] = {}
        """Chunked prefill: sequences part-way through their prompt, apart from the running (decoding) ones:
        sid -> (spec, prompt tokens in the pool). They have blocks but no row, token or sampler yet."""

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
        """The step's prefill rows under chunked prefill: ``(specs, prompts, complete, rows)`` with one spec
        and one token list per row (the ``fill`` chunks of sequences mid-prefill, then the joining ones: whole,
        or the first ``spec.chunk`` tokens), the specs whose prompt completes in this step (sampled, they join
        the running rows) and each one's row. Sequences left mid-prefill wait in ``filling``."""
        specs, prompts, complete, rows = [], [], [], []
        steps = [(self.filling[sid][0], self.filling[sid][1], n) for sid, n in fill]
        steps += [(a, 0, a.chunk or len(a.prompt)) for a in admit]
        for spec, at, n in steps:
            specs.append(spec)
            prompts.append(list(spec.prompt[at:at + n]))
            if at + n < len(spec.prompt):
                self.filling[spec.sid] = (spec, at + n)
                continue
            self.filling.pop(spec.sid, None)
            complete.append(spec)
            rows.append(len(specs) - 1)
        return specs, prompts, complete, rows

    def step_inputs(self, prompts: List[List[int]], sids: Sequence[int], device: torch.device,
                    dtype: torch.dtype):
        """``(input_ids [1, T], mask(s), T)``: the running rows' newest tokens, then the prompts of the
        sequences ``sids`` (joining), in one row; their slots reserved in the pool."""
        self._new = [1] * len(self) + [len(p) for p in prompts]
        mask = self.cache.prepare(list(zip(list(self.sids) + list(sids), self._new)), device, dtype)
        parts = [self.last] if len(self) else []
        parts += [torch.tensor(p, dtype=torch.int64, device=device) for p in prompts]
        ids = torch.cat(parts)
        ids = ids[:, None] if self.cache.batched else ids[None]  # a decode step's batch, else one ragged row
        return ids, mask, ids.shape[1]

    def token_rows(self, rows: Sequence[object]) -> List[object]:
        """Per-row values (an adapter per sequence) repeated for each of the row's tokens in this step."""
        return [r for r, n in zip(rows, self._new) for _ in range(n)]

    @staticmethod
    def shared_prefill(specs: Sequence[object]) -> Tuple[List[int], List[int]]:
        """Every admitted sequence prefills its own row here (``RunningBatch.shared_prefill``'s shape): a copy
        of a shared prompt's KV would be a copy of its blocks, which the pool does not share yet."""
        return list(range(len(specs))), list(range(len(specs)))


__all__ = ["PagedBatch"]
