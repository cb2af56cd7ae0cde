"""Triton's model repository extension (KServe v2): list, load and unload models while serving.

    POST /v2/repository/index               {"ready"?: bool} -> [{"name", "version", "state", "reason"}]
    POST /v2/repository/models/{name}/load  {"parameters"?: {"config"?: "<JSON of a model entry>"}}
    POST /v2/repository/models/{name}/unload  {"parameters"?: {"unload_dependents"?: bool}} (ignored)

``tritonclient``'s ``get_model_repository_index``, ``load_model(name, config=...)`` and
``unload_model`` work unchanged. A load's ``config`` is a JSON object with the fields of a model entry
of ``computron serve --config`` (``path`` required; ``dtype``, ``max_batch_size``, ``queue_size``,
``task``, ``pinned``, ``priority``); with none, ``name`` is a directory of ``--model-repository``. What
a load of a served name does (replace, or nothing), and the index's states, are ``registry.py``'s.
Triton's file overrides (``parameters["file:..."]``) are refused. Loads answer once the model is
served, unloads once it is drained and freed on every rank.

The API key guards all three. Errors answer ``{"error": "..."}``: 400 a bad body or config (naming the
field), 404 an unknown model, 409 a change of that model already under way, 500 a build that failed on
the workers, 503 while shutting down or once the engine is dead.
"""
from __future__ import annotations

import json
from typing import Any, Dict

from fastapi import APIRouter, Depends, Request

from ..errors import V2Error
from ..http import json_response, read_body
from ..state import ServerState, api_key, served_state

router = APIRouter()

EXTENSION = "model_repository"
"""The name ``GET /v2`` lists among the server's extensions."""


async def _body(request: Request) -> Dict[str, Any]:
    """The JSON object of the request; {} for an empty body (tritonclient's index sends none)."""
    raw = await read_body(request)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise V2Error(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise V2Error(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _parameters(body: Dict[str, Any]) -> Dict[str, Any]:
    params = body.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise V2Error(400, "parameters: must be an object")
    return params


def _config(params: Dict[str, Any]) -> Any:
    """The load's model entry (parsed from ``parameters.config``), or None."""
    files = sorted(k for k in params if k.startswith("file:"))
    if files:
        raise V2Error(400, f"parameters.{files[0]}: file overrides are not supported; give the checkpoint "
                           "directory as parameters.config's path")
    text = params.get("config")
    if text is None:
        return None
    if isinstance(text, dict):  # a client that sends the object itself
        return text
    if not isinstance(text, str):
        raise V2Error(400, "parameters.config: must be a JSON string of a model entry ({\"path\": ...})")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise V2Error(400, f"parameters.config: not valid JSON: {exc}") from None


@router.post("/v2/repository/index", dependencies=[Depends(api_key())])
async def index(request: Request, state: ServerState = Depends(served_state)):
    ready = (await _body(request)).get("ready", False)
    if not isinstance(ready, bool):
        raise V2Error(400, f"ready: must be true or false, got {ready!r}")
    return json_response(await state.registry.index(ready_only=ready))


@router.post("/v2/repository/models/{name:path}/load", dependencies=[Depends(api_key())])
async def load(name: str, request: Request, state: ServerState = Depends(served_state)):
    config = _config(_parameters(await _body(request)))
    state.check_serving()
    outcome = await state.registry.load(name, config)
    return json_response({"name": name, "outcome": outcome})


@router.post("/v2/repository/models/{name:path}/unload", dependencies=[Depends(api_key())])
async def unload(name: str, request: Request, state: ServerState = Depends(served_state)):
    _parameters(await _body(request))  # unload_dependents: accepted; no model here has dependents
    state.check_serving()
    await state.registry.unload(name)
    return json_response({"name": name, "outcome": "unloaded"})
