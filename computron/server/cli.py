"""``computron serve``: validate the config, load the tokenizers, start the engine, serve HTTP.

    computron serve ckpt/a ckpt/b --tp 2 --max-loaded 1           # quick: model ids from directory names
    computron serve small=ckpt/a big=ckpt/b --port 8000 --api-key sk-1
    computron serve --config serve.yaml                           # models, engine and server sections
    computron serve cls=ckpt/bert-sst2 emb=ckpt/bert --task emb=embedding   # encoders: /v2 and /v1/embeddings
    computron serve --model-repository models/ --repository-poll 10   # each models/NAME loads on first use
    computron serve smol=SmolLM2-135M-Instruct.Q4_1.gguf --pp 2    # a GGUF file: its blocks as they are
    computron serve llama=org/name org/name@v1.0 org/repo-GGUF:m.Q4_1.gguf   # hub ids, via the HF cache

Encoder (bert, roberta, xlm-roberta) and ViT checkpoints are served over the Open
Inference Protocol (/v2/models/ID/infer); embedding models also at /v1/embeddings.
Models are loaded and unloaded while serving through Triton's repository API
(/v2/repository/index, /v2/repository/models/NAME/load and unload); with
--model-repository, each subdirectory with a config.json is a model loaded on its
first request (--repository-poll rescans the directory). LoRA adapters are served
on a causal LM from YAML entries with base and adapter, or added and removed while
serving through /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's).

Everything is checked before any worker starts: every field and path, the HTTP
port (bound then, and held), and each model's shape against --tp and --pp. A
mistake ends the command with one line naming it. SIGTERM or SIGINT stops
accepting connections, lets in-flight requests finish within
``drain_s``, then stops the workers.

This module parses the command line; ``serving.py`` runs what it asks for. torch, transformers and
FastAPI are imported inside the functions that need them, so ``computron --help`` answers at once.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import logging
import sys
from typing import List, Optional

from ..preflight import PreflightError, reserve_port
from .config import (DTYPES, ConfigError, ServeConfig, from_mapping, load_file, model_entries_from_paths)
from .ps_cli import add_ps_parser, ps_main
from .serving import config_error, prepare, serve, serve_cluster

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
                   help="checkpoint directories or .gguf files (the model id is the directory name, or the "
                   "file's without .gguf, unless ID= names it); a .gguf file keeps its quantized blocks (its "
                   "config and tokenizer are written once into $COMPUTRON_CACHE_DIR/gguf, default "
                   "~/.cache/computron/gguf); its other tensors are served in --dtype (default float32); "
                   "or Hugging Face hub ids org/name[@REVISION][:FILE.gguf] that name no local path, from "
                   "huggingface_hub's cache (HF_HUB_CACHE), fetched first unless HF_HUB_OFFLINE=1")
    s.add_argument("--config", help="YAML config file (models, engine, server); flags given override it")
    s.add_argument("--tp", type=int, help="tensor-parallel degree (default 1)")
    s.add_argument("--pp", type=int, help="pipeline-parallel degree (default 1)")
    s.add_argument("--max-loaded", type=int, help="models resident on the devices at once (default 1)")
    s.add_argument("--max-batch-size", type=int, help="sequences batched per model (default 8)")
    s.add_argument("--queue-size", type=int, help="waiting requests per model before 429 (default 512; 0: unbounded)")
    s.add_argument("--keep-alive", dest="keep_alive", metavar="DURATION", help="how long an idle model stays "
                   "resident: '5m', '30s', seconds, 0 (offload once done), -1 (while memory allows: the default)")
    s.add_argument("--dtype", choices=DTYPES, help="dtype of every model given on the command line")
    s.add_argument("--quantization", metavar="int8|int4|int4-gG",
                   help="quantize the layers' Linears of every float checkpoint given on the command line at load "
                   "(weight-only: int8 per output channel, int4 in groups of 32, int4-g128 in groups of 128)")
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
    s.add_argument("--strict-fields", action="store_true", default=None, dest="strict_fields",
                   help="answer 400 to request fields the server does not know (default: ignore them, logged once)")
    s.add_argument("--engine-restarts", type=int, dest="engine_restarts", metavar="N",
                   help="restart a dead engine at most N times within 10 minutes (default 3; 0: never)")
    s.add_argument("--ray", action="store_true",
                   help="serve with several engine groups on Ray (pip install -e .[ray]); same HTTP API")
    s.add_argument("--groups", type=int, default=1,
                   help="with --ray: engine groups, each of TP x PP workers serving every model (default 1)")
    s.add_argument("--ray-address", help="with --ray: join this Ray cluster ('auto': this node's); "
                   "default: start a local one")
    s.add_argument("--model-repository", metavar="DIR", help="serve every subdirectory of DIR that has a "
                   "config.json (or one .gguf file), by its name, loaded on its first request (models given "
                   "besides it load at start)")
    s.add_argument("--repository-poll", type=float, dest="repository_poll_s", metavar="S",
                   help="rescan --model-repository every S seconds: new directories become servable, models whose "
                   "directory disappeared are unloaded")
    add_ps_parser(sub)
    return p


def build_config(args: argparse.Namespace) -> ServeConfig:
    raw = load_file(args.config) if args.config else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{args.config}: the config must be a mapping with models, engine and server")
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    server_raw = raw.get("server") if isinstance(raw.get("server"), dict) else {}
    repository = args.model_repository or server_raw.get("model_repository")
    if args.checkpoints:
        if raw.get("models"):
            raise ConfigError("checkpoints given both on the command line and in the config's models")
        raw["models"] = model_entries_from_paths(args.checkpoints, args.tasks)
        if args.dtype:
            for m in raw["models"]:
                m["dtype"] = args.dtype
        if args.quantization:
            for m in raw["models"]:
                m["quantization"] = args.quantization
    elif not raw.get("models") and not repository:
        raise ConfigError("no models: give checkpoint directories, --config with a models list, or "
                          "--model-repository")
    elif args.tasks:
        raise ConfigError("--task goes with checkpoints given on the command line (in a config: models[i].task)")
    engine = raw.setdefault("engine", {}) if isinstance(raw.get("engine", {}), dict) else raw["engine"]
    server = raw.setdefault("server", {}) if isinstance(raw.get("server", {}), dict) else raw["server"]
    if isinstance(engine, dict):
        for flag, key in (("tp", "tp"), ("pp", "pp"), ("max_loaded", "max_loaded"),
                          ("max_batch_size", "max_batch_size"), ("queue_size", "queue_size"),
                          ("keep_alive", "keep_alive")):
            if getattr(args, flag) is not None:
                engine[key] = getattr(args, flag)
    if isinstance(server, dict):
        for key in ("host", "port", "api_keys", "request_timeout_s", "drain_s", "log_level", "model_repository",
                    "repository_poll_s", "strict_fields", "engine_restarts"):
            if getattr(args, key) is not None:
                server[key] = getattr(args, key)
    return from_mapping(raw)


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "ps":
        return ps_main(args)
    level = getattr(logging, (args.log_level or "info").upper())
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("computron").setLevel(level)
    if not args.ray and (args.groups != 1 or args.ray_address):
        return config_error(ValueError("--groups and --ray-address need --ray"))
    try:
        cfg = build_config(args)
        logging.getLogger("computron").setLevel(getattr(logging, cfg.server.log_level.upper()))
        sock = reserve_port(cfg.server.host, cfg.server.port, "server.port")
    except (ConfigError, PreflightError) as exc:
        return config_error(exc)
    with sock:  # held until the server listens on it, closed on every way out
        from ..runtime.worker_start import start_fork_server
        stop_early_server = None if args.ray else start_fork_server(cfg.engine)  # imports beside prepare's
        try:
            prepared = prepare(cfg)
        except BaseException as exc:  # any way out, Ctrl-C too: the early fork server stops; re-raised
            if stop_early_server:
                stop_early_server()
            if isinstance(exc, (ConfigError, PreflightError)):
                return config_error(exc)
            raise
        if args.ray:
            return asyncio.run(serve_cluster(cfg, sock, *prepared, groups=args.groups, ray_address=args.ray_address))
        return asyncio.run(serve(cfg, sock, *prepared))


def console() -> int:
    """The ``computron`` command and ``python -m computron``: ``main``, then the process ends at once.

    Everything ``main`` started is stopped and flushed when it returns; what is left is the interpreter's
    teardown, which helps nobody here: its garbage collections walk every object torch and transformers made
    at import (about two seconds on 2 CPU cores, after a stop that took a fraction of one), and where triton is
    installed (``torch._dynamo`` imports it, and transformers' model classes import ``torch._dynamo``) its
    nanobind module prints some fifty ``nanobind: leaked ...`` lines for the objects it finds alive when its
    own teardown runs. So after ``main`` the logs are flushed and the process exits with ``os._exit``, as the
    workers do. Not in ``main``, which tests and programs call in-process.
    """
    status = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


if __name__ == "__main__":
    sys.exit(console())
