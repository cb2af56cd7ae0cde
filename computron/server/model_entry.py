"""The ``models`` entries of ``computron serve``'s config (``config.py``), checked one by one: a checkpoint
(``path``: a causal LM, an encoder or a ViT model, whose kind is read from its ``config.json``; or a ``.gguf``
file, converted here into a cached checkpoint directory; or a Hugging Face hub id, ``org/name[@rev][:FILE.gguf]``,
resolved here through huggingface_hub's cache into one of those, ``hub.py``) or a LoRA
adapter (``base`` and ``adapter``) served on a causal LM of the same list. The registry checks the
entries given while serving (the repository API, ``/v1/load_lora_adapter``) with the same functions.

Every error raises ``ConfigError`` naming the field (``models[1].path``) or the path.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Container, Dict, List, Optional

from ..errors import GGUFError, HubError
from ..loading import DTYPES, has_tokenizer
from ..sched.keep_alive import KeepAliveError, parse_keep_alive
from .model_kind import ModelKind

TOOL_CALL_PARSERS = ("hermes", "qwen", "llama3_json", "llama3")
"""The names ``tool_call_parser`` takes (``openai.tool_parsers.PARSERS``)."""

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
"""A model id: letters, digits and ._:/-, starting with a letter or a digit."""


class ConfigError(ValueError):
    """A bad config file or flag; the message names the field or the path."""


@dataclass
class ModelEntry:
    id: str
    """Name requests use in their `model` field."""
    path: Optional[str] = None
    """Local checkpoint directory (config.json, weights, tokenizer files); None for an adapter. A hub id
    (``org/name``, ``org/name@rev``, ``org/name:FILE.gguf``) is resolved by validation into the cached
    snapshot or file (``hub.py``), which sets ``hub`` to the id. A ``.gguf`` file is converted by validation
    (once, cached: ``storage/gguf.py``), which sets ``path`` to the converted directory and ``gguf`` to the file."""
    dtype: Optional[str] = None
    """float32, float16 or bfloat16; None keeps the checkpoint's dtype."""
    quantization: Optional[str] = None
    """``int8``, ``int4`` or ``int4-gG``: the layers' Linears quantized at load (``ModelConfig.quantization``)."""
    max_batch_size: Optional[int] = None
    """Sequences of this model batched together; None takes engine.max_batch_size."""
    queue_size: Optional[int] = None
    """Waiting requests of this model before the server answers 429; None takes engine.queue_size."""
    task: Optional[str] = None
    """Encoders and ViT only: 'embedding' or 'classification'; None picks classification when the checkpoint
    has a classification head, else embedding."""
    pinned: bool = False
    """Never evict this model once it is loaded (``ModelConfig.pinned``)."""
    priority: int = 0
    """Higher goes first when models wait for a slot, and is evicted last (``ModelConfig.priority``)."""
    keep_alive: Any = None
    """How long it stays resident once idle: '5m', '30s', seconds, 0, -1 (``ModelConfig.keep_alive``); None:
    the engine's. Read into seconds by validation."""
    base: Optional[str] = None
    """A LoRA adapter's: the id of the served causal LM whose weights and tokenizer it runs on."""
    adapter: Optional[str] = None
    """A PEFT LoRA adapter directory (``adapter_config.json``, ``adapter_model.safetensors``), served on
    ``base`` instead of a checkpoint of its own (``ModelConfig.adapter``); made absolute by validation."""
    tool_call_parser: Optional[str] = None
    """A causal LM's: how its answers' tool calls are read (``hermes``/``qwen``, ``llama3_json``/``llama3``);
    None: what its chat template shows (``openai.tool_parsers.detect``), else ``hermes``."""
    strict_fields: Optional[bool] = None
    """True: this model's requests with a field the server does not know answer 400; False: such fields are
    ignored (logged once); None: ``server.strict_fields`` decides."""
    kind: Optional[ModelKind] = None
    """Set by validation: GENERATION for a causal LM, else the kind of encoder or ViT model."""
    gguf: Optional[str] = None
    """Set by validation: the ``.gguf`` file ``path`` named, when it named one (``path`` is then its
    converted checkpoint directory)."""
    hub: Optional[str] = None
    """Set by validation: the Hugging Face hub id ``path`` named, when it named one (``path`` is then the local
    snapshot directory or GGUF file it resolved to)."""


def _check_type(name: str, value: Any, kind, allow_none: bool = False):
    if value is None and allow_none:
        return
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{name}={value!r}: must be an integer")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{name}={value!r}: must be a number")
    if kind is str and not isinstance(value, str):
        raise ConfigError(f"{name}={value!r}: must be a string")


TASKS = ("embedding", "classification")


def encoder_model_types() -> set:
    """transformers ``model_type`` values served by the encoder runner (bert, roberta, xlm-roberta, vit)."""
    from ..models.families import ENCODER, model_types
    return set(model_types(ENCODER))


def checkpoint_info(path: str) -> Dict[str, Any]:
    """``model_type`` and ``architectures`` of a checkpoint's config.json ({} when unreadable)."""
    import json
    try:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def understanding_kind(name: str, path: str, task: Optional[str]) -> ModelKind:
    """GENERATION for a checkpoint outside the encoder families, else the kind its batch manager serves."""
    info = checkpoint_info(path)
    model_type = info.get("model_type")
    archs = [a for a in (info.get("architectures") or []) if isinstance(a, str)]
    if model_type not in encoder_model_types():
        if task is not None:
            raise ConfigError(f"{name.rsplit('.', 1)[0]}.task={task!r}: only encoder and ViT checkpoints "
                              f"(bert, roberta, xlm-roberta, vit) take a task; {path!r} is {model_type!r}")
        return ModelKind.GENERATION
    where = f"{name.rsplit('.', 1)[0]}.task"
    if task is not None and task not in TASKS:
        raise ConfigError(f"{where}={task!r}: must be one of {list(TASKS)}")
    if model_type == "vit":
        if not any(a.endswith("ForImageClassification") for a in archs):
            raise ConfigError(f"{name}: ViT checkpoint {path!r} has no image classification head "
                              f"(architectures={archs!r}); only ViT classifiers are served")
        if task == "embedding":
            raise ConfigError(f"{where}='embedding': ViT checkpoints serve image classification only")
        return ModelKind.IMAGE_CLS
    head = (ModelKind.TOKEN_CLS if any(a.endswith("ForTokenClassification") for a in archs) else
            ModelKind.SEQUENCE_CLS if any(a.endswith("ForSequenceClassification") for a in archs) else None)
    if task == "classification" and head is None:
        raise ConfigError(f"{where}='classification': {path!r} has no sequence or token classification head "
                          f"(architectures={archs!r})")
    if task == "embedding" or head is None:
        return ModelKind.EMBEDDING
    return head


def check_checkpoint(name: str, path: Any) -> str:
    """A checkpoint directory with a config.json and tokenizer files, or a ConfigError naming it. Encoder
    and ViT checkpoints need no tokenizer (then they take input_ids or pixel values). A ``.gguf`` file
    passes when it begins as a GGUF file does (``parse_model`` converts it)."""
    _check_type(name, path, str)
    from ..storage import gguf
    if gguf.is_gguf(path):
        try:
            return gguf.check_header(path)
        except GGUFError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    if not os.path.isdir(path):
        raise ConfigError(f"{name}: checkpoint directory {path!r} does not exist")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{name}: {path!r} has no config.json (not a transformers checkpoint)")
    if checkpoint_info(path).get("model_type") not in encoder_model_types() and not has_tokenizer(path):
        raise ConfigError(f"{name}: {path!r} has no tokenizer files (tokenizer.json or tokenizer_config.json)")
    return path


def parse_model(m: Any, where: str, taken: Container[str] = ()) -> ModelEntry:
    """One model entry (a mapping with the fields of ``ModelEntry``) checked, its path made absolute and its
    kind read from the checkpoint; ``where`` names it in errors (``models[1]``). An entry with ``base`` and
    ``adapter`` is a LoRA adapter (``_parse_adapter``). Reads ``config.json``: not on an event loop."""
    if not isinstance(m, dict):
        raise ConfigError(f"{where}: must be a mapping with id and path (or id, base and adapter), got {m!r}")
    known = {f.name for f in dataclasses.fields(ModelEntry)} - {"kind", "gguf", "hub"}
    unknown = sorted(set(m) - known)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown field (known: {sorted(known)})")
    if "base" in m or "adapter" in m:
        return _parse_adapter(m, where, taken)
    for req in ("id", "path"):
        if req not in m:
            raise ConfigError(f"{where}.{req}: missing")
    entry = ModelEntry(**m)
    _check_id(entry.id, where, taken)
    entry.path = _from_hub(where, entry)
    entry.path = os.path.abspath(os.path.expanduser(check_checkpoint(f"{where}.path", entry.path)))
    if entry.dtype is not None and entry.dtype not in DTYPES:
        raise ConfigError(f"{where}.dtype={entry.dtype!r}: must be one of {list(DTYPES)}")
    if entry.quantization is not None:
        from ..quant.names import quantization_kind
        try:
            quantization_kind(entry.quantization)
        except ValueError as exc:
            raise ConfigError(f"{where}.{exc}") from None
        if entry.path.lower().endswith(".gguf"):
            raise ConfigError(f"{where}.quantization={entry.quantization!r}: a .gguf file is served at the "
                              "quantization it holds")
    if entry.path.lower().endswith(".gguf"):  # converted once, in the served dtype; then a checkpoint like any
        entry.gguf, entry.path = entry.path, check_checkpoint(f"{where}.path", _converted(where, entry))
    _check_type(f"{where}.task", entry.task, str, allow_none=True)
    entry.kind = understanding_kind(f"{where}.path", entry.path, entry.task)
    for k in ("max_batch_size", "queue_size"):
        v = getattr(entry, k)
        _check_type(f"{where}.{k}", v, int, allow_none=True)
        if v is not None and v < (1 if k == "max_batch_size" else 0):
            raise ConfigError(f"{where}.{k}={v!r}: must be >= {1 if k == 'max_batch_size' else 0}")
    if not isinstance(entry.pinned, bool):
        raise ConfigError(f"{where}.pinned={entry.pinned!r}: must be true or false")
    _check_type(f"{where}.priority", entry.priority, int)
    if entry.keep_alive is not None:
        try:
            entry.keep_alive = parse_keep_alive(entry.keep_alive, f"{where}.keep_alive")
        except KeepAliveError as exc:
            raise ConfigError(str(exc)) from None
    if entry.tool_call_parser is not None and entry.tool_call_parser not in TOOL_CALL_PARSERS:
        raise ConfigError(f"{where}.tool_call_parser={entry.tool_call_parser!r}: must be one of "
                          f"{', '.join(TOOL_CALL_PARSERS)}")
    if entry.strict_fields is not None and not isinstance(entry.strict_fields, bool):
        raise ConfigError(f"{where}.strict_fields={entry.strict_fields!r}: must be true or false")
    return entry


def _from_hub(where: str, entry: ModelEntry) -> Any:
    """The local path of the entry's ``path`` when it is a hub id (``hub.resolve``; ``entry.hub`` set), else
    ``path`` as it is."""
    from .. import hub
    if not hub.is_hub_id(entry.path):
        return entry.path
    try:
        local = hub.resolve(entry.path)
    except HubError as exc:
        raise ConfigError(f"{where}.path: {exc}") from None
    entry.hub = entry.path
    return local


def _converted(where: str, entry: ModelEntry) -> str:
    """The checkpoint directory of the entry's ``.gguf`` file in its dtype (``storage.gguf.convert``)."""
    from ..storage import gguf
    try:
        return gguf.convert(entry.path, entry.dtype)
    except GGUFError as exc:
        raise ConfigError(f"{where}.path: {exc}") from None


def _check_id(model_id: Any, where: str, taken: Container[str]) -> None:
    _check_type(f"{where}.id", model_id, str)
    if not _ID.match(model_id):
        raise ConfigError(f"{where}.id={model_id!r}: must be letters, digits and ._:/- ")
    if model_id in taken:
        raise ConfigError(f"{where}.id={model_id!r}: duplicate model id")


ADAPTER_FIELDS = ("id", "base", "adapter")
"""The fields of an adapter entry: it runs on its base's weights, tokenizer, batch bound and queue."""


def _parse_adapter(m: Dict[str, Any], where: str, taken: Container[str]) -> ModelEntry:
    """A LoRA adapter entry: ``id``, ``base`` (a causal LM's id) and ``adapter`` (its directory, made
    absolute). Its files are checked against the base's checkpoint when it is built (``building.py``)."""
    for req in ADAPTER_FIELDS:
        if req not in m:
            raise ConfigError(f"{where}.{req}: missing (a LoRA adapter entry has id, base and adapter)")
    extra = sorted(set(m) - set(ADAPTER_FIELDS))
    if extra:
        why = ("an adapter has no checkpoint of its own: it runs on its base's" if extra[0] == "path" else
               "an adapter runs on its base's weights, batch bound and queue: set it on the base")
        raise ConfigError(f"{where}.{extra[0]}: not a field of a LoRA adapter entry (id, base, adapter); {why}")
    entry = ModelEntry(**m)
    _check_id(entry.id, where, taken)
    _check_type(f"{where}.base", entry.base, str)
    if not _ID.match(entry.base):
        raise ConfigError(f"{where}.base={entry.base!r}: must be a model id (letters, digits and ._:/-)")
    if entry.base == entry.id:
        raise ConfigError(f"{where}.base={entry.base!r}: an adapter runs on another model, not on itself")
    _check_type(f"{where}.adapter", entry.adapter, str)
    if not entry.adapter.strip():
        raise ConfigError(f"{where}.adapter: must be the adapter's directory")
    entry.adapter = os.path.abspath(os.path.expanduser(entry.adapter))
    entry.kind = ModelKind.GENERATION
    return entry


def parse_models(raw: Any, allow_empty: bool = False) -> List[ModelEntry]:
    """Every entry of ``models`` (``parse_model``); ``allow_empty`` when a model repository may supply them.
    An adapter's base must be a causal LM of the same list (adapters are added once it serves)."""
    if raw is None and allow_empty:
        return []
    if not isinstance(raw, list) or not (raw or allow_empty):
        raise ConfigError("models: must be a non-empty list of {id, path, ...}")
    out: List[ModelEntry] = []
    seen: set = set()
    for i, m in enumerate(raw):
        entry = parse_model(m, f"models[{i}]", seen)
        seen.add(entry.id)
        out.append(entry)
    by_id = {e.id: e for e in out}
    for i, e in enumerate(out):
        if e.adapter is None:
            continue
        base = by_id.get(e.base)
        where = f"models[{i}].base={e.base!r}"
        if base is None:
            models = ", ".join(x.id for x in out if x.adapter is None) or "none"
            raise ConfigError(f"{where}: not a model of this file (its models: {models}); an adapter is "
                              "served on a causal LM given beside it")
        if base.adapter is not None:
            raise ConfigError(f"{where}: an adapter itself; adapters run on a model's weights")
        if base.kind is not ModelKind.GENERATION:
            raise ConfigError(f"{where}: a {base.kind} model; LoRA adapters run on causal LMs")
    return out


def model_entries_from_paths(paths: List[str], tasks: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """``ckpt/a`` serves as model ``a`` (``ckpt/b.gguf`` as ``b``, the hub id ``org/c@rev`` as ``c``,
    ``org/d:e.gguf`` as ``e``); ``name=ckpt/a`` names it. ``tasks`` (``--task ID=TASK``) sets an encoder's task."""
    from .. import hub
    out = []
    for p in paths:
        mid, sep, path = p.partition("=")
        if not sep and hub.is_hub_id(p):
            mid, path = hub.parse(p).model_id, p
        elif not sep:
            mid, path = os.path.basename(os.path.normpath(p)), p
            mid = mid[:-len(".gguf")] if mid.lower().endswith(".gguf") and len(mid) > len(".gguf") else mid
        out.append({"id": mid, "path": path})
    ids = {m["id"]: m for m in out}
    for t in tasks or []:
        mid, sep, task = t.partition("=")
        if not sep or mid not in ids:
            raise ConfigError(f"--task {t!r}: must be ID=TASK naming a model given on the command line "
                              f"({', '.join(ids)})")
        ids[mid]["task"] = task
    return out
