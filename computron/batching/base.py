"""Batching interface, shaped like EnergonAI's so its batch managers port over.

``make_batch`` pops requests off a model's queue and returns one ``TaskEntry``
(the uids it took and the batched input) plus an ``info`` dict; the engine
runs the batch and hands ``split_batch`` a ``TaskEntry`` of the same uids with
the batched *output*, along with ``**info``. ``split_batch`` returns
``[(uid, output), ...]``.
"""
from __future__ import annotations

from typing import Any, Deque, Hashable, List, Tuple


class SubmitEntry:
    __slots__ = ("uid", "data")

    def __init__(self, uid: Hashable, data: Any):
        self.uid = uid
        self.data = data

    def __repr__(self):
        return f"SubmitEntry(uid={self.uid!r})"


class TaskEntry:
    __slots__ = ("uids", "batch")

    def __init__(self, uids: Tuple[Hashable, ...], batch: Any):
        self.uids = tuple(uids)
        self.batch = batch

    def __repr__(self):
        return f"TaskEntry(uids={self.uids!r})"


class BatchManager:
    """Default: batches of one request; the model's forward gets the request data unchanged."""

    prepare_off_loop: bool = False
    """``prepare`` does enough CPU work (tokenizing, decoding images) to run on a thread of its own,
    off the caller's event loop."""

    def validate(self, data: Any) -> None:
        """Reject a malformed request at submit time (raise ValueError/TypeError). Optional hook."""

    def prepare(self, data: Any) -> Any:
        """Check a request and turn it into what ``make_batch`` batches. The engine calls it at submit,
        outside its lock (on a thread when ``prepare_off_loop``), so ``make_batch`` only has to pad and
        stack. Default: ``validate``, the data unchanged."""
        self.validate(data)
        return data

    def make_batch(self, q: Deque[SubmitEntry]) -> Tuple[TaskEntry, dict]:
        entry = q.popleft()
        return TaskEntry((entry.uid,), entry.data), {}

    def split_batch(self, task_entry: TaskEntry, **info) -> List[Tuple[Hashable, Any]]:
        return [(task_entry.uids[0], task_entry.batch)]


def take_batch(batch_manager, q: Deque[SubmitEntry]):
    """Run ``make_batch``; report which entries it consumed, also when it raises.

    Returns ``(task_entry, info, None)`` on success and ``(None, taken, exc)``
    on failure, where ``taken`` holds the entries that left the queue (at least
    the head entry, so a request that cannot be batched never blocks its queue).
    """
    before = list(q)
    try:
        task, info = batch_manager.make_batch(q)
        if not isinstance(task, TaskEntry):
            raise TypeError(f"make_batch returned {type(task).__name__}, expected TaskEntry")
        if not isinstance(info, dict):
            raise TypeError(f"make_batch returned info of type {type(info).__name__}, expected dict")
        return task, info, None
    except Exception as exc:  # noqa: BLE001 - the batch's requests get this error
        remaining = {id(e) for e in q}
        taken = [e for e in before if id(e) not in remaining]
        if not taken and q:
            taken = [q.popleft()]
        return None, taken, exc
