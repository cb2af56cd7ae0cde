"""LoRA adapters served on resident base models: which adapter ids exist, on which base, and changes to them.

An adapter id is served like a model id (``submit``, ``stream``, the HTTP doors), but its requests are
queued as its base's (under the base version's key, with ``Request.adapter`` set): the scheduler sees
one model, one load serves the base and every adapter on it, and sequences of different adapters and of
the bare base share a step (the workers' ``lora.slots`` apply each row's adapter). Adding one reads its
weights into every rank's host memory (``AddAdapter``); a device slot is taken when a step first uses
it. Removing one refuses new requests at once, and frees it on every rank once its admitted requests
are answered (``reap``). A base with adapters is neither replaced nor removed before they are: their
weights were made for that version's.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

from ..comm import messages as msg
from ..config import ModelConfig
from ..errors import ModelChangeError, ModelConflictError, UnknownModelError
from .catalog import Catalog, Done
from .commands import CommandKind, CommandTracker, PendingCommand
from .requests import RequestTable
from .token_level import TokenLevel

log = logging.getLogger("computron.engine")


class Adapters:
    """The caller holds the engine's lock."""

    def __init__(self, tracker: CommandTracker, requests: RequestTable, catalog: Catalog,
                 token_level: TokenLevel):
        self._tracker = tracker
        self._requests = requests
        self._catalog = catalog
        self._token_level = token_level
        self.base_of: Dict[str, str] = {}
        """Served adapter id -> its base's model id."""
        self.infos: Dict[str, object] = {}
        """Adapter id -> its ``lora.adapter.AdapterInfo`` (served, adding or retiring)."""
        self._key: Dict[str, str] = {}
        """Adapter id -> the base version key its weights are on."""
        self._adding: Dict[str, Done] = {}
        self._retiring: Dict[str, List[Done]] = {}
        self._removing: Dict[str, List[Done]] = {}

    # ---- what callers ask ----------------------------------------------------
    def route(self, model_id) -> Optional[Tuple[str, str]]:
        """``(base key, adapter id)`` for a served adapter id, else None."""
        base = self.base_of.get(model_id) if isinstance(model_id, str) else None
        return None if base is None else (self._key[model_id], model_id)

    def on_base(self, model_id: str) -> List[str]:
        """Adapters (served, adding or retiring) on this model id."""
        return sorted(a for a, k in self._key.items() if self._catalog.id_of(k) == model_id)

    def busy(self, adapter_id: str) -> bool:
        return adapter_id in self._key

    def base_config(self, mc: ModelConfig) -> ModelConfig:
        """The config of the version an adapter would go on (UnknownModelError for a base not served)."""
        return self._catalog.configs[self._catalog.key_of(mc.base)]

    # ---- adding --------------------------------------------------------------
    def add(self, mc: ModelConfig, info, done: Done) -> None:
        aid = mc.model_id
        if aid in self._key or aid in self._catalog.current:
            raise ModelConflictError(f"model {aid!r} is already served (or being changed)")
        key = self._catalog.key_of(mc.base)
        if key not in self._token_level:
            raise ModelChangeError(f"adapter {aid!r}: its base {mc.base!r} does not generate token by token "
                                   "(adapters need EngineConfig.step_mode and a causal LM base)")
        self._key[aid] = key
        self.infos[aid] = info
        self._adding[aid] = done
        log.info("adding adapter %s on %s (rank %d, %.1f MB)", aid, mc.base, info.r, info.nbytes / 2**20)
        self._tracker.send(CommandKind.ADD_ADAPTER, key, lambda seq: msg.AddAdapter(seq, key, aid, info),
                           adapter=aid)

    def complete_add(self, p: PendingCommand, now: float, error: Optional[str]) -> None:
        aid = p.adapter
        done = self._adding.pop(aid)
        if error is not None:
            failure = ModelChangeError(f"adding adapter {aid!r} failed: {error}")
            log.error("%s", failure)
            key = self._key.pop(aid)
            self.infos.pop(aid, None)
            self._tracker.send(CommandKind.CLEANUP, key, lambda seq: msg.RemoveAdapter(seq, key, aid))
            done(failure)
            return
        self.base_of[aid] = self._catalog.id_of(p.model_id)
        log.info("added adapter %s on every rank in %.1f ms", aid, (now - p.start) * 1e3)
        done(None)

    # ---- removing ------------------------------------------------------------
    def remove(self, aid: str, done: Done, drain: bool = True) -> None:
        if aid in self._adding or aid in self._retiring or aid in self._removing:
            raise ModelConflictError(f"adapter {aid!r} is being changed right now: wait for that to end")
        del self.base_of[aid]
        self._retiring[aid] = [done]
        log.info("removing adapter %s (%s)", aid, "its admitted requests finish first" if drain
                 else "its admitted requests fail now")
        if not drain:
            self._catalog.fail_requests(lambda r: r.adapter == aid,
                                        UnknownModelError(aid, list(self._catalog.current) + list(self.base_of)))

    def reap(self) -> None:
        for aid in [a for a in self._retiring if not any(r.adapter == a for r in self._requests.requests.values())]:
            key = self._key[aid]
            self._removing[aid] = self._retiring.pop(aid)
            self._tracker.send(CommandKind.REMOVE_ADAPTER, key,
                               lambda seq, a=aid, k=key: msg.RemoveAdapter(seq, k, a), adapter=aid)

    def complete_remove(self, p: PendingCommand, now: float, error: Optional[str]) -> None:
        aid = p.adapter
        waiters = self._removing.pop(aid)
        del self._key[aid]
        self.infos.pop(aid, None)
        failure = None if error is None else ModelChangeError(f"removing adapter {aid!r}: {error}")
        if failure is not None:
            log.error("%s", failure)
        else:
            log.info("removed adapter %s from every rank", aid)
        for w in waiters:
            w(failure)

    def abandon(self, error: BaseException) -> None:
        waiting = list(self._adding.values()) + [w for ws in list(self._retiring.values())
                                                 + list(self._removing.values()) for w in ws]
        self._adding.clear()
        self._retiring.clear()
        self._removing.clear()
        for w in waiting:
            w(error)


def add_at_launch(engine, configs: List[ModelConfig], timeout: float) -> None:
    """Adapters given to ``LaunchEngine``: added through the engine's own path once it serves (on a thread
    with a loop of its own, since the launcher may be called from inside a running loop)."""
    import asyncio
    import threading
    errors: List[BaseException] = []

    def run() -> None:
        async def all_of():
            for mc in configs:
                await engine.add_model(mc)
        try:
            asyncio.run(asyncio.wait_for(all_of(), timeout))
        except BaseException as exc:  # noqa: BLE001 - raised on the launcher's thread
            errors.append(exc)
    t = threading.Thread(target=run, name="computron-launch-adapters")
    t.start()
    t.join()
    if errors:
        engine.close()
        raise errors[0]
