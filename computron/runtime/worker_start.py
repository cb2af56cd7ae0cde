"""How spawn mode starts its workers: multiprocessing's fork server or plain spawn (no torch imported here,
so that ``computron serve`` can start the fork server before its own imports)."""
from __future__ import annotations

import glob
import multiprocessing as mp
import os
import signal
import sys
from multiprocessing import forkserver, resource_tracker
from typing import Callable, Optional

from ..config import EngineConfig

FORK_SERVER_PRELOAD = ["computron.runtime.fork_server"]


def in_fork_server() -> bool:
    """Whether this code runs inside multiprocessing's fork server (during its start-up imports)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == "multiprocessing.forkserver":
            return True
        frame = frame.f_back
    return False


def worker_context(config: EngineConfig, device: Optional[str] = None):
    """The multiprocessing context spawn mode starts its workers from (``EngineConfig.start_method``);
    ``device``: the resolved device where the caller knows it (else ``config.resolved_device()``).

    The fork server is one single-threaded process per master, started at the first launch (or earlier, by
    ``start_fork_server``) and ending with the master; each worker is a fork of it, so it starts with
    ``computron.runtime.fork_server``'s imports done, without forking the master's threads (asyncio, HTTP, Ray). It
    keeps the environment of its own start: ``process_setup.adopt_environment`` gives each worker the
    master's environment of the moment. ``auto`` keeps spawn for CUDA workers: a server whose imports
    touched the CUDA driver would fork children that cannot use it, and no GPU has run the fork server yet.
    """
    method = config.start_method
    if method == "auto":
        method = "spawn" if (device or config.resolved_device()) == "cuda" else "forkserver"
    if method != "forkserver" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORK_SERVER_PRELOAD)  # no effect once the server runs
    return ctx


def start_server(ctx) -> None:
    """Start the fork server of ``ctx`` now where it has one and none runs: its imports begin at once while
    the caller goes on (the first worker's start waits for them; without this call it would start them)."""
    if ctx.get_start_method() == "forkserver":
        forkserver.ensure_running()


def _gpu_device_nodes() -> bool:
    """Whether this machine has a GPU device node (NVIDIA's, AMD's KFD, WSL's): without one torch finds no
    CUDA device, so ``device`` left to ``auto`` is the CPU, known without importing torch to ask."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg"))


def start_fork_server(config: EngineConfig) -> Optional[Callable[[], None]]:
    """Start the fork server now if the launch will fork its workers from it; returns how to stop what this
    call started (None where it started nothing: spawn, or a server already runs in this process).

    The server's imports (torch, transformers' model code: most of a worker's start-up) then run beside the
    master's own (tokenizers, checkpoint configs, the HTTP app) instead of after them. Where ``device`` is
    left to ``auto`` on a machine with a GPU, it does nothing: resolving the device would import torch
    here, and CUDA workers spawn anyway. The stop is for a master that ends before any launch (a
    configuration error found after this call): it leaves no process behind, not even a server still
    importing (which would notice its master has gone only once its imports are done).
    """
    device = config.device
    if device is None:
        if _gpu_device_nodes():
            return None
        device = "cpu"
    ctx = worker_context(config, device)
    server, tracker = forkserver._forkserver, resource_tracker._resource_tracker
    if ctx.get_start_method() != "forkserver" or getattr(server, "_forkserver_pid", None) is not None:
        return None
    tracker_ran = getattr(tracker, "_fd", None) is not None
    start_server(ctx)  # starts multiprocessing's resource tracker too, where none runs

    def stop() -> None:
        pid = getattr(server, "_forkserver_pid", None)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            server._stop()  # closes the pipe that keeps it alive, reaps it and forgets it
        if not tracker_ran:
            tracker._stop()
    return stop
