"""Where the master channel's replies go, before and after the engine exists (``ReplyRouter``)."""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, List, Optional

from ..comm import messages as msg
from ..comm.topology import Groups
from ..comm.transport import MasterChannel

if TYPE_CHECKING:
    from ..engine import Engine

log = logging.getLogger("computron.launch")


class ReplyRouter:
    """Where the master channel's replies go, before and after the engine exists.

    In attach mode the channel starts before rank 0 has built its shards, so the other ranks' ready
    messages, and then their heartbeats, can arrive before there is an engine: start-up messages
    are collected here, anything else is held and handed to the engine, in order, by ``attach``.
    A failure while handling a reply kills the engine naming that failure (never a healthy rank),
    and the receiver thread goes on (it still has the workers' goodbyes to collect).
    """

    def __init__(self, expected_ready: int, exit_cause=lambda: None):
        self.expected_ready = expected_ready
        self.ready: List[msg.WorkerReady] = []
        self.failed: List[msg.WorkerStartFailed] = []
        self.started = threading.Event()
        if expected_ready == 0:
            self.started.set()
        self._exit_cause = exit_cause
        self._engine: Optional[Engine] = None
        self._held: list = []
        self._lock = threading.Lock()

    def channel(self, groups: Groups, keepalive_s: Optional[float] = None) -> MasterChannel:
        return MasterChannel(groups, on_reply=self.route, on_transport_error=self.transport_error,
                             on_handler_error=self.handler_error, keepalive_s=keepalive_s)

    def missing(self) -> int:
        return self.expected_ready - len(self.ready) - len(self.failed)

    def route(self, reply) -> None:
        if isinstance(reply, (msg.WorkerReady, msg.WorkerStartFailed)):
            (self.ready if isinstance(reply, msg.WorkerReady) else self.failed).append(reply)
            if self.missing() <= 0:
                self.started.set()
            return
        engine = self._engine
        if engine is None:
            with self._lock:
                engine = self._engine
                if engine is None:
                    self._held.append(reply)
                    return
        engine.on_reply(reply)

    def attach(self, engine: Engine) -> None:
        """Hand over what arrived before the engine existed; from now on replies go straight to it."""
        with self._lock:
            if self._held:
                log.debug("handing %d replies that arrived during start-up to the engine", len(self._held))
            for reply in self._held:
                engine.on_reply(reply)
            self._held.clear()
            self._engine = engine

    def transport_error(self, exc: BaseException) -> None:
        engine = self._engine
        if engine is not None:
            engine.on_transport_error(exc, cause=self._exit_cause())
        else:
            self.failed.append(msg.WorkerStartFailed(-1, f"control plane failed: {type(exc).__name__}: {exc}"))
            self.started.set()

    def handler_error(self, exc: BaseException, reply) -> None:
        log.error("the master failed handling %s", type(reply).__name__,
                  exc_info=(type(exc), exc, exc.__traceback__))
        engine = self._engine
        if engine is not None:
            engine.on_internal_error(exc, reply)
        else:
            self.failed.append(msg.WorkerStartFailed(
                -1, f"the master failed handling {type(reply).__name__}: {type(exc).__name__}: {exc}"))
            self.started.set()
