"""Health, Prometheus and the status page: the router no API key guards.

    GET /              the status page (one static HTML file polling the two feeds below)
    GET /api/status    each model's residency (``residency.py``: disk, host, loading, resident,
                       offloading), queued and running sequences, last load and offload; a LoRA
                       adapter's row has its ``base`` (its residency is that model's)
    GET /api/events    the timeline after ``?since=N`` (loads, offloads, batches, steps)
    GET /health        200 while serving; 503 when draining or when the engine is dead (with why)
    GET /metrics       Prometheus (``metrics.py``)

Served by engine groups (``computron serve --ray --groups N``: the engine's snapshot is a
``ClusterSnapshot`` with ``groups``), ``/health`` and ``/api/status`` also carry ``groups``, one entry
per group: ``{"group", "alive", "reason", "restarts"}``; and each model row of ``/api/status`` its
residency on each alive group serving it (``"groups": {group: residency}``; None for a plain engine).
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional

from fastapi import APIRouter, Depends
from fastapi.responses import FileResponse, Response

from ..engine.protocol import ClusterModelSnapshot, ClusterSnapshot
from .http import json_response
from .metrics import CONTENT_TYPE
from .residency import Residency
from .state import ServerState, served_state

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")

router = APIRouter()


@router.get("/")
async def index():
    return FileResponse(os.path.join(STATIC_DIR, "index.html"), media_type="text/html")


@router.get("/health")
async def health(state: ServerState = Depends(served_state)):
    extra = _groups(state.engine.snapshot())
    if state.draining:
        return json_response({"status": "shutting_down", **extra}, 503)
    if not state.engine.is_alive:
        return json_response({"status": "dead", "reason": state.engine.dead_reason, **extra}, 503)
    return json_response({"status": "ok", **extra})


@router.get("/metrics")
async def metrics(state: ServerState = Depends(served_state)):
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


def _groups(snap: Any) -> Dict[str, Any]:
    """``{"groups": [...]}``, each engine group's liveness and restarts, for a cluster's snapshot; ``{}``
    for a plain engine's."""
    if not isinstance(snap, ClusterSnapshot):
        return {}
    return {"groups": [{"group": i, "alive": g.alive, "reason": g.dead_reason, "restarts": snap.restarts.get(i, 0)}
                       for i, g in sorted(snap.groups.items())]}


def _group_residency(snap: Any, model_id: str) -> Optional[Dict[int, str]]:
    """The model's residency on each alive group serving it, from each group's own snapshot (None for a
    plain engine's snapshot; ``{}`` for a model no alive group reports)."""
    if not isinstance(snap, ClusterSnapshot):
        return None
    merged = snap.models.get(model_id)
    held = merged.groups if isinstance(merged, ClusterModelSnapshot) else {}
    groups = snap.groups
    return {i: Residency.of(groups[i].models.get(model_id) if i in groups else None).value for i in sorted(held)}


def _model_row(model_id: str, s: Optional[Any], snap: Any) -> Dict[str, Any]:
    """One row of the status page; ``s`` is the model's ``ModelSnapshot`` in ``snap`` (None: not reported)."""
    return {"id": model_id, "base": s.base if s else None, "state": Residency.of(s).value,
            "engine_state": s and s.state, "tier": s and s.tier, "waiting": s.waiting if s else 0,
            "running": s.running if s else 0,
            "last_load": s and s.last_load, "last_offload": s and s.last_offload,
            "weight_format": s and getattr(s, "weight_format", None), "host_bytes": s and getattr(s, "host_bytes", 0),
            "device_bytes": s and getattr(s, "device_bytes", 0),
            "swap_bytes": s and s.last_load and s.last_load.get("bytes"),
            "groups": _group_residency(snap, model_id)}


@router.get("/api/status")
async def status(state: ServerState = Depends(served_state)):
    snap = state.engine.snapshot()
    return json_response({"alive": snap.alive, "dead_reason": snap.dead_reason, "draining": state.draining,
                          "time": time.time(), **_groups(snap),
                          "models": [_model_row(m, snap.models.get(m), snap) for m in state.models]})


@router.get("/api/events")
async def events(since: int = 0, state: ServerState = Depends(served_state)):
    cursor, evs = state.engine.events(since)
    return json_response({"next": cursor, "events": evs})
