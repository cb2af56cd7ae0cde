"""The models the engine keeps in host memory by plan (``Engine.set_host_models``), under ``host_budget``.

A planner that sees more than this engine (``cluster/placement.py``: which models each engine group keeps in
host memory) decides; here the set goes to every rank (``messages.SetHostModels``), which sends those shards
to disk last of all and reads the ones on disk ahead of their next load (``worker/host_tier.py``). The set names
served ids; the ranks know versions by key, so a planned id's new version (``replace_model``) is sent again
once it is served, and an id removed leaves the set. Without ``host_budget`` every shard stays in host
memory anyway: the call is a no-op that says so.
"""
from __future__ import annotations

import logging
from typing import Dict, FrozenSet, Iterable, Optional, Tuple

from ..comm import messages as msg
from ..errors import EngineDeadError, UnknownModelError, WorkerError
from .catalog import Catalog, Done
from .commands import CommandKind, CommandTracker
from .swaps import Swaps

log = logging.getLogger("computron.engine")


class HostModels:
    """The plan in force and its sending; the caller holds the engine's lock."""

    def __init__(self, host_budget: Optional[int], tracker: CommandTracker, catalog: Catalog, base_of: Dict[str, str],
                 swaps: Swaps):
        self._host_budget = host_budget
        self._tracker = tracker
        self._catalog = catalog
        self._base_of = base_of
        """A LoRA adapter's id -> its base model's (``Adapters.base_of``): an adapter's shards are its base's."""
        self._swaps = swaps
        self.ids: Tuple[str, ...] = ()
        """The planned ids, in the plan's order (that of the reads ahead)."""
        self._said_no_budget = False

    def keys(self) -> FrozenSet[str]:
        """The planned versions, by key."""
        return frozenset(self._catalog.current[m] for m in self.ids if m in self._catalog.current)

    def set(self, model_ids: Iterable[str], done: Done) -> bool:
        """Check ``model_ids`` (UnknownModelError before any rank hears of it), then send the set to every
        rank; ``done`` is told once each has read ahead what it had room for. False (``done`` told at
        once) when there is no ``host_budget``."""
        if isinstance(model_ids, str):
            raise TypeError(f"model_ids={model_ids!r}: a list of model ids, not one id")
        ids = []
        for m in model_ids:
            base = self._base_of.get(m, m) if isinstance(m, str) else m
            if base not in self._catalog.current:
                raise UnknownModelError(m, list(self._catalog.current) + list(self._base_of))
            ids.append(base)
        if self._host_budget is None:
            if not self._said_no_budget:
                log.info("set_host_models: no EngineConfig.host_budget, so every shard stays in host memory; "
                         "nothing to plan")
                self._said_no_budget = True
            done(None)
            return False
        self.ids = tuple(dict.fromkeys(ids))
        log.info("keeping in host memory by plan: %s", list(self.ids) or "nothing")
        self._send(done)
        return True

    def id_changed(self, model_id: str) -> None:
        """The catalog served a new version of ``model_id`` or stopped serving it (``Catalog.on_id_change``)."""
        if model_id not in self.ids:
            return
        if model_id not in self._catalog.current:
            self.ids = tuple(m for m in self.ids if m != model_id)
        else:
            self._send(None)

    def _send(self, done: Optional[Done]) -> None:
        keys = tuple(self._catalog.current[m] for m in self.ids if m in self._catalog.current)
        self._tracker.send(CommandKind.HOST_MODELS, None, lambda seq: msg.SetHostModels(seq, keys),
                           waiter=lambda replies: self._answered(replies, done))

    def _answered(self, replies: Dict[int, object], done: Optional[Done]) -> None:
        """Every rank answered (``replies``), or the engine stopped first (no replies)."""
        if not replies:
            if done is not None:
                done(EngineDeadError("the engine stopped before every rank had its host plan"))
            return
        answers = [x for x in replies.values() if isinstance(x, msg.HostModelsSet)]
        self._swaps.note_host_resident(answers)
        failures = {r: x.error for r, x in replies.items() if isinstance(x, msg.CommandFailed)}
        for x in answers:
            if x.read or x.no_room or x.failed:
                log.info("rank %d: read ahead %s; no room for %s; failed: %s", x.rank, list(x.read), list(x.no_room),
                         x.failed or "none")
        if done is not None:
            done(WorkerError(f"setting the host plan failed on ranks {failures}") if failures else None)


class HostModelsControl:
    """``Engine.set_host_models``, mixed into ``Engine`` (its ``_change`` and ``_host_models``)."""

    async def set_host_models(self, model_ids: Iterable[str]) -> bool:
        """Keep ``model_ids`` in host memory by plan, replacing the previous set: every rank sends them to disk
        last of all, and reads those on disk ahead of their next load (in this order, on a thread beside its
        command loop, while ``host_budget`` has room without sending a model on the device, loading or
        planned to disk). Returns True once every rank has; ``snapshot()`` says which models are planned
        (``host_plan``) and where each is (``tier``). ``UnknownModelError`` for an id not served, before any
        rank hears of it; without ``host_budget`` a no-op that returns False (every shard is in host memory)."""
        sent = []
        await self._change(lambda done, _: sent.append(self._host_models.set(model_ids, done)))
        return sent[0]
