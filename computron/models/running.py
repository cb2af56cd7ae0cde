"""A model's running sequences on one rank, between generation steps.

The batch is left-padded: row ``i`` holds sequence ``sids[i]``, its attention
mask row is 0 over the padding, and every layer's KV cache has one row per
sequence (``[batch, heads, length, head_dim]``). Sequences join by
concatenation (the shorter side is padded on the left) and leave by row
selection, after which columns that are padding in every row are cut off, as
TGI's causal-LM batch does. Every rank applies the same operations in the same
order, so their batches stay identical in shape; only the output rank holds
the per-sequence random generators.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional

import torch
import torch.nn.functional as F


def _layers(cache):
    return list(getattr(cache, "layers", ()))


class RunningBatch:
    def __init__(self):
        self.sids: List[int] = []
        self.specs: Dict[int, object] = {}
        self.counts: Dict[int, int] = {}
        self.mask: Optional[torch.Tensor] = None   # [B, L] int64
        self.cache = None                          # transformers DynamicCache, one row per sequence
        self.last: Optional[torch.Tensor] = None   # [B] the newest token of each sequence
        self.generators: Dict[int, torch.Generator] = {}
        self.parked = False
        """True while the KV caches sit in host memory (the model was preempted and offloaded)."""

    def __len__(self) -> int:
        return len(self.sids)

    def clear(self) -> None:
        self.__init__()

    def kv_bytes(self) -> int:
        """KV cache bytes of these sequences, wherever they are (see ``parked``)."""
        total = 0
        for layer in _layers(self.cache):
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total

    # ---- preemption ------------------------------------------------------------
    def _move(self, fn) -> None:
        self.mask, self.last = fn(self.mask), fn(self.last)
        for layer in _layers(self.cache):
            layer.keys, layer.values = fn(layer.keys), fn(layer.values)

    def park(self) -> int:
        """Move the KV caches to host memory (pinned where CUDA is); return the bytes moved."""
        if not len(self) or self.parked:
            return 0
        if self.mask.device.type == "cuda":
            def to_host(t):
                out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                out.copy_(t, non_blocking=True)
                return out
            self._move(to_host)
            torch.cuda.current_stream().synchronize()
        self.parked = True
        return self.kv_bytes()

    def unpark(self, device: torch.device) -> int:
        """Bring parked KV caches back to ``device``; return the bytes moved."""
        if not self.parked:
            return 0
        if device.type == "cuda":
            self._move(lambda t: t.to(device, non_blocking=True))
        self.parked = False
        return self.kv_bytes()

    def generator_states(self, sids: Iterable[int]) -> Dict[int, bytes]:
        return {s: bytes(self.generators[s].get_state().numpy().tobytes()) for s in sids if s in self.generators}

    # ---- leaving -------------------------------------------------------------
    def drop(self, sids: Iterable[int]) -> None:
        gone = set(sids) & set(self.sids)
        if not gone:
            return
        keep = [i for i, s in enumerate(self.sids) if s not in gone]
        for s in gone:
            self.specs.pop(s, None)
            self.counts.pop(s, None)
            self.generators.pop(s, None)
        if not keep:
            self.clear()
            return
        self.sids = [self.sids[i] for i in keep]
        idx = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.mask = self.mask.index_select(0, idx)
        self.last = self.last.index_select(0, idx)
        used = (self.mask.sum(0) > 0).nonzero()
        first = int(used[0]) if len(used) else 0
        self.mask = self.mask[:, first:]
        for layer in _layers(self.cache):
            layer.keys = layer.keys.index_select(0, idx.to(layer.keys.device))[..., first:, :]
            layer.values = layer.values.index_select(0, idx.to(layer.values.device))[..., first:, :]

    # ---- joining -------------------------------------------------------------
    def merge(self, other: "RunningBatch") -> None:
        """Append ``other``'s sequences (a freshly prefilled batch) after this batch's rows."""
        if not len(other):
            return
        if not len(self):
            self.__dict__.update(other.__dict__)
            return
        la, lb = self.mask.shape[1], other.mask.shape[1]
        width = max(la, lb)
        self.mask = torch.cat([F.pad(self.mask, (width - la, 0)), F.pad(other.mask, (width - lb, 0))], 0)
        self.last = torch.cat([self.last, other.last])
        mine, theirs = _layers(self.cache), _layers(other.cache)
        if len(mine) != len(theirs):
            raise RuntimeError(f"KV caches of {len(mine)} and {len(theirs)} layers cannot be merged")
        for a, b in zip(mine, theirs):
            a.keys = torch.cat([F.pad(a.keys, (0, 0, width - la, 0)), F.pad(b.keys, (0, 0, width - lb, 0))], 0)
            a.values = torch.cat([F.pad(a.values, (0, 0, width - la, 0)),
                                  F.pad(b.values, (0, 0, width - lb, 0))], 0)
        self.sids += other.sids
        self.specs.update(other.specs)
        self.counts.update(other.counts)
        self.generators.update(other.generators)

    def ended(self, eos_hit: List[bool]) -> List[int]:
        """Sequences whose newest token is an EOS or that reached their max_tokens."""
        return [s for s, hit in zip(self.sids, eos_hit) if hit or self.counts[s] >= self.specs[s].max_tokens]


def sample(logits: torch.Tensor, specs: List[object], generators: Dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row: greedy where a row's temperature is 0 (or top_k is 1), else sampled with
    that sequence's own generator, so a seeded sequence gets the same tokens in any batch."""
    out = logits.argmax(-1)
    for i, spec in enumerate(specs):
        if not spec.temperature or spec.top_k == 1:
            continue
        row = logits[i:i + 1] / float(spec.temperature)
        if spec.top_k:
            kth = torch.topk(row, min(int(spec.top_k), row.shape[-1]), dim=-1).values[:, -1:]
            row = row.masked_fill(row < kth, float("-inf"))
        if spec.top_p < 1.0:
            sorted_row, idx = torch.sort(row, descending=True, dim=-1)
            probs = sorted_row.softmax(-1)
            drop = probs.cumsum(-1) - probs > float(spec.top_p)
            sorted_row = sorted_row.masked_fill(drop, float("-inf"))
            row = torch.full_like(row, float("-inf")).scatter(-1, idx, sorted_row)
        out[i] = torch.multinomial(row.softmax(-1), 1, generator=generators[spec.sid])[0, 0]
    return out


def is_valid_seed(seed) -> bool:
    return isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2 ** 63


def is_finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
