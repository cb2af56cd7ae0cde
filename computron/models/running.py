"""A model's running sequences on one rank, between generation steps.

The batch is left-padded: row ``i`` holds sequence ``sids[i]``, its attention
mask row is 0 over the padding, and every layer's KV cache has one row per
sequence (``[batch, heads, length, head_dim]``). Sequences join in the same
forward that decodes the running ones (``step_inputs``, then ``joined``, which
compacts the padding that leaves), or in a prefill forward of their own after
the decode (``decode_inputs``, ``prefill_inputs``, ``merge_prefilled``), and
leave by row selection, after which
columns that are padding in every row are cut off. Every rank applies the same
operations in the same order, so their batches stay identical in shape; only the
output rank holds the per-sequence random generators.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .sampling_controls import SeqSampler


def _left_padded(prompts: List[List[int]], width: int, pad_id: int, device: torch.device):
    """``(input_ids [N, width], attention_mask [N, width])`` of ``prompts``, each right-aligned."""
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64, device=device)
    for i, prompt in enumerate(prompts):
        if prompt:
            ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.int64, device=device)
            mask[i, width - len(prompt):] = 1
    return ids, mask


def _layers(cache):
    return list(getattr(cache, "layers", ()))


class SequenceBook:
    """What a running batch knows of its sequences, whatever holds their KV (``RunningBatch`` here, the paged
    pool's ``paged_running.PagedBatch``): ids in row order, specs, tokens generated, generators, samplers."""

    def __init__(self):
        self.sids: List[int] = []
        self.specs: Dict[int, object] = {}
        self.counts: Dict[int, int] = {}
        self.last: Optional[torch.Tensor] = None   # [B] the newest token of each sequence
        self.generators: Dict[int, torch.Generator] = {}
        self.samplers: Dict[int, SeqSampler] = {}
        """Sampling rank: each sequence's sampling state (penalty counts, grammar matcher)."""

    def __len__(self) -> int:
        return len(self.sids)

    def forget_prefixes(self) -> None:
        """No cached prompt KV may be used again (a padded batch caches none; the paged pool does)."""

    def generator_states(self, sids: Iterable[int]) -> Dict[int, bytes]:
        return {s: bytes(self.generators[s].get_state().numpy().tobytes()) for s in sids if s in self.generators}

    def _forget(self, sids: Iterable[int]) -> Tuple[set, List[int]]:
        """``(gone, keep)``: the running sequences among ``sids``, forgotten, and the rows that stay."""
        gone = set(sids) & set(self.sids)
        for s in gone:
            self.specs.pop(s, None)
            self.counts.pop(s, None)
            self.generators.pop(s, None)
            self.samplers.pop(s, None)
        return gone, [i for i, s in enumerate(self.sids) if s not in gone]

    def joined(self, specs: List[object], generators: Dict[int, torch.Generator], mask, last: torch.Tensor,
               samplers: Optional[Dict[int, SeqSampler]] = None) -> None:
        """After a step's forward: ``specs`` join (their generators and samplers with them), every row has
        generated one more token, ``last`` holds each row's newest (``mask`` is the KV holder's)."""
        self.samplers.update(samplers or {})
        for spec in specs:
            self.sids.append(spec.sid)
            self.specs[spec.sid] = spec
            self.counts[spec.sid] = 0
        for s in self.sids:
            self.counts[s] += 1
        self.generators.update(generators)
        self.last = last

    def ended(self, eos_hit: List[bool]) -> List[int]:
        """Sequences whose newest token ended them (an EOS, a stop id, a complete grammar: the sampling
        rank's verdict) or that reached their max_tokens."""
        return [s for s, hit in zip(self.sids, eos_hit) if hit or self.counts[s] >= self.specs[s].max_tokens]


class RunningBatch(SequenceBook):
    def __init__(self):
        super().__init__()
        self.mask: Optional[torch.Tensor] = None   # [B, L] int64
        self.cache = None                          # transformers DynamicCache, one row per sequence
        self.parked = False
        """True while the KV caches sit in host memory (the model was preempted and offloaded)."""

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

    # ---- leaving -------------------------------------------------------------
    def drop(self, sids: Iterable[int]) -> None:
        gone, keep = self._forget(sids)
        if not gone:
            return
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

    # ---- one forward for every row ------------------------------------------
    def step_inputs(self, prompts: List[List[int]], pad_id: int, device: torch.device):
        """The inputs of one forward that prefills ``prompts`` (new rows, appended after the running
        ones) and decodes the running rows: ``(input_ids [B, W], attention_mask [B, L + W], W)``.

        Every row gets ``W`` new columns, the longest prompt's length (1 without prompts): a running
        row's newest token sits in the last of them, left of it are masked padding columns; a new row's
        cache is ``L`` masked zero columns, so every row of every layer has the same length. A step
        thus costs one forward, not a prefill forward plus a decode forward (on few small tensors
        the fixed cost of a forward, collectives included, dominates; where the padding would cost
        more, ``messages.Step.prefill_apart`` asks for the two). ``compact`` removes the
        padding columns this leaves between a running row's history and its newest token.
        """
        n_run, n_new = len(self), len(prompts)
        width = max((len(p) for p in prompts), default=1)
        ids, new_mask = _left_padded([[]] * n_run + list(prompts), width, pad_id, device)
        if n_run:
            ids[:n_run, -1] = self.last
            new_mask[:n_run, -1] = 1
        if not n_run:
            from transformers import DynamicCache
            self.cache = DynamicCache()
            return ids, new_mask, width
        old = self.mask
        if n_new:
            old = torch.cat([old, old.new_zeros(n_new, old.shape[1])])
            for layer in _layers(self.cache):
                layer.keys = torch.cat([layer.keys, layer.keys.new_zeros((n_new, *layer.keys.shape[1:]))])
                layer.values = torch.cat([layer.values,
                                          layer.values.new_zeros((n_new, *layer.values.shape[1:]))])
        return ids, torch.cat([old, new_mask], dim=1), width

    # ---- or two: a decode forward and a prefill forward (``messages.Step.prefill_apart``) ----------
    def decode_inputs(self):
        """``(input_ids [R, 1], attention_mask [R, L + 1])``: one new token for each running row."""
        return self.last[:, None], torch.cat([self.mask, self.mask.new_ones(len(self), 1)], dim=1)

    @staticmethod
    def prefill_inputs(prompts: List[List[int]], pad_id: int, device: torch.device):
        """``(input_ids [N, W], attention_mask [N, W], W, cache)``: the prompts left-padded, a fresh cache."""
        from transformers import DynamicCache
        width = max(len(p) for p in prompts)
        return (*_left_padded(prompts, width, pad_id, device), width, DynamicCache())

    def merge_prefilled(self, run_mask: torch.Tensor, new_mask: torch.Tensor, new_cache) -> torch.Tensor:
        """Append the separately prefilled rows (their mask and cache) after the running ones, both
        left-padded with masked columns to the longer length; returns the joined mask."""
        length = max(run_mask.shape[1], new_mask.shape[1])

        def left_pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            short = length - t.shape[dim]
            if not short:
                return t
            shape = list(t.shape)
            shape[dim] = short
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        for layer, new in zip(_layers(self.cache), _layers(new_cache)):
            layer.keys = torch.cat([left_pad(layer.keys, 2), left_pad(new.keys, 2)])
            layer.values = torch.cat([left_pad(layer.values, 2), left_pad(new.values, 2)])
        return torch.cat([left_pad(run_mask, 1), left_pad(new_mask, 1)])

    def joined(self, specs: List[object], generators: Dict[int, torch.Generator], mask: torch.Tensor,
               last: torch.Tensor, samplers: Optional[Dict[int, SeqSampler]] = None) -> None:
        """After a step's forward: the new rows' sequences join, every row has its newest token."""
        super().joined(specs, generators, mask, last, samplers)
        self.mask = mask
        if specs and len(self) > len(specs):
            self.compact()

    def compact(self) -> None:
        """Move each row's unmasked columns to the right end and cut the columns no row uses."""
        width = int(self.mask.sum(1).max())
        if width == self.mask.shape[1]:
            return
        idx = torch.argsort(self.mask, dim=1, stable=True)[:, -width:]  # masked columns first, in order
        self.mask = self.mask.gather(1, idx)
        for layer in _layers(self.cache):
            b, h, _, d = layer.keys.shape
            kv_idx = idx.to(layer.keys.device)[:, None, :, None].expand(b, h, width, d)
            layer.keys = layer.keys.gather(2, kv_idx)
            layer.values = layer.values.gather(2, kv_idx)

    # ---- sequences with the same prompt share one prefill row ------------------
    @staticmethod
    def shared_prefill(specs: Sequence[object]) -> Tuple[List[int], List[int]]:
        """``(firsts, rows)``: the admitted sequences that prefill (the first of each group with the same
        prompt and adapter), and for each admitted sequence the index in ``firsts`` of the row it copies."""
        seen: Dict[tuple, int] = {}
        firsts: List[int] = []
        rows: List[int] = []
        for i, spec in enumerate(specs):
            key = (tuple(spec.prompt), spec.adapter)
            if key not in seen:
                seen[key] = len(firsts)
                firsts.append(i)
            rows.append(seen[key])
        return firsts, rows

    @staticmethod
    def copy_rows(cache, mask: torch.Tensor, index: List[int]) -> torch.Tensor:
        """Rows ``index`` of a cache (in place) and of its mask (returned): prefilled rows copied into the
        sequences that share them."""
        idx = torch.tensor(index, dtype=torch.long, device=mask.device)
        for layer in _layers(cache):
            layer.keys = layer.keys.index_select(0, idx.to(layer.keys.device))
            layer.values = layer.values.index_select(0, idx.to(layer.values.device))
        return mask.index_select(0, idx)
