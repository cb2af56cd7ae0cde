"""Chunked prefill: how many of a step's ``max_step_tokens`` each sequence gets (paged KV only).

Pure policy, no torch. A step spends its token budget in this order: every decoding sequence's one token,
then the sequences part-way through their prompt (oldest first), then new admissions (recomputes, then the
queue). A prompt that does not fit in what is left takes a chunk of it and continues in the next steps, so
one long prompt never holds up the decoding sequences for more than a step's budget. Two guards:

- a chunk smaller than ``min_chunk`` is not worth a forward's share: the prompt waits for the next step
  (unless nothing else prefills this step, so that a prompt always progresses);
- a prompt that must not be split (``prompt_logprobs`` scores it in one forward) goes whole, alone if it
  does not fit, as before chunking.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

MIN_CHUNK = 16
"""Smallest chunk worth cutting, in tokens (lowered for a budget under 4 x this)."""


def min_chunk(max_step_tokens: int) -> int:
    return max(1, min(MIN_CHUNK, max_step_tokens // 4))


class StepBudget:
    """One step's token budget, handed out in the caller's order (decoders, filling, admissions)."""

    def __init__(self, max_step_tokens: int, decoding: int):
        self.left = max_step_tokens - decoding
        self.min_chunk = min_chunk(max_step_tokens)
        self.prefills = 0
        """Prompts (whole or a chunk) given tokens so far this step."""
        self.closed = False

    def grant(self, remaining: int, chunkable: bool = True) -> int:
        """Tokens of a prompt with ``remaining`` tokens still to prefill that this step runs (0: it waits,
        and so does everything after it: a later prompt never overtakes)."""
        if remaining <= 0 or self.closed:
            return 0
        if remaining <= self.left:
            n = remaining
        elif chunkable and self.left >= self.min_chunk:
            n = self.left
        elif self.prefills == 0:  # alone: it goes all the same (whole, or the smallest chunk)
            n = remaining if not chunkable else min(remaining, max(self.left, self.min_chunk))
        else:
            self.closed = True
            return 0
        self.left -= n
        self.prefills += 1
        return n


@dataclass(frozen=True)
class Plan:
    fill: Tuple[Tuple[int, int], ...]
    """``(sid, tokens)`` of the sequences mid-prefill that continue this step."""
    admit: Tuple[Tuple[int, int], ...]
    """``(sid, tokens)`` of the sequences joining this step (tokens < their prompt: a first chunk)."""


def plan(max_step_tokens: int, decoding: int, filling: Sequence[Tuple[int, int]],
         waiting: Sequence[Tuple[int, int, bool]], slots: int) -> Plan:
    """The whole policy at once (what ``TokenBatch.next_step`` does step by step): ``filling`` is
    ``(sid, tokens left)`` oldest first, ``waiting`` ``(sid, prompt length, chunkable)`` in admission order,
    ``slots`` how many of them the batch size still lets in."""
    budget = StepBudget(max_step_tokens, decoding)
    fill: List[Tuple[int, int]] = []
    for sid, left in filling:
        n = budget.grant(left)
        if not n:
            break
        fill.append((sid, n))
    admit: List[Tuple[int, int]] = []
    for sid, length, chunkable in list(waiting)[:max(0, slots)]:
        n = budget.grant(length, chunkable)
        if not n:
            break
        admit.append((sid, n))
    return Plan(tuple(fill), tuple(admit))


__all__ = ["MIN_CHUNK", "Plan", "StepBudget", "min_chunk", "plan"]
