"""The models the engine serves, and every change to them while it serves.

A model id names its current *version*. The engine's other components (queues,
running batches, the scheduler, the workers) know a version by its key: the
first version's key is the id itself, later ones ``<id>@v<n>``. A request is
admitted under the key its id named when it was queued and keeps that version to
its end; ``replace`` points the id at a new key the moment the new version is
built on every rank, so there is no window where the id is unknown, and the old
version retires.

A retiring version takes no new request. Once its queue is empty, its
sequences have ended, nothing of it is in flight and it is not moving between
tiers (``reap``, called on every pump), the scheduler forgets it and every rank
is told to free it (``RemoveModel``); its waiters hear when all ranks did.
Removing with ``drain=False`` fails its waiting and running requests first.
Records and counters name versions by key, so a replaced model's new numbers are
apart from the old ones (as Triton's per-version statistics are).
"""
from __future__ import annotations

import logging
import re
from dataclasses import replace as _replace
from typing import Any, Callable, Dict, List, Optional

from ..batching.causal_lm import CausalLMBatchManager, batch_manager_for
from ..comm import messages as msg
from ..config import EngineConfig, ModelConfig
from ..errors import ModelChangeError, ModelConflictError, UnknownModelError
from ..sched.scheduler import ModelState, Scheduler
from .commands import CommandKind, CommandTracker, PendingCommand
from .requests import RequestTable
from .swaps import Swaps
from .token_level import TokenLevel

log = logging.getLogger("computron.engine")

Done = Callable[[Optional[BaseException]], None]
"""Told once when a change is complete: None, or what went wrong."""

_VERSION_KEY = re.compile(r"@v\d+$")


def version_key(model_id: str, version: int) -> str:
    return model_id if version == 1 else f"{model_id}@v{version}"


class Catalog:
    """Which versions exist and which one each id names; adding, replacing, removing. The caller holds
    the engine's lock."""

    def __init__(self, config: EngineConfig, model_configs: List[ModelConfig], sched: Scheduler,
                 tracker: CommandTracker, requests: RequestTable, token_level: TokenLevel, swaps: Swaps):
        self._config = config
        self._sched = sched
        self._tracker = tracker
        self._requests = requests
        self._token_level = token_level
        self._swaps = swaps
        self.current: Dict[str, str] = {mc.model_id: mc.model_id for mc in model_configs}
        """Each served id -> the key of its current version."""
        self.configs: Dict[str, ModelConfig] = {mc.model_id: mc for mc in model_configs}
        """Every version's config, by key (retiring ones too)."""
        self._id_of: Dict[str, str] = {mc.model_id: mc.model_id for mc in model_configs}
        self._versions: Dict[str, int] = {mc.model_id: 1 for mc in model_configs}
        self._changing: Dict[str, str] = {}
        """Ids with a change under way -> which ('adding', 'replacing', 'removing')."""
        self._retiring: Dict[str, List[Done]] = {}
        """Versions that take no new request -> who waits for them to be gone."""
        self._removing: Dict[str, List[Done]] = {}
        """Versions whose RemoveModel is out -> who waits for every rank's answer."""
        self._adding: Dict[str, Done] = {}
        self.adapters_on: Callable[[str], List[str]] = lambda model_id: []
        """The adapters on a model id (``adapters.py`` sets it): a base with adapters keeps its version."""
        self.on_id_change: Callable[[str], None] = lambda model_id: None
        """Told when an id names a new version or none any more (``host_models.py`` sets it)."""

    # ---- what callers ask ----------------------------------------------------
    def key_of(self, model_id) -> str:
        key = self.current.get(model_id) if isinstance(model_id, str) else None
        if key is None:
            raise UnknownModelError(model_id, self.current)
        return key

    def id_of(self, key: str) -> str:
        return self._id_of[key]

    def accepts(self, key: str) -> bool:
        """May a request prepared for ``key`` still be queued there? Yes until the version is removed:
        a retiring version still drains what reached it."""
        return key in self.configs and key not in self._removing

    def version(self, model_id: str) -> int:
        """The current version's number (1 for the model served at launch or first added)."""
        key = self.current[model_id]
        return int(key.rpartition("@v")[2]) if _VERSION_KEY.search(key) else 1

    def old_versions(self, model_id: str) -> List[str]:
        """Keys of this id's earlier versions still draining."""
        return [k for k in list(self._retiring) + list(self._removing)
                if self._id_of.get(k) == model_id and k != self.current.get(model_id)]

    # ---- adding and replacing ------------------------------------------------
    def add(self, mc: ModelConfig, done: Done, replace: bool = False) -> str:
        """Send ``AddModel`` for a new id (or a new version of a served one with ``replace``); ``done``
        is told when every rank has built it and it is served (or why not). Returns the new key."""
        mid = mc.model_id
        if _VERSION_KEY.search(mid):
            raise ValueError(f"model id {mid!r}: an id may not end in '@v<number>' (the engine names "
                             "versions that way)")
        self._check_idle(mid)
        if replace and mid not in self.current:
            raise UnknownModelError(mid, self.current)
        if not replace and mid in self.current:
            raise ModelConflictError(f"model {mid!r} is already served: replace it, or remove it first")
        self._check_no_adapters(mid, "replaced")
        version = self._versions.get(mid, 0) + 1
        key = version_key(mid, version)
        self._versions[mid] = version
        self._changing[mid] = "replacing" if replace else "adding"
        self._adding[key] = done
        keyed = mc if key == mid else _with_id(mc, key)
        log.info("%s %s (version %d, key %s): building it on every rank while serving",
                 "replacing" if replace else "adding", mid, version, key)
        self._tracker.send(CommandKind.ADD, key, lambda seq: msg.AddModel(seq, keyed.for_workers()),
                           cause="replace" if replace else "add")
        self.configs[key] = keyed
        self._id_of[key] = mid
        return key

    def complete_add(self, p: PendingCommand, now: float, error: Optional[str]) -> None:
        key = p.model_id
        mid = self._id_of[key]
        done = self._adding.pop(key)
        replace = self._changing.pop(mid, None) == "replacing"
        added = p.of_type(msg.ModelAdded)
        failure: Optional[BaseException] = None
        if error is not None:
            failure = ModelChangeError(f"adding model {mid!r} failed: {error}")
        else:
            try:
                self._sched.add_model(key, self._size(added), pinned=self.configs[key].pinned,
                                      priority=self.configs[key].priority)
            except ValueError as exc:  # cannot fit the device budget
                failure = ModelChangeError(f"adding model {mid!r} failed: {exc}")
        if failure is not None:
            log.error("%s", failure)
            del self.configs[key]
            del self._id_of[key]
            self._versions[mid] -= 1  # never served: the next try reuses its key (the cleanup goes first)
            self._tracker.send(CommandKind.CLEANUP, key, lambda seq: msg.RemoveModel(seq, key))
            done(failure)
            return
        self._register(key, added)
        old = self.current.get(mid)
        self.current[mid] = key
        self._swaps.note_host_resident(added)
        self.on_id_change(mid)
        log.info("%s %s: version %d built on every rank in %.2f s", "replaced" if replace else "added", mid,
                 self._versions[mid], now - p.start)
        if replace and old is not None:
            self._retiring[old] = []
        done(None)

    def _size(self, added: List[msg.ModelAdded]) -> int:
        """Device bytes per rank (``budget.model_sizes``' rule): the largest shard plus the KV reserve."""
        return int(max((max(x.host_bytes, x.device_need) for x in added), default=0) * (1 + self._config.kv_reserve))

    def _register(self, key: str, added: List[msg.ModelAdded]) -> None:
        mc = self.configs[key]
        batching = next((x.batching for x in added if x.batching is not None), None)
        bm = batch_manager_for(batching, self._config.max_batch_size, mc)
        queue_size = self._config.queue_size if mc.queue_size is None else mc.queue_size
        self._requests.add_model(key, bm, queue_size)
        if not self._token_level.adopt(key, bm, batching) and isinstance(bm, CausalLMBatchManager):
            bm.request_level = True  # whole batches per command: no per-sequence sampling controls

    # ---- removing ------------------------------------------------------------
    def remove(self, model_id: str, done: Done, drain: bool = True) -> None:
        """The id takes no new request from now on; ``done`` is told once every version of it is gone
        from every rank. Without ``drain`` its waiting and running requests fail at once."""
        key = self.key_of(model_id)
        self._check_idle(model_id)
        self._check_no_adapters(model_id, "removed")
        del self.current[model_id]
        self.on_id_change(model_id)
        keys = [key] + self.old_versions(model_id)
        log.info("removing %s (%s)", model_id, "its admitted requests finish first" if drain
                 else "its admitted requests fail now")
        self._changing[model_id] = "removing"
        left = {"n": len(keys)}
        errors: List[BaseException] = []

        def one_gone(error: Optional[BaseException]) -> None:
            if error is not None:
                errors.append(error)
            left["n"] -= 1
            if left["n"] == 0:
                self._changing.pop(model_id, None)
                done(errors[0] if errors else None)

        for k in keys:
            (self._removing[k] if k in self._removing else self._retiring.setdefault(k, [])).append(one_gone)
            if not drain:
                self.fail_requests(lambda r, k=k: r.model_id == k, UnknownModelError(model_id, self.current))

    def fail_requests(self, which: Callable[[Any], bool], error: BaseException) -> None:
        """Fail at once every admitted request ``which`` selects, waiting or running."""
        for uid, req in list(self._requests.requests.items()):
            if not which(req):
                continue
            self._requests.finish(uid, error=error)
            if not self._token_level.cancel(req):
                self._requests.unqueue(uid, req.model_id)

    def reap(self) -> None:
        """Send ``RemoveModel`` for every retiring version with nothing left to do."""
        for key in [k for k in self._retiring if self._settled(k)]:
            self._sched.remove_model(key)
            self._removing[key] = self._retiring.pop(key)
            log.info("freeing %s on every rank", key)
            self._tracker.send(CommandKind.REMOVE, key, lambda seq, k=key: msg.RemoveModel(seq, k),
                               cause="remove")

    def _settled(self, key: str) -> bool:
        if self._requests.queues[key] or key in self._token_level.live_models():
            return False
        state = self._sched.state(key)
        return self._sched.in_flight(key) == 0 and state in (ModelState.OFFLOADED, ModelState.LOADED)

    def complete_remove(self, p: PendingCommand, now: float, error: Optional[str]) -> None:
        key = p.model_id
        waiters = self._removing.pop(key)
        self._requests.remove_model(key)
        self._token_level.remove_model(key)
        self._swaps.note_host_resident(p.of_type(msg.ModelRemoved))
        del self.configs[key]
        del self._id_of[key]
        failure = None
        if error is not None:  # the version is gone from the master; a rank could not free all of it
            failure = ModelChangeError(f"removing {key!r} did not free everything: {error}")
            log.error("%s", failure)
        else:
            log.info("removed %s from every rank in %.1f ms", key, (now - p.start) * 1e3)
        for w in waiters:
            w(failure)

    # ---- settings ------------------------------------------------------------
    def set_pinned(self, model_id: str, pinned: bool) -> None:
        if not isinstance(pinned, bool):
            raise ValueError(f"pinned={pinned!r}: must be True or False")
        self._sched.set_pinned(self.key_of(model_id), pinned)

    def set_priority(self, model_id: str, priority: int) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority={priority!r}: must be an int")
        self._sched.set_priority(self.key_of(model_id), priority)

    # ---- the engine stops ----------------------------------------------------
    def abandon(self, error: BaseException) -> None:
        """The engine died or closed: every change under way fails with ``error``."""
        waiting = list(self._adding.values()) + [w for ws in list(self._retiring.values())
                                                 + list(self._removing.values()) for w in ws]
        self._adding.clear()
        self._retiring.clear()
        self._removing.clear()
        self._changing.clear()
        for w in waiting:
            w(error)

    def _check_no_adapters(self, model_id: str, what: str) -> None:
        on = self.adapters_on(model_id)
        if on:
            raise ModelConflictError(f"model {model_id!r} has adapters {on}, made for its weights: remove them "
                                     f"before it is {what}")

    def _check_idle(self, model_id: str) -> None:
        change = self._changing.get(model_id)
        if change is not None:
            raise ModelConflictError(f"model {model_id!r} is {change} right now: wait for that to end")


def _with_id(mc: ModelConfig, key: str) -> ModelConfig:
    return _replace(mc, model_id=key)



def done_on(loop, fut) -> Done:
    """A ``Done`` that settles ``fut`` on its own loop (from whichever thread completes the change)."""
    def settle(error: Optional[BaseException]) -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)
    return lambda error: loop.call_soon_threadsafe(settle, error)
