"""The scheduler's vocabulary, the token-level policies and the recompute choice: pure, no torch, no processes.

``ModelState``, ``ActionKind``, ``Reason`` and ``Action`` are what the scheduler (``scheduler.py``,
which re-exports them) decides and tracks.

``Policy`` names the rule that decides when a waiting model may take the slot of one with live
sequences (``RunToCompletion``, ``Quantum``, ``Deadline``; ``POLICY_RULES`` maps each name to its
rules); the scheduler applies them (``scheduler.py``). Under ``quantum`` a waiting model may preempt a
running one once its turn (time since its first step after loading) reached ``quantum_s`` and it had
``MIN_TURN_STEPS`` steps; under ``deadline``, once the waiting model's oldest request has used half of
``ttft_slo_s`` and the victim had a minimal turn, or at once when it has waited ``4 * ttft_slo_s``
(anti-starvation; such a model is also visited first). ``choose_recompute`` picks the paused
sequences whose KV cache is cheaper to rebuild than to copy to host memory and back.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Set


class ModelState(enum.Enum):
    OFFLOADED = "offloaded"
    LOADING = "loading"
    LOADED = "loaded"
    OFFLOADING = "offloading"


class ActionKind(enum.Enum):
    LOAD = "load"
    OFFLOAD = "offload"
    RUN = "run"


class Reason(enum.Enum):
    """Why a decision was taken (for the log, the timeline and the engine's preemption glue)."""
    SERVE = "serve"
    """RUN: the model has work; LOAD: its oldest request waits for it."""
    EVICT_IDLE = "evict_idle"
    """OFFLOAD: an idle model (the first in eviction order) makes room."""
    DRAIN = "drain"
    """OFFLOAD queued behind the model's last batch (prefetch): its queue is empty."""
    PREEMPT = "preempt"
    """OFFLOAD of a model with live sequences whose turn is over under the policy: they pause."""
    KEEP_ALIVE = "keep_alive"
    """OFFLOAD of an idle model whose keep-alive is up (``keep_alive.py``)."""


@dataclass(frozen=True)
class Action:
    """One decision: what to send for which model, and why (``reason``; ``for_model``: the model an
    offload makes room for). Two actions are equal when kind and model are."""
    kind: ActionKind
    model_id: str
    reason: Reason = field(default=Reason.SERVE, compare=False)
    for_model: Optional[str] = field(default=None, compare=False)

    @property
    def preempts(self) -> bool:
        return self.reason is Reason.PREEMPT


MIN_TURN_STEPS = 4
"""A model is preempted only after this many steps since it loaded, however short the quantum."""


class Policy(str, enum.Enum):
    """Which model's generation runs when more models have work than fit (see EngineConfig.policy)."""
    RUN_TO_COMPLETION = "run_to_completion"
    QUANTUM = "quantum"
    DEADLINE = "deadline"


POLICIES = tuple(p.value for p in Policy)


class RunToCompletion:
    """A resident model keeps its slot until its running sequences end: nothing is preempted."""

    def __init__(self, quantum_s: float, ttft_slo_s: float):
        self.quantum_s = quantum_s
        self.ttft_slo_s = ttft_slo_s

    def starving(self, waited: float) -> bool:
        """Visited before every other model, and may preempt at once."""
        return False

    def may_preempt(self, waited: float, turn: float) -> bool:
        """May a model whose oldest request ``waited`` preempt one whose turn has lasted ``turn``?"""
        return False


class Quantum(RunToCompletion):
    """A model's turn ends after ``quantum_s`` of steps when another model waits for its slot."""

    def may_preempt(self, waited: float, turn: float) -> bool:
        return turn >= self.quantum_s


class Deadline(RunToCompletion):
    """The model closest to missing ``ttft_slo_s`` goes first; one that waited 4x it goes regardless."""

    def starving(self, waited: float) -> bool:
        return waited >= 4 * self.ttft_slo_s

    def may_preempt(self, waited: float, turn: float) -> bool:
        return self.starving(waited) or (
            waited >= self.ttft_slo_s / 2 and turn >= min(self.quantum_s, self.ttft_slo_s) / 4)


POLICY_RULES = {Policy.RUN_TO_COMPLETION: RunToCompletion, Policy.QUANTUM: Quantum, Policy.DEADLINE: Deadline}


def choose_recompute(contexts: Mapping[int, int], kv_bytes_per_token: float, copy_bytes_per_s: float,
                     prefill_tokens_per_s: float) -> Set[int]:
    """Which paused sequences lose their KV cache (rebuilt later by a prefill) rather than have it
    copied to host memory and back: those whose context is cheaper to recompute than to move twice.

    ``contexts``: sequence -> tokens in its cache (prompt + generated). Costs per sequence:
    copy = 2 * n * kv_bytes_per_token / copy_bytes_per_s (out and back); recompute =
    n / prefill_tokens_per_s * (1 + n / ATTENTION_SCALE), the second factor standing for attention's
    quadratic share, which the measured rate (from short prompts) does not show. So short contexts
    are recomputed where prefill is cheap per token, long ones copied. Unknown rates (zero) keep the
    cache (copying never loses work).
    """
    if kv_bytes_per_token <= 0 or copy_bytes_per_s <= 0 or prefill_tokens_per_s <= 0:
        return set()
    copy_per_token = 2 * kv_bytes_per_token / copy_bytes_per_s
    return {sid for sid, n in contexts.items()
            if n / prefill_tokens_per_s * (1 + n / ATTENTION_SCALE) < n * copy_per_token}


ATTENTION_SCALE = 4096


APART_MIN_WASTE = {"cpu": 2e9, "cuda": 4e12}
"""Wasted positions x shard bytes per rank from which ``prefill_apart`` splits a step, by device type: about
four positions of a 0.5 GB shard on a CPU (tens of ms, a TP=2 forward's fixed cost over gloo), a few hundred
of a 14 GB shard on a GPU (where a forward is bound by reading its weights up to about that many rows)."""


def prefill_apart(n_running: int, prompt_lens: Sequence[int], shard_bytes: int, device_type: str) -> bool:
    """Whether a step that admits prompts of ``prompt_lens`` while ``n_running`` sequences run should prefill
    them in a forward of their own, after a decode forward of the running ones, rather than in one forward.

    One forward gives every row the longest prompt's width ``W``: the running rows' ``n_running * (W - 1)``
    padding positions are computed for nothing, each at about the cost of reading the rank's weights
    (``shard_bytes``). Two forwards pay a second forward's fixed cost instead. Split where the waste is
    more than the positions the step needs and, in position-bytes, at least ``APART_MIN_WASTE``.
    """
    if not n_running or not prompt_lens:
        return False
    width = max(prompt_lens)
    waste = n_running * (width - 1)
    needed = n_running + len(prompt_lens) * width
    return waste > needed and waste * shard_bytes >= APART_MIN_WASTE.get(device_type, APART_MIN_WASTE["cuda"])
