"""The served models of a cluster: the catalog every group follows (``ClusterEngine``'s half that changes it).

The front keeps one catalog: each model's ``ModelConfig`` and a *tag* that changes when the model is added
or replaced, plus the pins and priorities set while serving. A change goes to every group that is up; a
group that is down (Ray restarting it) gets it when it comes back: the restarted group was rebuilt with
the models it was launched with, and ``_reconcile`` adds, replaces and removes what differs, by tag.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, List, Optional, Tuple

from ..errors import EngineDeadError, ModelConflictError, UnknownModelError
from .board import GroupDied, short_error

log = logging.getLogger("computron.cluster")


class CatalogMixin:
    """Needs the front's ``_lock``, ``_catalog`` (id -> (config, tag)), ``_settings``, ``_tags``, ``_board``,
    ``_groups`` and ``_call``."""

    async def _reconcile(self, i: int) -> None:
        """Bring a restarted group's models up to the catalog (it was rebuilt with the launch's models)."""
        with self._lock:
            have = dict(self._views[i].update.tags)
            catalog = dict(self._catalog)
            settings = {m: dict(s) for m, s in self._settings.items()}
        try:
            for m in [m for m in have if m not in catalog]:
                await self._call(i, "remove_model", m, False)
            for m, (config, tag) in catalog.items():
                if m not in have:
                    await self._call(i, "add_model", config, tag)
                elif have[m] != tag:
                    await self._call(i, "replace_model", m, config, tag)
            for m, s in settings.items():
                for method, value in s.items():
                    await self._call(i, method, m, value)
        except Exception as exc:  # noqa: BLE001 - the group serves what it could build
            log.error("engine group %d: bringing its models up to date failed: %s", i, short_error(exc))

    async def _everywhere(self, method: str, *args) -> Tuple[List[int], Optional[BaseException]]:
        """Call ``method`` on every alive group: ``(groups that did it, the first engine error or None)``. A
        group that dies meanwhile is brought up to date when it comes back; ``EngineDeadError`` when none is up."""
        with self._lock:
            targets = self._board.alive_ids()
        results = await asyncio.gather(*(self._call(i, method, *args) for i in targets), return_exceptions=True)
        ok = [i for i, r in zip(targets, results) if not isinstance(r, BaseException)]
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, GroupDied)]
        if not ok and not errors:
            raise EngineDeadError(f"no engine group is up to {method}: {self._board.reasons()}")
        return ok, errors[0] if errors else None

    async def add_model(self, config: Any) -> None:
        """Serve one more model on every group (none keeps it if one fails to build it)."""
        mid = config.model_id
        with self._lock:
            if mid in self._catalog:
                raise ModelConflictError(f"model {mid!r} is already served (or being added)")
            tag = next(self._tags)
            self._catalog[mid] = (config, tag)
        error: Optional[BaseException] = None
        try:
            ok, error = await self._everywhere("add_model", config, tag)
            if error is not None:
                await asyncio.gather(*(self._call(i, "remove_model", mid, False) for i in ok), return_exceptions=True)
                raise error
        except BaseException:  # cancellation too: the catalog entry is taken back; re-raised
            with self._lock:
                if self._catalog.get(mid, (None, None))[1] == tag:
                    del self._catalog[mid]
            raise

    async def replace_model(self, model_id: str, config: Any) -> None:
        """Serve a new version under ``model_id`` on every group. Should some group fail to build it, the
        groups that did serve the new version and that group no longer serves the model (its error is
        raised); should all fail, the old version stays everywhere."""
        with self._lock:
            if model_id not in self._catalog:
                raise UnknownModelError(model_id, self._catalog)
            old, tag = self._catalog[model_id], next(self._tags)
            self._catalog[model_id] = (dataclasses.replace(config, model_id=model_id), tag)
        ok: List[int] = []
        try:
            ok, error = await self._everywhere("replace_model", model_id, config, tag)
            if error is not None:
                raise error
        except BaseException:  # cancellation too: the old version is put back; re-raised
            with self._lock:
                if not ok and self._catalog.get(model_id, (None, None))[1] == tag:
                    self._catalog[model_id] = old
            raise

    async def remove_model(self, model_id: str, drain: bool = True) -> None:
        """Stop serving ``model_id`` on every group."""
        with self._lock:
            if self._catalog.pop(model_id, None) is None:
                raise UnknownModelError(model_id, self._catalog)
            self._settings.pop(model_id, None)
        _, error = await self._everywhere("remove_model", model_id, drain)
        if error is not None:
            raise error

    def _set(self, method: str, model_id: str, value: Any) -> None:
        with self._lock:
            if model_id not in self._catalog:
                raise UnknownModelError(model_id, self._catalog)
            self._settings.setdefault(model_id, {})[method] = value
            targets = [g for g, v in zip(self._groups, self._views) if v.alive]
        for g in targets:  # not awaited: the server calls these from its loop; a group that dies gets it again
            getattr(g, method).remote(model_id, value)

    def set_pinned(self, model_id: str, pinned: bool = True) -> None:
        self._set("set_pinned", model_id, pinned)

    def set_priority(self, model_id: str, priority: int) -> None:
        self._set("set_priority", model_id, priority)

