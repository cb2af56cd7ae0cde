"""What the OpenAI routes read of a served model's config: its tool-call parser, its field policy, and its
``/v1/models`` object (which says both, and whether it has a chat template).

A LoRA adapter takes its base's settings (its entry has none of its own) and its base's tokenizer.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from ..residency import Residency
from ..state import ServedModel, ServerState
from .tool_parsers import DEFAULT_PARSER, PARSERS, ToolCallParser, detect

UNLOADED = "unloaded"
"""The ``state`` of a ``--model-repository`` model no request has loaded yet."""


def _entry_of(state: ServerState, served: ServedModel):
    if served.base is not None:
        base = state.models.get(served.base)
        return base.entry if base is not None else None
    return served.entry


def tool_parser_name(state: ServerState, served: ServedModel) -> Optional[str]:
    """The model's ``tool_call_parser``, else what its chat template shows, else ``hermes``; None for a
    model that does not generate text."""
    if served.text is None:
        return None
    entry = _entry_of(state, served)
    name = getattr(entry, "tool_call_parser", None)
    return name or detect(getattr(served.text, "chat_template", None)) or DEFAULT_PARSER


def tool_parser(state: ServerState, served: ServedModel) -> ToolCallParser:
    return PARSERS[tool_parser_name(state, served) or DEFAULT_PARSER]()


def strict_fields(state: ServerState, served: Optional[ServedModel]) -> Optional[bool]:
    """The model's ``strict_fields`` (None: the server's setting decides)."""
    return None if served is None else getattr(_entry_of(state, served), "strict_fields", None)


def model_object(state: ServerState, model_id: str, path: str, snap) -> Dict[str, Any]:
    """OpenAI's model object, with the model's ``state`` (an adapter's is its base's), its checkpoint or
    adapter directory as ``root``, an adapter's base as ``parent``, and for a text generator ``chat_template``
    (whether it has one: chat needs it) and ``tool_call_parser`` (how its tool calls are read)."""
    served = state.models.get(model_id)
    if served is not None:
        where = Residency.of(snap.models.get(model_id)).openai_state
    else:
        where = Residency.LOADING.openai_state if state.registry.loading(model_id) else UNLOADED
    out: Dict[str, Any] = {"id": model_id, "object": "model", "created": int(state.started), "owned_by": "computron",
                           "state": where, "root": path, "parent": served.base if served else None}
    s = snap.models.get(model_id) if served is not None else None
    if s is not None and getattr(s, "weight_format", ""):  # the bytes it holds, by rank holding the most
        last = s.last_load or {}
        out["weights"] = {"format": s.weight_format, "host_bytes": s.host_bytes, "device_bytes": s.device_bytes,
                          "swap_bytes": last.get("bytes")}
    if served is not None and served.text is not None:
        out["max_model_len"] = served.max_positions
        out["chat_template"] = bool(getattr(served.text, "has_chat_template", False))
        out["tool_call_parser"] = tool_parser_name(state, served)
    return out
