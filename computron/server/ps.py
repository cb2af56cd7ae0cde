"""``GET /api/ps``: what ``computron ps`` prints (Ollama's ``/api/ps``, for every served model, loaded or not).

One row per served model, in the order the server serves them::

    {"models": [{"name": "opt-a", "state": "resident", "host_bytes": 1310720, "device_bytes": 1441792,
                 "last_used": 1765150000.5, "keep_alive": "5m", "keep_alive_s": 300.0,
                 "expires_at": 1765150300.5}, ...], "time": 1765150012.0}

``state`` is the status page's residency (``residency.py``); ``host_bytes`` its largest shard in host memory,
``device_bytes`` what it holds on each device while resident (its shard and KV reserve); ``last_used`` when
its last request was answered (wall-clock seconds; null: not yet); ``keep_alive`` how long it stays once
idle (``forever``: while memory allows); ``expires_at`` when it is offloaded if nothing comes for it (null
while it has requests, is not resident, or is kept for ever). A LoRA adapter's row carries its ``base``.
Guarded by the API key like ``/v1/models``.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Optional

from fastapi import APIRouter, Depends

from ..sched.keep_alive import describe
from .http import json_response
from .residency import Residency
from .state import ServerState, api_key, served_state

router = APIRouter()


def ps_row(model_id: str, s: Optional[Any]) -> Dict[str, Any]:
    """One model's row; ``s``: its ``ModelSnapshot`` (None: the engine does not report it)."""
    keep = getattr(s, "keep_alive_s", -1.0)
    return {"name": model_id, "base": getattr(s, "base", None), "state": Residency.of(s).value,
            "host_bytes": getattr(s, "host_bytes", 0), "device_bytes": getattr(s, "device_bytes", 0),
            "last_used": getattr(s, "last_used", None), "keep_alive": describe(keep), "keep_alive_s": keep,
            "expires_at": getattr(s, "keep_until", None)}


@router.get("/api/ps", dependencies=[Depends(api_key())])
async def ps(state: ServerState = Depends(served_state)):
    snap = state.engine.snapshot()
    return json_response({"time": time.time(), "models": [ps_row(m, snap.models.get(m)) for m in state.models]})
