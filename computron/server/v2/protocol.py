"""The Open Inference Protocol (KServe v2 REST) for encoders, classifiers and ViT: parsing and encoding.

This module only parses and encodes; ``v2/routes.py`` submits what it builds to the
engine (one engine request per row of a v2 batch; the model's batch manager batches
them again).

    GET  /v2/models/{name}         metadata: inputs and outputs with name, datatype, shape
    GET  /v2/models/{name}/ready   200 while the engine serves it, 503 when dead or draining, 404 unknown
    POST /v2/models/{name}/infer   {"id"?, "inputs": [{name, shape, datatype, data}], "parameters"?, "outputs"?}

Inputs, by model:

- text (classification or embedding): ``text`` BYTES ``[n]`` (or ``[n, 1]``), optionally ``text_pair``
  BYTES of the same shape; or ``input_ids`` INT* ``[n, L]`` with optional ``attention_mask`` and
  ``token_type_ids`` of the same shape (a row's trailing masked positions are dropped: padding);
- images: ``pixel_values`` FP* ``[n, C, H, W]`` (preprocessed) or ``image`` BYTES ``[n]``, each element
  the base64 text of encoded image bytes (PNG, JPEG, ...).

Request ``parameters``: ``top_k`` (classifiers: labels per row, best first) and ``normalize``
(embeddings: unit-length vectors). Outputs (``outputs`` in the request picks some; default all):

- sequence and image classification: ``label`` BYTES ``[n, k]``, ``score`` FP32 ``[n, k]`` (the top
  ``k`` = ``top_k`` labels, default 1 for text and 5 for images), ``logits`` FP32 ``[n, num_labels]``;
- token classification: ``label`` BYTES ``[n, T]``, ``score`` FP32 ``[n, T]``, ``logits`` FP32
  ``[n, T, num_labels]`` with ``T`` the longest row (shorter rows padded with "" and 0), ``length``
  INT64 ``[n]``;
- embeddings: ``embedding`` FP32 ``[n, dim]``.

Errors answer ``{"error": "..."}`` (``errors.V2Error``): 400 a bad tensor (``input 'image': row 0: ...``,
naming the input), 404 an unknown model or route, 405 a wrong method, 429 queue full, 503 engine dead,
504 timeout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..building import UnderstandingModel
from ..errors import V2Error
from ..model_kind import ModelKind

DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
             "FP64", "BYTES")
INT_TYPES = ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64")
FLOAT_TYPES = ("FP16", "FP32", "FP64")


# ---- tensors -------------------------------------------------------------------------

def _flatten(data: Any, out: list) -> None:
    if isinstance(data, list):
        for x in data:
            _flatten(x, out)
    else:
        out.append(data)


def _elements_ok(datatype: str, flat: list) -> bool:
    if datatype == "BYTES":
        return all(isinstance(x, str) for x in flat)
    if datatype == "BOOL":
        return all(isinstance(x, bool) for x in flat)
    if datatype in INT_TYPES:
        lo = 0 if datatype.startswith("U") else -(1 << (int(datatype.lstrip("UINT")) - 1))
        bits = int(datatype.lstrip("UINT"))
        hi = (1 << bits) - 1 if datatype.startswith("U") else (1 << (bits - 1)) - 1
        return all(isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi for x in flat)
    return all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in flat)


@dataclass
class Tensor:
    name: str
    datatype: str
    shape: List[int]
    data: list  # flat, row-major

    def rows(self) -> List[list]:
        """The tensor split along its first dimension (each row flat)."""
        n = self.shape[0]
        per = math.prod(self.shape[1:]) if len(self.shape) > 1 else 1
        return [self.data[i * per:(i + 1) * per] for i in range(n)]


def parse_tensor(i: int, raw: Any) -> Tensor:
    """One entry of ``inputs``, checked: name, a v2 datatype, a shape of non-negative ints, and data whose
    element count and element types match them."""
    if not isinstance(raw, dict):
        raise V2Error(400, f"inputs[{i}]: must be an object with name, shape, datatype and data")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise V2Error(400, f"inputs[{i}]: name (a string) is required")
    for k in ("shape", "datatype", "data"):
        if k not in raw:
            raise V2Error(400, f"input {name!r}: {k} is required")
    unknown = sorted(set(raw) - {"name", "shape", "datatype", "data", "parameters"})
    if unknown:
        raise V2Error(400, f"input {name!r}: unknown field {unknown[0]!r}")
    dt = raw["datatype"]
    if dt not in DATATYPES:
        raise V2Error(400, f"input {name!r}: datatype {dt!r} is not a v2 datatype (one of {', '.join(DATATYPES)})")
    shape = raw["shape"]
    if (not isinstance(shape, list) or not shape
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise V2Error(400, f"input {name!r}: shape {shape!r} must be a non-empty list of non-negative integers")
    flat: list = []
    _flatten(raw["data"], flat)
    n = math.prod(shape)
    if len(flat) != n:
        raise V2Error(400, f"input {name!r}: data has {len(flat)} elements; shape {shape} needs {n}")
    if not _elements_ok(dt, flat):
        raise V2Error(400, f"input {name!r}: data elements do not match datatype {dt}")
    return Tensor(name, dt, shape, flat)


# ---- infer requests -------------------------------------------------------------------

_TEXT_INPUTS = ("text", "text_pair", "input_ids", "attention_mask", "token_type_ids")
_IMAGE_INPUTS = ("pixel_values", "image")


def _want(t: Tensor, kinds: Sequence[str], what: str) -> None:
    if t.datatype not in kinds:
        raise V2Error(400, f"input {t.name!r}: datatype {t.datatype} is not accepted; {what}")


def _rows_of_strings(t: Tensor) -> List[str]:
    _want(t, ("BYTES",), "send BYTES")
    if not (len(t.shape) == 1 or (len(t.shape) == 2 and t.shape[1] == 1)):
        raise V2Error(400, f"input {t.name!r}: shape {t.shape} must be [n] or [n, 1]")
    return list(t.data)


def parse_parameters(model: UnderstandingModel, raw: Any) -> Dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise V2Error(400, "parameters: must be an object")
    out = {}
    for k, v in raw.items():
        if k == "top_k" and model.kind in (ModelKind.SEQUENCE_CLS, ModelKind.IMAGE_CLS):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise V2Error(400, f"parameters.top_k={v!r}: must be an integer >= 1")
            out["top_k"] = min(v, len(model.labels))
        elif k == "normalize" and model.kind is ModelKind.EMBEDDING:
            if not isinstance(v, bool):
                raise V2Error(400, f"parameters.normalize={v!r}: must be true or false")
            out["normalize"] = v
        else:
            raise V2Error(400, f"parameters.{k}: not a parameter of model {model.id!r} ({model.kind})")
    return out


def parse_infer(model: UnderstandingModel, body: Any) -> Tuple[List[Dict[str, Any]], List[str], Optional[str]]:
    """An infer request as (engine requests, one per row; output names to answer; request id)."""
    if not isinstance(body, dict):
        raise V2Error(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - {"id", "inputs", "outputs", "parameters"})
    if unknown:
        raise V2Error(400, f"unknown field {unknown[0]!r} (known: id, inputs, outputs, parameters)")
    rid = body.get("id")
    if rid is not None and not isinstance(rid, str):
        raise V2Error(400, "id: must be a string")
    params = parse_parameters(model, body.get("parameters"))
    raw_inputs = body.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise V2Error(400, "inputs: a non-empty list of tensors is required")
    known = _TEXT_INPUTS if model.is_text else _IMAGE_INPUTS
    served = [s["name"] for s in model.input_specs()]
    tensors: Dict[str, Tensor] = {}
    for i, raw in enumerate(raw_inputs):
        t = parse_tensor(i, raw)
        if t.name not in served:
            why = "" if t.name not in known else " (this checkpoint has no tokenizer or image processor for it)"
            raise V2Error(400, f"input {t.name!r}: unknown input of model {model.id!r}{why}; "
                               f"its inputs: {', '.join(served)}")
        if t.name in tensors:
            raise V2Error(400, f"input {t.name!r}: given twice")
        tensors[t.name] = t
    outputs = _parse_outputs(model, body.get("outputs"))
    rows = _text_rows(model, tensors) if model.is_text else _image_rows(model, tensors)
    if not rows:
        raise V2Error(400, f"input {next(iter(tensors))!r}: the batch is empty (first dimension 0)")
    for r in rows:
        r.update(params)
    return rows, outputs, rid


def _parse_outputs(model: UnderstandingModel, raw: Any) -> List[str]:
    names = [s["name"] for s in model.output_specs()]
    if raw is None:
        return names
    if not isinstance(raw, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in raw):
        raise V2Error(400, "outputs: must be a list of {name}")
    want = []
    for o in raw:
        if o["name"] not in names:
            raise V2Error(400, f"output {o['name']!r}: unknown output of model {model.id!r}; "
                               f"its outputs: {', '.join(names)}")
        want.append(o["name"])
    return want


def _text_rows(model: UnderstandingModel, t: Dict[str, Tensor]) -> List[Dict[str, Any]]:
    if "text" not in t and "input_ids" not in t:
        if model.tokenizer is None:
            raise V2Error(400, "input 'input_ids': missing (this checkpoint has no tokenizer: send input_ids)")
        raise V2Error(400, "input 'text': missing; send text (or input_ids)")
    if "text" in t and "input_ids" in t:
        raise V2Error(400, "inputs 'text' and 'input_ids': send one of them, not both")
    if "text" in t:
        for k in ("attention_mask", "token_type_ids"):
            if k in t:
                raise V2Error(400, f"input {k!r}: goes with input_ids, not with text")
        texts = _rows_of_strings(t["text"])
        rows = [{"text": s} for s in texts]
        if "text_pair" in t:
            pairs = _rows_of_strings(t["text_pair"])
            if len(pairs) != len(texts):
                raise V2Error(400, f"input 'text_pair': {len(pairs)} rows; 'text' has {len(texts)}")
            for r, p in zip(rows, pairs):
                r["text_pair"] = p
        for r in rows:
            for k in ("text", "text_pair"):
                if k in r and not r[k]:
                    raise V2Error(400, f"input {k!r}: an empty string")
        return rows
    if "text_pair" in t:
        raise V2Error(400, "input 'text_pair': goes with text, not with input_ids")
    ids = t["input_ids"]
    _want(ids, INT_TYPES, "send an integer datatype (INT64)")
    if len(ids.shape) == 1:
        ids.shape = [1, ids.shape[0]]  # one sequence
    if len(ids.shape) != 2:
        raise V2Error(400, f"input 'input_ids': shape {ids.shape} must be [n, sequence length]")
    for k in ("attention_mask", "token_type_ids"):
        if k in t:
            x = t[k]
            _want(x, INT_TYPES, "send an integer datatype (INT64)")
            if len(x.shape) == 1:
                x.shape = [1, x.shape[0]]
            if x.shape != ids.shape:
                raise V2Error(400, f"input {k!r}: shape {x.shape} must equal input_ids' shape {ids.shape}")
    if ids.shape[1] == 0:
        raise V2Error(400, "input 'input_ids': sequences are empty (second dimension 0)")
    masks = t["attention_mask"].rows() if "attention_mask" in t else None
    types = t["token_type_ids"].rows() if "token_type_ids" in t else None
    rows = []
    for i, row in enumerate(ids.rows()):
        r: Dict[str, Any] = {"input_ids": row}
        n = len(row)
        if masks is not None:
            m = masks[i]
            if any(v not in (0, 1) for v in m):
                raise V2Error(400, "input 'attention_mask': values must be 0 or 1")
            n = max((j + 1 for j, v in enumerate(m) if v), default=0)
            if n == 0:
                raise V2Error(400, f"input 'attention_mask': row {i} hides every token")
            r["input_ids"], r["attention_mask"] = row[:n], m[:n]
        if types is not None:
            r["token_type_ids"] = types[i][:n]
        rows.append(r)
    return rows


def _image_rows(model: UnderstandingModel, t: Dict[str, Tensor]) -> List[Dict[str, Any]]:
    if ("pixel_values" in t) == ("image" in t):
        if "pixel_values" in t:
            raise V2Error(400, "inputs 'pixel_values' and 'image': send one of them, not both")
        raise V2Error(400, "input 'pixel_values': missing; send pixel_values"
                      + (" or image" if model.batch_manager.processor is not None else ""))
    if "image" in t:
        return [{"image": s} for s in _rows_of_strings(t["image"])]
    pv = t["pixel_values"]
    _want(pv, FLOAT_TYPES + INT_TYPES, "send FP32")
    want = list(model.batch_manager.shape)
    if len(pv.shape) == 3:
        pv.shape = [1] + pv.shape
    if len(pv.shape) != 4 or pv.shape[1:] != want:
        raise V2Error(400, f"input 'pixel_values': shape {pv.shape} must be [n, {', '.join(map(str, want))}]")
    c, h, w = want
    out = []
    for row in pv.rows():
        out.append({"pixel_values": [[row[(ci * h + y) * w:(ci * h + y + 1) * w] for y in range(h)]
                                     for ci in range(c)]})
    return out


# ---- infer answers -------------------------------------------------------------------

def _out(name: str, datatype: str, shape: List[int], data: list) -> Dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


def encode_outputs(model: UnderstandingModel, answers: List[Dict[str, Any]], want: Sequence[str],
                   rid: Optional[str]) -> Dict[str, Any]:
    n = len(answers)
    outs: Dict[str, Dict[str, Any]] = {}
    if model.kind is ModelKind.EMBEDDING:
        dim = len(answers[0]["embedding"]) if answers else 0
        outs["embedding"] = _out("embedding", "FP32", [n, dim], [x for a in answers for x in a["embedding"]])
    elif model.kind is ModelKind.TOKEN_CLS:
        width = max(len(a["labels"]) for a in answers)
        c = len(model.labels)
        labels, scores, logits = [], [], []
        for a in answers:
            pad = width - len(a["labels"])
            labels += a["labels"] + [""] * pad
            scores += a["scores"] + [0.0] * pad
            logits += [x for row in a["logits"] for x in row] + [0.0] * (pad * c)
        outs["label"] = _out("label", "BYTES", [n, width], labels)
        outs["score"] = _out("score", "FP32", [n, width], scores)
        outs["logits"] = _out("logits", "FP32", [n, width, c], logits)
        outs["length"] = _out("length", "INT64", [n], [len(a["labels"]) for a in answers])
    else:
        k = max(len(a["labels"]) for a in answers)  # every row asked for the same top_k
        outs["label"] = _out("label", "BYTES", [n, k], [x["label"] for a in answers for x in a["labels"]])
        outs["score"] = _out("score", "FP32", [n, k], [x["score"] for a in answers for x in a["labels"]])
        outs["logits"] = _out("logits", "FP32", [n, len(model.labels)], [x for a in answers for x in a["logits"]])
    body = {"model_name": model.id, "model_version": "1", "outputs": [outs[w] for w in want]}
    if rid is not None:
        body["id"] = rid
    return body
