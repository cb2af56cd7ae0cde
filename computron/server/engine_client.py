"""What the HTTP server uses of the engine: the ``EngineClient`` protocol (requests, state, and the
served models' changes while serving).

``computron.engine.Engine`` implements it, and so does the tests' stub engine
(``tests/serve_helpers.StubEngineBase``), which puts the server in states a live engine cannot be
put into on demand. The server calls nothing else on the engine; a new call goes here first.
Import-light (no torch): the snapshot type is named for type checkers only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, List, Optional, Protocol, Tuple, runtime_checkable

if TYPE_CHECKING:
    from ..engine.telemetry import EngineSnapshot


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the server sees it: requests in, answers and state out."""

    @property
    def is_alive(self) -> bool:
        """False once the engine died or was shut down."""

    @property
    def dead_reason(self) -> Optional[str]:
        """Why the engine died (None while it serves)."""

    async def submit(self, model_id: str, data: Any, timeout: Optional[float] = None) -> Any:
        """One request's whole answer (encoders, classifiers, embeddings)."""

    def stream(self, model_id: str, data: Any, timeout: Optional[float] = None) -> AsyncIterator[int]:
        """One generation request's new token ids, as they are made; closing the iterator cancels it."""

    def snapshot(self) -> EngineSnapshot:
        """``alive``, ``dead_reason`` and each model's ``ModelSnapshot`` (state, tier, waiting, running,
        last load and offload)."""

    def counters(self) -> Dict[str, Dict]:
        """Running totals for Prometheus: swaps, swap seconds and bytes, preemptions, steps."""

    def events(self, since: int = 0) -> Tuple[int, List[Dict[str, Any]]]:
        """``(cursor, events)``: the status page's timeline after ``since``."""

    async def add_model(self, config: Any) -> None:
        """Serve one more model (a ``ModelConfig``), built on every rank while the others keep serving."""

    async def replace_model(self, model_id: str, config: Any) -> None:
        """Serve a new version under ``model_id``; admitted requests finish on the old one."""

    async def remove_model(self, model_id: str, drain: bool = True) -> None:
        """Stop serving ``model_id`` (new requests: UnknownModelError at once); returns once it is freed."""

    def set_pinned(self, model_id: str, pinned: bool = True) -> None:
        """Never evict ``model_id`` once it is loaded (or allow it again)."""

    def set_priority(self, model_id: str, priority: int) -> None:
        """Higher goes first for a slot and is evicted last."""

    async def shutdown(self) -> None:
        """Stop the engine and its workers (the app does it on exit when it owns the engine)."""
