"""The master's state machine: requests in, the scheduler's decisions out, replies put into effect.

The engine is driven by two kinds of event, both ending in ``_pump``: a caller's
``submit``/``stream`` (from any asyncio loop) and a worker's reply (from the
transport's receiver thread). ``_pump`` asks the scheduler what to do and hands
each decision to the component that carries it out; a reply goes, once every
rank has sent one, to the handler of its command's kind. Futures and streams are
resolved on their own loop with ``call_soon_threadsafe``. Nothing waits by sleeping; the
liveness watchdog wakes on a timer to check on the workers, and ``TokenLevel``'s to send a step ahead.

Components (one owner each, all called under the engine's lock): ``requests.RequestTable`` (queues, answers),
``commands.CommandTracker`` (sequence numbers, replies per rank), ``token_level.TokenLevel`` (every running
batch of token-level generation), ``swaps.Swaps`` (loads and offloads), ``liveness.Liveness`` (heartbeats,
the watchdog), ``telemetry.Telemetry`` (records, timeline, counters), ``catalog.Catalog`` (which models and
versions exist; adding, replacing, removing them while serving), ``adapters.Adapters`` (LoRA adapters on
served models) and ``host_models.HostModels`` (the models kept in host memory by plan), ``admission.Admission``
(refusals before any work on a request) and ``sched.keep_alive.KeepAlives`` (idle models offloaded when their
keep-alive is up, here and on the watchdog's timer). ``views.EngineViews`` is the read-only half of the public
API, ``intake.Intake`` the half that takes requests in. Causal LMs generate token by token
(``EngineConfig.step_mode``); other models, and paper mode, run each batch as one command.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

from .. import preflight
from ..batching.causal_lm import batch_manager_for
from ..comm import messages as msg
from ..config import EngineConfig, ModelConfig
from ..errors import EngineDeadError, ModelConflictError, RequestTimeoutError, worker_exit_reason
from ..lora.adapter import check_adapter_config
from ..sched.keep_alive import KeepAlives
from ..sched.scheduler import ActionKind, ModelState
from .adapters import Adapters
from .admission import Admission
from .batches import RequestLevel
from .budget import make_scheduler
from .catalog import Catalog, Done, done_on
from .commands import CommandKind, CommandTracker, complete_cleanup, complete_query
from .host_models import HostModels, HostModelsControl
from .intake import Intake
from .liveness import Liveness
from .preparation import PumpSoon, preparation_pool
from .requests import RequestTable
from .sequences import consume
from .swaps import Swaps
from .telemetry import Telemetry
from .token_level import TokenLevel
from .views import EngineViews

log = logging.getLogger("computron.engine")


class Engine(EngineViews, HostModelsControl, Intake):
    def __init__(self, config: EngineConfig, model_configs: List[ModelConfig], layout, channel,
                 workers: List[msg.WorkerReady], on_close: Optional[Callable[[bool], None]] = None):
        self.config = config
        self.layout = layout
        self.n_workers = layout.n_workers
        self.workers: Dict[int, msg.WorkerReady] = {w.rank: w for w in workers}
        """What each worker reported when it became ready (pid, host, device, shard sizes)."""
        self._on_close = on_close
        self._batch_managers = {mc.model_id: batch_manager_for(
            self._batching_info(mc.model_id), config.max_batch_size, mc) for mc in model_configs}
        self._sched = make_scheduler(config, model_configs, workers)
        self._lock = threading.RLock()  # re-entered: a reply handler may end in _die
        self._pump_soon = PumpSoon(self._pump, self._lock)  # a caller's requests of one loop tick: one step
        self._telemetry = Telemetry(config.metrics_history)
        self._requests = RequestTable(self._batch_managers, {
            mc.model_id: config.queue_size if mc.queue_size is None else mc.queue_size for mc in model_configs},
            self._telemetry)
        self._admission = Admission(config, self._requests, self._sched, self._telemetry)
        self._tracker = CommandTracker(self.n_workers, channel)
        self._keep = KeepAlives(config.keep_alive,
                                own=lambda k: getattr(self._catalog.configs.get(k), "keep_alive", None))
        self._requests.on_done = self._keep.done
        self._token_level = TokenLevel(config, self._requests, self._tracker, self._telemetry, self._sched,
                                       self.n_workers, workers[0].device, self._pump_soon.now)
        for m, bm in self._batch_managers.items():
            self._token_level.adopt(m, bm, self._batching_info(m))
        self._swaps = Swaps(self._sched, self._tracker, self._requests, self._token_level, self._telemetry,
                            self.n_workers, config.host_budget, workers)
        self._request_level = RequestLevel(self._batch_managers, self._requests, self._tracker, self._telemetry,
                                           self._sched)
        self._catalog = Catalog(config, model_configs, self._sched, self._tracker, self._requests,
                                self._token_level, self._swaps)
        self._adapters = Adapters(self._tracker, self._requests, self._catalog, self._token_level)
        self._catalog.adapters_on = self._adapters.on_base
        self._host_models = HostModels(config.host_budget, self._tracker, self._catalog, self._adapters.base_of,
                                       self._swaps)
        self._catalog.on_id_change = self._host_models.id_changed
        self._liveness = Liveness.of(config, self.n_workers, self.workers, self._telemetry.counters["late_heartbeats"])
        self._handlers = {CommandKind.LOAD: self._swaps.complete, CommandKind.OFFLOAD: self._swaps.complete,
                          CommandKind.STEP: self._token_level.complete_step,
                          CommandKind.BATCH: self._request_level.complete,
                          CommandKind.STATS: complete_query, CommandKind.HOST_MODELS: complete_query,
                          CommandKind.CLEANUP: complete_cleanup,
                          CommandKind.ADD: self._catalog.complete_add,
                          CommandKind.REMOVE: self._catalog.complete_remove,
                          CommandKind.ADD_ADAPTER: self._adapters.complete_add,
                          CommandKind.REMOVE_ADAPTER: self._adapters.complete_remove}
        self._preparation = preparation_pool(config.prepare_threads)
        self._dead: Optional[str] = None
        self._closed = threading.Event()  # close() ran
        self._stopped = threading.Event()  # closed or dead: run() returns

    def start(self) -> "Engine":
        """Start watching the workers' liveness (the launcher calls this once the channel runs)."""
        self._liveness.start(self._check_liveness, self._stopped)
        return self

    def _batching_info(self, model_id: str) -> Optional[msg.BatchingDefaults]:
        return next((w.batching[model_id] for w in self.workers.values() if model_id in w.batching), None)

    # ---- models while serving (catalog.py) -----------------------------------
    async def add_model(self, config: ModelConfig) -> None:
        """Serve one more model. Every rank builds its shard beside the command loop, so the models that
        are generating keep stepping; returns once it is served. The checks of a launch come first (the
        same one-line errors); ModelConflictError for a served id, ModelChangeError when a rank's build
        failed or the model cannot fit the device budget (what the other ranks built is freed).

        A config with ``adapter`` and ``base`` serves a LoRA adapter on that served model (``adapters.py``):
        checked against the base's checkpoint first (``lora.adapter.AdapterError``, one line)."""
        if config.adapter is not None:
            with self._lock:
                base = self._adapters.base_config(config)
            await self._change(lambda done, info: self._adapters.add(config, info, done),
                               check=lambda: check_adapter_config(config, base, self.config.max_lora_rank))
            return
        await self._change(lambda done, _: self._catalog.add(config, done),
                           check=lambda: preflight.check_added(config, self.layout.tp, self.layout.pp))

    async def replace_model(self, model_id: str, config: ModelConfig) -> None:
        """Serve a new version under ``model_id``: requests admitted before keep the old weights to their
        end, later ones get the new, and the id is never unknown meanwhile. The old version is freed on
        every rank once it has drained."""
        if self._adapters.route(model_id) is not None or config.adapter is not None:
            raise ModelConflictError(f"model {model_id!r}: adapters are not replaced in place: remove the "
                                     "adapter, then add the new one")
        config = dataclasses.replace(config, model_id=model_id)
        await self._change(lambda done, _: self._catalog.add(config, done, replace=True),
                           check=lambda: preflight.check_added(config, self.layout.tp, self.layout.pp))

    async def remove_model(self, model_id: str, drain: bool = True) -> None:
        """Stop serving ``model_id``: new requests get UnknownModelError at once; admitted ones finish
        (``drain``) or fail now; returns once its shards, host buffers and KV caches are freed on every
        rank (those of its versions still draining too)."""
        def start(done, _):
            if self._adapters.route(model_id) is not None:
                self._adapters.remove(model_id, done, drain)
            else:
                self._catalog.remove(model_id, done, drain)
        await self._change(start)

    def set_pinned(self, model_id: str, pinned: bool = True) -> None:
        """A pinned model, once loaded, is never evicted (it still counts against the budgets)."""
        with self._lock:
            self._catalog.set_pinned(model_id, pinned)
            self._pump()

    def note_keep_alive(self, model_id: str, seconds: Optional[float]) -> None:
        """A request for ``model_id`` gave this keep-alive (``sched/keep_alive.py``: seconds, ``FOREVER``;
        None: it gave none, the model's own applies): how long the model stays resident once idle."""
        with self._lock:
            self._keep.requested(self._key_of(model_id)[0], seconds)

    def set_priority(self, model_id: str, priority: int) -> None:
        """A higher priority goes first when models wait for a slot, and is evicted last."""
        with self._lock:
            self._catalog.set_priority(model_id, priority)
            self._pump()

    async def _change(self, start: Callable[[Done, Any], None], check: Optional[Callable[[], Any]] = None) -> None:
        """Run ``check`` (it reads files: not on the loop), then ``start(done, what check returned)`` under
        the lock, and wait for ``done``."""
        loop = asyncio.get_running_loop()
        checked = await loop.run_in_executor(None, check) if check is not None else None
        fut = loop.create_future()
        with self._lock:
            self._raise_if_dead()
            start(done_on(loop, fut), checked)
            self._pump()
        await fut

    async def submit(self, model_id: str, data: Any, timeout: Optional[float] = None) -> Any:
        """Queue one request for ``model_id`` and wait for its whole output."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        uid = await self._admit(model_id, data, fut, loop)
        fut.add_done_callback(lambda f, u=uid: f.cancelled() and self._cancel(u))
        if timeout is None:
            return await fut
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise RequestTimeoutError(f"request {uid} to model {model_id!r} took over {timeout}s") from None

    async def stream(self, model_id: str, data: Any, timeout: Optional[float] = None) -> AsyncIterator[int]:
        """Queue one generation request and yield its new token ids as they are produced.

        The tokens are exactly those ``submit`` would return (a 1-D LongTensor of ids, always); a request
        with ``logprobs`` or ``prompt_logprobs`` yields ``protocol.TokenLogprob`` items (the token, its raw
        logprob, its top alternatives) instead of ints, after one ``PromptLogprobs`` first for
        ``prompt_logprobs``. Leaving the loop early (``break``, ``aclose()``, a cancelled task) or going
        over ``timeout`` seconds in all drops the sequence at the next step and frees its cache. Models
        that do not generate token by token yield their whole answer at the end.
        """
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        queue: asyncio.Queue = asyncio.Queue()
        uid = await self._admit(model_id, data, fut, loop, stream=queue)
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # consumed through the queue
        complete = False
        try:
            async for tokens in consume(queue, timeout, f"request {uid} to model {model_id!r}"):
                for token in tokens:
                    yield token
            complete = True
        finally:
            if not complete:
                self._cancel(uid)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.shutdown()

    async def shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def run(self) -> None:
        """Block the calling thread until the engine is shut down (a server's main loop). Raises
        EngineDeadError if it ended because a worker died (after shutting the rest down); on Ctrl-C it
        shuts the engine down itself (as SIGTERM's handler does) before the interruption goes on."""
        try:
            self._stopped.wait()
        finally:
            dead = self._dead if not self._closed.is_set() else None
            self.close()
        if dead is not None:
            raise EngineDeadError(dead)

    # ---- requests ------------------------------------------------------------
    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _cancel(self, uid: int) -> None:
        with self._lock:
            req = self._requests.forget(uid)
            if req is None:
                return
            if not self._token_level.cancel(req):
                self._requests.unqueue(uid, req.model_id)
            self._pump()  # an emptied queue may change what comes next; a drop needs a step

    # ---- scheduling ----------------------------------------------------------
    def _heads(self, now: float) -> Dict[str, float]:
        """Each model with work, and when it started waiting: the arrival of its oldest waiting request,
        or when its live sequences paused or arrived (token-level generation)."""
        heads = {}
        for m in self._requests.queues:
            times = [t for t in (self._requests.oldest_waiting(m), self._token_level.head(m, now)) if t is not None]
            if times:
                heads[m] = min(times)
        return heads

    def _pump(self) -> None:
        """Act on the scheduler's decisions until it has nothing more to do. Caller holds the lock."""
        while self._dead is None and not self._closed.is_set():
            self._catalog.reap()
            self._adapters.reap()
            now = time.perf_counter()
            self._release_expired(now)
            heads = self._heads(now)
            actions = self._sched.decide(heads, self._token_level.live_models(), now, self._token_level.ahead(now))
            if not actions:
                return
            for a in actions:
                if a.kind is not ActionKind.RUN:
                    self._swaps.send(a, heads, now)
                elif a.model_id in self._token_level:
                    self._token_level.dispatch_step(a.model_id)
                else:
                    self._request_level.dispatch(a.model_id)

    def _release_expired(self, now: float) -> None:
        """Offload the idle resident models whose keep-alive is up. Caller holds the lock."""
        idle = [k for k in self._sched.resident() if self._sched.states[k] is ModelState.LOADED
                and not self._requests.busy(k)]
        for k in self._keep.expired(idle, now):
            action = self._sched.release(k)
            if action is not None:
                self._swaps.send(action, {}, now)

    # ---- replies from workers (receiver thread) ------------------------------
    def on_reply(self, reply: Any) -> None:
        """Called on the transport's receiver thread (or a worker thread in attach mode) for every reply."""
        self._telemetry.observe_reply(reply)
        if isinstance(reply, msg.Heartbeat):
            reason = self._liveness.on_heartbeat(reply)
            if reason is not None:
                self._die(reason)
            return
        with self._lock:
            try:
                self._on_reply_locked(reply)
            except Exception as exc:  # noqa: BLE001 - a bug here must not silently kill the receiver thread
                log.exception("engine failed handling %s", reply)
                self._die(f"internal error handling {type(reply).__name__}: {type(exc).__name__}: {exc}")

    def _on_reply_locked(self, reply: Any) -> None:
        if isinstance(reply, (msg.WorkerReady, msg.WorkerStartFailed)):
            return  # handled by the launcher before the engine exists
        self._liveness.heard_from(reply.rank)
        if isinstance(reply, msg.CommandFailed) and reply.fatal:
            self._die(f"rank {reply.rank} lost the data plane: {reply.error}")
            return
        known, pending = self._tracker.collect(reply)
        if not known:  # after close() or death, late replies have nobody waiting
            if not (self._stopped.is_set() or self._closed.is_set()):
                log.warning("reply for unknown command %s", reply)
            return
        if pending is None:
            return
        t0 = time.perf_counter()
        self._handlers[pending.kind](pending, t0, pending.root_cause())
        pending.master_s += time.perf_counter() - t0
        self._pump()

    # ---- liveness, death and shutdown ----------------------------------------
    def _check_liveness(self, now: float) -> bool:
        """The watchdog's question; False once there is nothing more to watch."""
        with self._lock:
            if self._closed.is_set():
                return False
            reason = (self._liveness.verdict(now)
                      or self._tracker.half_answered(now, self.config.heartbeat_timeout_s))
            if reason is not None:
                self._die(reason)
                return False
            self._release_expired(time.perf_counter())  # keep-alives run out on this timer too
            return True

    def on_transport_error(self, exc: BaseException, cause: Optional[str] = None) -> None:
        """``cause`` names the worker that died, when the launcher knows it."""
        prefix = f"{cause}; " if cause else ""
        self._die(f"{prefix}lost contact with the workers: {type(exc).__name__}: {exc}")

    def on_internal_error(self, exc: BaseException, reply: Any) -> None:
        """A bug in the master's handling of a reply: the engine cannot trust its state any more."""
        self._die(f"internal error in the master handling {type(reply).__name__} from rank "
                  f"{getattr(reply, 'rank', '?')}: {type(exc).__name__}: {exc}")

    def on_worker_exit(self, rank: int, exitcode: Optional[int]) -> None:
        if not self._closed.is_set():
            self._die(worker_exit_reason(rank, exitcode))

    def _die(self, reason: str) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._dead = f"engine is dead: {reason}"
            log.error(self._dead)
            self._fail_everything()
            self._stopped.set()
        self._token_level.stop_ahead()

    def _fail_everything(self) -> None:
        """Fail every waiting request and query with the engine's reason. Caller holds the lock."""
        self._requests.fail_all(EngineDeadError(self._dead))
        self._token_level.forget_all()
        self._tracker.abandon_all()
        self._catalog.abandon(EngineDeadError(self._dead))
        self._adapters.abandon(EngineDeadError(self._dead))

    def close(self) -> None:
        """The one shutdown path: fail what is waiting, stop the workers (within
        ``EngineConfig.shutdown_grace_s``, then by force), release processes. Idempotent."""
        with self._lock:
            if self._closed.is_set():
                return
            already_dead = self._dead is not None
            self._dead = self._dead or "engine is shutting down"
            self._fail_everything()
            self._closed.set()
        self._token_level.stop_ahead()
        self._preparation.shutdown(wait=False, cancel_futures=True)
        try:
            if self._on_close is not None:
                self._on_close(already_dead)
        finally:
            self._stopped.set()
