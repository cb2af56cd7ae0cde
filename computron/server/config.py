"""`computron serve` configuration: a YAML file or command-line flags, validated before any worker starts.

A config file::

    models:
      - id: opt-a                # the `model` field of requests
        path: ckpt/opt-a         # a local checkpoint directory with its tokenizer, or a .gguf file, or a
                                 # hub id: org/name, org/name@REVISION, org/name:FILE.gguf (docs/models.md)
        dtype: float16           # optional: float32 | float16 | bfloat16 (default: the checkpoint's)
        quantization: int4       # optional: int8 | int4 | int4-g128: Linears quantized at load (weight-only)
        max_batch_size: 8        # optional: sequences batched together for this model
        queue_size: 64           # optional: waiting requests before 429 (default: engine.queue_size)
        tool_call_parser: hermes # optional: hermes (qwen) | llama3_json (llama3); default: from the chat template
        strict_fields: false     # optional: this model's requests with unknown fields answer 400
        pinned: false            # optional: never evicted once loaded
        priority: 0              # optional: higher goes first for a slot and is evicted last
        keep_alive: 5m           # optional: resident once idle for 5m | 30s | 0 (offload when done) | -1 (ever)
      - id: embed                # an encoder (bert, roberta, xlm-roberta) or ViT checkpoint is served over
        path: ckpt/bert-base     # the v2 protocol (/v2/models/embed/infer), embeddings also at /v1/embeddings
        task: embedding          # optional: embedding | classification (default: classification when the
                                 # checkpoint has a classification head, else embedding)
      - id: opt-a-sql            # a PEFT LoRA adapter served on a causal LM of this file (no path: it runs
        base: opt-a              # on its base's weights, with its base's tokenizer, batch and queue)
        adapter: lora/opt-a-sql  # the adapter directory (adapter_config.json + adapter_model.safetensors)
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
      model_repository: models/  # optional: each subdirectory with a config.json (or one .gguf) is servable,
                                 # by its name, on its first request (then `models` may be empty)
      repository_poll_s: 10      # optional: rescan it this often (new directories, removed ones unloaded)
      strict_fields: false       # optional: true answers 400 to unknown request fields (default: ignored, logged)
      max_n: 16                  # optional: the most choices (n) per prompt

Every error raises ``ConfigError`` naming the field (``models[1].path``) or the path. The ``models``
entries are checked by ``model_entry.py`` (its names are importable from here too).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..config import EngineConfig
from ..loading import DTYPES
from .model_entry import (_ID, ConfigError, ModelEntry, _check_type, check_checkpoint,
                          checkpoint_info, encoder_model_types, model_entries_from_paths, parse_model, parse_models,
                          understanding_kind)


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
    strict_fields: bool = False
    """Answer 400 to a request field the server does not know (default: ignore it, logged once per field name,
    as vLLM, SGLang, Ollama and llama.cpp do). A model's ``strict_fields`` overrides it."""
    max_n: int = 16
    """The most choices (``n``) one prompt of a completion request may ask for; above it: 400 naming ``n``."""
    repository_poll_s: Optional[float] = None
    """Rescan ``model_repository`` every this many seconds: new directories become servable, and models
    loaded from a directory that disappeared are unloaded (drained). None: scanned at start-up and by the
    index and load requests only."""
    engine_restarts: int = 3
    """A dead engine (a worker killed, hung or stopped) is restarted at most this many times within
    ``engine_restart_window_s`` (0: never; the server then stays up with a dead engine, /health 503)."""
    engine_restart_backoff_s: float = 2.0
    """Wait before a restart, doubled for every restart already made within the window."""
    engine_restart_window_s: float = 600.0
    """The window the restarts are counted in (and the back-off doubles in)."""


@dataclass
class ServeConfig:
    models: List[ModelEntry]
    engine: EngineConfig
    tp: int = 1
    pp: int = 1
    server: ServerSettings = field(default_factory=ServerSettings)


def _engine_fields() -> Dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(EngineConfig)}


_ON_OFF_FIELDS = ("compile_decode", "pin_workers")
"""Engine fields whose values include 'on' or 'off' (a YAML file may write them bare)."""


SERVE_METRICS_HISTORY = 2_000
"""``EngineConfig.metrics_history`` under ``computron serve`` unless ``engine:`` sets it. The server reads no
record (``/metrics`` and the status page read running totals and the event timeline), and with the library's
100 000 the master's memory grew by about 7 KB per swapped request for the first ~20 000 of them
(``benchmarks/swap_hygiene.py``); 2 000 records are a few MB, full within minutes."""


def parse_engine(raw: Any) -> tuple:
    """EngineConfig from a mapping whose keys are EngineConfig's fields (plus tp and pp); ``metrics_history``
    defaults to ``SERVE_METRICS_HISTORY``."""
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError("engine: must be a mapping")
    raw = dict(raw or {})
    raw.setdefault("metrics_history", SERVE_METRICS_HISTORY)
    tp, pp = raw.pop("tp", 1), raw.pop("pp", 1)
    for name, v in (("engine.tp", tp), ("engine.pp", pp)):
        _check_type(name, v, int)
        if v < 1:
            raise ConfigError(f"{name}={v!r}: must be >= 1")
    fields = _engine_fields()
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"engine.{unknown[0]}: unknown field (known: tp, pp, {', '.join(sorted(fields))})")
    for name in _ON_OFF_FIELDS:  # YAML 1.1 reads a bare on / off as a boolean
        if isinstance(raw.get(name), bool):
            raw[name] = "on" if raw[name] else "off"
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
    _check_type("server.engine_restarts", s.engine_restarts, int)
    if s.engine_restarts < 0:
        raise ConfigError(f"server.engine_restarts={s.engine_restarts}: must be >= 0")
    for key in ("engine_restart_backoff_s", "engine_restart_window_s"):
        _check_type(f"server.{key}", getattr(s, key), float)
        if getattr(s, key) <= 0:
            raise ConfigError(f"server.{key}={getattr(s, key)!r}: must be > 0 seconds")
    _check_type("server.default_max_tokens", s.default_max_tokens, int)
    if s.default_max_tokens < 1:
        raise ConfigError(f"server.default_max_tokens={s.default_max_tokens}: must be >= 1")
    if not isinstance(s.strict_fields, bool):
        raise ConfigError(f"server.strict_fields={s.strict_fields!r}: must be true or false")
    _check_type("server.max_n", s.max_n, int)
    if s.max_n < 1:
        raise ConfigError(f"server.max_n={s.max_n}: must be >= 1")
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


__all__ = ["ConfigError", "ModelEntry", "ServerSettings", "ServeConfig", "DTYPES", "parse_model", "parse_models",
           "parse_engine", "parse_server", "from_mapping", "load_file", "model_entries_from_paths", "check_checkpoint",
           "checkpoint_info", "encoder_model_types", "understanding_kind", "_ID"]
