"""The one sampling implementation: the next token of each sequence, on the rank that samples, on the device that
holds the logits.

``pick`` chooses the step's token of every row in a few batched operations on the logits' device: the rows'
controls (``sampling_controls``: logit bias, ``min_tokens``, penalties, grammar bitmasks), then the argmax
(greedy at temperature 0 or ``top_k`` 1) or the draw (``sampling_draw``: temperature, ``min_p``, ``top_k``,
``top_p``, each seeded row with its own generator on the device). Logprobs are those of the raw logits, before
any of it, computed on the device for the rows that ask. Only the token ids and those logprobs cross to the
host, in one copy per step; ``SeqSampler.accept`` then decides which rows end.

``sample_rows`` is the request-level path (one set of parameters and one generator for a whole batch).
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from .sampling_controls import SeqSampler, apply_controls
from .sampling_draw import device_tensor, draw, sample_rows, warp


class Picked(NamedTuple):
    tokens: torch.Tensor
    """[B] int64 on the logits' device."""
    ids: List[int]
    """The same tokens on the host."""
    ends: List[bool]
    """Whether each token ends its sequence (EOS unless ignored, a stop id, a complete grammar: not max_tokens)."""
    logprobs: Tuple[object, ...]
    """``()`` when no row asked, else None or ``(logprob, top)`` per row."""


def _top(values: Sequence[float], ids: Sequence[float], k: int) -> Tuple[Tuple[int, float], ...]:
    return tuple((int(t), float(v)) for t, v in zip(ids[:k], values[:k]))


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


def _scores(lp: torch.Tensor, tokens: torch.Tensor, k: int) -> List[torch.Tensor]:
    """Each row's logprob of its token, then its ``k`` best logprobs and their ids, as float64 (ids exact)."""
    parts = [lp.gather(1, tokens[:, None]).double()]
    if k:
        vals, ids = torch.topk(lp, min(k, lp.shape[-1]))
        parts += [vals.double(), ids.double()]
    return [torch.cat(parts, 1).flatten()]


def prompt_logprobs(logits: torch.Tensor, prompt, k: int) -> Tuple[object, ...]:
    """One entry per prompt token from the prefill's logits [len(prompt) - 1, V] (row j predicts token j + 1,
    on any device): None for the first, ``(token, logprob, top k)`` for the others. One copy to the host."""
    out: List[object] = [None]
    n = len(prompt) - 1
    if n < 1 or not logits.shape[0]:
        return tuple(out)
    lp = torch.log_softmax(logits.float(), -1)
    k = min(k, lp.shape[-1])
    flat = _scores(lp, device_tensor([int(t) for t in prompt[1:]], torch.int64, lp.device), k)[0].tolist()
    width = 1 + 2 * k
    for j, tok in enumerate(prompt[1:]):
        row = flat[j * width:(j + 1) * width]
        out.append((int(tok), row[0], _top(row[1:1 + k], row[1 + k:], k)))
    return tuple(out)


def seq_generator(spec, device: Union[str, torch.device] = "cpu") -> torch.Generator:
    """A sequence's own sampling generator on ``device``: seeded, or restored where its sequence was paused
    (a state of the same device type)."""
    gen = torch.Generator(device=device)
    if spec.gen_state is not None:
        gen.set_state(torch.frombuffer(bytearray(spec.gen_state), dtype=torch.uint8))
    else:
        gen.manual_seed(spec.seed)
    return gen


def scored_logits(t, vocab: int, device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """A scored prompt's logits, where they are ([0, V] for a prompt of one token, which has none)."""
    return t if isinstance(t, torch.Tensor) else torch.empty(0, vocab, device=device)


def pick(logits: torch.Tensor, specs: List[object], samplers: Dict[int, SeqSampler],
         generators: Dict[int, Optional[torch.Generator]]) -> Picked:
    """The step's token for every row of ``logits`` [B, V] (row ``i`` is ``specs[i]``'s sequence, sampled with
    ``generators[sid]``, or the device's default generator where there is none), with the rows' logprobs."""
    rows = len(specs)
    controlled = [(i, samplers[s.sid]) for i, s in enumerate(specs) if s.has_controls]
    x = logits
    if controlled:
        x = logits.clone()
        apply_controls(x, logits, controlled)
    tokens = x.argmax(-1)
    drawn = [i for i, s in enumerate(specs) if s.temperature and s.top_k != 1]
    if drawn:
        at = None if len(drawn) == rows else device_tensor(drawn, torch.int64, x.device)
        ss = [specs[i] for i in drawn]
        probs = warp(x if at is None else x.index_select(0, at), [s.temperature for s in ss],
                     [s.min_p for s in ss], [s.top_k for s in ss], [s.top_p for s in ss])
        got = draw(probs, [generators.get(s.sid) for s in ss])
        tokens = got if at is None else tokens.index_copy(0, at, got)
    wants = [i for i, s in enumerate(specs) if s.logprobs is not None or s.prompt_logprobs is not None]
    k = max((specs[i].logprobs or 0 for i in wants), default=0)
    parts = [tokens.double()]
    if wants:
        at = None if len(wants) == rows else device_tensor(wants, torch.int64, x.device)
        raw, chosen = (logits, tokens) if at is None else (logits.index_select(0, at), tokens.index_select(0, at))
        k = min(k, logits.shape[-1])
        parts += _scores(torch.log_softmax(raw.float(), -1), chosen, k)
    host = torch.cat(parts).tolist()  # the step's one copy to the host: ids, then the asked-for logprobs
    ids = [int(t) for t in host[:rows]]
    ends = [samplers[s.sid].accept(t) for s, t in zip(specs, ids)]
    logprobs: List[object] = [None] * rows
    width = 1 + 2 * k
    for n, i in enumerate(wants):
        row = host[rows + n * width:rows + (n + 1) * width]
        own = min(specs[i].logprobs or 0, k)
        logprobs[i] = (row[0], _top(row[1:1 + k], row[1 + k:], own))
    return Picked(tokens, ids, ends, tuple(logprobs) if wants else ())


__all__ = ["sample_rows", "pick", "Picked", "SeqSampler", "token_logprob", "prompt_logprobs", "top_logprobs",
           "scored_logits", "seq_generator"]
