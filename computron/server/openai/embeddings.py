"""OpenAI's ``/v1/embeddings`` shapes for embedding models: the request as engine rows, the answer's data."""
from __future__ import annotations

import base64
import struct
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

from ..errors import bad

if TYPE_CHECKING:
    from ..building import UnderstandingModel

EMBEDDING_FIELDS = {"model", "input", "encoding_format", "user", "dimensions"}
"""The fields of an embeddings request (others: the server's ``FieldPolicy``)."""


def parse_embeddings(model: UnderstandingModel, body: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], str]:
    """OpenAI's embeddings request as (engine requests, encoding format); 400 naming the field at fault.
    The engine checks and tokenizes each row (``PayloadError`` naming its row)."""
    dims = body.get("dimensions")
    if dims is not None and dims != model.hidden_size:
        raise bad("dimensions", f"dimensions={dims!r}: model {model.id!r} answers {model.hidden_size} "
                                "dimensions only")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad("encoding_format", f"encoding_format={fmt!r}: must be 'float' or 'base64'")
    inp = body.get("input")

    def is_ids(x):
        return isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    if isinstance(inp, str) or is_ids(inp):
        items = [inp]
    elif isinstance(inp, list) and inp and all(isinstance(x, str) or is_ids(x) for x in inp):
        items = inp
    else:
        raise bad("input", "input: must be a non-empty string, a list of strings, a list of token ids "
                           "or a list of lists of token ids")
    rows = []
    for i, x in enumerate(items):
        if isinstance(x, str):
            if not x:
                raise bad("input", f"input[{i}]: an empty string")
            rows.append({"text": x})
        else:
            rows.append({"input_ids": list(x)})
    return rows, fmt


def embedding_data(vectors: List[List[float]], fmt: str) -> List[Dict[str, Any]]:
    out = []
    for i, v in enumerate(vectors):
        emb: Any = v
        if fmt == "base64":  # little-endian float32, as OpenAI sends them
            emb = base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
        out.append({"object": "embedding", "index": i, "embedding": emb})
    return out
