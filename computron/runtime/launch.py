"""Starting the engine: spawn mode (we start the workers) and attach mode (torchrun started us).

Spawn mode: the calling process becomes the master, one extra rank after the ``tp * pp`` workers, which it
starts from multiprocessing's fork server (``worker_start.worker_context``). Each worker reports ready or its
start-up traceback over a pipe; the master waits on those pipes and on the processes' sentinels together, so a
worker that dies during start-up fails the launch at once. Workers die with the master (a watcher thread on the
parent's sentinel, PR_SET_PDEATHSIG, ``worker.master_watch``). Attach mode (``RANK``/``WORLD_SIZE`` set by
torchrun or ``colossalai run``): global rank 0 hosts the master next to worker 0 and returns the engine; the
other ranks serve until shutdown and return None. Each process's set-up: ``process_setup.py`` (logging, threads,
device, rendezvous), ``affinity.py`` (cores); where the master's replies go: ``reply_router.py``."""
from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import preflight
from ..comm import messages as msg
from ..comm.topology import Groups, Layout
from ..comm.transport import WorkerChannel
from ..config import EngineConfig, ModelConfig, check_model_configs, check_world
from ..engine import Engine
from ..engine.budget import check_memory
from ..errors import LaunchError
from ..worker.shard_builder import packs_linears
from ..worker.worker import Worker
from .spawned import SpawnedWorkers
from .prefetch import prefetch_startup
from .process_setup import (adopt_environment, device_for, die_with_parent, destroy_group_in_background,
                            host_rendezvous, join_rendezvous, keepalive_interval, rendezvous_error,
                            pin_and_lend, setup_logging, threads_per_worker)
from .reply_router import ReplyRouter
from .worker_start import in_fork_server, start_server, worker_context

log = logging.getLogger("computron.launch")


def LaunchEngine(engine_config: EngineConfig, model_configs: List[ModelConfig], tp_world_size: int = 1,
                 pp_world_size: int = 1, n_nodes: int = 1, node_rank: int = 0) -> Optional[Engine]:
    """Start serving ``model_configs``, each split over ``tp_world_size * pp_world_size`` workers.

    Returns the ``Engine`` where the master lives (node 0 / global rank 0), None elsewhere.
    """
    if not isinstance(engine_config, EngineConfig):
        raise ValueError(f"engine_config: expected EngineConfig, got {type(engine_config).__name__}")
    configs = check_model_configs(model_configs, allow_empty=True)  # models may be added while serving
    check_world(tp_world_size, pp_world_size, n_nodes, node_rank)
    if mp.current_process().name.startswith("computron-worker") or in_fork_server():
        raise RuntimeError("LaunchEngine ran again inside a worker process, which imports the main module: "
                           "call it under `if __name__ == '__main__':`")
    adapters = [mc for mc in configs if mc.adapter is not None]  # added once the engine serves their bases
    configs = [mc for mc in configs if mc.adapter is None]
    preflight.check(engine_config, configs, tp_world_size, pp_world_size, n_nodes, node_rank)
    preflight.check_adapters(engine_config, adapters, configs)
    setup_logging(engine_config, None if "RANK" not in os.environ else int(os.environ["RANK"]))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        engine = _attach(engine_config, configs, tp_world_size, pp_world_size)
    else:
        engine = _spawn(engine_config, configs, tp_world_size, pp_world_size, n_nodes, node_rank)
    if engine is not None and adapters:
        from ..engine.adapters import add_at_launch
        add_at_launch(engine, adapters, engine_config.start_timeout_s)
    return engine


launch_computron = LaunchEngine


# ---- spawn mode ---------------------------------------------------------------

def _worker_main(rank: int, local_rank: int, local_world: int, layout: Layout, config: EngineConfig,
                 model_configs: List[ModelConfig], addr: str, port: int, status, parent_thread_lasts: bool,
                 env: dict, master_pid: Optional[int]) -> None:
    adopt_environment(env)
    # the master decides when we stop: a signal to the whole process group (Ctrl-C, `kill -TERM -PGID`,
    # a supervisor) reaches the master, which drains and then stops us (SIGKILL if we don't exit)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(parent_thread_lasts)
    setup_logging(config, rank)
    threads = threads_per_worker(config, local_world)
    try:
        device = device_for(config, local_rank, local_world)
        # before torch starts its intra-op threads (they inherit the pinning)
        pin_and_lend(config, device, local_rank, local_world, threads, layout.n_workers,
                     packs=any(packs_linears(config, mc) for mc in model_configs))
        torch.set_num_threads(threads)
        join_rendezvous(addr, port, rank, layout.world_size, config.rendezvous_timeout_s)
        groups = Groups(layout, rank, config.resolved_backend(), timedelta(seconds=config.death_timeout_s))
        channel = WorkerChannel(groups)
        worker = Worker(rank, groups, channel, model_configs, config, device)
        worker.build()
    except BaseException:  # noqa: BLE001 - the master raises it as LaunchError
        status.send(msg.WorkerStartFailed(rank, traceback.format_exc()))
        status.close()
        os._exit(1)
    status.send(worker.ready_message())
    status.close()
    worker.serve(master_pid)
    channel.reply(msg.Bye(rank))
    dist.destroy_process_group()
    # nothing is left to do: skip the interpreter's teardown, where a C++ thread of the communication libraries
    # still being torn down aborts the process now and then ("terminate called without an active exception")
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def _spawn(config: EngineConfig, configs, tp: int, pp: int, n_nodes: int, node_rank: int) -> Optional[Engine]:
    if n_nodes > 1 and config.master_port == 0:
        raise ValueError("EngineConfig.master_port=0: several nodes need a fixed rendezvous port")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process; LaunchEngine's spawn "
                           "mode starts its own process group (shut the previous engine down first)")
    layout = Layout(tp=tp, pp=pp, master_rank=tp * pp, master_is_worker=False)
    addr, store = config.master_host, None
    if node_rank == 0:
        store = host_rendezvous(addr, config.master_port, layout.world_size, config.death_timeout_s)
    port = store.port if store is not None else config.master_port
    local_world = layout.n_workers // n_nodes
    first = node_rank * local_world
    ctx = worker_context(config)
    start_server(ctx)  # a fork server's imports (or the spawned workers', below) run beside the disk reads:
    prefetch_startup(configs, config.host_budget, layout.n_workers, config.paper_mode)
    lasts = ctx.get_start_method() == "forkserver" or threading.current_thread() is threading.main_thread()
    worker_configs = [mc.for_workers() for mc in configs]
    procs, status = [], []
    for i in range(local_world):
        recv_end, send_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker_main, name=f"computron-worker-{first + i}", daemon=True,
                        args=(first + i, i, local_world, layout, config, worker_configs, addr, port, send_end,
                              lasts, dict(os.environ), os.getpid() if node_rank == 0 else None))
        p.start()
        send_end.close()
        procs.append(p)
        status.append(recv_end)
    workers = SpawnedWorkers(procs, first)
    if node_rank != 0:  # this node only hosts workers
        try:
            _await_ready(workers, status, None, config.start_timeout_s)
            mpc.wait(workers.sentinels())
        finally:
            workers.stop(grace_s=30)
        return None

    init_done = threading.Event()
    init = {}

    def init_master():
        try:
            # torch labels every later traceback of this process "[rank<N>]:" by replacing sys.excepthook;
            # the user's own process is no rank of theirs: keep their hook
            excepthook = sys.excepthook
            try:
                dist.init_process_group("gloo", store=store, rank=layout.master_rank,
                                        world_size=layout.world_size,
                                        timeout=timedelta(seconds=config.rendezvous_timeout_s))
            except Exception as exc:  # noqa: BLE001 - said naming where it waited
                raise rendezvous_error("the master", addr, port, config.rendezvous_timeout_s, exc) from exc
            finally:
                sys.excepthook = excepthook
            init["groups"] = Groups(layout, layout.master_rank, config.resolved_backend(),
                                    timedelta(seconds=config.death_timeout_s))
        except BaseException as exc:  # noqa: BLE001
            init["error"] = exc
        finally:
            init_done.set()
            wake_send.send(b"")

    wake_recv, wake_send = ctx.Pipe(duplex=False)
    threading.Thread(target=init_master, name="computron-rendezvous", daemon=True).start()
    try:
        ready = _await_ready(workers, status, wake_recv, config.start_timeout_s, init)
        if not init_done.wait(config.start_timeout_s):
            raise LaunchError("the master could not join the workers' process group in time")
        if "error" in init:
            raise LaunchError(str(init['error']))
        check_memory(config, ready)
    except BaseException:  # any way out, Ctrl-C too: no worker or process group outlives the launch; re-raised
        workers.stop(grace_s=0)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise

    router = ReplyRouter(expected_ready=0, exit_cause=lambda: workers.exited(wait_s=5))
    channel = router.channel(init["groups"], keepalive_s=keepalive_interval(config))

    def on_close(dead: bool):
        if dead:
            channel.abandon()
            workers.stop(grace_s=0)
            clean = False
        else:
            # everything within shutdown_grace_s: the workers' goodbyes, then SIGKILL, then the process group
            deadline = time.monotonic() + config.shutdown_grace_s
            channel.send(msg.Shutdown())
            clean = channel.close(timeout=0.8 * config.shutdown_grace_s)
            if not clean:
                channel.abandon()
            workers.stop(grace_s=max(0.0, deadline - 0.5 - time.monotonic()))
        if clean and dist.is_initialized():
            dist.destroy_process_group()
        elif dist.is_initialized():
            destroy_group_in_background(1.0 if dead else max(0.1, deadline - time.monotonic()))

    engine = Engine(config, configs, layout, channel, ready, on_close=on_close)
    router.attach(engine)
    channel.start()
    engine.start()
    workers.monitor(engine.on_worker_exit)
    _install_exit_hooks(engine)
    return engine


def _await_ready(workers: SpawnedWorkers, status, wake, timeout: float, init=None) -> List[msg.WorkerReady]:
    """Wait for every worker's ready message; raise LaunchError on the first failure or death.

    A worker that dies closes its end of the status pipe, which wakes the wait with EOF; ``wake`` fires when
    the master's own rendezvous ends.
    """
    deadline = time.monotonic() + timeout
    pending = dict(zip(status, workers.procs))
    ready = []
    while pending:
        left = deadline - time.monotonic()
        waitables = list(pending) + ([wake] if wake is not None else [])
        got = mpc.wait(waitables, timeout=max(0.0, left))
        if not got:
            raise LaunchError(f"{len(pending)} worker(s) did not report ready within {timeout:.0f}s "
                              "(EngineConfig.start_timeout_s)")
        for obj in got:
            if obj is wake:
                wake = None
                if init is not None and "error" in init:
                    raise LaunchError(str(init['error']))
                continue
            proc = pending.pop(obj)
            try:
                payload = obj.recv()
            except EOFError:
                proc.join(5)
                raise LaunchError(f"{proc.name} exited during start-up (exit code {proc.exitcode})") from None
            if isinstance(payload, msg.WorkerStartFailed):
                raise LaunchError(f"{proc.name} failed to start:\n{payload.error}")
            ready.append(payload)
            log.info("worker rank %d ready on %s (%s): %d model shards, %.1f MB, %.1fs after launch",
                     payload.rank, payload.host, payload.device, len(payload.host_bytes),
                     sum(payload.host_bytes.values()) / 2**20, timeout - (deadline - time.monotonic()))
    return ready


def _install_exit_hooks(engine: Engine) -> None:
    atexit.register(engine.close)
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        engine.close()
        if callable(previous):
            previous(signum, frame)
        raise SystemExit(128 + signum)
    if previous in (signal.SIG_DFL, None) or callable(previous):
        signal.signal(signal.SIGTERM, on_term)


# ---- attach mode --------------------------------------------------------------

def _attach(config: EngineConfig, configs, tp: int, pp: int) -> Optional[Engine]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world != tp * pp:
        raise ValueError(f"WORLD_SIZE={world} from the launcher, but tp_world_size*pp_world_size={tp * pp}")
    setup_logging(config, rank)
    torch.set_num_threads(threads_per_worker(config, local_world))
    device = device_for(config, local_rank, local_world)
    if not dist.is_initialized():
        try:
            dist.init_process_group("gloo", timeout=timedelta(seconds=config.rendezvous_timeout_s))
        except Exception as exc:  # noqa: BLE001 - said naming where it waited
            raise rendezvous_error(f"rank {rank}", os.environ.get("MASTER_ADDR", "?"),
                                   os.environ.get("MASTER_PORT", "?"), config.rendezvous_timeout_s, exc) from exc
    layout = Layout(tp=tp, pp=pp, master_rank=0, master_is_worker=True)
    groups = Groups(layout, rank, config.resolved_backend(), timedelta(seconds=config.death_timeout_s))
    if rank != 0:
        channel = WorkerChannel(groups)
        worker = Worker(rank, groups, channel, [mc.for_workers() for mc in configs], config, device)
        failure = None
        try:
            worker.build()
        except Exception:  # noqa: BLE001 - rank 0 raises it too; we wait for its shutdown first
            failure = traceback.format_exc()
            channel.reply(msg.WorkerStartFailed(rank, failure))
        else:
            channel.reply(worker.ready_message())
        worker.serve()
        channel.reply(msg.Bye(rank))
        dist.destroy_process_group()
        if failure is not None:
            raise LaunchError(f"rank {rank} failed to start:\n{failure}")
        return None

    router = ReplyRouter(expected_ready=layout.n_workers - 1)
    channel = router.channel(groups, keepalive_s=keepalive_interval(config))
    channel.start()
    worker = Worker(0, groups, WorkerChannel(groups, master=channel), [mc.for_workers() for mc in configs],
                    config, device)
    own_error = None
    try:
        worker.build()
    except Exception:  # noqa: BLE001
        own_error = traceback.format_exc()
    serve_thread = threading.Thread(target=worker.serve, name="computron-worker-0", daemon=True)
    serve_thread.start()
    problems = [f"rank 0:\n{own_error}"] if own_error else []
    # Without rank 0's shard the others may be stuck in a collective of their own build: don't wait for them.
    if not own_error and not router.started.wait(config.start_timeout_s):
        problems.append(f"{router.missing()} worker(s) did not report ready within {config.start_timeout_s}s "
                        "(EngineConfig.start_timeout_s)")
    problems += [f"rank {f.rank}:\n{f.error}" for f in router.failed]
    if not problems:
        try:
            check_memory(config, [worker.ready_message()] + router.ready)
        except LaunchError as exc:
            problems.append(str(exc))
    if problems:
        why = "\n".join(problems)
        channel.send(msg.Shutdown())
        channel.close(timeout=30)
        dist.destroy_process_group()
        raise LaunchError(f"a worker failed to start:\n{why}")

    def on_close(dead: bool):
        channel.send(msg.Shutdown())
        clean = channel.close(timeout=config.shutdown_grace_s)
        serve_thread.join(config.shutdown_grace_s)
        if clean:
            dist.destroy_process_group()

    engine = Engine(config, configs, layout, channel, [worker.ready_message()] + router.ready,
                    on_close=on_close)
    router.attach(engine)
    engine.start()
    _install_exit_hooks(engine)
    return engine
