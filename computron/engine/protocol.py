"""The engine's contract with what serves it: ``EngineClient`` (requests, state, and the served models'
changes while serving) and the snapshot types it answers with.

``computron.engine.Engine`` implements it, and so do the cluster's ``ClusterEngine`` (``cluster/front.py``,
whose snapshots are ``ClusterSnapshot``) and the tests' stub engine (``tests/serve_helpers.StubEngineBase``),
which puts the server in states a live engine cannot be put into on demand. The server calls nothing else
on the engine; a new call goes here first. Import-light: no torch, nothing of the engine's mechanism.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional, Protocol, Tuple, runtime_checkable


@dataclass(frozen=True)
class ModelSnapshot:
    """One model, as ``Engine.snapshot`` sees it."""
    state: str
    """The scheduler's state: 'offloaded', 'loading', 'loaded' or 'offloading'."""
    tier: str
    """Where its shards are: 'device', 'host' or 'disk'."""
    waiting: int
    running: int
    paused: int
    token_level: bool
    pinned: bool
    last_load: Optional[dict] = None
    last_offload: Optional[dict] = None
    version: int = 1
    """The served version (2 and up after ``Engine.replace_model``)."""
    draining_versions: int = 0
    """Earlier versions still finishing the requests admitted under them."""
    base: Optional[str] = None
    """A LoRA adapter's: the model it runs on (state and tier are that model's)."""
    host_plan: bool = False
    """Kept in host memory by plan (``Engine.set_host_models``): the last to go to disk, read ahead from it."""
    host_bytes: int = 0
    """Its largest shard: the host memory it takes on the rank it takes the most of."""
    weight_format: str = ""
    """How its weights are held: ``gguf:Q4_1``, ``int4-g32``, ``int8``, ``float32``..."""
    device_bytes: int = 0
    """While resident: its bytes on the device on the rank holding the most (packed bytes plus what a
    quantized model expanded on arrival, with its KV reserve); 0 otherwise."""
    last_used: Optional[float] = None
    """Wall-clock time its last request was answered (None: none yet)."""
    keep_alive_s: float = -1.0
    """How long it stays resident once idle (its latest request's keep_alive, else its own, else the
    engine's; -1: while memory allows)."""
    keep_until: Optional[float] = None
    """Wall-clock time it is offloaded if nothing comes for it: resident, idle, with a keep-alive; else None."""

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class EngineSnapshot:
    alive: bool
    dead_reason: Optional[str]
    models: Dict[str, ModelSnapshot] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return {"alive": self.alive, "dead_reason": self.dead_reason,
                "models": {m: s.to_dict() for m, s in self.models.items()}}


@dataclass(frozen=True)
class ClusterModelSnapshot(ModelSnapshot):
    groups: Dict[int, str] = field(default_factory=dict)
    """Each alive group serving the model -> its state there ('loaded', 'loading', ...)."""


@dataclass(frozen=True)
class ClusterSnapshot(EngineSnapshot):
    """The groups' snapshots merged per model (best state, summed queues), and each group's own."""
    groups: Dict[int, EngineSnapshot] = field(default_factory=dict)
    """Each group's last pushed snapshot (a group that is down: ``alive`` False, ``dead_reason`` why)."""
    restarts: Dict[int, int] = field(default_factory=dict)
    """How often Ray restarted each group."""

    def to_dict(self) -> Dict[str, Any]:
        return {**super().to_dict(), "groups": {i: g.to_dict() for i, g in self.groups.items()},
                "restarts": dict(self.restarts)}


@dataclass(frozen=True)
class TokenLogprob:
    """A generated (or prompt) token with its raw logprob (log_softmax of the model's own final logits,
    before penalties, bias, temperature and grammar) and the ``k`` most likely ``(id, logprob)``, most
    likely first (``k``: the request's ``logprobs``; none when only ``prompt_logprobs`` was asked)."""
    token: int
    logprob: float
    top: Tuple[Tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's tokens scored by the prefill: one entry per prompt token, the first None."""
    entries: Tuple[Optional[TokenLogprob], ...]


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

    def stream(self, model_id: str, data: Any, timeout: Optional[float] = None) -> AsyncIterator[Any]:
        """One generation request's new token ids, as they are made; closing the iterator cancels it. A
        request with ``logprobs`` or ``prompt_logprobs`` yields ``TokenLogprob`` items instead of ints,
        after one ``PromptLogprobs`` first if it asked for ``prompt_logprobs``."""

    def check_admission(self, model_id: str, arriving: int = 0) -> None:
        """Raise the refusal a request for ``model_id`` would get now (``QueueFullError`` with its reason and
        ``retry_after_s``: a full queue, a predicted time to first token over the limit), counted in
        ``counters()["rejections"]``; nothing to admit it. ``arriving``: requests the caller let through and
        has not submitted yet, counted as waiting. The server asks this before any other work on a request.
        An engine that refuses only when a request reaches it (engine groups) does nothing here."""

    def snapshot(self) -> EngineSnapshot:
        """``alive``, ``dead_reason`` and each model's ``ModelSnapshot`` (state, tier, waiting, running,
        last load and offload); a ``ClusterSnapshot`` when the engine is a cluster of groups."""

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

    def note_keep_alive(self, model_id: str, seconds: Optional[float]) -> None:
        """A request for ``model_id`` gave this ``keep_alive`` (seconds; -1.0: while memory allows; None: it
        gave none, so the model's own applies): how long the model stays resident once its requests are done."""

    async def shutdown(self) -> None:
        """Stop the engine and its workers (the app does it on exit when it owns the engine)."""


__all__ = ["EngineClient", "EngineSnapshot", "ModelSnapshot", "ClusterSnapshot", "ClusterModelSnapshot",
           "TokenLogprob", "PromptLogprobs"]
