"""The master: per-model queues, batching, and the scheduler's decisions put into effect.

The engine is a state machine behind one lock. It is driven by two kinds of
event, both of which end in ``_pump``: a caller's ``submit`` (from any asyncio
loop) and a worker's reply (from the transport's receiver thread). ``_pump``
asks the scheduler what to do and sends the commands; futures are resolved on
their own loop with ``call_soon_threadsafe``. Nothing waits by sleeping.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional

from . import messages as msg
from .batch import BatchManager, SubmitEntry, TaskEntry, take_batch
from .generation import OPTBatchManager
from .config import EngineConfig, ModelConfig
from .errors import (EngineDeadError, PayloadError, QueueFullError, RequestTimeoutError, UnknownModelError,
                     WorkerError)
from .metrics import BatchRecord, RequestRecord, SwapRecord
from .scheduler import ActionKind, Scheduler

log = logging.getLogger("computron.engine")


@dataclass
class _Request:
    uid: int
    model_id: str
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    submitted: float


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
        self._requests: Dict[int, _Request] = {}
        self._pending: Dict[int, _Pending] = {}
        paper = config.paper_mode
        # One batch in flight per model: workers run commands in order anyway, and a
        # second batch sent early would only split a burst into smaller batches.
        self._sched = Scheduler([mc.model_id for mc in model_configs], config.max_loaded,
                                prefetch=config.prefetch and not paper, overlap=config.overlap and not paper,
                                max_inflight=1)
        self._lock = threading.RLock()
        self._uids = itertools.count()
        self._seqs = itertools.count()
        self._records: Deque[Any] = deque(maxlen=config.metrics_history or None)
        self._dead: Optional[str] = None
        self._closed = threading.Event()  # close() ran
        self._stopped = threading.Event()  # closed or dead: run() returns

    def _default_batch_manager(self, model_id: str):
        """Causal LMs get an OPTBatchManager for their token ids; anything else batches of one."""
        info = next((w.batching[model_id] for w in self.workers.values() if model_id in w.batching), None)
        if info is None:
            return BatchManager()
        return OPTBatchManager(max_batch_size=self.config.max_batch_size or 8, **info)

    # ---- public API ----------------------------------------------------------
    @property
    def model_ids(self) -> List[str]:
        return list(self._queues)

    def model_states(self) -> Dict[str, str]:
        with self._lock:
            return {m: self._sched.state(m).value for m in self._queues}

    def metrics(self, kind: Optional[str] = None) -> List[Any]:
        """Records of the loads, offloads, batches and requests so far, oldest first
        (the last ``EngineConfig.metrics_history`` of them)."""
        with self._lock:
            return [r for r in self._records if kind is None or r.kind == kind]

    @property
    def is_alive(self) -> bool:
        return self._dead is None

    async def submit(self, model_id: str, data: Any, timeout: Optional[float] = None) -> Any:
        """Queue one request for ``model_id`` and wait for its output."""
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

    def _enqueue(self, model_id, data, fut, loop) -> int:
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
                raise PayloadError(f"model {model_id!r}: malformed request: {exc}") from None
            if self.config.queue_size and len(queue) >= self.config.queue_size:
                raise QueueFullError(f"model {model_id!r} already has {len(queue)} waiting requests "
                                     f"(queue_size={self.config.queue_size})")
            uid = next(self._uids)
            now = time.perf_counter()
            self._requests[uid] = _Request(uid, model_id, fut, loop, now)
            queue.append(SubmitEntry(uid, data))
            self._pump()
            return uid

    def _cancel(self, uid: int) -> None:
        with self._lock:
            req = self._requests.pop(uid, None)
            if req is None:
                return
            q = self._queues[req.model_id]
            for e in list(q):
                if e.uid == uid:
                    q.remove(e)
                    break
            self._pump()  # an emptied queue may change what comes next

    def _finish(self, uid: int, value: Any = None, error: Optional[BaseException] = None,
                 batch_seq: Optional[int] = None) -> None:
        req = self._requests.pop(uid, None)
        if req is None:
            return
        self._records.append(RequestRecord(uid, req.model_id, req.submitted, time.perf_counter(),
                                           batch_uid=batch_seq, error=None if error is None else str(error)))

        def resolve(f=req.future):
            if f.done():
                return
            if error is not None:
                f.set_exception(error)
            else:
                f.set_result(value)
        try:
            req.loop.call_soon_threadsafe(resolve)
        except RuntimeError:  # the caller's loop is closed: nobody is waiting
            pass

    # ---- scheduling ----------------------------------------------------------
    def _pump(self) -> None:
        """Act on the scheduler's decisions until it has nothing more to do. Caller holds the lock."""
        while self._dead is None and not self._closed.is_set():
            heads = {m: self._requests[q[0].uid].submitted for m, q in self._queues.items() if q}
            actions = self._sched.decide(heads)
            if not actions:
                return
            for a in actions:
                if a.kind is ActionKind.RUN:
                    self._dispatch_batch(a.model_id)
                else:
                    seq = next(self._seqs)
                    kind = "load" if a.kind is ActionKind.LOAD else "offload"
                    self._pending[seq] = _Pending(kind, a.model_id, time.perf_counter())
                    cmd = msg.Load(seq, a.model_id) if kind == "load" else msg.Offload(seq, a.model_id)
                    self._channel.send(cmd)

    def _dispatch_batch(self, model_id: str) -> None:
        queue = self._queues[model_id]
        task, info, exc = take_batch(self._batch_managers[model_id], queue)
        if task is None:
            for entry in info:
                self._finish(entry.uid, error=PayloadError(
                    f"model {model_id!r}: the batch manager could not batch this request: "
                    f"{type(exc).__name__}: {exc}"))
            self._sched.on_batch_done(model_id)
            return
        seq = next(self._seqs)
        self._pending[seq] = _Pending("batch", model_id, time.perf_counter(), uids=task.uids, info=info)
        self._channel.send(msg.RunBatch(seq, model_id, task.batch))

    # ---- replies from workers (receiver thread) ------------------------------
    def on_reply(self, reply: Any) -> None:
        """Called on the transport's receiver thread (or a worker thread in attach mode) for every reply."""
        with self._lock:
            try:
                self._on_reply_locked(reply)
            except Exception as exc:  # noqa: BLE001 - a bug here must not silently kill the receiver thread
                log.exception("engine failed handling %s", reply)
                self._die(f"internal error handling {type(reply).__name__}: {type(exc).__name__}: {exc}")

    def _on_reply_locked(self, reply: Any) -> None:
        if isinstance(reply, (msg.WorkerReady, msg.WorkerStartFailed)):
            return  # handled by the launcher before the engine exists
        pending = self._pending.get(reply.seq)
        if pending is None:  # after close() or death, late replies have nobody waiting
            if not self._stopped.is_set():
                log.warning("reply for unknown command %s", reply)
            return
        pending.replies[reply.rank] = reply
        if len(pending.replies) < self.n_workers:
            return
        del self._pending[reply.seq]
        self._complete(reply.seq, pending)
        self._pump()

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
        if p.kind == "load":
            self._records.append(SwapRecord(
                "load", p.model_id, p.start, now, times,
                nbytes=sum(getattr(x, "nbytes", 0) for x in p.replies.values()),
                device_bytes={r: x.device_bytes for r, x in p.replies.items() if hasattr(x, "device_bytes")},
                error=error))
            if error is None:
                self._sched.on_loaded(p.model_id)
                return
            log.error("loading %s failed: %s", p.model_id, error)
            self._sched.on_load_failed(p.model_id)
            for entry in list(self._queues[p.model_id]):
                self._finish(entry.uid, error=WorkerError(f"loading model {p.model_id!r} failed: {error}"))
            self._queues[p.model_id].clear()
            seq = next(self._seqs)  # release whatever some ranks did load
            self._pending[seq] = _Pending("cleanup", p.model_id, now)
            self._channel.send(msg.Offload(seq, p.model_id))
            return
        if p.kind == "offload":
            self._records.append(SwapRecord(
                "offload", p.model_id, p.start, now, times,
                device_bytes={r: x.device_bytes for r, x in p.replies.items() if hasattr(x, "device_bytes")},
                error=error))
            if error is not None:  # the store releases its buffers even then; say what went wrong
                log.error("offloading %s reported: %s", p.model_id, error)
            self._sched.on_offloaded(p.model_id)
            return
        # a batch
        self._sched.on_batch_done(p.model_id)
        self._records.append(BatchRecord(p.model_id, p.start, now, len(p.uids), tuple(p.uids), times, error,
                                         seq=seq))
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

    # ---- death and shutdown --------------------------------------------------
    def on_transport_error(self, exc: BaseException, cause: Optional[str] = None) -> None:
        """``cause`` names the worker that died, when the launcher knows it."""
        prefix = f"{cause}; " if cause else ""
        self._die(f"{prefix}lost contact with the workers: {type(exc).__name__}: {exc}")

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
        for p in list(self._pending.values()):
            if p.waiter is not None:
                p.waiter({})
        self._pending.clear()

    def close(self) -> None:
        """The one shutdown path: fail what is waiting, stop the workers, release processes. Idempotent."""
        with self._lock:
            if self._closed.is_set():
                return
            already_dead = self._dead is not None
            self._dead = self._dead or "engine is shut down"
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
