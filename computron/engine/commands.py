"""Commands in flight: one sequence number per command, and every rank's reply collected for it.

The master sends each command to every worker (the transport broadcasts it) and
waits for one reply per rank. ``CommandTracker`` allocates the sequence numbers,
remembers what each command was for (``PendingCommand``, typed per kind) and
hands a command back once its last rank has answered. It also knows which
commands failed on some ranks while others stay silent (the watchdog's second
rule) and which rank's error is the root cause.
"""
from __future__ import annotations

import enum
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

from ..comm import messages as msg

log = logging.getLogger("computron.engine")


class CommandKind(enum.Enum):
    LOAD = "load"
    OFFLOAD = "offload"
    STEP = "step"
    BATCH = "batch"
    STATS = "stats"
    ADD = "add"
    """A model added (or a new version) while serving: every rank builds its shard."""
    REMOVE = "remove"
    """A retired version leaves every rank."""
    ADD_ADAPTER = "add_adapter"
    REMOVE_ADAPTER = "remove_adapter"
    HOST_MODELS = "host_models"
    """The models every rank keeps in host memory by plan (``host_models.py``)."""
    CLEANUP = "cleanup"
    """Releases what a failure left behind on the workers (an offload after a failed load, a drop of
    sequences some ranks still hold): nobody waits for it, its errors are only logged."""


@dataclass
class PendingCommand:
    """A command sent to every worker, waiting for every worker's reply."""
    seq: int
    kind: CommandKind
    model_id: Optional[str]
    start: float
    uids: tuple = ()
    """Requests the command serves (a batch's rows, a step's running sequences)."""
    cause: str = ""
    """Swaps: why, for the log and the timeline."""
    adapter: str = ""
    """Adapter changes: the adapter's id."""
    recompute: tuple = ()
    """Preemption offloads: the sequences whose KV cache is dropped (rebuilt by prefill on resume)."""
    admitted: int = 0
    dropped: int = 0
    prompt_tokens: int = 0
    batch_info: Dict[str, Any] = field(default_factory=dict)
    """Batches: what ``split_batch`` needs besides the output."""
    waiter: Optional[Callable[[Dict[int, Any]], None]] = None
    """Queries: called with the replies (or {} when the engine dies first)."""
    replies: Dict[int, Any] = field(default_factory=dict)
    first_failure: Optional[float] = None
    master_s: float = 0.0
    """The master's own time spent on this command (preparing it, handling its replies)."""

    def failures(self) -> Dict[int, msg.CommandFailed]:
        return {r: x for r, x in self.replies.items() if isinstance(x, msg.CommandFailed)}

    def root_cause(self) -> Optional[str]:
        """The first rank's own error, rather than a downstream rank's 'an upstream stage failed'."""
        failures = self.failures()
        if not failures:
            return None
        own = [f for f in failures.values() if not f.upstream]
        pick = min(own or failures.values(), key=lambda f: f.rank)
        return f"rank {pick.rank}: {pick.error}"

    def rank_times(self) -> Dict[int, Tuple[float, float]]:
        return {r: (x.start, x.end) for r, x in self.replies.items() if isinstance(x, msg.CommandDone)}

    def of_type(self, cls) -> list:
        return [x for x in self.replies.values() if isinstance(x, cls)]


class CommandTracker:
    """Sequence numbers, sending, and reply collection. The caller holds the engine's lock."""

    def __init__(self, n_workers: int, channel):
        self.n_workers = n_workers
        self._channel = channel
        self._seqs = itertools.count()
        self._pending: Dict[int, PendingCommand] = {}

    def send(self, kind: CommandKind, model_id: Optional[str], make: Callable[[int], Any],
             **fields) -> PendingCommand:
        """Record a command of ``kind`` and send ``make(seq)`` to every worker."""
        seq = next(self._seqs)
        pending = PendingCommand(seq, kind, model_id, fields.pop("start", None) or time.perf_counter(), **fields)
        self._pending[seq] = pending
        self._channel.send(make(seq))
        return pending

    def collect(self, reply) -> Tuple[bool, Optional[PendingCommand]]:
        """Add one rank's reply. Returns (known, the command if that was its last reply)."""
        pending = self._pending.get(reply.seq)
        if pending is None:
            return False, None
        pending.replies[reply.rank] = reply
        if isinstance(reply, msg.CommandFailed) and pending.first_failure is None:
            pending.first_failure = time.perf_counter()
        if len(pending.replies) < self.n_workers:
            return True, None
        del self._pending[reply.seq]
        return True, pending

    def half_answered(self, now: float, limit: float) -> Optional[str]:
        """A command that failed on some ranks while the others stayed silent for ``limit`` seconds."""
        for p in self._pending.values():
            if p.first_failure is not None and now - p.first_failure > limit:
                silent = sorted(set(range(self.n_workers)) - set(p.replies))
                return (f"command {p.seq} ({p.kind.value} {p.model_id}) failed on ranks {sorted(p.replies)} "
                        f"and ranks {silent} gave no answer for {limit}s")
        return None

    def abandon_all(self) -> None:
        """The engine is dead or closing: wake every waiter with no replies and forget every command."""
        for p in list(self._pending.values()):
            if p.waiter is not None:
                p.waiter({})
        self._pending.clear()


def complete_query(p: PendingCommand, now: float, error: Optional[str]) -> None:
    """A query (``STATS``) has every rank's reply: hand them to its waiter."""
    p.waiter(p.replies)


def complete_cleanup(p: PendingCommand, now: float, error: Optional[str]) -> None:
    """A ``CLEANUP`` is answered: nobody waits for it, its errors are only logged."""
    if error is not None:
        log.warning("cleaning up after a failure of %s did not work everywhere: %s", p.model_id, error)
