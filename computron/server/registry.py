"""The served-model registry, changed while serving: load, replace, unload, and a repository's lazy loads.

``ModelRegistry.models`` maps each served id to its ``ServedModel``; every route reads it, so
``/v1/models``, the status page and the v2 routes follow a change at once (the Prometheus gauges read
the engine's snapshot, which changes with it). A change runs as one task per model id, registered
before its first await, so two changes of one id never interleave:

- ``load(name, raw)``: ``raw`` (a config entry's fields, or None for the repository's directory
  ``name``) is checked and built off the event loop (``building.py``: the start-up path), then
  ``engine.add_model``; the id is served once every rank has built it. A served id whose entry would
  build something else (another path, dtype, queue or batch bound, task) is replaced
  (``engine.replace_model``: admitted requests finish on the old version, and the id is never unknown
  meanwhile); an entry that would build the same model changes nothing but ``pinned`` and ``priority``
  (``engine.set_pinned``, ``set_priority``). Triton reloads in that case; here a reload of unchanged
  files would only cost a rebuild.
- ``unload(name)``: the id leaves ``models`` at once (new requests: 404, or, for a repository model, a
  new load after this one ends), then ``engine.remove_model(drain=True)`` lets admitted requests finish.
- adapters (a ``raw`` with ``base`` and ``adapter``; ``/v1/load_lora_adapter`` sends one): built on
  their base's ``ServedModel`` (``building.build_adapter``; a repository base not loaded yet is loaded
  first), then ``engine.add_model``, which checks the adapter's files against the base's checkpoint. An
  adapter is never replaced in place (the engine answers ``ModelConflictError``: unload it, then load
  it again), and a base with adapters is neither replaced nor unloaded (409) until they are unloaded;
  a poll keeps such a base while its directory is gone (with a warning).
- ``resolve(id)``: the served model; a repository model not served yet is loaded first. The first
  request starts the load, later ones wait on the same task, and all get its error. The loads are
  shielded: a requester that leaves or times out (``request_timeout_s``) does not cancel them.

While a replace runs, requests keep the old ``ServedModel`` (its tokenizer) until the engine has the
new version; one admitted in between tokenizes with the old tokenizer (versions normally share one).
``index()`` is Triton's repository index: READY, LOADING, UNLOADING, UNAVAILABLE (with the reason:
``unloaded`` or why a load failed), and "" for a repository model never loaded. In poll mode
(``repository_poll_s``) a task of the server's loop rescans the repository every so often
(``asyncio.sleep``: the polling is the feature) and unloads the models whose directory is gone.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional

from ..engine.protocol import EngineClient
from ..errors import EngineDeadError, ModelChangeError, ModelConflictError, RequestTimeoutError, UnknownModelError
from .building import BuiltModel, ServedModel, build_adapter, entry_for
from .config import ModelEntry
from .repository import ModelRepository

log = logging.getLogger("computron.server")

READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"
"""Triton's names of a model's states in the repository index."""


@dataclass
class _Change:
    kind: str
    """LOADING or UNLOADING."""
    task: asyncio.Task


def _not_servable(name: str, *why: str) -> UnknownModelError:
    """404 for a load of a name the server cannot find, saying where it looked."""
    err = UnknownModelError(name, ())
    err.args = (f"unknown model {name!r}: {', '.join(why)}",)
    return err


def _row(name: str, version: str = "", state: str = "", reason: str = "") -> Dict[str, str]:
    return {"name": name, "version": version, "state": state, "reason": reason}


class ModelRegistry:
    def __init__(self, engine: EngineClient, models: Dict[str, ServedModel], build: Callable[..., BuiltModel],
                 repository: Optional[ModelRepository] = None, request_timeout_s: Optional[float] = None):
        self.engine = engine
        self.models = models
        """The served models by id: what every route sees."""
        self.repository = repository
        self._build = build
        self._timeout = request_timeout_s
        self._changes: Dict[str, _Change] = {}
        self._unavailable: Dict[str, str] = {}
        """Ids no longer (or never) served, with why: 'unloaded', or the error of their last load."""
        self._poll: Optional[asyncio.Task] = None
        self._kept: set = set()
        """Models whose repository directory is gone but whose adapters keep them (warned about once)."""

    # ---- lifecycle (the app's lifespan) ----------------------------------------------------------------
    async def start(self, poll_s: Optional[float] = None) -> None:
        """Scan the repository, and rescan it every ``poll_s`` seconds from now on."""
        if self.repository is None:
            return
        await self.repository.rescan()
        if poll_s:
            self._poll = asyncio.ensure_future(self._poll_forever(poll_s))

    async def stop(self) -> None:
        """Stop polling and cancel the changes under way (the server is stopping)."""
        tasks = [c.task for c in self._changes.values()] + ([self._poll] if self._poll else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _poll_forever(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)  # poll mode: rescanning on a period is the feature
            try:
                await self.sync_repository()
            except Exception:  # noqa: BLE001 - a bad scan must not end the poll
                log.exception("model repository %s: rescan failed", self.repository.root)

    async def sync_repository(self) -> None:
        """Rescan, then unload (drain) every served model loaded from a directory that is gone."""
        present = set((await self.repository.rescan()).values())
        for name, m in list(self.models.items()):
            path = (m.entry.gguf if m.entry is not None else None) or m.path  # a .gguf file: not its cache dir
            if self.repository.holds(path) and path not in present and name not in self._changes:
                if self.adapters_on(name):
                    if name not in self._kept:
                        log.warning("model repository: %s is gone from %s, but adapters %s run on it: kept until "
                                    "they are unloaded", name, self.repository.root, self.adapters_on(name))
                    self._kept.add(name)
                    continue
                log.info("model repository: %s is gone from %s: unloading it", name, self.repository.root)
                self._start_unload(name)

    # ---- what is served -------------------------------------------------------------------------------
    def can_load(self, model_id: Any) -> bool:
        """Whether ``model_id`` is served, or is being loaded, or is a repository model a request loads."""
        return isinstance(model_id, str) and (model_id in self.models or model_id in self._changes or (
            self.repository is not None and model_id in self.repository.known))

    def adapters_on(self, model_id: str) -> List[str]:
        """The served LoRA adapters that run on ``model_id``."""
        return sorted(a for a, m in self.models.items() if m.base == model_id)

    def unloaded(self) -> Dict[str, str]:
        """Repository models not served (loading ones included): name -> path."""
        known = self.repository.known if self.repository else {}
        return {n: p for n, p in known.items() if n not in self.models}

    def loading(self, name: str) -> bool:
        """Whether ``name`` is being added (not a replace: a replaced model is served meanwhile)."""
        change = self._changes.get(name)
        return change is not None and change.kind == LOADING and name not in self.models

    async def resolve(self, model_id: str) -> ServedModel:
        """The served model ``model_id``; a repository model is loaded first (see the module docstring).
        UnknownModelError when it is neither; ModelChangeError when its load fails."""
        while True:
            m = self.models.get(model_id)
            if m is not None:
                return m
            change = self._changes.get(model_id)
            if change is None:
                if not (self.repository is not None and model_id in self.repository.known):
                    raise UnknownModelError(model_id, self.models)
                log.info("%s: first request: loading it from the model repository", model_id)
                change = self._start(model_id, LOADING, self._load(model_id, None))
            try:
                await self._wait(model_id, change)
            except (EngineDeadError, RequestTimeoutError):
                raise
            except Exception as exc:  # noqa: BLE001 - the requester gets the load's error
                if change.kind == LOADING:
                    raise ModelChangeError(f"model {model_id!r} could not be loaded: {exc}") from exc
            # an unload ended (or a load did): look again

    async def _wait(self, model_id: str, change: _Change) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(change.task), self._timeout)
        except asyncio.TimeoutError:
            raise RequestTimeoutError(f"model {model_id!r} was still loading after {self._timeout}s") from None

    # ---- changes ----------------------------------------------------------------------------------------
    def _start(self, name: str, kind: str, coro) -> _Change:
        """Run ``coro`` as the one change of ``name`` (ModelConflictError while another runs)."""
        if name in self._changes:
            coro.close()
            raise ModelConflictError(f"model {name!r}: a {self._changes[name].kind.lower()} is under way; "
                                     "try again once it is done")
        change = _Change(kind, asyncio.ensure_future(coro))
        self._changes[name] = change

        def done(t: asyncio.Task) -> None:
            if self._changes.get(name) is change:
                del self._changes[name]
            if not t.cancelled() and t.exception() is not None:  # retrieved: waiters re-raise it
                log.info("%s of %s failed: %s", kind.lower(), name, t.exception())
        change.task.add_done_callback(done)
        return change

    async def load(self, name: str, raw: Optional[Dict[str, Any]], where: str = "parameters.config") -> str:
        """Triton's load (see the module docstring): 'added', 'replaced' or 'unchanged'. ``where`` names
        ``raw`` in the errors about its fields."""
        return await asyncio.shield(self._start(name, LOADING, self._load(name, raw, where)).task)

    async def _load(self, name: str, raw: Optional[Dict[str, Any]], where: str = "parameters.config") -> str:
        loop = asyncio.get_running_loop()
        bodiless = raw is None
        if bodiless:
            if self.repository is not None:
                await self.repository.rescan()
            if self.repository is None or name not in self.repository.known:
                if name in self.models:
                    return "unchanged"  # Triton: loading a loaded model with no new config succeeds
                raise _not_servable(name, f"no directory {name!r} in the model repository {self.repository.root}"
                                    if self.repository else "no --model-repository to load it from",
                                    "and no parameters.config given")
            raw, where = {"path": self.repository.known[name]}, f"model_repository/{name}"
        entry = await loop.run_in_executor(None, entry_for, name, raw, where)
        current = self.models.get(name)
        if current is not None and current.same_build(entry):
            if not bodiless:  # a config's pinned and priority apply; the repository's directory has none
                self._set_in_place(current, entry)
            return "unchanged"
        try:
            if entry.adapter is not None:
                built = build_adapter(entry, await self._base_of(entry), where)
            else:
                built = await loop.run_in_executor(None, functools.partial(self._build, entry, where=where))
            if current is None:
                await self.engine.add_model(built.config)
            else:
                await self.engine.replace_model(name, built.config)
        except Exception as exc:  # any failure: recorded for the index, re-raised
            if current is None and (name in self._unavailable or (self.repository and name in self.repository.known)):
                self._unavailable[name] = f"load failed: {exc}"  # for the index (names known already only)
            raise
        self.models[name] = built.served
        self._unavailable.pop(name, None)
        version = getattr(self.engine.snapshot().models.get(name), "version", 1)
        log.info("%s %s (version %s) from %s", "replaced" if current else "loaded", name, version,
                 entry.path or f"LoRA adapter {entry.adapter} on {entry.base}")
        return "replaced" if current else "added"

    async def _base_of(self, entry: ModelEntry) -> ServedModel:
        """The served model an adapter entry goes on (a repository model is loaded first); 404 naming it."""
        try:
            return await self.resolve(entry.base)
        except UnknownModelError:
            err = UnknownModelError(entry.base, self.models)
            err.args = (f"base model {entry.base!r} of adapter {entry.id!r} is not served (served: "
                        f"{sorted(self.models)})",)
            raise err from None

    def _set_in_place(self, current: ServedModel, entry: ModelEntry) -> None:
        old = current.entry or ModelEntry(current.id, current.path)
        if entry.pinned != old.pinned:
            self.engine.set_pinned(current.id, entry.pinned)
        if entry.priority != old.priority:
            self.engine.set_priority(current.id, entry.priority)
        self.models[current.id] = replace(current, entry=entry)

    async def unload(self, name: str) -> None:
        """Triton's unload: drained, then freed on every rank (see the module docstring)."""
        await asyncio.shield(self._start_unload(name).task)

    def _start_unload(self, name: str) -> _Change:
        if name in self._changes:
            return self._start(name, UNLOADING, self._unload(name))  # raises ModelConflictError
        if name not in self.models:
            raise UnknownModelError(name, self.models)
        on = self.adapters_on(name)
        if on:
            raise ModelConflictError(f"model {name!r} has LoRA adapters {on} running on it: unload them first")
        served = self.models.pop(name)  # before the first await: new requests no longer reach it
        return self._start(name, UNLOADING, self._unload(name, served))

    async def _unload(self, name: str, served: Optional[ServedModel] = None) -> None:
        try:
            await self.engine.remove_model(name, drain=True)
        except UnknownModelError:
            pass  # the engine had already dropped it
        except ModelConflictError:
            if served is not None:  # an adapter being added on it meanwhile: the engine keeps serving it
                self.models[name] = served
            raise
        self._unavailable[name] = "unloaded"
        self._kept.discard(name)
        log.info("unloaded %s", name)

    # ---- Triton's index ---------------------------------------------------------------------------------
    async def index(self, ready_only: bool = False) -> List[Dict[str, str]]:
        """Every model served, changing, unloaded or in the repository (rescanned first), by name."""
        if self.repository is not None:
            await self.repository.rescan()
        rows = {n: _row(n, state=UNAVAILABLE, reason=r) for n, r in self._unavailable.items()}
        for n in (self.repository.known if self.repository else {}):
            rows.setdefault(n, _row(n))
        snap = self.engine.snapshot()
        for n in self.models:
            version = str(getattr(snap.models.get(n), "version", 1) or 1)
            rows[n] = _row(n, version, READY) if snap.alive else _row(n, version, UNAVAILABLE, snap.dead_reason or "")
        for n, change in self._changes.items():
            if n not in self.models:
                rows[n] = _row(n, state=change.kind)
        out = [rows[n] for n in sorted(rows)]
        return [r for r in out if r["state"] == READY] if ready_only else out
