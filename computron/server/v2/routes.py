"""The Open Inference Protocol's routes (KServe v2 REST): the ``/v2`` router.

    GET  /v2                     server metadata          GET /v2/health/live, /v2/health/ready
    GET  /v2/models/{name}       model metadata           GET /v2/models/{name}/ready
    POST /v2/models/{name}/infer (each also under /versions/{v}/, v the model's current version)

Only encoder and ViT models are v2 models: a causal LM's metadata and infer answer 404 here (it lives
under /v1), but its readiness answers, as Triton's repository API (``repository.py``) loads it too.
An infer naming a model of ``--model-repository`` not loaded yet waits while it loads. The version
is the engine's: 1, then one more at each replace. ``/v2/models/*`` needs the API key when keys are
set; ``/v2`` and ``/v2/health/*`` do not. Every answer, errors included, is in v2's shape
(``errors.to_v2``; ``app.py``'s handlers for what a route raises).
"""
from __future__ import annotations

import logging
from typing import Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..errors import ClientGone, V2Error, to_v2
from ..http import json_response, read_json
from ..model_kind import ModelKind
from ..state import Call, ServedModel, ServerState, api_key, served_state
from .protocol import encode_outputs, parse_infer
from .repository import EXTENSION

log = logging.getLogger("computron.server")

router = APIRouter()


def _v2_model(state: ServerState, name: str) -> ServedModel:
    """An encoder or ViT model, or 404 naming the v2 models."""
    m = state.models.get(name)
    if m is None or m.kind is ModelKind.GENERATION:
        v2_ids = sorted(i for i, s in state.models.items() if s.kind is not ModelKind.GENERATION)
        if m is not None:
            raise V2Error(404, f"model {name!r} is a text-generation model, served under /v1 only; "
                               f"v2 models: {v2_ids}")
        raise V2Error(404, f"unknown model {name!r}; v2 models: {v2_ids}")
    return m


def _version(state: ServerState, name: str) -> str:
    """The engine's version of a served model ('1' until it is replaced)."""
    return str(getattr(state.engine.snapshot().models.get(name), "version", 1) or 1)


def _check_version(state: ServerState, name: str, version: Optional[str]) -> None:
    if version is not None and version != _version(state, name):
        raise V2Error(404, f"model {name!r} has no version {version!r}; versions: [{_version(state, name)!r}]")


@router.get("/v2")
async def server_metadata():
    return json_response({"name": "computron", "version": "1", "extensions": [EXTENSION]})


@router.get("/v2/health/live")
async def live():
    return json_response({"live": True})


@router.get("/v2/health/ready")
async def ready(state: ServerState = Depends(served_state)):
    ok = state.engine.is_alive and not state.draining
    return json_response({"ready": ok}, 200 if ok else 503)


@router.get("/v2/models/{name:path}/ready", dependencies=[Depends(api_key())])  # second: the versions route first
@router.get("/v2/models/{name:path}/versions/{version}/ready", dependencies=[Depends(api_key())])
async def model_ready(name: str, version: Optional[str] = None, state: ServerState = Depends(served_state)):
    if name not in state.models:
        raise V2Error(404, f"unknown model {name!r} (not loaded); served: {sorted(state.models)}")
    _check_version(state, name, version)
    state.check_serving()
    return json_response({"name": name, "ready": True})


@router.get("/v2/models/{name:path}", dependencies=[Depends(api_key())])  # second: the versions route first
@router.get("/v2/models/{name:path}/versions/{version}", dependencies=[Depends(api_key())])
async def model_metadata(name: str, version: Optional[str] = None, state: ServerState = Depends(served_state)):
    m = _v2_model(state, name)
    _check_version(state, name, version)
    return json_response({**m.understanding.metadata(), "versions": [_version(state, name)]})


@router.post("/v2/models/{name:path}/infer", dependencies=[Depends(api_key("v2_infer"))])
@router.post("/v2/models/{name:path}/versions/{version}/infer", dependencies=[Depends(api_key("v2_infer"))])
async def infer(name: str, request: Request, version: Optional[str] = None,
                state: ServerState = Depends(served_state)) -> Response:
    call = Call(state, "v2_infer")
    try:
        body = await read_json(request)
        state.refuse_early(call, name)
        if name not in state.models and state.registry.can_load(name):
            await state.resolve(request, name)  # a repository model's first request: load it
        served = _v2_model(state, name)
        call.label = name
        _check_version(state, name, version)
        m = served.understanding
        rows, want, rid = parse_infer(m, body)
        state.admit(served)
        call.arrived()  # its rows reach the engine as the next thing this loop runs
        out = encode_outputs(m, await state.submit_rows(request, name, rows), want, rid)
    except ClientGone:
        return call.gone()
    except Exception as exc:  # noqa: BLE001 - every failure answers in the v2 shape
        return call.failed(to_v2(exc))
    finally:
        call.arrived()
    state.metrics.observe_e2e(name, call.answered(f"{len(rows)} rows"))
    return json_response(out)
