"""The control plane over torch.distributed (gloo, also on GPU clusters).

Commands: the master broadcasts each command to every worker on the ``cmd``
group, from one sender thread, so all workers see one total order. Replies:
each worker sends a (length, payload) pair to the master on the ``res`` group;
the master's receiver thread blocks on a receive from any source. Both sides
block on the transport; nothing polls.

In attach mode the master shares rank 0 with worker 0: that worker gets its
commands from an in-process queue and hands replies straight to the master.
"""
from __future__ import annotations

import pickle
import queue
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .messages import Bye, Shutdown
from .topology import Groups


def _to_tensor(obj: Any) -> torch.Tensor:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _from_tensor(t: torch.Tensor) -> Any:
    return pickle.loads(t.numpy().tobytes())


class MasterChannel:
    """Master side: ``send(cmd)`` never blocks the caller; replies go to ``on_reply``."""

    def __init__(self, groups: Groups, on_reply: Callable[[Any], None],
                 on_transport_error: Callable[[BaseException], None]):
        self.groups = groups
        self.layout = groups.layout
        self._on_reply = on_reply
        self._on_error = on_transport_error
        self._outbox: "queue.Queue[Any]" = queue.Queue()
        self.local_worker_inbox: Optional["queue.Queue[Any]"] = (
            queue.Queue() if self.layout.master_is_worker else None)
        self._remote_workers = self.layout.n_workers - (1 if self.layout.master_is_worker else 0)
        self._closed = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="computron-cmd-send", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name="computron-reply-recv", daemon=True)

    def start(self) -> None:
        self._sender.start()
        if self._remote_workers:
            self._receiver.start()

    def send(self, cmd: Any) -> None:
        self._outbox.put(cmd)

    def deliver_local(self, reply: Any) -> None:
        """Used by the co-located worker in attach mode."""
        self._on_reply(reply)

    def _send_loop(self) -> None:
        while True:
            cmd = self._outbox.get()
            try:
                if self.local_worker_inbox is not None:
                    self.local_worker_inbox.put(cmd)
                if self._remote_workers:
                    dist.broadcast_object_list([cmd], src=self.layout.master_rank, group=self.groups.cmd)
            except Exception as exc:  # noqa: BLE001
                if not self._closed.is_set():
                    self._on_error(exc)
                return
            if isinstance(cmd, Shutdown):
                return

    def _recv_loop(self) -> None:
        header = torch.zeros(1, dtype=torch.int64)
        byes = 0
        while byes < self._remote_workers:
            try:
                src = dist.recv(header, src=None, group=self.groups.res)
                payload = torch.empty(int(header.item()), dtype=torch.uint8)
                dist.recv(payload, src=src, group=self.groups.res)
                reply = _from_tensor(payload)
            except Exception as exc:  # noqa: BLE001
                if not self._closed.is_set():
                    self._on_error(exc)
                return
            if isinstance(reply, Bye):
                byes += 1
                continue
            self._on_reply(reply)

    def close(self, timeout: float) -> bool:
        """Wait for the queued commands (a Shutdown last) to go out and every worker's Bye.

        Returns True when both threads finished, so the process groups can be destroyed.
        """
        self._sender.join(timeout)
        if self._receiver.is_alive():
            self._receiver.join(timeout)
        self._closed.set()
        return not self._sender.is_alive() and not self._receiver.is_alive()

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

    def recv(self) -> Any:
        if self._master is not None:
            return self._master.local_worker_inbox.get()
        box = [None]
        dist.broadcast_object_list(box, src=self.layout.master_rank, group=self.groups.cmd)
        return box[0]

    def reply(self, msg: Any) -> None:
        if self._master is not None:
            self._master.deliver_local(msg)
            return
        payload = _to_tensor(msg)
        header = torch.tensor([payload.numel()], dtype=torch.int64)
        with self._lock:
            dist.send(header, dst=self.layout.master_rank, group=self.groups.res)
            dist.send(payload, dst=self.layout.master_rank, group=self.groups.res)
