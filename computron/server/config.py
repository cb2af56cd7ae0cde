"""`computron serve` configuration: a YAML file or command-line flags, validated before any worker starts.

A config file::

    models:
      - id: opt-a                # the `model` field of requests
        path: ckpt/opt-a         # a local checkpoint directory with its tokenizer
        dtype: float16           # optional: float32 | float16 | bfloat16 (default: the checkpoint's)
        max_batch_size: 8        # optional: sequences batched together for this model
        queue_size: 64           # optional: waiting requests before 429 (default: engine.queue_size)
        pinned: false            # optional: never evicted once loaded
        priority: 0              # optional: higher goes first for a slot and is evicted last
      - id: embed                # an encoder (bert, roberta, xlm-roberta) or ViT checkpoint is served over
        path: ckpt/bert-base     # the v2 protocol (/v2/models/embed/infer), embeddings also at /v1/embeddings
        task: embedding          # optional: embedding | classification (default: classification when the
                                 # checkpoint has a classification head, else embedding)
    engine:                      # any EngineConfig field, plus tp and pp
      tp: 2
      pp: 1
      max_loaded: 1
    server:
      host: 127.0.0.1
      port: 8000
      api_keys: [sk-local-1]     # optional; then /v1/*, /v2/models/*, /v2/repository/* need `Bearer <key>`
      request_timeout_s: 600     # a request over this answers 504
      drain_s: 30                # SIGTERM/SIGINT: how long in-flight requests may take to finish
                                 # (old name, still read: shutdown_grace_s)
      model_repository: models/  # optional: each subdirectory with a config.json is servable by its name,
                                 # loaded on its first request (then `models` may be empty)
      repository_poll_s: 10      # optional: rescan it this often (new directories, removed ones unloaded)

Every error raises ``ConfigError`` naming the field (``models[1].path``) or the path.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Container, Dict, List, Optional

from ..config import EngineConfig
from ..loading import DTYPES, has_tokenizer  # DTYPES: also cli.py's --dtype choices
from .model_kind import ModelKind
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")


class ConfigError(ValueError):
    """A bad config file or flag; the message names the field or the path."""


@dataclass
class ModelEntry:
    id: str
    """Name requests use in their `model` field."""
    path: str
    """Local checkpoint directory (config.json, weights, tokenizer files)."""
    dtype: Optional[str] = None
    """float32, float16 or bfloat16; None keeps the checkpoint's dtype."""
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
    kind: Optional[ModelKind] = None
    """Set by validation: GENERATION for a causal LM, else the kind of encoder or ViT model."""


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on (0 picks a free one and logs it); bound before any worker starts."""
    api_keys: List[str] = field(default_factory=list)
    """Accepted bearer tokens for /v1/*, /v2/models/* and /v2/repository/* (not /health, /metrics, the status
    page, /v2 and /v2/health/*); empty means no authentication."""
    request_timeout_s: float = 600.0
    """A request still unanswered after this long fails with 504."""
    drain_s: float = 30.0
    """On SIGTERM/SIGINT, how long in-flight requests may run before they are cancelled (the HTTP drain;
    ``EngineConfig.shutdown_grace_s`` is the workers' own). The YAML key ``shutdown_grace_s`` is read as
    its old name."""
    default_max_tokens: int = 256
    """max_tokens of a chat completion that names none (capped by the model's positions)."""
    log_level: str = "info"
    """Server log level: debug logs every request's model, status and latency."""
    model_repository: Optional[str] = None
    """A directory whose subdirectories with a ``config.json`` are servable by their names (Triton's model
    repository, Ollama's load on first request): the first request for one waits while it is added, and
    ``/v2/repository/*`` lists, loads and unloads them. With it, ``models`` may be empty."""
    repository_poll_s: Optional[float] = None
    """Rescan ``model_repository`` every this many seconds: new directories become servable, and models
    loaded from a directory that disappeared are unloaded (drained). None: scanned at start-up and by the
    index and load requests only."""


@dataclass
class ServeConfig:
    models: List[ModelEntry]
    engine: EngineConfig
    tp: int = 1
    pp: int = 1
    server: ServerSettings = field(default_factory=ServerSettings)


def _engine_fields() -> Dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(EngineConfig)}


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
    from ..models.registry import ENCODER, model_types
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
    and ViT checkpoints need no tokenizer (then they take input_ids or pixel values)."""
    _check_type(name, path, str)
    if not os.path.isdir(path):
        raise ConfigError(f"{name}: checkpoint directory {path!r} does not exist")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{name}: {path!r} has no config.json (not a transformers checkpoint)")
    if checkpoint_info(path).get("model_type") not in encoder_model_types() and not has_tokenizer(path):
        raise ConfigError(f"{name}: {path!r} has no tokenizer files (tokenizer.json or tokenizer_config.json)")
    return path


def parse_model(m: Any, where: str, taken: Container[str] = ()) -> ModelEntry:
    """One model entry (a mapping with the fields of ``ModelEntry``) checked, its path made absolute and its
    kind read from the checkpoint; ``where`` names it in errors (``models[1]``). Reads ``config.json``:
    not on an event loop."""
    if not isinstance(m, dict):
        raise ConfigError(f"{where}: must be a mapping with id and path, got {m!r}")
    known = {f.name for f in dataclasses.fields(ModelEntry)} - {"kind"}
    unknown = sorted(set(m) - known)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown field (known: {sorted(known)})")
    for req in ("id", "path"):
        if req not in m:
            raise ConfigError(f"{where}.{req}: missing")
    entry = ModelEntry(**m)
    _check_type(f"{where}.id", entry.id, str)
    if not _ID.match(entry.id):
        raise ConfigError(f"{where}.id={entry.id!r}: must be letters, digits and ._:/- ")
    if entry.id in taken:
        raise ConfigError(f"{where}.id={entry.id!r}: duplicate model id")
    entry.path = os.path.abspath(os.path.expanduser(check_checkpoint(f"{where}.path", entry.path)))
    _check_type(f"{where}.task", entry.task, str, allow_none=True)
    entry.kind = understanding_kind(f"{where}.path", entry.path, entry.task)
    if entry.dtype is not None and entry.dtype not in DTYPES:
        raise ConfigError(f"{where}.dtype={entry.dtype!r}: must be one of {list(DTYPES)}")
    for k in ("max_batch_size", "queue_size"):
        v = getattr(entry, k)
        _check_type(f"{where}.{k}", v, int, allow_none=True)
        if v is not None and v < (1 if k == "max_batch_size" else 0):
            raise ConfigError(f"{where}.{k}={v!r}: must be >= {1 if k == 'max_batch_size' else 0}")
    if not isinstance(entry.pinned, bool):
        raise ConfigError(f"{where}.pinned={entry.pinned!r}: must be true or false")
    _check_type(f"{where}.priority", entry.priority, int)
    return entry


def parse_models(raw: Any, allow_empty: bool = False) -> List[ModelEntry]:
    """Every entry of ``models`` (``parse_model``); ``allow_empty`` when a model repository may supply them."""
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
    return out


def parse_engine(raw: Any) -> tuple:
    """EngineConfig from a mapping whose keys are EngineConfig's fields (plus tp and pp)."""
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError("engine: must be a mapping")
    raw = dict(raw or {})
    tp, pp = raw.pop("tp", 1), raw.pop("pp", 1)
    for name, v in (("engine.tp", tp), ("engine.pp", pp)):
        _check_type(name, v, int)
        if v < 1:
            raise ConfigError(f"{name}={v!r}: must be >= 1")
    fields = _engine_fields()
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"engine.{unknown[0]}: unknown field (known: tp, pp, {', '.join(sorted(fields))})")
    try:
        engine = EngineConfig(**raw)
    except (TypeError, ValueError) as exc:
        msg = str(exc)
        raise ConfigError(f"engine.{msg[len('EngineConfig.'):]}" if msg.startswith("EngineConfig.") else
                          f"engine: {msg}") from None
    return engine, tp, pp


_OLD_DRAIN = "shutdown_grace_s"
"""The YAML key ``drain_s`` had before it was told apart from ``EngineConfig.shutdown_grace_s``."""


def parse_server(raw: Any) -> ServerSettings:
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError("server: must be a mapping")
    known = {f.name for f in dataclasses.fields(ServerSettings)}
    unknown = sorted(set(raw) - known - {_OLD_DRAIN})
    if unknown:
        raise ConfigError(f"server.{unknown[0]}: unknown field (known: {sorted(known)})")
    drain_key = _OLD_DRAIN if _OLD_DRAIN in raw else "drain_s"  # the name the messages use
    if drain_key == _OLD_DRAIN:
        if "drain_s" in raw:
            raise ConfigError(f"server.{_OLD_DRAIN}: the old name of server.drain_s; give only one of them")
        raw = {("drain_s" if k == _OLD_DRAIN else k): v for k, v in raw.items()}
    s = ServerSettings(**raw)
    _check_type("server.host", s.host, str)
    _check_type("server.port", s.port, int)
    if not 0 <= s.port <= 65535:
        raise ConfigError(f"server.port={s.port}: must be in 0..65535")
    if isinstance(s.api_keys, str):
        s.api_keys = [s.api_keys]
    if not isinstance(s.api_keys, list) or not all(isinstance(k, str) and k for k in s.api_keys):
        raise ConfigError("server.api_keys: must be a list of non-empty strings")
    for key, v in (("request_timeout_s", s.request_timeout_s), (drain_key, s.drain_s)):
        _check_type(f"server.{key}", v, float)
        if v <= 0:
            raise ConfigError(f"server.{key}={v!r}: must be > 0 seconds")
    _check_type("server.default_max_tokens", s.default_max_tokens, int)
    if s.default_max_tokens < 1:
        raise ConfigError(f"server.default_max_tokens={s.default_max_tokens}: must be >= 1")
    if s.log_level not in ("critical", "error", "warning", "info", "debug"):
        raise ConfigError(f"server.log_level={s.log_level!r}: must be one of critical, error, warning, info, debug")
    if s.model_repository is not None:
        _check_type("server.model_repository", s.model_repository, str)
        if not os.path.isdir(s.model_repository):
            raise ConfigError(f"server.model_repository: directory {s.model_repository!r} does not exist")
        s.model_repository = os.path.abspath(os.path.expanduser(s.model_repository))
    if s.repository_poll_s is not None:
        _check_type("server.repository_poll_s", s.repository_poll_s, float)
        if s.repository_poll_s <= 0:
            raise ConfigError(f"server.repository_poll_s={s.repository_poll_s!r}: must be > 0 seconds")
        if s.model_repository is None:
            raise ConfigError("server.repository_poll_s: needs server.model_repository (the directory to rescan)")
    return s


def from_mapping(raw: Any) -> ServeConfig:
    if not isinstance(raw, dict):
        raise ConfigError("the config must be a mapping with models, engine and server")
    unknown = sorted(set(raw) - {"models", "engine", "server"})
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown section (known: models, engine, server)")
    engine, tp, pp = parse_engine(raw.get("engine"))
    server_raw = raw.get("server")
    has_repository = isinstance(server_raw, dict) and server_raw.get("model_repository") is not None
    models = parse_models(raw.get("models"), allow_empty=has_repository)  # checked before the server section
    return ServeConfig(models=models, engine=engine, tp=tp, pp=pp, server=parse_server(server_raw))


def load_file(path: str) -> Dict[str, Any]:
    import yaml
    if not os.path.isfile(path):
        raise ConfigError(f"--config: {path!r} does not exist")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return raw if raw is not None else {}


def model_entries_from_paths(paths: List[str], tasks: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """``ckpt/a`` serves as model ``a``; ``name=ckpt/a`` names it. ``tasks`` (``--task ID=TASK``) sets an
    encoder's task."""
    out = []
    for p in paths:
        mid, sep, path = p.partition("=")
        if not sep:
            mid, path = os.path.basename(os.path.normpath(p)), p
        out.append({"id": mid, "path": path})
    ids = {m["id"]: m for m in out}
    for t in tasks or []:
        mid, sep, task = t.partition("=")
        if not sep or mid not in ids:
            raise ConfigError(f"--task {t!r}: must be ID=TASK naming a model given on the command line "
                              f"({', '.join(ids)})")
        ids[mid]["task"] = task
    return out
