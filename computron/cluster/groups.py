"""Engine groups on Ray: one Computron engine of ``tp x pp`` workers per Ray actor.

``EngineGroup`` is a plain class made a Ray *async* actor by ``launch_groups`` (so this module imports
without Ray). Its constructor starts the engine with ``LaunchEngine`` in spawn mode inside the actor's
process: the workers are that process's children and die with it. Each group reserves its resources
with a placement group of one bundle (``group_bundle``), and Ray restarts a group whose process dies
(``max_restarts``): when the engine dies (a worker killed, a lost data plane) the actor exits at once
with status 1, the restarted actor runs the constructor again and rebuilds the models it was started
with; the front (``front.py``) then adds the models changed since (``tags``).

State travels by pushes, never by polls: the engine's observers (every load, offload, step, request)
and the group's own admissions mark the state dirty; at most every ``PUSH_INTERVAL_S`` the group wakes
its subscribers, and ``watch`` (a Ray streaming generator the front keeps open) yields a
``GroupUpdate``. The front lives in the server's process, which is no actor, so it cannot be called
back: the open stream is how a group pushes to it. A stream that ends with an actor error is how the
front learns that the group died.

Errors of the engine travel as ``Relayed`` (``relay.py``; some of ours, like ``UnknownModelError``, cannot be rebuilt
by pickle from their message alone); the front re-raises the original type, so the HTTP server answers
404, 400, 429 or 504 exactly as it does over one engine.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Tuple

from .costs import GroupCosts, group_state, model_of  # noqa: F401 - model_of: part of this module's API
from .policy import GroupState
from .relay import Relayed

log = logging.getLogger("computron.cluster")

PUSH_INTERVAL_S = 0.05
"""The shortest time between two pushes of one group (changes in between are coalesced into one)."""

DEFAULT_MAX_TOKENS = 16
"""Tokens assumed for a generation request that names no ``max_tokens`` (the batch manager's default)."""



def request_tokens(data: Any) -> int:
    """The tokens a request asks to generate (its weight in the router's queues); 1 for a request that
    generates none (an encoder's, a classifier's)."""
    if isinstance(data, dict) and "input_ids" in data:
        n = data.get("max_tokens")
        return int(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else DEFAULT_MAX_TOKENS
    return 1


def replayable(data: Any) -> bool:
    """Whether a generation gives the same tokens when sent again, on any group and in any batch: greedy
    (no temperature, 0, or ``top_k`` 1), or sampled with its own ``seed``."""
    if not isinstance(data, dict):
        return False
    return not data.get("temperature") or data.get("top_k") == 1 or data.get("seed") is not None


@dataclass(frozen=True)
class GroupUpdate:
    """One push of a group: what the router needs, and what the server shows of it."""
    state: GroupState
    snapshot: Any
    """The group engine's ``EngineSnapshot``."""
    counters: Dict[str, Dict]
    """The group engine's ``counters()`` (totals of this incarnation)."""
    events: List[dict]
    """Timeline events new or extended since the subscriber's previous update."""
    incarnation: str
    """Changes when Ray restarts the group."""
    tags: Dict[str, int] = field(default_factory=dict)
    """Per served model, the front's tag of the config it was built from (see ``front.py``)."""
    pids: Dict[int, int] = field(default_factory=dict)
    """The engine's worker processes: rank -> pid."""
    node: str = ""
    """The node (host name) the group runs on."""
    host_budget: Optional[int] = None
    """Its engine's ``host_budget`` (bytes per rank; None: every shard stays in host memory)."""


def group_bundle(tp: int, pp: int, n_groups: int, cluster: Dict[str, float], use_gpu: bool) -> Dict[str, float]:
    """One group's placement bundle: ``tp * pp`` GPUs where there are, and CPUs for its workers plus one
    for the master when the cluster has that many for every group (else one per worker, else a share)."""
    workers = tp * pp
    cpus = int(cluster.get("CPU", 0))
    if cpus >= n_groups * (workers + 1):
        cpu = workers + 1
    elif cpus >= n_groups * workers:
        cpu = workers
    else:
        cpu = max(1, cpus // n_groups)
    bundle: Dict[str, float] = {"CPU": cpu}
    if use_gpu:
        bundle["GPU"] = workers
    return bundle


class EngineGroup:
    """One engine of ``tp x pp`` workers in this (actor) process; see the module docstring.

    ``tags``: the front's tag of each initial model (0 when not given)."""

    def __init__(self, group: int, engine_config, model_configs: Sequence[Any], tp: int = 1, pp: int = 1,
                 tags: Optional[Dict[str, int]] = None):
        from ..runtime.launch import LaunchEngine
        self.group = group
        self.incarnation = uuid.uuid4().hex[:12]
        if engine_config.log_dir:  # one directory per group: the ranks' file names repeat
            engine_config = dataclasses.replace(engine_config,
                                                log_dir=os.path.join(engine_config.log_dir, f"group{group}"))
        self.tags = {mc.model_id: (tags or {}).get(mc.model_id, 0) for mc in model_configs}
        self._closing = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._flag = threading.Lock()
        self._scheduled = False
        self._last_push = 0.0
        self._version = 0
        self._wake: Optional[asyncio.Event] = None
        self._queued: Counter = Counter()
        self.costs = GroupCosts()
        self._front_watch = None
        """The watchdog on the front (``master_watch``), armed by its first keepalive ping."""
        self._master_timeout_s = engine_config.resolved_master_timeout_s()
        # on a thread of its own: Ray runs this constructor on the actor's event loop, which has nothing to
        # do until the engine exists (a restarted group answers no call before it is rebuilt)
        with ThreadPoolExecutor(1, thread_name_prefix="computron-group-launch") as pool:
            self.engine = pool.submit(LaunchEngine, engine_config, list(model_configs), tp, pp).result()
        self.engine.add_observer(self._on_record)
        # what the engine did before it was observed (its start-up's loads): in the first push already
        self.costs.seed(sorted(self.engine.metrics("load") + self.engine.metrics("step"), key=lambda r: r.end))
        threading.Thread(target=self._exit_with_engine, name="computron-group-watch", daemon=True).start()
        log.info("group %d (incarnation %s) serves %s on workers %s", group, self.incarnation,
                 sorted(self.tags), self.worker_pids())

    # ---- dying with the engine -------------------------------------------------
    def _exit_with_engine(self) -> None:
        """Block until the engine stops; if it died (not closed by us), end this process so Ray restarts
        the group. Its requests have already failed with EngineDeadError and its workers are stopped."""
        from ..errors import EngineDeadError
        try:
            self.engine.run()
            return
        except EngineDeadError as exc:
            if self._closing:
                return
            log.error("group %d: %s; exiting so that Ray restarts the group", self.group, exc)
        for h in logging.getLogger().handlers + log.handlers:
            h.flush()
        os._exit(1)

    def _heard_from_front(self) -> None:
        """A keepalive ping: the front is there. The first arms the watchdog that ends this group (its engine,
        its workers, this process) when the front falls silent for ``EngineConfig.master_timeout_s``: a node
        cut off from the front must not keep the memory a restarted group needs."""
        from ..worker.master_watch import MasterSilence, MasterWatch
        if self._front_watch is None:
            silence = MasterSilence(self._master_timeout_s, self._master_timeout_s, time.monotonic(),
                                    contacts="no keepalive ping from the front")
            self._front_watch = MasterWatch(self.group, silence, on_gone=self._leave_cut_off)
            self._front_watch.start()
        self._front_watch.heard()

    def _leave_cut_off(self, group: int, why: str) -> None:
        from ..worker.master_watch import exit_master_gone
        self._closing = True
        exit_master_gone(group, why, cleanup=self.engine.close, who="group")

    # ---- pushes ----------------------------------------------------------------
    def _bind(self) -> None:
        """Remember the actor's event loop (the first async call tells it) and push at once."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            self._changed()

    def _on_record(self, rec: Any) -> None:
        """Engine observer (engine threads, under its lock): keep the measured figures, mark dirty."""
        self.costs.record(rec)
        self._changed()

    def _changed(self) -> None:
        """Schedule one push within ``PUSH_INTERVAL_S`` (thread-safe; repeated calls coalesce)."""
        loop = self._loop
        with self._flag:
            if self._scheduled or loop is None:
                return
            self._scheduled = True
        loop.call_soon_threadsafe(self._schedule)

    def _schedule(self) -> None:
        delay = max(0.0, self._last_push + PUSH_INTERVAL_S - time.monotonic())
        self._loop.call_later(delay, self._push)

    def _push(self) -> None:
        with self._flag:
            self._scheduled = False
        self._last_push = time.monotonic()
        self._version += 1
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()

    async def state(self) -> GroupState:
        """What the router needs of this group now (``seq``: this incarnation's push count)."""
        return self._state(self.engine.snapshot())

    def _state(self, snap) -> GroupState:
        return group_state(self.group, snap, self.engine.model_ids, self.costs, self._queued, self._version,
                           self.engine.config)

    def _update(self, since: int) -> Tuple[GroupUpdate, int]:
        cursor, events = self.engine.events(max(0, since - 1))  # the last one again: steps extend it in place
        snap = self.engine.snapshot()
        upd = GroupUpdate(self._state(snap), snap, self.engine.counters(), events, self.incarnation,
                          dict(self.tags), self.worker_pids(), os.uname().nodename, self.engine.config.host_budget)
        return upd, cursor

    async def watch(self) -> AsyncIterator[GroupUpdate]:
        """Yield an update now, then one after every change (at most every ``PUSH_INTERVAL_S``), until the
        caller cancels (a Ray streaming generator)."""
        self._bind()
        seen, cursor = -1, 0
        while True:
            while self._version == seen:
                await self._wake.wait()
            seen = self._version
            upd, cursor = self._update(cursor)
            yield upd

    # ---- requests ----------------------------------------------------------------
    def _track(self, model_id: str, tokens: int) -> None:
        self._queued[model_id] += tokens
        if self._queued[model_id] <= 0:
            del self._queued[model_id]
        self._changed()

    async def submit(self, model_id: str, data: Any, timeout: Optional[float] = None) -> Any:
        """``Engine.submit``: the whole output."""
        self._bind()
        tokens = request_tokens(data)
        self._track(model_id, tokens)
        try:
            return await self.engine.submit(model_id, data, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - relayed with its type
            raise Relayed.of(exc) from None
        finally:
            self._track(model_id, -tokens)

    async def stream(self, model_id: str, data: Any, timeout: Optional[float] = None) -> AsyncIterator[int]:
        """``Engine.stream``: token ids as they are made (a Ray streaming generator; cancelling it cancels
        the request)."""
        self._bind()
        left = request_tokens(data)
        self._track(model_id, left)
        it = self.engine.stream(model_id, data, timeout=timeout)
        try:
            async for tok in it:
                if left > 1:
                    left -= 1
                    self._track(model_id, -1)
                yield tok
        except Exception as exc:  # noqa: BLE001
            raise Relayed.of(exc) from None
        finally:
            await it.aclose()
            self._track(model_id, -left)

    # ---- models while serving ----------------------------------------------------
    async def _change(self, coro, model_id: str, tag: Optional[int]) -> None:
        self._bind()
        try:
            await coro
        except Exception as exc:  # noqa: BLE001
            raise Relayed.of(exc) from None
        if tag is None:
            self.tags.pop(model_id, None)
        else:
            self.tags[model_id] = tag
        self._changed()

    async def add_model(self, config, tag: int = 0) -> None:
        await self._change(self.engine.add_model(config), config.model_id, tag)

    async def replace_model(self, model_id: str, config, tag: int = 0) -> None:
        await self._change(self.engine.replace_model(model_id, config), model_id, tag)

    async def remove_model(self, model_id: str, drain: bool = True) -> None:
        await self._change(self.engine.remove_model(model_id, drain), model_id, None)

    async def set_pinned(self, model_id: str, pinned: bool = True) -> None:
        try:
            self.engine.set_pinned(model_id, pinned)
        except Exception as exc:  # noqa: BLE001
            raise Relayed.of(exc) from None

    async def set_priority(self, model_id: str, priority: int) -> None:
        try:
            self.engine.set_priority(model_id, priority)
        except Exception as exc:  # noqa: BLE001
            raise Relayed.of(exc) from None

    async def set_host_models(self, model_ids: List[str]) -> bool:
        """``Engine.set_host_models`` (the front's host placement, ``placement.py``), then a push."""
        self._bind()
        try:
            kept = await self.engine.set_host_models(model_ids)
        except Exception as exc:  # noqa: BLE001
            raise Relayed.of(exc) from None
        self._changed()
        return kept

    # ---- views ---------------------------------------------------------------------
    async def snapshot(self):
        return self.engine.snapshot()

    async def counters(self) -> Dict[str, Dict]:
        return self.engine.counters()

    async def metrics(self, kind: Optional[str] = None) -> List[Any]:
        return self.engine.metrics(kind)

    async def events(self, since: int = 0):
        return self.engine.events(since)

    def worker_pids(self) -> Dict[int, int]:
        """The engine's worker processes: rank -> pid (kill one to test a group's death)."""
        return {r: w.pid for r, w in self.engine.workers.items()}

    async def ping(self) -> str:
        """The front's keepalive (``keepalive.py``): this incarnation."""
        self._heard_from_front()
        return self.incarnation

    async def info(self) -> Dict[str, Any]:
        return {"group": self.group, "incarnation": self.incarnation, "pids": self.worker_pids(),
                "actor_pid": os.getpid(), "node": os.uname().nodename, "alive": self.engine.is_alive}

    async def close(self) -> None:
        """Stop the engine and its workers (the actor itself is ended by its owner)."""
        self._closing = True
        await asyncio.get_running_loop().run_in_executor(None, self.engine.close)


def launch_groups(n_groups: int, engine_config, model_configs: Sequence[Any], tp: int = 1, pp: int = 1, *,
                  max_restarts: int = 3, tags: Optional[Dict[str, int]] = None, pg_timeout_s: float = 60.0):
    """Start ``n_groups`` ``EngineGroup`` actors, each in a placement group of its own (``group_bundle``);
    returns ``(actor handles, placement groups)``. Ray must be initialized. A bundle the cluster cannot
    hold within ``pg_timeout_s`` raises ``LaunchError`` naming what it asked and what the cluster has.
    The groups start their engines concurrently; ``ClusterEngine.start`` waits for them."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from ..errors import LaunchError
    if n_groups < 1:
        raise ValueError(f"n_groups={n_groups}: must be >= 1")
    cluster = ray.cluster_resources()
    device = engine_config.device
    use_gpu = device == "cuda" or (device is None and cluster.get("GPU", 0) >= tp * pp)
    bundle = group_bundle(tp, pp, n_groups, cluster, use_gpu)
    pgs = [placement_group([bundle], strategy="STRICT_PACK", name=f"computron-group-{i}") for i in range(n_groups)]
    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=n_groups, timeout=pg_timeout_s)
    if len(ready) < n_groups:
        for pg in pgs:
            remove_placement_group(pg)
        raise LaunchError(f"{n_groups} groups of {bundle} do not fit the Ray cluster within {pg_timeout_s:.0f}s "
                          f"(cluster resources: {cluster}; available now: {ray.available_resources()})")
    actor = ray.remote(EngineGroup)
    handles = []
    for i, pg in enumerate(pgs):
        handles.append(actor.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=max_restarts, max_task_retries=0,
            max_concurrency=10_000, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0),
        ).remote(i, engine_config, list(model_configs), tp, pp, tags))
    log.info("started %d engine groups of TP=%d x PP=%d, each in a placement group %s (max_restarts=%d)",
             n_groups, tp, pp, bundle, max_restarts)
    return handles, pgs
