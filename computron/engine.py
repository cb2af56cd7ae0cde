"""The master: per-model queues, batching, and the scheduler's decisions put into effect.

The engine is a state machine behind one lock. It is driven by two kinds of
event, both of which end in ``_pump``: a caller's ``submit``/``stream`` (from
any asyncio loop) and a worker's reply (from the transport's receiver thread).
``_pump`` asks the scheduler what to do and sends the commands; futures and
streams are resolved on their own loop with ``call_soon_threadsafe``. Nothing
waits by sleeping; a watchdog thread wakes on a timer only to check liveness.

Causal LMs generate token by token (``EngineConfig.step_mode``): a model's
"batch" is one step of its running batch, whose per-sequence bookkeeping lives
in ``sequences.TokenBatch``. Other models, and paper mode, run each batch as
one command.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Deque, Dict, List, Optional

import torch

from . import messages as msg
from .batch import BatchManager, SubmitEntry, TaskEntry, take_batch
from .config import EngineConfig, ModelConfig
from .errors import (EngineDeadError, PayloadError, QueueFullError, RequestTimeoutError, UnknownModelError,
                     WorkerError)
from .generation import CausalLMBatchManager
from .budget import device_budget, model_sizes
from .metrics import BatchRecord, KVRecord, PreemptionRecord, RequestRecord, StepRecord, SwapRecord
from .scheduler import ActionKind, ModelState, Scheduler, choose_recompute
from .sequences import END, Request, TokenBatch

log = logging.getLogger("computron.engine")

_EVENT_HISTORY = 2000


@dataclass
class _Pending:
    """A command sent to every worker, waiting for every worker's reply."""
    kind: str
    model_id: Optional[str]
    start: float
    uids: tuple = ()
    info: dict = field(default_factory=dict)
    replies: Dict[int, Any] = field(default_factory=dict)
    waiter: Optional[Callable[[Dict[int, Any]], None]] = None
    first_failure: Optional[float] = None
    master_s: float = 0.0


class Engine:
    def __init__(self, config: EngineConfig, model_configs: List[ModelConfig], layout, channel,
                 workers: List[msg.WorkerReady], on_close: Optional[Callable[[bool], None]] = None):
        self.config = config
        self.layout = layout
        self.n_workers = layout.n_workers
        self.workers: Dict[int, msg.WorkerReady] = {w.rank: w for w in workers}
        """What each worker reported when it became ready (pid, host, device, shard sizes)."""
        self._channel = channel
        self._on_close = on_close
        self._batch_managers = {mc.model_id: mc.batch_manager or self._default_batch_manager(mc.model_id)
                                for mc in model_configs}
        self._queues: Dict[str, Deque[SubmitEntry]] = {mc.model_id: deque() for mc in model_configs}
        self._requests: Dict[int, Request] = {}
        self._pending: Dict[int, _Pending] = {}
        paper = config.paper_mode
        self._token_batches: Dict[str, TokenBatch] = {}
        """Models generating token by token, and their running sequences."""
        if config.step_mode and not paper:
            for mid, bm in self._batch_managers.items():
                if isinstance(bm, CausalLMBatchManager) and self._is_causal_lm(mid):
                    self._token_batches[mid] = TokenBatch(bm, bm.max_batch_size, config.max_step_tokens)
        # One batch (or step) in flight per model: workers run commands in order anyway, and a
        # second batch sent early would only split a burst into smaller batches.
        self._sched = Scheduler([mc.model_id for mc in model_configs], config.max_loaded,
                                prefetch=config.prefetch and not paper, overlap=config.overlap and not paper,
                                max_inflight=1, policy="run_to_completion" if paper else config.policy,
                                quantum_s=config.quantum_ms / 1e3, ttft_slo_s=config.ttft_slo_s,
                                sizes=model_sizes(config, workers), device_budget=device_budget(config, workers),
                                pinned=[mc.model_id for mc in model_configs if mc.pinned],
                                priority={mc.model_id: mc.priority for mc in model_configs})
        self._lock = threading.RLock()
        self._uids = itertools.count()
        self._seqs = itertools.count()
        self._records: Deque[Any] = deque(maxlen=config.metrics_history or None)
        self._events: Deque[dict] = deque(maxlen=_EVENT_HISTORY)
        self._event_ids = itertools.count(1)
        self._counters = {"swaps": Counter(), "swap_seconds": Counter(), "swap_bytes": Counter(),
                          "preemptions": Counter(), "steps": Counter(), "tokens": Counter(),
                          "requests": Counter()}
        self._last_swap: Dict[str, Dict[str, dict]] = defaultdict(dict)
        self._host_resident: Dict[int, set] = {w.rank: set(w.host_resident) for w in workers
                                               if w.host_resident is not None}
        """Per rank, the models whose shard it holds in host memory, as its last load reported."""
        self._kv_bytes: Dict[str, int] = {}
        """Each model's KV cache bytes on the output rank after its last step."""
        self._prefill_rate: Dict[str, float] = {}
        """Prompt tokens per second of each model's prefills (steps that admitted sequences)."""
        self._wall_offset = time.time() - time.perf_counter()
        self._dead: Optional[str] = None
        self._closed = threading.Event()  # close() ran
        self._stopped = threading.Event()  # closed or dead: run() returns
        now = time.perf_counter()
        self._last_beat: Dict[int, float] = {r: now for r in range(self.n_workers)}
        threading.Thread(target=self._watchdog, name="computron-watchdog", daemon=True).start()

    def _batching_info(self, model_id: str) -> Optional[dict]:
        return next((w.batching[model_id] for w in self.workers.values() if model_id in w.batching), None)

    def _is_causal_lm(self, model_id: str) -> bool:
        return self._batching_info(model_id) is not None

    def _default_batch_manager(self, model_id: str):
        """Causal LMs get a CausalLMBatchManager for their token ids; anything else batches of one."""
        info = self._batching_info(model_id)
        if info is None:
            return BatchManager()
        return CausalLMBatchManager(max_batch_size=self.config.max_batch_size or 8, **info)

    def _wall(self, t: float) -> float:
        return t + self._wall_offset

    # ---- public API ----------------------------------------------------------
    @property
    def model_ids(self) -> List[str]:
        return list(self._queues)

    def model_states(self) -> Dict[str, str]:
        with self._lock:
            return {m: self._sched.state(m).value for m in self._queues}

    def metrics(self, kind: Optional[str] = None) -> List[Any]:
        """Records of the loads, offloads, batches, steps and requests so far, oldest first
        (the last ``EngineConfig.metrics_history`` of them)."""
        with self._lock:
            return [r for r in self._records if kind is None or r.kind == kind]

    def counters(self) -> Dict[str, Dict]:
        """Running totals since start that never expire (for Prometheus counters): ``swaps``,
        ``swap_seconds``, ``swap_bytes`` keyed by (model_id, 'load'|'offload'); ``steps``, ``tokens``,
        ``preemptions`` keyed by model_id; ``requests`` keyed by (model_id, 'ok'|'error'|'cancelled')."""
        with self._lock:
            return {k: dict(v) for k, v in self._counters.items()}

    def snapshot(self) -> Dict[str, Any]:
        """Where every model is and what it is doing, for a status page or a health check."""
        with self._lock:
            models = {}
            for m, q in self._queues.items():
                state = self._sched.state(m)
                tb = self._token_batches.get(m)
                models[m] = {"state": state.value, "tier": self._tier(m, state),
                             "waiting": len(q), "running": len(tb.running) if tb else self._sched.inflight[m],
                             "paused": (len(tb.to_recompute) + (len(tb.running) if tb.paused_since else 0))
                             if tb else 0,
                             "token_level": tb is not None, "pinned": m in self._sched.pinned,
                             "last_load": self._last_swap[m].get("load"),
                             "last_offload": self._last_swap[m].get("offload")}
            return {"alive": self._dead is None, "dead_reason": self._dead, "models": models}

    def _tier(self, m: str, state: ModelState) -> str:
        """'device' while resident; else 'host' where every rank holds its shard in host memory, 'disk'
        where some rank would read it from its checkpoint first (EngineConfig.host_budget)."""
        if state is not ModelState.OFFLOADED:
            return "device"
        if self.config.host_budget is None or not self._host_resident:
            return "host"
        return "host" if all(m in held for held in self._host_resident.values()) else "disk"

    def events(self, since: int = 0):
        """``(cursor, [event, ...])``: timeline events (load, offload, batch, step) with an id above
        ``since``, oldest first; pass the cursor back to get only newer ones."""
        with self._lock:
            out = [e for e in self._events if e["id"] > since]
            cursor = self._events[-1]["id"] if self._events else since
            return max(cursor, since), out

    @property
    def is_alive(self) -> bool:
        return self._dead is None

    @property
    def dead_reason(self) -> Optional[str]:
        return self._dead

    async def submit(self, model_id: str, data: Any, timeout: Optional[float] = None) -> Any:
        """Queue one request for ``model_id`` and wait for its whole output."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        uid = self._enqueue(model_id, data, fut, loop)
        fut.add_done_callback(lambda f, u=uid: f.cancelled() and self._cancel(u))
        if timeout is None:
            return await fut
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise RequestTimeoutError(f"request {uid} to model {model_id!r} took over {timeout}s") from None

    async def stream(self, model_id: str, data: Any, timeout: Optional[float] = None) -> AsyncIterator[int]:
        """Queue one generation request and yield its new token ids as they are produced.

        The tokens are exactly those ``submit`` would return. Leaving the loop early (``break``,
        ``aclose()``, a cancelled task) or going over ``timeout`` seconds in all drops the sequence
        at the next step and frees its cache. Models that do not generate token by token yield
        their whole answer at the end.
        """
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        queue: asyncio.Queue = asyncio.Queue()
        uid = self._enqueue(model_id, data, fut, loop, stream=queue)
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # consumed through the queue
        deadline = None if timeout is None else loop.time() + timeout
        complete = False
        try:
            while True:
                if deadline is None:
                    item = await queue.get()
                else:
                    try:
                        item = await asyncio.wait_for(queue.get(), max(0.0, deadline - loop.time()))
                    except asyncio.TimeoutError:
                        raise RequestTimeoutError(
                            f"request {uid} to model {model_id!r} took over {timeout}s") from None
                if item is END:
                    complete = True
                    return
                if isinstance(item, BaseException):
                    complete = True
                    raise item
                for token in item:
                    yield token
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
        """Block the calling thread until the engine is shut down (a server's main loop).

        Raises EngineDeadError if it ended because a worker died (after shutting the rest down).
        """
        self._stopped.wait()
        dead = self._dead if not self._closed.is_set() else None
        self.close()
        if dead is not None:
            raise EngineDeadError(dead)

    def stats(self, timeout: float = 60.0) -> Dict[int, msg.Stats]:
        """Every worker's device memory accounting, asked for and answered through the control plane."""
        done = threading.Event()
        result: Dict[int, Any] = {}

        def waiter(replies):
            result.update(replies)
            done.set()

        with self._lock:
            self._raise_if_dead()
            seq = next(self._seqs)
            self._pending[seq] = _Pending("stats", None, time.perf_counter(), waiter=waiter)
            self._channel.send(msg.QueryStats(seq=seq))
        if not done.wait(timeout):
            raise TimeoutError(f"workers did not answer a stats query within {timeout}s")
        self._raise_if_dead()
        return result

    # ---- requests ------------------------------------------------------------
    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _enqueue(self, model_id, data, fut, loop, stream: Optional[asyncio.Queue] = None) -> int:
        if not isinstance(model_id, str):
            raise UnknownModelError(model_id, self._queues)
        with self._lock:
            self._raise_if_dead()
            queue = self._queues.get(model_id)
            if queue is None:
                raise UnknownModelError(model_id, self._queues)
            validate = getattr(self._batch_managers[model_id], "validate", None)  # optional for ported managers
            try:
                if validate is not None:
                    validate(data)
            except Exception as exc:  # noqa: BLE001 - whatever the batch manager objects to
                raise PayloadError(f"model {model_id!r}: malformed request: {exc}", getattr(exc, "param", None),
                                   str(exc)) from None
            if self.config.queue_size and len(queue) >= self.config.queue_size:
                raise QueueFullError(f"model {model_id!r} already has {len(queue)} waiting requests "
                                     f"(queue_size={self.config.queue_size})")
            uid = next(self._uids)
            self._requests[uid] = Request(uid, model_id, fut, loop, time.perf_counter(), time.time(),
                                          stream=stream)
            queue.append(SubmitEntry(uid, data))
            self._pump()
            return uid

    def _cancel(self, uid: int) -> None:
        with self._lock:
            req = self._requests.pop(uid, None)
            if req is None:
                return
            self._counters["requests"][(req.model_id, "cancelled")] += 1
            tb = self._token_batches.get(req.model_id)
            where = tb.cancel(uid) if tb is not None else None
            if where is None:
                q = self._queues[req.model_id]
                for e in list(q):
                    if e.uid == uid:
                        q.remove(e)
                        break
            elif where == "workers" and not self._sched.can_accept_batches(req.model_id):
                # the model is away (or leaving) with this sequence parked: no step will come soon
                tb.to_drop.discard(uid)
                seq = next(self._seqs)
                self._pending[seq] = _Pending("cleanup", req.model_id, time.perf_counter())
                self._channel.send(msg.Drop(seq, req.model_id, (uid,)))
            self._pump()  # an emptied queue may change what comes next; a drop needs a step

    def _finish(self, uid: int, value: Any = None, error: Optional[BaseException] = None,
                 batch_seq: Optional[int] = None) -> None:
        req = self._requests.pop(uid, None)
        if req is None:
            return
        now = time.perf_counter()
        first = req.first_token if req.spec is not None else (now if error is None else None)
        self._records.append(RequestRecord(uid, req.model_id, req.submitted, now, batch_uid=batch_seq,
                                           error=None if error is None else str(error),
                                           submitted_wall=req.submitted_wall, first_token=first,
                                           n_tokens=len(req.tokens), preemptions=req.preemptions))
        self._counters["requests"][(req.model_id, "ok" if error is None else "error")] += 1
        req.resolve(value, error)

    # ---- scheduling ----------------------------------------------------------
    def _heads(self, now: float) -> Dict[str, float]:
        """Each model with work, and the arrival time of its oldest waiting or running request (for a
        model whose sequences were paused by a preemption: when they paused)."""
        heads = {}
        for m, q in self._queues.items():
            tb = self._token_batches.get(m)
            times = [self._requests[q[0].uid].submitted] if q else []
            if tb is not None and tb.live:
                if tb.paused_since is not None:
                    times.append(tb.paused_since)
                else:
                    times.append(tb.oldest() if (tb.running or tb.to_recompute) else now)
            if times:
                heads[m] = min(times)
        return heads

    def _pump(self) -> None:
        """Act on the scheduler's decisions until it has nothing more to do. Caller holds the lock."""
        while self._dead is None and not self._closed.is_set():
            now = time.perf_counter()
            running = [m for m, tb in self._token_batches.items() if tb.live]
            heads = self._heads(now)
            actions = self._sched.decide(heads, running, now)
            if not actions:
                return
            preempted = list(self._sched.preempted)
            for a in actions:
                if a.kind is ActionKind.RUN:
                    if a.model_id in self._token_batches:
                        self._dispatch_step(a.model_id)
                    else:
                        self._dispatch_batch(a.model_id)
                else:
                    self._send_swap(a.kind, a.model_id, heads, preempted, actions)

    def _send_swap(self, kind: ActionKind, model_id: str, heads: Dict[str, float], preempted=(),
                   actions=()) -> None:
        seq = next(self._seqs)
        now = time.perf_counter()
        name = "load" if kind is ActionKind.LOAD else "offload"
        recompute: tuple = ()
        if name == "load":
            waited = now - heads[model_id] if model_id in heads else 0.0
            cause = f"its oldest request has waited {waited * 1e3:.0f} ms" if model_id in heads else "prefetch"
            log.info("loading %s (%s; resident: %s)", model_id, cause, self._sched.resident())
        else:
            loads = [a.model_id for a in actions if a.kind is ActionKind.LOAD]
            waiting = loads or [m for m in heads if self._sched.state(m) is ModelState.OFFLOADED]
            target = waiting[0] if waiting else "another model"
            if model_id in preempted:
                recompute = self._preempt(model_id, target, now)
                cause = f"preempted ({self._sched.policy} policy) for {target}"
            else:
                cause = f"evicted (least recently used) to make room for {target}"
            log.info("offloading %s: %s", model_id, cause)
        self._pending[seq] = _Pending(name, model_id, now, info={"cause": cause, "recompute": recompute})
        self._channel.send(msg.Load(seq, model_id) if name == "load" else
                           msg.Offload(seq, model_id, recompute=recompute))

    def _preempt(self, model_id: str, target: str, now: float) -> tuple:
        """Pause a model's sequences; return those whose KV cache is dropped (to be recomputed)."""
        tb = self._token_batches[model_id]
        contexts = {sid: len(r.spec.prompt) + len(r.tokens) for sid, r in tb.running.items()}
        if self.config.kv_swap == "offload":
            recompute = ()
        elif self.config.kv_swap == "recompute":
            recompute = tuple(sorted(contexts))
        else:
            recompute = tuple(sorted(choose_recompute(contexts, **self._kv_costs(model_id))))
        tb.pause(list(recompute), now)
        self._counters["preemptions"][model_id] += 1
        self._records.append(PreemptionRecord(model_id, now, target, parked=len(tb.running),
                                              recomputed=len(recompute), wall_start=self._wall(now)))
        log.info("preempting %s for %s: %d sequences parked with their KV cache, %d to recompute",
                 model_id, target, len(tb.running), len(recompute))
        return recompute

    def _kv_costs(self, model_id: str) -> Dict[str, float]:
        """What moving a KV cache and recomputing it cost here, from this model's own records."""
        tokens = sum(len(r.spec.prompt) + len(r.tokens) for r in self._token_batches[model_id].running.values())
        kv = self._kv_bytes.get(model_id, 0)
        kv_per_token = kv / tokens if kv and tokens else 0.0
        load = self._last_swap[model_id].get("load")
        copy_bps = load["bytes"] / max(load["seconds"], 1e-9) / self.n_workers if load else 1e10
        return {"kv_bytes_per_token": kv_per_token, "copy_bytes_per_s": copy_bps,
                "prefill_tokens_per_s": self._prefill_rate.get(model_id, 2000.0)}

    def _dispatch_batch(self, model_id: str) -> None:
        queue = self._queues[model_id]
        task, info, exc = take_batch(self._batch_managers[model_id], queue)
        if task is None:
            param = getattr(exc, "param", None)
            reason = str(exc) if param else (f"the batch manager could not batch this request: "
                                             f"{type(exc).__name__}: {exc}")
            for entry in info:
                self._finish(entry.uid, error=PayloadError(f"model {model_id!r}: {reason}", param, reason))
            self._sched.on_batch_done(model_id)
            return
        seq = next(self._seqs)
        self._pending[seq] = _Pending("batch", model_id, time.perf_counter(), uids=task.uids, info=info)
        self._channel.send(msg.RunBatch(seq, model_id, task.batch))

    def _dispatch_step(self, model_id: str) -> None:
        t0 = time.perf_counter()
        tb = self._token_batches[model_id]
        admit, drop, rejected = tb.next_step(self._queues[model_id], self._requests)
        for uid, exc in rejected:
            self._finish(uid, error=PayloadError(f"model {model_id!r}: malformed request: "
                                                 f"{type(exc).__name__}: {exc}"))
        seq = next(self._seqs)
        self._pending[seq] = _Pending("step", model_id, t0, uids=tuple(tb.running),
                                      info={"admitted": len(admit), "dropped": len(drop),
                                            "prompt_tokens": sum(len(a.prompt) for a in admit)})
        self._channel.send(msg.Step(seq, model_id, admit=tuple(admit), drop=drop))
        self._pending[seq].master_s = time.perf_counter() - t0

    # ---- replies from workers (receiver thread) ------------------------------
    def on_reply(self, reply: Any) -> None:
        """Called on the transport's receiver thread (or a worker thread in attach mode) for every reply."""
        if isinstance(reply, msg.Heartbeat):
            self._on_heartbeat(reply)
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
        self._last_beat[reply.rank] = time.perf_counter()
        if isinstance(reply, msg.CommandFailed) and reply.fatal:
            self._die(f"rank {reply.rank} lost the data plane: {reply.error}")
            return
        pending = self._pending.get(reply.seq)
        if pending is None:  # after close() or death, late replies have nobody waiting
            if not self._stopped.is_set():
                log.warning("reply for unknown command %s", reply)
            return
        pending.replies[reply.rank] = reply
        if isinstance(reply, msg.CommandFailed) and pending.first_failure is None:
            pending.first_failure = time.perf_counter()
        if len(pending.replies) < self.n_workers:
            return
        del self._pending[reply.seq]
        t0 = time.perf_counter()
        self._complete(reply.seq, pending)
        pending.master_s += time.perf_counter() - t0
        self._pump()

    def _record(self, rec) -> None:
        self._records.append(rec)
        kind = rec.kind
        event = {"id": next(self._event_ids), "kind": kind, "model_id": rec.model_id,
                 "start_wall": self._wall(rec.start), "end_wall": self._wall(rec.end),
                 "seconds": rec.end - rec.start, "error": rec.error}
        if kind == "step":
            if self._events and self._events[-1]["kind"] == "step" \
                    and self._events[-1]["model_id"] == rec.model_id and not rec.error:
                last = self._events[-1]  # consecutive steps of one model: one timeline bar
                last.update(end_wall=event["end_wall"], seconds=event["end_wall"] - last["start_wall"],
                            steps=last.get("steps", 1) + 1, running=rec.running)
                return
            event.update(steps=1, running=rec.running)
        elif kind == "batch":
            event["batch_size"] = rec.batch_size
        else:
            event["bytes"] = rec.nbytes
            event["cause"] = rec.cause
        self._events.append(event)

    def _complete(self, seq: int, p: _Pending) -> None:
        now = time.perf_counter()
        failures = {r: x for r, x in p.replies.items() if isinstance(x, msg.CommandFailed)}
        times = {r: (x.start, x.end) for r, x in p.replies.items() if hasattr(x, "start")}
        error = _first_error(failures)
        if p.kind == "stats":
            p.waiter(p.replies)
            return
        if p.kind == "cleanup":
            return
        if p.kind in ("load", "offload"):
            self._complete_swap(p, now, times, error)
            return
        if p.kind == "step":
            self._complete_step(seq, p, now, times, error)
            return
        # a batch
        self._sched.on_batch_done(p.model_id)
        self._record(BatchRecord(p.model_id, p.start, now, len(p.uids), tuple(p.uids), times, error, seq=seq,
                                 wall_start=self._wall(p.start)))
        if error is not None:
            for uid in p.uids:
                self._finish(uid, error=WorkerError(f"model {p.model_id!r}: {error}"), batch_seq=seq)
            return
        out = next(x.output for x in p.replies.values() if getattr(x, "has_output", False))
        try:
            results = self._batch_managers[p.model_id].split_batch(TaskEntry(p.uids, out), **p.info)
        except Exception as exc:  # noqa: BLE001
            for uid in p.uids:
                self._finish(uid, error=PayloadError(f"model {p.model_id!r}: split_batch failed: {exc}"),
                             batch_seq=seq)
            return
        answered = set()
        for uid, value in results:
            answered.add(uid)
            self._finish(uid, value, batch_seq=seq)
        for uid in set(p.uids) - answered:
            self._finish(uid, error=WorkerError(f"model {p.model_id!r}: split_batch returned no output "
                                                f"for request {uid}"), batch_seq=seq)

    def _complete_swap(self, p: _Pending, now: float, times, error: Optional[str]) -> None:
        m = p.model_id
        device_bytes = {r: x.device_bytes for r, x in p.replies.items() if hasattr(x, "device_bytes")}
        nbytes = sum(getattr(x, "nbytes", 0) for x in p.replies.values()) if p.kind == "load" else 0
        loaded = [x for x in p.replies.values() if isinstance(x, msg.Loaded)]
        tier = "disk" if any(x.tier == "disk" for x in loaded) else "host"
        read_s = max((x.read_s for x in loaded), default=0.0)
        read_bytes = sum(x.read_bytes for x in loaded)
        for x in loaded:
            if x.host_resident is not None:
                self._host_resident[x.rank] = set(x.host_resident)
        self._record(SwapRecord(p.kind, m, p.start, now, times, nbytes=nbytes, device_bytes=device_bytes,
                                error=error, wall_start=self._wall(p.start), cause=p.info.get("cause", ""),
                                tier=tier, read_s=read_s, read_bytes=read_bytes))
        seconds = now - p.start
        if error is None:
            key = (m, p.kind)
            self._counters["swaps"][key] += 1
            self._counters["swap_seconds"][key] += seconds
            self._counters["swap_bytes"][key] += nbytes
            self._last_swap[m][p.kind] = {"seconds": seconds, "bytes": nbytes, "wall_time": self._wall(now),
                                          "gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0}
            if p.kind == "load":
                self._last_swap[m]["load"].update(
                    tier=tier, read_s=read_s, read_gbps=read_bytes / read_s / 1e9 if read_s > 0 else None)
        if p.kind == "load":
            if error is None:
                log.info("loaded %s in %.3f s (%.3f GB, %.2f GB/s over %d ranks)", m, seconds, nbytes / 1e9,
                         nbytes / seconds / 1e9 if seconds > 0 else 0.0, self.n_workers)
                self._sched.on_loaded(m)
                return
            log.error("loading %s failed: %s", m, error)
            self._sched.on_load_failed(m)
            failure = WorkerError(f"loading model {m!r} failed: {error}")
            for entry in list(self._queues[m]):
                self._finish(entry.uid, error=failure)
            self._queues[m].clear()
            seq = next(self._seqs)  # release whatever some ranks did load
            self._pending[seq] = _Pending("cleanup", m, now)
            self._channel.send(msg.Offload(seq, m))
            tb = self._token_batches.get(m)
            if tb is not None and tb.live:  # paused sequences cannot resume without their model
                on_workers = tuple(sorted(set(tb.running) | tb.to_drop))
                for req in tb.take_all():
                    self._finish(req.uid, error=failure)
                tb.to_drop.clear()
                tb.paused_since = None
                if on_workers:
                    seq = next(self._seqs)
                    self._pending[seq] = _Pending("cleanup", m, now)
                    self._channel.send(msg.Drop(seq, m, on_workers))
            return
        if error is not None:  # the store releases its buffers even then; say what went wrong
            log.error("offloading %s reported: %s", m, error)
        else:
            log.info("offloaded %s in %.1f ms", m, seconds * 1e3)
        tb = self._token_batches.get(m)
        if tb is not None and (p.info.get("recompute") or tb.running):
            parked = [x for x in p.replies.values() if isinstance(x, msg.Offloaded)]
            states = {sid: st for x in parked for sid, st in x.gen_states.items()}
            for req in tb.to_recompute:
                if req.uid in states:
                    req.gen_state = states[req.uid]
            kv = sum(x.kv_parked_bytes for x in parked)
            if kv:
                self._records.append(KVRecord("kv_offload", m, p.start, now, kv,
                                              {x.rank: (x.end - x.kv_park_s, x.end) for x in parked},
                                              wall_start=self._wall(p.start)))
        self._sched.on_offloaded(m)

    def _complete_step(self, seq: int, p: _Pending, now: float, times, error: Optional[str]) -> None:
        m = p.model_id
        tb = self._token_batches[m]
        self._sched.on_batch_done(m)
        out = next((x for x in p.replies.values() if isinstance(x, msg.StepDone) and x.sids), None)
        done = [x for x in p.replies.values() if isinstance(x, msg.StepDone)]
        self._counters["steps"][m] += 1
        if error is not None:
            log.error("a step of %s failed: %s", m, error)
            victims = tb.take_all()
            for req in victims:
                self._finish(req.uid, error=WorkerError(f"model {m!r}: {error}"), batch_seq=seq)
            if any(x.running for x in done):  # some ranks kept sequences the others dropped: realign
                stale = tuple(sorted({r.uid for r in victims} | set(p.uids)))
                rseq = next(self._seqs)
                self._pending[rseq] = _Pending("cleanup", m, now)
                self._channel.send(msg.Step(rseq, m, drop=stale))
        elif out is not None:
            self._counters["tokens"][m] += len(out.sids)
            self._kv_bytes[m] = out.kv_bytes
            ended = set(out.ended)
            # a preemption decided while this step ran may already have moved sequences to recompute
            paused = {r.uid: r for r in tb.to_recompute}
            for sid, token in zip(out.sids, out.tokens):
                req = tb.running.get(sid) or paused.get(sid)
                if req is None:
                    continue  # cancelled while this step ran; the workers drop it next step
                req.push([token])
                if sid in ended:
                    if sid in tb.running:
                        del tb.running[sid]
                    else:
                        tb.to_recompute.remove(req)
                    self._finish(sid, torch.tensor(req.tokens, dtype=torch.int64), batch_seq=seq)
        restored = sum(x.kv_restored_bytes for x in done)
        if restored:
            self._records.append(KVRecord("kv_restore", m, p.start, now, restored,
                                          {x.rank: (x.start, x.start + x.kv_restore_s) for x in done},
                                          wall_start=self._wall(p.start)))
        if error is None and p.info.get("prompt_tokens") and now > p.start:
            rate = p.info["prompt_tokens"] / (now - p.start)
            self._prefill_rate[m] = 0.8 * self._prefill_rate.get(m, rate) + 0.2 * rate
        self._record(StepRecord(m, p.start, now, running=len(out.sids) if out else 0,
                                admitted=p.info.get("admitted", 0), dropped=p.info.get("dropped", 0),
                                rank_times=times, error=error, seq=seq,
                                kv_bytes=out.kv_bytes if out else 0,
                                master_s=p.master_s + (time.perf_counter() - now),
                                wall_start=self._wall(p.start)))

    # ---- liveness ------------------------------------------------------------
    def _on_heartbeat(self, beat: msg.Heartbeat) -> None:
        self._last_beat[beat.rank] = time.perf_counter()
        if beat.busy_seq is not None and beat.busy_s > self.config.command_timeout_s:
            self._die(f"worker rank {beat.rank} has been executing command {beat.busy_seq} for "
                      f"{beat.busy_s:.0f}s (EngineConfig.command_timeout_s={self.config.command_timeout_s}); "
                      "it is stuck")

    def _watchdog(self) -> None:
        """Declare the engine dead when a worker stops sending heartbeats, or when a command that
        failed on some ranks is never answered by the others."""
        limit = self.config.heartbeat_timeout_s
        while not self._stopped.wait(min(limit / 4, 0.5)):
            now = time.perf_counter()
            with self._lock:
                if self._closed.is_set():
                    return
                for rank, seen in self._last_beat.items():
                    if now - seen > limit:
                        self._die(f"worker rank {rank} sent no heartbeat for {now - seen:.1f}s "
                                  f"(EngineConfig.heartbeat_timeout_s={limit}); it is hung, stopped or gone")
                        return
                for seq, p in self._pending.items():
                    if p.first_failure is not None and now - p.first_failure > limit:
                        silent = sorted(set(range(self.n_workers)) - set(p.replies))
                        self._die(f"command {seq} ({p.kind} {p.model_id}) failed on ranks "
                                  f"{sorted(p.replies)} and ranks {silent} gave no answer for {limit}s")
                        return

    # ---- death and shutdown --------------------------------------------------
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
            self._die(f"worker rank {rank} exited unexpectedly (exit code {exitcode})")

    def _die(self, reason: str) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._dead = f"engine is dead: {reason}"
            log.error(self._dead)
            self._fail_everything()
            self._stopped.set()

    def _fail_everything(self) -> None:
        """Fail every waiting request and query with the engine's reason. Caller holds the lock."""
        for uid in list(self._requests):
            self._finish(uid, error=EngineDeadError(self._dead))
        for q in self._queues.values():
            q.clear()
        for tb in self._token_batches.values():
            tb.take_all()
            tb.to_drop.clear()
        for p in list(self._pending.values()):
            if p.waiter is not None:
                p.waiter({})
        self._pending.clear()

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
        try:
            if self._on_close is not None:
                self._on_close(already_dead)
        finally:
            self._stopped.set()


def _first_error(failures: Dict[int, msg.CommandFailed]) -> Optional[str]:
    """The root cause: a rank's own error rather than a downstream rank's 'upstream failed'."""
    if not failures:
        return None
    own = [f for f in failures.values() if not f.error.startswith("UpstreamFailed")]
    pick = min(own or failures.values(), key=lambda f: f.rank)
    return f"rank {pick.rank}: {pick.error}"
