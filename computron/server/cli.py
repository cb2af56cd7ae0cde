"""``computron serve``: validate the config, load the tokenizers, start the engine, serve HTTP.

    computron serve ckpt/a ckpt/b --tp 2 --max-loaded 1           # quick: model ids from directory names
    computron serve small=ckpt/a big=ckpt/b --port 8000 --api-key sk-1
    computron serve --config serve.yaml                           # models, engine and server sections
    computron serve cls=ckpt/bert-sst2 emb=ckpt/bert --task emb=embedding   # encoders: /v2 and /v1/embeddings

Encoder (bert, roberta, xlm-roberta) and ViT checkpoints are served over the Open
Inference Protocol (/v2/models/ID/infer); embedding models also at /v1/embeddings.

Everything is checked before any worker starts: every field and path, the HTTP
port (bound then, and held), and each model's shape against --tp and --pp. A
mistake ends the command with one line naming it. SIGTERM or SIGINT stops
accepting connections, lets in-flight requests finish within
``drain_s``, then stops the workers.

torch, transformers and FastAPI are imported inside the functions that need
them, so ``computron --help`` answers at once.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import List, Optional

from ..preflight import PreflightError, check, reserve_port
from .config import (DTYPES, ConfigError, ServeConfig, from_mapping, load_file, model_entries_from_paths)
from .model_kind import ModelKind

log = logging.getLogger("computron.server")

_EXIT_STATUS = ("exit status: 0 after a graceful stop (SIGTERM or SIGINT); 1 when the engine fails to\n"
                "start (a worker's error, logged); 2 for a configuration error (a bad field or path, a\n"
                "port in use, a shape --tp does not divide), found before any worker starts")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="computron", description="Computron: serve many models by model-parallel "
                                "swapping.", epilog=_EXIT_STATUS)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve local checkpoints over an OpenAI-compatible HTTP API",
                       description=__doc__, epilog=_EXIT_STATUS, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("checkpoints", nargs="*", metavar="[ID=]PATH",
                   help="checkpoint directories (the model id is the directory name unless ID= names it)")
    s.add_argument("--config", help="YAML config file (models, engine, server); flags given override it")
    s.add_argument("--tp", type=int, help="tensor-parallel degree (default 1)")
    s.add_argument("--pp", type=int, help="pipeline-parallel degree (default 1)")
    s.add_argument("--max-loaded", type=int, help="models resident on the devices at once (default 1)")
    s.add_argument("--max-batch-size", type=int, help="sequences batched per model (default 8)")
    s.add_argument("--queue-size", type=int, help="waiting requests per model before 429 (default unbounded)")
    s.add_argument("--dtype", choices=DTYPES, help="dtype of every model given on the command line")
    s.add_argument("--task", action="append", dest="tasks", metavar="ID=TASK",
                   help="an encoder's task: embedding or classification (repeatable; default: classification "
                   "when the checkpoint has a classification head, else embedding)")
    s.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="port to listen on (default 8000)")
    s.add_argument("--api-key", action="append", dest="api_keys", help="accepted bearer token (repeatable)")
    s.add_argument("--request-timeout", type=float, dest="request_timeout_s", help="seconds before 504")
    s.add_argument("--drain", "--shutdown-grace", type=float, dest="drain_s",
                   help="seconds in-flight requests get on SIGTERM (default 30)")
    s.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    return p


def build_config(args: argparse.Namespace) -> ServeConfig:
    raw = load_file(args.config) if args.config else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{args.config}: the config must be a mapping with models, engine and server")
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    if args.checkpoints:
        if raw.get("models"):
            raise ConfigError("checkpoints given both on the command line and in the config's models")
        raw["models"] = model_entries_from_paths(args.checkpoints, args.tasks)
        if args.dtype:
            for m in raw["models"]:
                m["dtype"] = args.dtype
    elif not raw.get("models"):
        raise ConfigError("no models: give checkpoint directories or --config with a models list")
    elif args.tasks:
        raise ConfigError("--task goes with checkpoints given on the command line (in a config: models[i].task)")
    engine = raw.setdefault("engine", {}) if isinstance(raw.get("engine", {}), dict) else raw["engine"]
    server = raw.setdefault("server", {}) if isinstance(raw.get("server", {}), dict) else raw["server"]
    if isinstance(engine, dict):
        for flag, key in (("tp", "tp"), ("pp", "pp"), ("max_loaded", "max_loaded"),
                          ("max_batch_size", "max_batch_size"), ("queue_size", "queue_size")):
            if getattr(args, flag) is not None:
                engine[key] = getattr(args, flag)
    if isinstance(server, dict):
        for key in ("host", "port", "api_keys", "request_timeout_s", "drain_s", "log_level"):
            if getattr(args, key) is not None:
                server[key] = getattr(args, key)
    return from_mapping(raw)


def load_texts(cfg: ServeConfig):
    """Every causal LM's tokenizer and position limit, and every encoder's batch manager, before any worker
    starts: ``(texts, max_positions, hf_configs, encoders)``."""
    from transformers import AutoConfig
    from .text import ModelText
    texts, max_positions, hf_configs, encoders = {}, {}, {}, {}
    for i, m in enumerate(cfg.models):
        try:
            hf = AutoConfig.from_pretrained(m.path, local_files_only=True)
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"models[{i}].path: {m.path!r}: cannot read config.json: {exc}") from None
        hf_configs[m.id] = hf
        if m.kind not in (None, ModelKind.GENERATION):
            encoders[m.id] = _understanding_model(cfg, i, m, hf)
            continue
        try:
            texts[m.id] = ModelText(m.id, m.path)
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"models[{i}].path: {m.path!r}: cannot load its tokenizer: "
                              f"{type(exc).__name__}: {exc}") from None
        n = getattr(hf, "max_position_embeddings", None)
        if isinstance(n, int):
            max_positions[m.id] = n
    return texts, max_positions, hf_configs, encoders


def _understanding_model(cfg: ServeConfig, i: int, m, hf):
    """The batch manager (from ``computron.understanding``) of an encoder or ViT entry, wrapped for the
    v2 routes."""
    from ..understanding import (EmbeddingBatchManager, ImageClassificationBatchManager,
                                 TextClassificationBatchManager)
    from .v2 import EMBEDDING, IMAGE, UnderstandingModel
    cls = {EMBEDDING: EmbeddingBatchManager, IMAGE: ImageClassificationBatchManager}.get(
        m.kind, TextClassificationBatchManager)
    bs = m.max_batch_size or cfg.engine.max_batch_size or 8
    try:
        bm = cls.for_checkpoint(m.path, max_batch_size=bs)
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"models[{i}].path: {m.path!r}: cannot build its {m.kind} batch manager: "
                          f"{type(exc).__name__}: {exc}") from None
    return UnderstandingModel(m.id, m.path, m.kind, bm, hidden_size=getattr(hf, "hidden_size", None))


def model_configs(cfg: ServeConfig, hf_configs, encoders=None):
    from ..config import ModelConfig
    from ..loading import load_causal_lm, load_encoder
    from ..generation import CausalLMBatchManager
    encoders = encoders or {}
    out = []
    for m in cfg.models:
        kwargs = {"path": m.path}
        if m.dtype is not None:
            kwargs["dtype"] = m.dtype
        if m.id in encoders:
            out.append(ModelConfig(m.id, load_encoder, kwargs, batch_manager=encoders[m.id].batch_manager,
                                   checkpoint=m.path, queue_size=m.queue_size))
            continue
        bm = None
        if m.max_batch_size is not None:
            bm = CausalLMBatchManager.for_config(hf_configs[m.id], max_batch_size=m.max_batch_size)
        out.append(ModelConfig(m.id, load_causal_lm, kwargs, batch_manager=bm, checkpoint=m.path,
                               queue_size=m.queue_size))
    return out


def _uvicorn_server(app, cfg: ServeConfig, on_signal):
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            on_signal(sig)
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a graceful stop exits 0 rather than re-raising the signal

        async def startup(self, sockets=None):
            await super().startup(sockets)
            for s in self.servers:
                for sock in s.sockets:
                    host, port = sock.getsockname()[:2]
                    log.info("serving %s on http://%s:%d (OpenAI API under /v1, KServe v2 under /v2, "
                             "status page at /)", ", ".join(m.id for m in cfg.models), host, port)
    s = cfg.server
    config = uvicorn.Config(app, host=s.host, port=s.port, log_level=s.log_level, access_log=False,
                            timeout_graceful_shutdown=s.drain_s, lifespan="on", loop="asyncio",
                            http="h11", ws="none")
    return Server(config)


def prepare(cfg: ServeConfig):
    """Tokenizers, batch managers and model configs of every model, checked against the engine's
    preflight (shapes against TP and PP, devices, ...): ``(configs, texts, max_positions, encoders)``.
    Raises ``ConfigError`` or ``PreflightError``; no worker has started."""
    texts, max_positions, hf_configs, encoders = load_texts(cfg)
    configs = model_configs(cfg, hf_configs, encoders)
    check(cfg.engine, configs, cfg.tp, cfg.pp)
    return configs, texts, max_positions, encoders


async def serve(cfg: ServeConfig, sock, configs, texts, max_positions, encoders=None) -> int:
    """Start the engine, then serve HTTP on ``sock`` (bound by ``preflight.reserve_port``) until a signal."""
    from ..errors import LaunchError
    from ..launch import LaunchEngine
    from .app import create_app
    s = cfg.server
    log.info("starting %d workers (TP=%d x PP=%d) for %d models: %s; max_loaded=%d", cfg.tp * cfg.pp, cfg.tp,
             cfg.pp, len(cfg.models), ", ".join(f"{m.id} ({m.path})" for m in cfg.models), cfg.engine.max_loaded)
    try:
        engine = await asyncio.to_thread(LaunchEngine, cfg.engine, configs, cfg.tp, cfg.pp)
    except LaunchError as exc:
        log.error("the engine failed to start: %s", exc)
        return 1
    app = create_app(engine, texts, s, max_positions=max_positions, owns_engine=True, encoders=encoders)
    state = app.state.computron

    def on_signal(sig):
        if not state.draining:
            log.info("%s: draining (no new connections; in-flight requests get %.0fs), then stopping",
                     signal.Signals(sig).name, s.drain_s)
        state.draining = True
    server = _uvicorn_server(app, cfg, on_signal)
    try:
        await server.serve(sockets=[sock])
    finally:
        await engine.shutdown()  # idempotent; the lifespan already did it on a normal stop
    log.info("stopped")
    return 0


def _config_error(exc: Exception) -> int:
    print(f"computron serve: error: {exc}", file=sys.stderr)
    return 2


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    level = getattr(logging, (args.log_level or "info").upper())
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("computron").setLevel(level)
    try:
        cfg = build_config(args)
        logging.getLogger("computron").setLevel(getattr(logging, cfg.server.log_level.upper()))
        sock = reserve_port(cfg.server.host, cfg.server.port, "server.port")
    except (ConfigError, PreflightError) as exc:
        return _config_error(exc)
    with sock:  # held until the server listens on it, closed on every way out
        try:
            prepared = prepare(cfg)
        except (ConfigError, PreflightError) as exc:
            return _config_error(exc)
        return asyncio.run(serve(cfg, sock, *prepared))


if __name__ == "__main__":
    sys.exit(main())
