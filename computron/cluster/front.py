"""``ClusterEngine``: many engine groups (``groups.py``) behind the one ``EngineClient`` the HTTP server uses.

Every request is routed by a router of ``policy.py`` (``SwapAwareRouter``; ``RoundRobinRouter`` to compare)
and told to it again when it ends (``finished``). The router's picture of each group comes from the
group's pushes (``EngineGroup.watch``, kept open on the front's own thread and event loop): never a poll
per request. ``snapshot``, ``counters`` and ``events`` answer from the last pushes too, so the server's
status page and Prometheus scrapes cost no call to a group.

Groups die and come back. A call that finds its group dead (the actor gone, or its engine's
``EngineDeadError``) marks the group down in the router at once; then
- a request that got nothing yet is sent once more, to another group (the router's ``exclude``): a
  non-streamed one, and a stream before its first token (the server's completions are streams, and a
  request waiting through its model's load has no token yet);
- a stream that already yielded tokens is sent once more too where its tokens do not depend on the group
  or the batch (greedy, or seeded: ``groups.replayable``): the new group's first tokens are checked
  against those already yielded and not yielded again. Any other stream, or one whose replay differs,
  ends with ``EngineDeadError`` naming the group.
When Ray has restarted a group (a push with a new ``incarnation``), the front brings its models up to
date with the catalog (models added, replaced or removed since the group was launched, pins and
priorities); until then the router sends it only the models whose version it holds (``tags``).

Beside it: ``board.py`` (the groups' last pushes, merged into the server's views), ``catalog.py`` (the
served models every group follows: adding, replacing, removing them, and bringing a restarted group up to date)
and ``placement.py`` (which models each group keeps in host memory, re-planned from the requests routed and
the groups' pushes).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import EngineDeadError, LaunchError, RequestTimeoutError, UnknownModelError
from .board import Board, GroupDied, short_error
from .catalog import CatalogMixin
from .views import ViewsMixin
from .groups import GroupUpdate, replayable, request_tokens
from .keepalive import KeepaliveConfig, keep_alive
from .placement import HostPlacement, HostPlanning
from .policy import GroupState, NoGroupError
from .relay import Relayed

log = logging.getLogger("computron.cluster")


class ClusterEngine(CatalogMixin, HostPlanning, ViewsMixin):
    """The server's ``EngineClient`` over ``groups`` (``EngineGroup`` actor handles, index = group), routed
    by ``router``; ``model_configs`` are the models the groups were launched with (the catalog).
    ``start`` subscribes to every group and waits for their engines. ``placement``: the host placement's
    re-planning state (``placement.HostPlacement``; its defaults when not given). ``keepalive``: the front's
    pings of each group (``keepalive.KeepaliveConfig``; its defaults when not given)."""

    def __init__(self, groups: Sequence[Any], router, model_configs: Sequence[Any] = (), *,
                 placement_groups: Sequence[Any] = (), shutdown_grace_s: float = 30.0,
                 placement: Optional[HostPlacement] = None, keepalive: Optional[KeepaliveConfig] = None):
        self._groups = list(groups)
        self._router = router
        self._pgs = list(placement_groups)
        self._grace = shutdown_grace_s
        self._lock = threading.RLock()
        self._board = Board(len(self._groups))
        self._views = self._board.views
        self._tags = itertools.count(1)
        self._catalog: Dict[str, Tuple[Any, int]] = {mc.model_id: (mc, 0) for mc in model_configs}
        self._settings: Dict[str, Dict[str, Any]] = {}  # set_pinned / set_priority, re-applied after restarts
        self._observers: List[Callable[[int, Optional[GroupUpdate]], None]] = []
        self._closed = False
        self.retries = 0
        """Requests sent to a second group because the first died before it had answered them whole."""
        self._placement = placement or HostPlacement(len(self._groups))
        self._keepalive = keepalive if keepalive is not None else KeepaliveConfig()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="computron-cluster-front", daemon=True)

    # ---- start and the groups' pushes (the front's thread) -------------------------------------
    def start(self, timeout_s: float = 600.0) -> "ClusterEngine":
        """Subscribe to every group and wait until each pushed its first state; ``LaunchError`` naming the
        groups that failed to start (their actors' errors) or did not start within ``timeout_s``."""
        self._thread.start()
        for i in range(len(self._groups)):
            asyncio.run_coroutine_threadsafe(self._watch(i), self._loop)
            if self._keepalive.enabled:
                asyncio.run_coroutine_threadsafe(
                    keep_alive(i, self._groups[i].ping.remote, self._keepalive, self._on_silent, self._on_answer,
                               lambda i=i: self._closed or self._views[i].gone), self._loop)
        deadline = time.monotonic() + timeout_s
        for v in self._views:
            v.started.wait(max(0.0, deadline - time.monotonic()))
        bad = {i: (v.reason if v.gone else f"not started within {timeout_s:.0f}s")
               for i, v in enumerate(self._views) if v.gone or not v.started.is_set()}
        if bad:
            self.close()
            raise LaunchError("engine groups failed to start: " + "; ".join(f"group {i}: {r}" for i, r in bad.items()))
        with self._lock:  # the first host plan, now that every group is there
            self._placement.started = True
        self._plan_hosts()
        return self

    async def _watch(self, i: int) -> None:
        """Keep group ``i``'s push stream open; on its death, mark it down and subscribe again (the call
        waits while Ray restarts the actor; one for a dead-for-good actor fails at once)."""
        from ray.exceptions import ActorDiedError
        failures = 0
        while not self._closed:
            gen = self._groups[i].watch.remote()
            try:
                async for ref in gen:
                    upd = await ref
                    failures = 0
                    self._on_update(i, upd)
                exc: BaseException = RuntimeError("the group's push stream ended")
            except asyncio.CancelledError:
                import ray
                ray.cancel(gen)
                raise
            except Exception as e:  # noqa: BLE001 - the actor died, or worse: the group is down either way
                exc = e
            if self._closed:
                return
            failures += 1
            permanent = failures > 1 and isinstance(exc, ActorDiedError)
            self._on_death(i, exc, permanent)
            if permanent:
                return

    def _on_update(self, i: int, upd: GroupUpdate) -> None:
        with self._lock:
            restarted = self._board.record(i, upd)
            routed = self._routed_state(upd, self._views[i].seq)
            self._router.update(routed)
            if restarted:
                self._placement.down(i)
            self._observe_for_plan(i, upd, routed.served, time.monotonic())
        if restarted:
            self._loop.create_task(self._reconcile(i))
        self._notify(i, upd)

    def _on_death(self, i: int, exc: BaseException, permanent: bool) -> None:
        with self._lock:
            reason = f"dead for good: {exc}"[:2000] if permanent else short_error(exc)
            seq = self._board.down(i, reason, permanent,
                                   noticed="its push stream" + ("" if permanent else "; Ray restarts it"))
            self._router.update(GroupState(group=i, alive=False, seq=seq))
            self._placement.down(i)
        self._notify(i, None)

    def _suspect(self, i: int, incarnation: Optional[str], err: GroupDied) -> None:
        """A call found group ``i`` dead: mark it down now unless it has come back meanwhile."""
        with self._lock:
            v = self._views[i]
            if v.alive and v.incarnation == incarnation:
                seq = self._board.down(i, err.reason, noticed="a request")
                self._router.update(GroupState(group=i, alive=False, seq=seq))

    def _on_silent(self, i: int, reason: str) -> None:
        """The keepalive got no answer from group ``i`` in time: no new request goes there until it answers."""
        with self._lock:
            seq = self._board.silence(i, reason)
            if seq is not None:
                self._router.update(GroupState(group=i, alive=False, seq=seq))
        if seq is not None:
            self._notify(i, None)

    def _on_answer(self, i: int, incarnation: Any) -> None:
        """Group ``i`` answered a keepalive: routed again if the keepalive had taken it out."""
        with self._lock:
            seq = self._board.revive(i, incarnation)
            upd = self._views[i].update
            if seq is not None:
                self._router.update(self._routed_state(upd, seq))
        if seq is not None:
            self._notify(i, upd)

    def use_router(self, router) -> None:
        """Route from now on with ``router`` (to compare policies over the same groups), told every group's
        last state first."""
        with self._lock:
            for i, v in enumerate(self._views):
                if v.alive and v.update is not None:
                    router.update(self._routed_state(v.update, v.seq))
                else:
                    router.update(GroupState(group=i, alive=False, seq=v.seq))
            self._router = router

    def _routed_state(self, upd: GroupUpdate, seq: int) -> GroupState:
        """A push as the router sees it: the front's seq, and only the models the group holds in the
        catalog's version (a restarted group may hold an older one until it is brought up to date)."""
        tags = {m: t for m, (_, t) in self._catalog.items()}
        served = frozenset(m for m in upd.state.served if upd.tags.get(m, tags.get(m)) == tags.get(m))
        return dataclasses.replace(upd.state, seq=seq, served=served)

    def _notify(self, i: int, upd: Optional[GroupUpdate]) -> None:
        for fn in list(self._observers):
            try:
                fn(i, upd)
            except Exception:  # noqa: BLE001
                log.exception("a cluster observer failed")

    def add_observer(self, fn: Callable[[int, Optional[GroupUpdate]], None]) -> None:
        """Call ``fn(group, update)`` on the front's thread for every push (``update`` None: the group died or
        went silent; a silent group's answer repeats its last update)."""
        self._observers.append(fn)

    # ---- calls to groups --------------------------------------------------------------------
    def _translate(self, i: int, exc: BaseException) -> BaseException:
        """A group call's exception as the caller should see it: the engine's own type, or ``GroupDied``."""
        from ray.exceptions import RayActorError, RayTaskError
        if isinstance(exc, RayActorError):
            return GroupDied(i, short_error(exc))
        cause = exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc
        orig = cause.original() if isinstance(cause, Relayed) else cause
        if isinstance(orig, EngineDeadError):
            return GroupDied(i, str(orig))
        return orig

    async def _call(self, i: int, method: str, *args) -> Any:
        import ray
        ref = getattr(self._groups[i], method).remote(*args)
        try:
            return await ref
        except asyncio.CancelledError:
            ray.cancel(ref)
            raise
        except Exception as exc:  # noqa: BLE001
            raise self._translate(i, exc) from None

    def _route(self, model_id: str, tokens: int, exclude: List[int], died: List[str]) -> Tuple[int, Optional[str]]:
        with self._lock:
            if self._closed:
                raise EngineDeadError("the cluster is shut down")
            now = time.monotonic()
            if not exclude:  # a retry is the same request
                self._note_arrival(model_id, now)
            try:
                g = self._router.route(model_id, tokens, now, exclude)
            except NoGroupError as exc:
                if model_id not in self._catalog:
                    raise UnknownModelError(model_id, self._catalog) from None
                first = f"{died[-1]} before answering, and " if died else ""
                raise EngineDeadError(f"{first}no engine group can serve model {model_id!r} now ({exc}); "
                                      f"groups: {self._board.reasons()}") from None
            return g, self._views[g].incarnation

    def _finished(self, g: int, model_id: str, tokens: int) -> None:
        with self._lock:
            self._router.finished(g, model_id, tokens)

    # ---- EngineClient: requests -----------------------------------------------------------------
    async def submit(self, model_id: str, data: Any, timeout: Optional[float] = None) -> Any:
        """One request's whole answer, from the group the router picks; sent once more to another group if
        that one dies before answering."""
        deadline = None if timeout is None else time.monotonic() + timeout
        tokens, exclude, died = request_tokens(data), [], []
        for _ in range(2):
            g, inc = self._route(model_id, tokens, exclude, died)
            try:
                return await self._call(g, "submit", model_id, data, _left(deadline, timeout, model_id))
            except GroupDied as exc:
                self._suspect(g, inc, exc)
                self.retries += 1
                exclude.append(g)
                died.append(str(exc))
            finally:
                self._finished(g, model_id, tokens)
        raise EngineDeadError(f"request to model {model_id!r} failed twice: {'; then '.join(died)}")

    def check_admission(self, model_id: str, arriving: int = 0) -> None:
        """Nothing: each group's engine refuses a request the router sends it (its queue is that group's)."""

    def note_keep_alive(self, model_id: str, seconds: Optional[float]) -> None:
        """Nothing: engine groups keep their models by their configs (``ModelConfig.keep_alive``), not by a
        request's ``keep_alive`` (docs/serving.md says so)."""

    async def stream(self, model_id: str, data: Any, timeout: Optional[float] = None) -> AsyncIterator[int]:
        """One generation's token ids as its group makes them. Sent once more to another group if its group
        dies before the first token, or after it where the generation is ``replayable`` (the tokens already
        yielded are checked and skipped); otherwise the group's death ends the stream with ``EngineDeadError``."""
        import ray
        deadline = None if timeout is None else time.monotonic() + timeout
        tokens, exclude, died, sent = request_tokens(data), [], [], []
        for _ in range(2):
            g, inc = self._route(model_id, tokens, exclude, died)
            gen = self._groups[g].stream.remote(model_id, data, _left(deadline, timeout, model_id))
            n, error, complete, differed = 0, None, False, False
            try:
                it = gen.__aiter__()
                while True:
                    try:
                        tok = await (await it.__anext__())
                    except StopAsyncIteration:
                        complete, differed, at = True, n < len(sent), n + 1
                        if not differed:
                            return
                        break
                    except Exception as exc:  # noqa: BLE001
                        error = self._translate(g, exc)
                        break
                    n += 1
                    if n <= len(sent):  # a replay: what the dead group already gave is checked, not yielded
                        if tok != sent[n - 1]:
                            differed, at = True, n
                            break
                        continue
                    sent.append(tok)
                    yield tok
            finally:
                self._finished(g, model_id, tokens)
                if not complete and (error is None or differed):
                    ray.cancel(gen)  # the caller left, or a replay differed: the group drops the sequence
            if differed:
                raise EngineDeadError(f"{died[-1]} while streaming model {model_id!r} ({len(sent)} tokens sent); "
                                      f"its replay on group {g} differed at token {at}: the "
                                      "stream ends here")
            if not isinstance(error, GroupDied):
                raise error
            self._suspect(g, inc, error)
            if sent and not replayable(data):
                raise EngineDeadError(f"{error} while streaming model {model_id!r} ({len(sent)} tokens sent): "
                                      "the stream ends here")
            self.retries += 1
            exclude.append(g)
            died.append(str(error))
        raise EngineDeadError(f"request to model {model_id!r} failed twice: {'; then '.join(died)}")

    # ---- shutdown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every group's engine (within ``shutdown_grace_s``), end the actors and their placement
        groups, stop the front's thread. Idempotent."""
        import ray
        from ray.util.placement_group import remove_placement_group
        with self._lock:
            if self._closed:
                return
            self._closed = True
            up = [g for g, v in zip(self._groups, self._views) if not v.gone]
        refs = [g.close.remote() for g in up]
        ray.wait(refs, num_returns=len(refs), timeout=self._grace)
        for g in self._groups:
            ray.kill(g, no_restart=True)
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop_tasks(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()
        for pg in self._pgs:
            remove_placement_group(pg)

    async def _stop_tasks(self) -> None:
        """Cancel the watchers and reconciliations on the front's loop, and wait for them to end."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)


def _left(deadline: Optional[float], timeout: Optional[float], model_id: str) -> Optional[float]:
    """Seconds left of a request's timeout (a retry gets what the first try left)."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise RequestTimeoutError(f"request to model {model_id!r} took over {timeout}s")
    return left
