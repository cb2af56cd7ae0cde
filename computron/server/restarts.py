"""``computron serve``'s engine that comes back: a dead engine is restarted, with bounded retries and back-off.

``RestartingEngine`` is an ``EngineClient`` over the current ``Engine``. When that engine dies (a worker
killed, hung or stopped past its heartbeat timeout), a watcher task logs the cause, closes it (its workers
stopped, its process group released) and launches a new one over the same models (those added, replaced or
removed while serving as they are now, pins and priorities re-applied) after a back-off of
``ServerSettings.engine_restart_backoff_s`` doubled for every restart already made within
``ServerSettings.engine_restart_window_s``; at most ``ServerSettings.engine_restarts`` restarts in that
window, after which the server stays up with a dead engine (``/health`` 503 saying why). Meanwhile
``is_alive`` is False, so ``/health`` and new requests answer 503 naming the restart.

Requests that were in flight when the engine died are sent again to the new engine as the engine groups of
``computron serve --ray`` send them to another group (``cluster.groups.replayable``): a whole-answer
request once; a stream if it had yielded nothing yet or is replayable (greedy, or seeded), its replay checked
against the tokens already yielded, which are not yielded again. Any other fails with ``EngineDeadError``
(503) naming the restart. Counters and the status page's events carry on across restarts.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter, deque
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Tuple

from ..cluster.groups import replayable
from ..errors import EngineDeadError

log = logging.getLogger("computron.server")


def _add(a: Dict[str, Dict], b: Dict[str, Dict]) -> Dict[str, Dict]:
    out = {k: Counter(v) for k, v in a.items()}
    for k, v in b.items():
        out.setdefault(k, Counter()).update(v)
    return {k: dict(v) for k, v in out.items()}


class RestartingEngine:
    def __init__(self, engine: Any, launch: Callable[[List[Any]], Any], configs: List[Any], restarts: int = 3,
                 backoff_s: float = 2.0, window_s: float = 600.0):
        self._engine = engine
        self._launch = launch
        self._configs: Dict[str, Any] = {mc.model_id: mc for mc in configs}
        self._pinned: Dict[str, bool] = {}
        self._priority: Dict[str, int] = {}
        self.max_restarts, self.backoff_s, self.window_s = restarts, backoff_s, window_s
        self.restarts = 0
        self._recent: deque = deque()
        self._gave_up: Optional[str] = None
        self._closing = False
        self._past: Dict[str, Dict] = {}
        self._event_base = 0
        self._changed: Optional[asyncio.Condition] = None
        self._task: Optional[asyncio.Task] = None

    def start(self) -> "RestartingEngine":
        """Watch the engine (call on the server's event loop)."""
        self._changed = asyncio.Condition()
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="computron-engine-restarts")
        return self

    # ---- the watcher ---------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            engine = self._engine
            try:
                await asyncio.to_thread(engine.run)  # returns on shutdown; closes a dead engine, then raises
                return
            except EngineDeadError as exc:
                cause = str(exc)
            if self._closing:
                return
            new = await self._restart(engine, cause)
            async with self._changed:
                if new is not None:
                    self._past = _add(self._past, engine.counters())
                    self._event_base += engine.events(0)[0]
                    self._engine = new
                    for m, p in self._pinned.items():
                        new.set_pinned(m, p)
                    for m, p in self._priority.items():
                        new.set_priority(m, p)
                    self.restarts += 1
                    log.info("engine restarted (restart %d): serving again", self.restarts)
                self._changed.notify_all()
            if new is None:
                return

    async def _restart(self, engine: Any, cause: str) -> Optional[Any]:
        """A new engine, or None once the restarts allowed are spent."""
        while True:
            now = time.monotonic()
            while self._recent and now - self._recent[0] > self.window_s:
                self._recent.popleft()
            if len(self._recent) >= self.max_restarts:
                self._gave_up = (f"{cause}; not restarted: {len(self._recent)} restarts within {self.window_s:g}s "
                                 f"already (ServerSettings.engine_restarts={self.max_restarts})")
                log.error("%s", self._gave_up)
                return None
            delay = self.backoff_s * 2 ** len(self._recent)
            log.warning("%s: restarting the engine in %.1fs (restart %d of at most %d within %gs)", cause, delay,
                        len(self._recent) + 1, self.max_restarts, self.window_s)
            await asyncio.sleep(delay)  # the back-off itself
            if self._closing:
                return None
            self._recent.append(time.monotonic())
            try:
                new = await asyncio.to_thread(self._launch, list(self._configs.values()))
            except Exception as exc:  # noqa: BLE001 - logged; the next attempt backs off further
                cause = f"the engine's restart failed: {type(exc).__name__}: {exc}"
                log.error("%s", cause)
                continue
            if self._closing:  # shut down while it started
                await new.shutdown()
                return None
            return new

    async def _replacement(self, engine: Any, exc: EngineDeadError, deadline: Optional[float]) -> Any:
        """The engine that replaced the dead ``engine``; raises (naming the restart) where there is none."""
        if self._closing or self._changed is None:
            raise exc
        left = None if deadline is None else max(0.0, deadline - time.monotonic())

        async def wait():
            async with self._changed:
                await self._changed.wait_for(lambda: self._engine is not engine or self._gave_up or self._closing)
        try:
            await asyncio.wait_for(wait(), left)
        except asyncio.TimeoutError:
            raise EngineDeadError(f"{exc}; the engine is restarting, and the request's time ran out") from None
        if self._engine is engine:
            raise EngineDeadError(self._gave_up or str(exc)) from None
        return self._engine

    # ---- EngineClient: requests ----------------------------------------------
    async def submit(self, model_id: str, data: Any, timeout: Optional[float] = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        engine = self._engine
        try:
            return await engine.submit(model_id, data, timeout)
        except EngineDeadError as exc:
            engine = await self._replacement(engine, exc, deadline)
        log.info("request to model %r sent again to the restarted engine", model_id)
        left = None if deadline is None else max(0.001, deadline - time.monotonic())
        return await engine.submit(model_id, data, left)

    async def stream(self, model_id: str, data: Any, timeout: Optional[float] = None) -> AsyncIterator[int]:
        deadline = None if timeout is None else time.monotonic() + timeout
        engine, sent = self._engine, []
        for attempt in range(2):
            left = None if deadline is None else max(0.001, deadline - time.monotonic())
            n, differed = 0, False
            try:
                async with aclosing(engine.stream(model_id, data, left)) as tokens:
                    async for tok in tokens:
                        n += 1
                        if n <= len(sent):  # a replay: what the dead engine gave is checked, not yielded again
                            if tok != sent[n - 1]:
                                differed, n = True, n - 1
                                break
                            continue
                        sent.append(tok)
                        yield tok
                differed = differed or n < len(sent)
                if not differed:
                    return
                raise EngineDeadError(f"the engine restarted while streaming model {model_id!r} ({len(sent)} "
                                      f"tokens sent); its replay differed at token {n + 1}: the "
                                      "stream ends here")
            except EngineDeadError as exc:
                if differed or attempt or (sent and not replayable(data)):
                    if differed or self._closing:
                        raise
                    raise EngineDeadError(f"{exc} while streaming model {model_id!r} ({len(sent)} tokens sent); "
                                          "the engine is restarting: the stream ends here") from None
                engine = await self._replacement(engine, exc, deadline)
                log.info("stream of model %r sent again to the restarted engine (%d tokens to check)", model_id,
                         len(sent))

    def check_admission(self, model_id: str, arriving: int = 0) -> None:
        if self._engine.is_alive:  # a dead engine's requests wait for the restarted one
            self._engine.check_admission(model_id, arriving)

    # ---- EngineClient: state --------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._engine.is_alive and self._gave_up is None

    @property
    def dead_reason(self) -> Optional[str]:
        if self._gave_up is not None:
            return self._gave_up
        reason = self._engine.dead_reason
        if reason is None or self._closing or reason == "engine is shutting down":
            return reason
        return f"{reason}; the engine is restarting (ServerSettings.engine_restarts={self.max_restarts})"

    def snapshot(self):
        snap = self._engine.snapshot()
        return dataclasses.replace(snap, alive=self.is_alive, dead_reason=self.dead_reason)

    def counters(self) -> Dict[str, Dict]:
        return _add(self._past, {**self._engine.counters(), "engine_restarts": {(): self.restarts}})

    def events(self, since: int = 0) -> Tuple[int, List[Dict[str, Any]]]:
        base = self._event_base
        cursor, events = self._engine.events(max(0, since - base))
        return cursor + base, [{**e, "id": e["id"] + base} for e in events]

    # ---- EngineClient: the served models --------------------------------------
    async def add_model(self, config: Any) -> None:
        await self._engine.add_model(config)
        self._configs[config.model_id] = config

    async def replace_model(self, model_id: str, config: Any) -> None:
        await self._engine.replace_model(model_id, config)
        self._configs[model_id] = config

    async def remove_model(self, model_id: str, drain: bool = True) -> None:
        await self._engine.remove_model(model_id, drain)
        self._configs.pop(model_id, None)
        self._pinned.pop(model_id, None)
        self._priority.pop(model_id, None)

    def set_pinned(self, model_id: str, pinned: bool = True) -> None:
        self._engine.set_pinned(model_id, pinned)
        self._pinned[model_id] = pinned

    def set_priority(self, model_id: str, priority: int) -> None:
        self._engine.set_priority(model_id, priority)
        self._priority[model_id] = priority

    def note_keep_alive(self, model_id: str, seconds: Optional[float]) -> None:
        if self._engine.is_alive:
            self._engine.note_keep_alive(model_id, seconds)

    async def shutdown(self) -> None:
        self._closing = True
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()
        await self._engine.shutdown()
        if self._task is not None:
            await asyncio.wait([self._task], timeout=30)


__all__ = ["RestartingEngine"]
