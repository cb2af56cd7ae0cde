"""The one sampling implementation: the next token of each sequence, on the rank that samples.

``sample_rows`` draws one token per row with shared temperature/top-k/top-p/min-p parameters (the
request-level path, and the rows without controls). ``SeqSampler`` is one sequence's state under
token-level generation (its generator, the counts its penalties need, its grammar matcher), and
``pick`` the step's choice for every row: the controls of ``batching.controls`` applied in this order
to the model's final logits (vLLM's order): ``logit_bias``; ``min_tokens`` (ending ids masked);
``repetition_penalty`` (prompt and generated tokens), ``frequency_penalty`` and ``presence_penalty``
(generated tokens); the grammar's mask; then temperature, ``min_p``, ``top_k``, ``top_p`` and the draw
(greedy at temperature 0). Logprobs are those of the raw logits, before any of it.

A resumed sequence's spec carries prompt + generated tokens and how many were generated
(``SeqSpec.generated``): its sampler counts those as generated and its matcher accepts them again.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

NEG_INF = float("-inf")


def sample_rows(logits: torch.Tensor, temperature: Optional[float], top_k: Optional[int] = 0,
                top_p: Optional[float] = 1.0, generator: Optional[torch.Generator] = None,
                min_p: float = 0.0) -> torch.Tensor:
    """One token per row of ``logits`` [N, V], every row with the same sampling parameters, drawn
    with one generator in one call: greedy where ``temperature`` is 0 or ``top_k`` is 1, else sampled
    from the temperature-scaled distribution cut to tokens at least ``min_p`` times as likely as the
    likeliest, to the ``top_k`` tokens and to the ``top_p`` nucleus. ``top_k`` 0 or None, ``top_p``
    1.0 or None and ``min_p`` 0 do not cut."""
    if not temperature or top_k == 1:
        return logits.argmax(-1)
    logits = logits / float(temperature)
    if min_p:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < float(min_p) * probs.max(-1, keepdim=True).values, NEG_INF)
    if top_k:
        kth = torch.topk(logits, min(int(top_k), logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p is not None and top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > float(top_p)
        sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
        logits = torch.full_like(logits, NEG_INF).scatter(-1, idx, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


def sample(logits: torch.Tensor, specs: List[object], generators: Dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row: row ``i`` with ``specs[i]``'s parameters and, where it samples, that
    sequence's own generator, so a seeded sequence gets the same tokens in any batch."""
    out = logits.argmax(-1)
    for i, spec in enumerate(specs):
        if spec.temperature and spec.top_k != 1:
            out[i] = sample_rows(logits[i:i + 1], spec.temperature, spec.top_k, spec.top_p,
                                 generators[spec.sid], getattr(spec, "min_p", 0.0))[0]
    return out


def top_logprobs(logprobs: torch.Tensor, k: int) -> Tuple[Tuple[int, float], ...]:
    """The ``k`` most likely ``(id, logprob)`` of a row of logprobs, most likely first."""
    if not k:
        return ()
    vals, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return tuple(zip(ids.tolist(), vals.tolist()))


def token_logprob(logits: torch.Tensor, token: int, k: int) -> Tuple[float, Tuple[Tuple[int, float], ...]]:
    """``(logprob of token, top k)`` under a row of raw logits."""
    lp = torch.log_softmax(logits.float(), -1)
    return float(lp[token]), top_logprobs(lp, k)


def prompt_logprobs(logits: torch.Tensor, prompt, k: int) -> Tuple[object, ...]:
    """One entry per prompt token from the prefill's logits [len(prompt) - 1, V] (row j predicts token
    j + 1): None for the first, ``(token, logprob, top k)`` for the others."""
    lp = torch.log_softmax(logits.float(), -1)
    out: List[object] = [None]
    for j, tok in enumerate(prompt[1:]):
        out.append((int(tok), float(lp[j, tok]), top_logprobs(lp[j], k)))
    return tuple(out)


class SeqSampler:
    """One sequence's sampling state on the sampling rank."""

    def __init__(self, spec, generator: Optional[torch.Generator]):
        self.spec = spec
        self.generator = generator
        n_prompt = len(spec.prompt) - spec.generated
        self.generated: List[int] = list(spec.prompt[n_prompt:])
        self._n_prompt = n_prompt
        self._seen: Optional[set] = None  # prompt and generated ids (repetition_penalty), made on first use
        self.stops = set(spec.stop_token_ids) | (set() if spec.ignore_eos else set(spec.eos))
        self.matcher = None
        if spec.grammar is not None:
            from .grammar import matcher_for
            self.matcher = matcher_for(spec.grammar)
            for t in self.generated:
                self.matcher.accept(t)
        self._counts: Optional[torch.Tensor] = None

    def _count_tensor(self, vocab: int) -> torch.Tensor:
        if self._counts is None or self._counts.shape[0] != vocab:
            self._counts = torch.zeros(vocab)
            for t in self.generated:
                if t < vocab:
                    self._counts[t] += 1
        return self._counts

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The row of raw logits [V] with this sequence's controls applied (a new tensor)."""
        spec, x, vocab = self.spec, logits.clone(), logits.shape[-1]
        for tid, bias in spec.logit_bias:
            if tid < vocab:
                x[tid] += bias
        masked_stops = None
        if spec.min_tokens and len(self.generated) < spec.min_tokens:
            masked_stops = torch.tensor(sorted(t for t in self.stops if t < vocab), dtype=torch.long)
            if len(masked_stops):
                x[masked_stops] = NEG_INF
        if spec.repetition_penalty != 1.0:
            if self._seen is None:
                self._seen = set(spec.prompt[:self._n_prompt]) | set(self.generated)
            ids = torch.tensor(sorted(self._seen), dtype=torch.long)
            ids = ids[ids < vocab]
            v = x[ids]
            x[ids] = torch.where(v > 0, v / spec.repetition_penalty, v * spec.repetition_penalty)
        if spec.frequency_penalty or spec.presence_penalty:
            counts = self._count_tensor(vocab)
            x -= spec.frequency_penalty * counts + spec.presence_penalty * (counts > 0).float()
        if self.matcher is not None:
            before = x.clone() if masked_stops is not None else None
            self.matcher.mask(x)
            if before is not None and not torch.isfinite(x).any():  # the grammar can only end: it wins
                before[masked_stops] = logits[masked_stops]
                self.matcher.mask(before)
                x = before
        return x

    def draw(self, x: torch.Tensor) -> int:
        spec = self.spec
        if spec.temperature and spec.top_k != 1:
            return int(sample_rows(x[None], spec.temperature, spec.top_k, spec.top_p, self.generator, spec.min_p)[0])
        return int(x.argmax())

    def accept(self, token: int) -> bool:
        """Record the chosen token; True if it ends the sequence (an ending id, or the grammar is complete)."""
        self.generated.append(token)
        if self._seen is not None:
            self._seen.add(token)
        if self._counts is not None and token < self._counts.shape[0]:
            self._counts[token] += 1
        ends = token in self.stops
        if self.matcher is not None:
            self.matcher.accept(token)
            ends = ends or self.matcher.terminated
        return ends


def seq_generator(spec) -> torch.Generator:
    """A sequence's own sampling generator: seeded, or restored where its sequence was paused."""
    gen = torch.Generator(device="cpu")
    if spec.gen_state is not None:
        gen.set_state(torch.frombuffer(bytearray(spec.gen_state), dtype=torch.uint8))
    else:
        gen.manual_seed(spec.seed)
    return gen


def scored_logits(t, vocab: int) -> torch.Tensor:
    """A scored prompt's logits on the CPU ([0, V] for a prompt of one token, which has none)."""
    return t.cpu() if isinstance(t, torch.Tensor) else torch.empty(0, vocab)


def pick(logits: torch.Tensor, specs: List[object], samplers: Dict[int, SeqSampler],
         generators: Dict[int, torch.Generator]) -> Tuple[torch.Tensor, List[bool], Tuple[object, ...]]:
    """The step's token for every row of ``logits`` [B, V] (row ``i`` is ``specs[i]``'s sequence), whether
    it ends the sequence (EOS unless ignored, a stop id, a complete grammar: not max_tokens), and the
    rows' logprobs (``()`` when no row asked, else None or ``(logprob, top)`` per row)."""
    tokens = logits.argmax(-1)
    logprobs: List[object] = []
    ends: List[bool] = []
    for i, spec in enumerate(specs):
        st = samplers[spec.sid]
        if spec.has_controls:
            tokens[i] = st.draw(st.process(logits[i]))
        elif spec.temperature and spec.top_k != 1:
            tokens[i] = sample_rows(logits[i:i + 1], spec.temperature, spec.top_k, spec.top_p,
                                    generators[spec.sid])[0]
        tok = int(tokens[i])
        ends.append(st.accept(tok))
        wants = spec.logprobs is not None or spec.prompt_logprobs is not None
        logprobs.append(token_logprob(logits[i], tok, spec.logprobs or 0) if wants else None)
    return tokens, ends, (tuple(logprobs) if any(x is not None for x in logprobs) else ())


__all__ = ["sample_rows", "sample", "pick", "SeqSampler", "token_logprob", "prompt_logprobs", "top_logprobs",
           "scored_logits", "seq_generator"]
