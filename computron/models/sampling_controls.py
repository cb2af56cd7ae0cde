"""One sequence's sampling state on the sampling rank (``SeqSampler``) and the controls of a batch of rows applied
on the logits' device (``apply_controls``), in vLLM's order: ``logit_bias``; ``min_tokens`` (ending ids masked);
``repetition_penalty`` (prompt and generated tokens), ``frequency_penalty`` and ``presence_penalty`` (generated
tokens); the grammar's bitmask.

What a penalty needs across steps lives on the device beside the logits, made at the sequence's first step:
the counts of its generated tokens, the ids its prompt and output hold, its bias and ending ids. ``accept``
updates them in place with the chosen token, which the host already knows, so nothing here copies from the
device to the host. A grammar's matcher stays on the host (xgrammar's); only its bitmask goes to the device.

A resumed sequence's spec carries prompt + generated tokens and how many were generated
(``SeqSpec.generated``): its sampler counts those as generated and its matcher accepts them again.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .sampling_draw import NEG_INF, device_tensor, draw, to_device, warp


class _DeviceState:
    """A sequence's control tensors on the logits' device, for one vocabulary width."""

    def __init__(self, st: "SeqSampler", vocab: int, device: torch.device):
        spec = st.spec
        self.key = (vocab, device)
        bias = [(t, b) for t, b in spec.logit_bias if t < vocab]
        self.bias_ids = device_tensor([t for t, _ in bias], torch.int64, device) if bias else None
        self.bias_values = device_tensor([b for _, b in bias], torch.float32, device) if bias else None
        stops = sorted(t for t in st.stops if t < vocab)
        self.stop_ids = device_tensor(stops, torch.int64, device) if spec.min_tokens and stops else None
        generated = [t for t in st.generated if t < vocab]
        self.counts: Optional[torch.Tensor] = None
        """Generated tokens' counts [V] (frequency and presence penalties)."""
        if spec.frequency_penalty or spec.presence_penalty:
            self.counts = torch.zeros(vocab, device=device)
            if generated:
                ids = device_tensor(generated, torch.int64, device)
                self.counts.index_add_(0, ids, torch.ones(len(generated), device=device))
        self.seen: Optional[torch.Tensor] = None
        """The ids the prompt and the output hold [V] (repetition penalty)."""
        if spec.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            held = sorted({t for t in spec.prompt[:st.n_prompt] if t < vocab} | set(generated))
            if held:
                self.seen[device_tensor(held, torch.int64, device)] = True

    def accept(self, token: int) -> None:
        if token < self.key[0]:
            if self.counts is not None:
                self.counts[token:token + 1].add_(1.0)
            if self.seen is not None:
                self.seen[token:token + 1].fill_(True)


class SeqSampler:
    """One sequence's sampling state on the sampling rank."""

    def __init__(self, spec, generator: Optional[torch.Generator]):
        self.spec = spec
        self.generator = generator
        self.n_prompt = len(spec.prompt) - spec.generated
        self.generated: List[int] = list(spec.prompt[self.n_prompt:])
        self.stops = set(spec.stop_token_ids) | (set() if spec.ignore_eos else set(spec.eos))
        self.matcher = None
        if spec.grammar is not None:
            from .grammar import matcher_for
            self.matcher = matcher_for(spec.grammar)
            for t in self.generated:
                self.matcher.accept(t)
        self._state: Optional[_DeviceState] = None

    def state(self, vocab: int, device: torch.device) -> _DeviceState:
        if self._state is None or self._state.key != (vocab, device):
            self._state = _DeviceState(self, vocab, device)
        return self._state

    @property
    def masks_stops(self) -> bool:
        return len(self.generated) < self.spec.min_tokens

    @property
    def samples(self) -> bool:
        """Drawn (else greedy)."""
        return bool(self.spec.temperature and self.spec.top_k != 1)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """One row of raw logits [V] with this sequence's controls applied (a new tensor)."""
        x = logits[None].clone()
        apply_controls(x, logits[None], [(0, self)])
        return x[0]

    def draw(self, x: torch.Tensor) -> int:
        """The token of one processed row [V]: its argmax, or drawn with this sequence's generator."""
        spec = self.spec
        if not self.samples:
            return int(x.argmax())
        probs = warp(x[None], [spec.temperature], [spec.min_p], [spec.top_k], [spec.top_p])
        return int(draw(probs, [self.generator])[0])

    def accept(self, token: int) -> bool:
        """Record the chosen token; True if it ends the sequence (an ending id, or the grammar is complete)."""
        self.generated.append(token)
        if self._state is not None:
            self._state.accept(token)
        ends = token in self.stops
        if self.matcher is not None:
            self.matcher.accept(token)
            ends = ends or self.matcher.terminated
        return ends


def apply_controls(x: torch.Tensor, raw: torch.Tensor, rows: Sequence[Tuple[int, SeqSampler]]) -> None:
    """Apply (in place) to row ``i`` of ``x`` [B, V] the controls of its sampler, for each ``(i, sampler)`` of
    ``rows``; ``raw`` holds the model's logits (a grammar that can only end while ``min_tokens`` masks the
    ending ids gets them back, with their raw logits)."""
    vocab, dev = x.shape[-1], x.device
    grammar: List[Tuple[int, SeqSampler]] = []
    fallback: Dict[int, torch.Tensor] = {}
    for i, st in rows:
        spec, state, row = st.spec, st.state(vocab, dev), x[i]
        if state.bias_ids is not None:
            row.index_add_(0, state.bias_ids, state.bias_values)
        masked = state.stop_ids is not None and st.masks_stops
        if masked:
            row.index_fill_(0, state.stop_ids, NEG_INF)
        if state.seen is not None:
            p = spec.repetition_penalty
            row.copy_(torch.where(state.seen, torch.where(row > 0, row / p, row * p), row))
        if state.counts is not None:
            row.sub_(spec.frequency_penalty * state.counts + spec.presence_penalty * (state.counts > 0).float())
        if st.matcher is not None:
            grammar.append((i, st))
            if masked:
                fallback[i] = row.index_copy(0, state.stop_ids, raw[i].index_select(0, state.stop_ids))
    if grammar:
        _apply_grammar(x, grammar, fallback)


def _apply_grammar(x: torch.Tensor, rows: List[Tuple[int, SeqSampler]], fallback: Dict[int, torch.Tensor]) -> None:
    """Each grammar row's bitmask, filled on the host, applied to its row on the device (ids past the
    tokenizer's vocabulary masked too); a row the grammar leaves empty takes its fallback, masked alike."""
    from .grammar import apply_bitmask, host_bitmask
    vocab = min(min(st.matcher.vocab for _, st in rows), x.shape[-1])
    order = [i for i, _ in rows] + list(fallback)
    bitmask = host_bitmask(len(order), vocab)
    for n, (_, st) in enumerate(rows):
        st.matcher.fill(bitmask, n)
    bitmask[len(rows):] = bitmask[[order.index(i) for i in fallback]]
    picked = device_tensor(order, torch.int64, x.device)
    sub = x.index_select(0, picked[:len(rows)])
    if fallback:
        sub = torch.cat([sub, torch.stack(list(fallback.values()))])
    apply_bitmask(sub, to_device(bitmask, x.device), vocab)
    sub[:, vocab:] = NEG_INF
    if fallback:
        alt, sub = sub[len(rows):], sub[:len(rows)]
        at = [order.index(i) for i in fallback]
        empty = ~torch.isfinite(sub[at]).any(-1, keepdim=True)
        sub[at] = torch.where(empty, alt, sub[at])
    x.index_copy_(0, picked[:len(rows)], sub)


__all__ = ["SeqSampler", "apply_controls"]
