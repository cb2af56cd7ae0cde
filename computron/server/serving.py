"""What ``computron serve`` runs once its config is parsed (``cli.py``): the served models built and checked
(``prepare``), the engine or the engine groups on Ray started, HTTP served until a signal drains it.

Each function returns the command's exit status: 0 after a graceful stop, 1 when the engine fails to
start, 2 for a configuration error (``config_error``, one line naming it).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Optional

from ..preflight import check
from .config import ServeConfig

log = logging.getLogger("computron.server")


def config_error(exc: Exception) -> int:
    print(f"computron serve: error: {exc}", file=sys.stderr)
    return 2


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
                             "status page at /)", ", ".join(m.id for m in cfg.models) or "no model yet", host, port)
    s = cfg.server
    config = uvicorn.Config(app, host=s.host, port=s.port, log_level=s.log_level, access_log=False,
                            timeout_graceful_shutdown=s.drain_s, lifespan="on", loop="asyncio",
                            http="h11", ws="none")
    return Server(config)


def prepare(cfg: ServeConfig):
    """Tokenizers, batch managers and model configs of every model (``building.build_models``: the path
    of models added while serving too), checked against the engine's preflight (shapes against TP and
    PP, devices, ...): ``(configs, served)``, the engine's ``ModelConfig`` list and the server's
    ``ServedModel`` by id. Raises ``ConfigError`` or ``PreflightError``; no worker has started."""
    from .building import build_models
    built = build_models(cfg)
    configs = [b.config for b in built]
    check(cfg.engine, [c for c in configs if c.adapter is None], cfg.tp, cfg.pp)  # adapters: checked when built
    return configs, {b.served.id: b.served for b in built}


async def serve(cfg: ServeConfig, sock, configs, served) -> int:
    """Start the engine, then serve HTTP on ``sock`` (bound by ``preflight.reserve_port``) until a signal."""
    from ..errors import LaunchError
    from ..runtime.launch import LaunchEngine
    log.info("starting %d workers (TP=%d x PP=%d) for %d models: %s; max_loaded=%d", cfg.tp * cfg.pp, cfg.tp,
             cfg.pp, len(cfg.models), ", ".join(f"{m.id} ({m.path or f'LoRA {m.adapter} on {m.base}'})"
                                         for m in cfg.models) or "none yet",
             cfg.engine.max_loaded)
    s = cfg.server
    if s.model_repository:
        log.info("model repository %s: its models load on their first request%s", s.model_repository,
                 f"; rescanned every {s.repository_poll_s:g}s" if s.repository_poll_s else "")
    try:
        engine = await asyncio.to_thread(LaunchEngine, cfg.engine, configs, cfg.tp, cfg.pp)
    except LaunchError as exc:
        log.error("the engine failed to start: %s", exc)
        return 1
    if s.engine_restarts:
        from .restarts import RestartingEngine
        engine = RestartingEngine(engine, lambda now: LaunchEngine(cfg.engine, now, cfg.tp, cfg.pp), configs,
                                  s.engine_restarts, s.engine_restart_backoff_s, s.engine_restart_window_s).start()
    return await serve_engine(cfg, sock, engine, served)


async def serve_engine(cfg: ServeConfig, sock, engine, served) -> int:
    """Serve HTTP on ``sock`` over a started ``engine`` (an ``Engine``, or the groups' ``ClusterEngine``)
    until a signal drains it, then shut the engine down; returns the exit status."""
    from functools import partial

    from .app import create_app
    from .building import build_model
    s = cfg.server
    app = create_app(engine, settings=s, owns_engine=True, models=served,
                     build=partial(build_model, default_max_batch_size=cfg.engine.max_batch_size))
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


async def serve_cluster(cfg: ServeConfig, sock, configs, served, groups: int, ray_address: Optional[str] = None,
                        router: str = "swap-aware", max_restarts: int = 3) -> int:
    """``serve`` over ``groups`` engine groups on Ray (``cluster.serve.start_cluster``): same arguments, same
    exit status (2: Ray missing or a bad ``--groups``; 1: a group failed to start; 0 after a graceful stop)."""
    from ..cluster.serve import RayMissingError, init_ray, start_cluster
    from ..errors import LaunchError
    if groups < 1:
        return config_error(ValueError(f"--groups={groups}: must be >= 1"))
    try:
        started_ray = init_ray(ray_address)
    except RayMissingError as exc:
        return config_error(exc)
    log.info("starting %d engine groups of %d workers (TP=%d x PP=%d) for %d models: %s; max_loaded=%d per group; "
             "router: %s", groups, cfg.tp * cfg.pp, cfg.tp, cfg.pp, len(cfg.models),
             ", ".join(f"{m.id} ({m.path})" for m in cfg.models) or "none yet", cfg.engine.max_loaded, router)
    try:
        try:
            cluster = await asyncio.to_thread(start_cluster, cfg.engine, configs, groups, cfg.tp, cfg.pp,
                                              router=router, max_restarts=max_restarts)
        except LaunchError as exc:
            log.error("the engine groups failed to start: %s", exc)
            return 1
        return await serve_engine(cfg, sock, cluster, served)
    finally:
        if started_ray:
            import ray
            ray.shutdown()


__all__ = ["config_error", "prepare", "serve", "serve_engine", "serve_cluster"]
