"""Block accounting of a paged KV pool (policy only: no torch; ``models/kv_pool.py`` holds the tensors).

The pool is ``num_blocks`` blocks of ``block_size`` token slots. Each sequence owns a list of blocks (its
block table) holding its tokens in order: token ``i`` of the sequence lives in slot
``table[i // block_size] * block_size + i % block_size``. A sequence takes a new block only when its last one
is full, so it wastes at most ``block_size - 1`` slots, and gives all of them back when it leaves. Free blocks
are reused lowest first (the pool's used part stays dense at its start, which is what a park copies).

Prefix caching: a block filled by a prompt's tokens only is registered under a content hash that chains every
token up to its end (block ``i`` of a prompt covers tokens ``0 .. (i + 1) * block_size - 1``, seeded by the
sequence's adapter name, so a LoRA sequence never shares with the bare model). A new prompt ``attach``es the
longest chain of registered blocks it starts with (at most ``(len(prompt) - 1) // block_size`` blocks: its
last token is always computed, for its logits) and computes only the rest. Blocks are reference counted;
one no sequence holds any more stays cached (evictable, least recently used first) until ``append`` needs it,
after the truly free blocks. A cached block is never written again (a sequence writes after its cached
prefix, which ends at a block boundary), so sharing needs no copy.

Every rank of a model applies the same calls in the same order, so their tables are identical.
"""
from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence


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
        self._refs: Dict[int, int] = {}               # block -> sequences holding it (in use: > 0)
        self._hash_of: Dict[int, bytes] = {}          # cached block -> its chained content hash
        self._block_of: Dict[bytes, int] = {}
        self._idle: "OrderedDict[int, None]" = OrderedDict()  # cached blocks no sequence holds, LRU first
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
        """Blocks ``append`` may take: the truly free ones and the cached ones no sequence holds."""
        return len(self._free) + len(self._idle)

    @property
    def used_blocks(self) -> int:
        """Blocks some sequence holds (a shared block counts once)."""
        return len(self._refs)

    @property
    def cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, held or not."""
        return len(self._hash_of)

    @property
    def used_tokens(self) -> int:
        """Tokens of every sequence (a shared prefix counts once per sequence holding it)."""
        return sum(self.lengths.values())

    def blocks_needed(self, sid: int, new_tokens: int) -> int:
        """Blocks sequence ``sid`` (new or not) must take to hold ``new_tokens`` more tokens."""
        have = len(self.tables.get(sid, ()))
        return max(0, -(-(self.lengths.get(sid, 0) + new_tokens) // self.block_size) - have)

    def high_water(self) -> int:
        """One past the highest block in use (0 when none): the used prefix of the pool."""
        return max(self._refs, default=-1) + 1

    # ---- sequences -----------------------------------------------------------------
    def append(self, sid: int, new_tokens: int) -> List[int]:
        """Reserve slots for ``new_tokens`` more tokens of ``sid`` (a new sequence starts empty); return
        their slot indices in order. ``PoolFull`` (nothing reserved) when the free blocks do not suffice."""
        if new_tokens < 0:
            raise ValueError(f"new_tokens={new_tokens}: must be >= 0")
        need = self.blocks_needed(sid, new_tokens)
        if need > self.free_blocks:
            raise PoolFull(f"sequence {sid} needs {need} more blocks of {self.block_size} tokens; "
                           f"{self.free_blocks} of {self.num_blocks} are free")
        table = self.tables.setdefault(sid, [])
        self.lengths.setdefault(sid, 0)
        for _ in range(need):
            b = heapq.heappop(self._free) if self._free else self._evict()
            self._refs[b] = 1
            table.append(b)
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
        """Give back every block of these sequences (unknown ones are ignored); return the blocks no sequence
        holds any more. A cached one stays cached (its last blocks first in line for eviction)."""
        n = 0
        for sid in sids:
            for b in reversed(self.tables.pop(sid, ())):
                self._refs[b] -= 1
                if self._refs[b]:
                    continue
                del self._refs[b]
                n += 1
                if b in self._hash_of:
                    self._idle[b] = None
                else:
                    heapq.heappush(self._free, b)
            self.lengths.pop(sid, None)
        return n

    def _evict(self) -> int:
        b, _ = self._idle.popitem(last=False)
        del self._block_of[self._hash_of.pop(b)]
        return b

    # ---- prefix cache ----------------------------------------------------------------
    def block_hashes(self, prompt: Sequence[int], seed: str = "") -> List[bytes]:
        """The chained content hash of each full block of ``prompt`` (``seed``: the adapter name, or "")."""
        bs, out = self.block_size, []
        h = hashlib.sha256(b"computron-kv\0" + seed.encode()).digest()
        for i in range(len(prompt) // bs):
            h = hashlib.sha256(h + array("q", prompt[i * bs:(i + 1) * bs]).tobytes()).digest()
            out.append(h)
        return out

    def cached_prefix(self, prompt: Sequence[int], seed: Optional[str] = "") -> List[int]:
        """The cached blocks ``prompt`` starts with (the longest chain, leaving its last token uncached;
        none where ``seed`` is None)."""
        found: List[int] = []
        if seed is None:
            return found
        for h in self.block_hashes(prompt[:max(0, len(prompt) - 1)], seed):
            b = self._block_of.get(h)
            if b is None:
                break
            found.append(b)
        return found

    def attach(self, sid: int, prompt: Sequence[int], seed: Optional[str] = "") -> int:
        """A new sequence ``sid`` starts with the cached blocks of ``prompt``'s longest cached prefix (held,
        never written); return their tokens, which it does not compute. ``seed`` None: no cache."""
        if sid in self.tables:
            raise ValueError(f"attach({sid}): the sequence already has blocks")
        blocks = self.cached_prefix(prompt, seed)
        for b in blocks:
            self._idle.pop(b, None)
            self._refs[b] = self._refs.get(b, 0) + 1
        self.tables[sid] = list(blocks)
        self.lengths[sid] = len(blocks) * self.block_size
        return self.lengths[sid]

    def register(self, sid: int, prompt: Sequence[int], seed: Optional[str] = "") -> int:
        """Cache the blocks of ``sid`` that ``prompt`` (its first tokens) fills whole; return how many were
        new to the cache (a content already cached keeps its block). ``seed`` None: nothing."""
        if seed is None:
            return 0
        n, table = 0, self.tables[sid]
        for b, h in zip(table, self.block_hashes(prompt[:self.lengths[sid]], seed)):
            if h not in self._block_of and b not in self._hash_of:
                self._block_of[h], self._hash_of[b] = b, h
                n += 1
        return n

    def renumber(self) -> List[int]:
        """Give the blocks in use the numbers 0..n-1 (keeping their order) in every table, the others the rest;
        return the old numbers in the new order (what a copy of the used blocks to the pool's front reads:
        a shared block once). Cached blocks no sequence holds leave the cache (they are not copied)."""
        for b in self._idle:
            del self._block_of[self._hash_of.pop(b)]
        self._idle.clear()
        order = sorted(self._refs)
        new_of = {b: i for i, b in enumerate(order)}
        for sid, table in self.tables.items():
            self.tables[sid] = [new_of[b] for b in table]
        self._refs = {new_of[b]: r for b, r in self._refs.items()}
        self._hash_of = {new_of[b]: h for b, h in self._hash_of.items()}
        self._block_of = {h: b for b, h in self._hash_of.items()}
        self._free = list(range(len(order), self.num_blocks))  # ascending: already a heap
        return order

    def forget_cache(self) -> None:
        """Empty the prefix cache (the weights behind its blocks changed): the blocks no sequence holds are
        free, the held ones stay with their sequences."""
        for b in self._idle:
            heapq.heappush(self._free, b)
        self._idle.clear()
        self._hash_of.clear()
        self._block_of.clear()

    def clear(self) -> None:
        """Forget every sequence and the cache (the pool's contents are no longer trusted)."""
        self.free(list(self.tables))
        self.forget_cache()


__all__ = ["BlockTables", "PoolFull"]
