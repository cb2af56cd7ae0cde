"""Block accounting of a paged KV pool (policy only: no torch; ``models/kv_pool.py`` holds the tensors).

The pool is ``num_blocks`` blocks of ``block_size`` token slots. Each sequence owns a list of blocks (its
block table) holding its tokens in order: token ``i`` of the sequence lives in slot
``table[i // block_size] * block_size + i % block_size``. A sequence takes a new block only when its last one
is full, so it wastes at most ``block_size - 1`` slots, and gives all of them back when it leaves. Free blocks
are reused lowest first (the pool's used part stays dense at its start, which is what a park copies).

Every rank of a model applies the same calls in the same order, so their tables are identical.
"""
from __future__ import annotations

import heapq
from typing import Dict, Iterable, List


class PoolFull(RuntimeError):
    """The pool has fewer free blocks than a reservation needs (``grow`` it, or admit less)."""


class BlockTables:
    def __init__(self, num_blocks: int, block_size: int):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r}: must be an int >= 1")
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks!r}: must be an int >= 0")
        self.block_size = block_size
        self.num_blocks = 0
        self._free: List[int] = []
        self.tables: Dict[int, List[int]] = {}
        self.lengths: Dict[int, int] = {}
        self.grow(num_blocks)

    # ---- capacity ----------------------------------------------------------------
    def grow(self, num_blocks: int) -> None:
        """The pool now has ``num_blocks`` blocks (never fewer than before)."""
        if num_blocks < self.num_blocks:
            raise ValueError(f"grow({num_blocks}): the pool already has {self.num_blocks} blocks")
        for b in range(self.num_blocks, num_blocks):
            heapq.heappush(self._free, b)
        self.num_blocks = num_blocks

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def used_tokens(self) -> int:
        return sum(self.lengths.values())

    def blocks_needed(self, sid: int, new_tokens: int) -> int:
        """Blocks sequence ``sid`` (new or not) must take to hold ``new_tokens`` more tokens."""
        have = len(self.tables.get(sid, ()))
        return max(0, -(-(self.lengths.get(sid, 0) + new_tokens) // self.block_size) - have)

    def high_water(self) -> int:
        """One past the highest block in use (0 when none): the used prefix of the pool."""
        return max((max(t) + 1 for t in self.tables.values() if t), default=0)

    # ---- sequences -----------------------------------------------------------------
    def append(self, sid: int, new_tokens: int) -> List[int]:
        """Reserve slots for ``new_tokens`` more tokens of ``sid`` (a new sequence starts empty); return
        their slot indices in order. ``PoolFull`` (nothing reserved) when the free blocks do not suffice."""
        if new_tokens < 0:
            raise ValueError(f"new_tokens={new_tokens}: must be >= 0")
        need = self.blocks_needed(sid, new_tokens)
        if need > len(self._free):
            raise PoolFull(f"sequence {sid} needs {need} more blocks of {self.block_size} tokens; "
                           f"{len(self._free)} of {self.num_blocks} are free")
        table = self.tables.setdefault(sid, [])
        self.lengths.setdefault(sid, 0)
        for _ in range(need):
            table.append(heapq.heappop(self._free))
        start = self.lengths[sid]
        self.lengths[sid] = start + new_tokens
        return self._slots(table, start, start + new_tokens)

    def slots(self, sid: int) -> List[int]:
        """The slot of every token of ``sid``, in order."""
        return self._slots(self.tables[sid], 0, self.lengths[sid])

    def _slots(self, table: List[int], start: int, end: int) -> List[int]:
        bs = self.block_size
        return [table[i // bs] * bs + i % bs for i in range(start, end)]

    def free(self, sids: Iterable[int]) -> int:
        """Give back every block of these sequences (unknown ones are ignored); return the blocks freed."""
        n = 0
        for sid in sids:
            for b in self.tables.pop(sid, ()):
                heapq.heappush(self._free, b)
                n += 1
            self.lengths.pop(sid, None)
        return n

    def renumber(self) -> List[int]:
        """Give the used blocks the numbers 0..n-1 (keeping their order) in every table, the others the rest;
        return the old numbers in the new order (what a copy of the used blocks to the pool's front reads)."""
        order = sorted(b for table in self.tables.values() for b in table)
        new_of = {b: i for i, b in enumerate(order)}
        for sid, table in self.tables.items():
            self.tables[sid] = [new_of[b] for b in table]
        self._free = list(range(len(order), self.num_blocks))  # ascending: already a heap
        return order

    def clear(self) -> None:
        self.free(list(self.tables))


__all__ = ["BlockTables", "PoolFull"]
