"""Request-level batches: models that run each batch as one command (encoders, ViT, MLPs, paper mode).

``RequestLevel`` takes a batch from a model's queue with its batch manager
(``make_batch``), sends it, and splits the output back into one answer per
request (``split_batch``). A batch manager that cannot batch a request fails
that request alone; a worker error fails the batch's requests; the engine goes on.
"""
from __future__ import annotations

from typing import Dict, Optional

from ..batching.base import TaskEntry, take_batch
from ..comm import messages as msg
from ..errors import PayloadError, WorkerError
from ..metrics import BatchRecord
from ..sched.scheduler import Scheduler
from .commands import CommandKind, CommandTracker, PendingCommand
from .requests import RequestTable
from .telemetry import Telemetry


class RequestLevel:
    def __init__(self, batch_managers: Dict[str, object], requests: RequestTable, tracker: CommandTracker,
                 telemetry: Telemetry, scheduler: Scheduler):
        self._batch_managers = batch_managers
        self._requests = requests
        self._tracker = tracker
        self._telemetry = telemetry
        self._sched = scheduler

    def dispatch(self, model_id: str) -> None:
        task, info, exc = take_batch(self._batch_managers[model_id], self._requests.queues[model_id])
        if task is None:
            param = getattr(exc, "param", None)
            reason = str(exc) if param else (f"the batch manager could not batch this request: "
                                             f"{type(exc).__name__}: {exc}")
            for entry in info:
                self._requests.finish(entry.uid, error=PayloadError(f"model {model_id!r}: {reason}", param, reason))
            self._sched.on_batch_done(model_id)
            return
        self._tracker.send(CommandKind.BATCH, model_id, lambda seq: msg.RunBatch(seq, model_id, task.batch),
                           uids=task.uids, batch_info=info)

    def complete(self, p: PendingCommand, now: float, error: Optional[str]) -> None:
        m = p.model_id
        self._sched.on_batch_done(m)
        self._telemetry.record(BatchRecord(m, p.start, now, len(p.uids), tuple(p.uids), p.rank_times(), error,
                                           seq=p.seq, wall_start=self._telemetry.wall(p.start)))
        if error is not None:
            self._fail(p, WorkerError(f"model {m!r}: {error}"))
            return
        out = next(x.output for x in p.replies.values() if getattr(x, "has_output", False))
        try:
            results = self._batch_managers[m].split_batch(TaskEntry(p.uids, out), **p.batch_info)
        except Exception as exc:  # noqa: BLE001 - a batch manager's bug fails its batch only
            self._fail(p, PayloadError(f"model {m!r}: split_batch failed: {exc}"))
            return
        answered = set()
        for uid, value in results:
            answered.add(uid)
            self._requests.finish(uid, value, batch_seq=p.seq)
        for uid in set(p.uids) - answered:
            self._requests.finish(uid, error=WorkerError(f"model {m!r}: split_batch returned no output "
                                                         f"for request {uid}"), batch_seq=p.seq)

    def _fail(self, p: PendingCommand, error: BaseException) -> None:
        for uid in p.uids:
            self._requests.finish(uid, error=error, batch_seq=p.seq)
