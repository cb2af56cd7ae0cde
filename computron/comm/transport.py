"""The control plane over torch.distributed (gloo, also on GPU clusters).

Commands: the master broadcasts each command to every worker on the ``cmd``
group, from one sender thread, so all workers see one total order; while it
has nothing to send for ``keepalive_s`` it broadcasts a ``Keepalive``, so a
worker can tell a quiet master from a gone one. Replies: each worker sends to
the master on the ``res`` group; the master has one receiver thread per
remote worker, each blocked on a receive from its own rank, so a peer stuck
halfway through a message (stopped, cut off) holds up nobody else's replies
or heartbeats. Both sides block on the transport; nothing polls.

Messages travel in fixed-size frames (``FRAME`` bytes: an 8-byte length, then
the pickled message), so a small message costs one transfer; a larger one
sends the rest in a second transfer of exactly the missing bytes.

In attach mode the master shares rank 0 with worker 0: that worker gets its
commands from an in-process queue and hands replies straight to the master.
"""
from __future__ import annotations

import pickle
import queue
import threading
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .messages import Bye, Keepalive, Shutdown
from .topology import Groups


FRAME = 16384
_HEAD = 8


def _frames(obj: Any):
    """The first frame (always FRAME bytes) and the overflow tensor, or None if it all fits."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    frame = torch.zeros(FRAME, dtype=torch.uint8)
    frame[:_HEAD] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    first = data[:FRAME - _HEAD]
    frame[_HEAD:_HEAD + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
    rest = data[FRAME - _HEAD:]
    return frame, (torch.frombuffer(bytearray(rest), dtype=torch.uint8) if rest else None)


def _overflow_size(frame: torch.Tensor) -> int:
    return max(0, int(frame[:_HEAD].view(torch.int64).item()) - (FRAME - _HEAD))


def _decode(frame: torch.Tensor, rest: Optional[torch.Tensor]) -> Any:
    n = int(frame[:_HEAD].view(torch.int64).item())
    data = frame[_HEAD:_HEAD + min(n, FRAME - _HEAD)].numpy().tobytes()
    if rest is not None:
        data += rest.numpy().tobytes()
    return pickle.loads(data)


class MasterChannel:
    """Master side: ``send(cmd)`` never blocks the caller; replies go to ``on_reply``."""

    def __init__(self, groups: Groups, on_reply: Callable[[Any], None],
                 on_transport_error: Callable[[BaseException], None],
                 on_handler_error: Callable[[BaseException, Any], None], keepalive_s: Optional[float] = None):
        self.groups = groups
        self.layout = groups.layout
        self._on_reply = on_reply
        self._on_error = on_transport_error
        self._on_handler_error = on_handler_error
        self._outbox: "queue.Queue[Any]" = queue.Queue()
        self.local_worker_inbox: Optional["queue.Queue[Any]"] = (
            queue.Queue() if self.layout.master_is_worker else None)
        first = 1 if self.layout.master_is_worker else 0
        self._remote_ranks = list(range(first, self.layout.n_workers))
        self._remote_workers = len(self._remote_ranks)
        self._keepalive_s = keepalive_s
        self._closed = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="computron-cmd-send", daemon=True)
        self._receivers = [threading.Thread(target=self._recv_loop, args=(r,), name=f"computron-reply-recv-{r}",
                                            daemon=True) for r in self._remote_ranks]

    def start(self) -> None:
        self._sender.start()
        for t in self._receivers:
            t.start()

    def send(self, cmd: Any) -> None:
        self._outbox.put(cmd)

    def deliver_local(self, reply: Any) -> None:
        """Used by the co-located worker in attach mode."""
        self._handle(reply)

    def _handle(self, reply: Any) -> None:
        """Hand one reply over; a failure in the handler is reported, never raised into this thread."""
        try:
            self._on_reply(reply)
        except Exception as exc:  # noqa: BLE001 - the receiver must outlive a bug in a handler
            self._on_handler_error(exc, reply)

    def _send_loop(self) -> None:
        while True:
            try:
                cmd = self._outbox.get(timeout=self._keepalive_s)
            except queue.Empty:  # nothing to say for keepalive_s: say that we are still here
                if self._closed.is_set():
                    return
                cmd = Keepalive()
            try:
                if self.local_worker_inbox is not None:
                    self.local_worker_inbox.put(cmd)
                if self._remote_workers:
                    frame, rest = _frames(cmd)
                    dist.broadcast(frame, src=self.layout.master_rank, group=self.groups.cmd)
                    if rest is not None:
                        dist.broadcast(rest, src=self.layout.master_rank, group=self.groups.cmd)
            except Exception as exc:  # noqa: BLE001 - a broken transport: the engine decides what it means
                if not self._closed.is_set():
                    self._on_error(exc)
                return
            if isinstance(cmd, Shutdown):
                return

    def _recv_loop(self, src: int) -> None:
        """Every reply of worker ``src``, until its Bye (or the transport breaks)."""
        frame = torch.zeros(FRAME, dtype=torch.uint8)
        while True:
            try:
                dist.recv(frame, src=src, group=self.groups.res)
                rest = None
                extra = _overflow_size(frame)
                if extra:
                    rest = torch.empty(extra, dtype=torch.uint8)
                    dist.recv(rest, src=src, group=self.groups.res)
                reply = _decode(frame, rest)
            except Exception as exc:  # noqa: BLE001 - a broken transport: the engine decides what it means
                if not self._closed.is_set():
                    self._on_error(exc)
                return
            if isinstance(reply, Bye):
                return
            self._handle(reply)

    def close(self, timeout: float) -> bool:
        """Wait for the queued commands (a Shutdown last) to go out and every worker's Bye.

        Returns True when all threads finished, so the process groups can be destroyed.
        """
        deadline = time.monotonic() + timeout
        self._sender.join(timeout)
        for t in self._receivers:
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))
        self._closed.set()
        return not self._sender.is_alive() and not any(t.is_alive() for t in self._receivers)

    def abandon(self) -> None:
        """After a worker died: stop reporting transport errors; the threads are daemons."""
        self._closed.set()


class WorkerChannel:
    """Worker side: ``recv()`` blocks until the next command; ``reply()`` is thread-safe."""

    def __init__(self, groups: Groups, master: Optional[MasterChannel] = None):
        self.groups = groups
        self.layout = groups.layout
        self._master = master
        self._lock = threading.Lock()

    @property
    def remote(self) -> bool:
        """Whether the master is another process (not the one this worker shares in attach mode)."""
        return self._master is None

    def recv(self) -> Any:
        if self._master is not None:
            return self._master.local_worker_inbox.get()
        frame = torch.zeros(FRAME, dtype=torch.uint8)
        dist.broadcast(frame, src=self.layout.master_rank, group=self.groups.cmd)
        rest = None
        extra = _overflow_size(frame)
        if extra:
            rest = torch.empty(extra, dtype=torch.uint8)
            dist.broadcast(rest, src=self.layout.master_rank, group=self.groups.cmd)
        return _decode(frame, rest)

    def reply(self, msg: Any) -> None:
        if self._master is not None:
            self._master.deliver_local(msg)
            return
        frame, rest = _frames(msg)
        with self._lock:
            dist.send(frame, dst=self.layout.master_rank, group=self.groups.res)
            if rest is not None:
                dist.send(rest, dst=self.layout.master_rank, group=self.groups.res)
