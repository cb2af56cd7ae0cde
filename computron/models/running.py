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

from typing import Dict, Iterable, List, Optional

import torch


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
               last: torch.Tensor) -> None:
        """After a step's forward: the new rows' sequences join, every row has its newest token."""
        for spec in specs:
            self.sids.append(spec.sid)
            self.specs[spec.sid] = spec
            self.counts[spec.sid] = 0
        for s in self.sids:
            self.counts[s] += 1
        self.generators.update(generators)
        self.mask, self.last = mask, last
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

    def ended(self, eos_hit: List[bool]) -> List[int]:
        """Sequences whose newest token is an EOS or that reached their max_tokens."""
        return [s for s, hit in zip(self.sids, eos_hit) if hit or self.counts[s] >= self.specs[s].max_tokens]


def sample_rows(logits: torch.Tensor, temperature: Optional[float], top_k: Optional[int] = 0,
                top_p: Optional[float] = 1.0, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of ``logits`` [N, V], every row with the same sampling parameters, drawn
    with one generator in one call: greedy where ``temperature`` is 0 or ``top_k`` is 1, else sampled
    from the temperature-scaled distribution cut to the ``top_k`` tokens and the ``top_p`` nucleus.
    ``top_k`` 0 or None and ``top_p`` 1.0 or None do not cut."""
    if not temperature or top_k == 1:
        return logits.argmax(-1)
    logits = logits / float(temperature)
    if top_k:
        kth = torch.topk(logits, min(int(top_k), logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > float(top_p)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


def sample(logits: torch.Tensor, specs: List[object], generators: Dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row: row ``i`` with ``specs[i]``'s parameters and, where it samples, that
    sequence's own generator, so a seeded sequence gets the same tokens in any batch."""
    out = logits.argmax(-1)
    for i, spec in enumerate(specs):
        if spec.temperature and spec.top_k != 1:
            out[i] = sample_rows(logits[i:i + 1], spec.temperature, spec.top_k, spec.top_p,
                                 generators[spec.sid])[0]
    return out
