"""Per-process set-up of the engine's processes (the master and each worker): logging, the torch threads a
worker gets, its pinning and the helper threads it lends its CPU products to, its device, dying with the
parent, and the rendezvous store (how workers are started: ``worker_start``)."""
from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as dist

from ..config import EngineConfig

log = logging.getLogger(__name__)


def host_rendezvous(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The process group's store, served by the master on ``port`` (0: the kernel picks one, read back from
    ``.port``). Binding here, rather than picking a free port for a worker to bind later, leaves no window in
    which another process (a second engine on this machine, Ray) takes the port first."""
    return dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def join_rendezvous(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
    """Join the default process group through the master's store (``host_rendezvous``) within ``timeout_s``
    (``EngineConfig.rendezvous_timeout_s``), else fail naming the address waited for."""
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - re-raised naming where it waited
        raise rendezvous_error(f"rank {rank}", host, port, timeout_s, exc) from exc


def rendezvous_error(who: str, host: str, port: int, timeout_s: float, exc: BaseException) -> RuntimeError:
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return RuntimeError(f"{who} could not join the process group of the rendezvous at {host}:{port} within "
                        f"{timeout_s:g}s (EngineConfig.rendezvous_timeout_s): {type(exc).__name__}: {first}. "
                        "Is every node started, can this host reach that address, and do the nodes' host names "
                        "resolve to addresses the others can reach (see GLOO_SOCKET_IFNAME)?")


def keepalive_interval(config: EngineConfig) -> float:
    """How often an idle master tells its workers it is still there (their own heartbeat interval)."""
    return min(config.heartbeat_timeout_s / 4, 1.0)


def destroy_group_in_background(wait_s: float) -> None:
    """A thread may still sit in a receive from a dead peer: don't let that block the caller for long
    (usually the group is gone by then, so a later LaunchEngine in this process can start its own)."""
    t = threading.Thread(target=dist.destroy_process_group, daemon=True)
    t.start()
    t.join(wait_s)


def device_for(config: EngineConfig, local_rank: int, local_world: int) -> torch.device:
    if config.resolved_device() == "cpu":
        return torch.device("cpu")
    n = torch.cuda.device_count()
    if n < local_world:
        raise RuntimeError(f"{local_world} workers on this node need as many GPUs; found {n}")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def setup_logging(config: EngineConfig, rank: Optional[int] = None) -> None:
    """Logging of the ``computron`` loggers in this process: a worker ``rank``, or the master (None).

    INFO by default (``COMPUTRON_LOG_LEVEL`` overrides; a level the application set on the
    ``computron`` logger is kept), wall-clock timestamps to the millisecond. Workers write to stderr,
    which spawned workers share with the master's console, or only to ``log_dir/worker_<rank>.log``
    when ``EngineConfig.log_dir`` is set. The master (and rank 0 under a launcher) writes to its
    console unless the application installed its own handlers, and also to ``log_dir/master.log``
    or the file ``COMPUTRON_LOG_FILE`` names. Also silences third-party noise the engine triggers:
    torch's "CPU process group does not support alltoall yet" and transformers' progress bars.
    """
    who = "master" if rank is None else f"rank{rank}"
    fmt = logging.Formatter(f"%(asctime)s.%(msecs)03d {who} %(name)s %(levelname)s: %(message)s",
                            datefmt="%Y-%m-%d %H:%M:%S")
    root = logging.getLogger("computron")
    for h in [h for h in root.handlers if getattr(h, "_computron", False)]:  # a second launch in this process
        root.removeHandler(h)
        h.close()
    env_level = os.environ.get("COMPUTRON_LOG_LEVEL")
    if env_level:
        root.setLevel(env_level.upper())
    elif root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    handlers = []
    if rank is not None and config.log_dir:
        os.makedirs(config.log_dir, exist_ok=True)
        handlers.append(logging.FileHandler(os.path.join(config.log_dir, f"worker_{rank}.log")))
    elif not root.handlers and not logging.getLogger().handlers:
        handlers.append(logging.StreamHandler())  # stderr: the master's console for spawned workers
    hosts_master = rank is None or (rank == 0 and "RANK" in os.environ)
    master_file = os.environ.get("COMPUTRON_LOG_FILE") or (
        os.path.join(config.log_dir, "master.log") if config.log_dir else None)
    if hosts_master and master_file:
        os.makedirs(os.path.dirname(os.path.abspath(master_file)), exist_ok=True)
        handlers.append(logging.FileHandler(master_file))
    for h in handlers:
        h.setFormatter(fmt)
        h._computron = True  # our own handlers, found again (and replaced) by a second launch
        root.addHandler(h)
    quiet_third_party(worker=rank is not None)
    age = process_age_s()
    if rank is not None and age is not None:
        logging.getLogger("computron.worker").info(
            "rank %d: process up %.2fs after it started (interpreter and imports), %.2f CPU s", rank, age,
            time.process_time())


def process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux ``/proc``), or None where that is not known."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def quiet_third_party(worker: bool) -> None:
    torch_log = logging.getLogger("torch.distributed.tensor._collective_utils")
    if not any(getattr(f, "_computron", False) for f in torch_log.filters):
        def no_alltoall(record):  # gloo's DTensor redistribution falls back to allgather: expected here
            return "does not support alltoall" not in record.getMessage()
        no_alltoall._computron = True
        torch_log.addFilter(no_alltoall)
    if not worker:  # the master builds no model: leave the application's progress bars alone
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when huggingface_hub is imported
    if "transformers" in sys.modules:  # already imported (a from_pretrained model_fn): switch its bars off
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()


def adopt_environment(env: dict) -> None:
    """In a worker: the master's environment as it was at the launch (see ``worker_start.worker_context``)."""
    if env != os.environ:
        os.environ.clear()
        os.environ.update(env)


def die_with_parent(parent_thread_lasts: bool) -> None:
    """Exit when the master does: by ``PR_SET_PDEATHSIG`` where the thread that forked this process lives as
    long as the master (the fork server's, which exits with the master, or the master's main thread: the
    signal fires when that *thread* exits), and when multiprocessing's pipe from the master closes."""
    if parent_thread_lasts:
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    parent = mp.parent_process()
    if parent is None:
        return

    def watch():
        mpc.wait([parent.sentinel])
        os._exit(1)
    threading.Thread(target=watch, name="computron-parent-watch", daemon=True).start()


def threads_per_worker(config: EngineConfig, local_world: int) -> int:
    if config.worker_threads:
        return config.worker_threads
    return max(1, ((os.cpu_count() or 1) - 1) // local_world)  # leave a core to the master


def usable_cores() -> List[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pin_and_lend(config: EngineConfig, device: torch.device, local_rank: int, local_world: int,
                 threads: int, world: int, *, packs: bool) -> int:
    """Pin this worker where ``EngineConfig.pin_workers`` says so or where it gets helper threads
    (``EngineConfig.cpu_helpers``: they need the worker to keep its core), to cores no other worker of this host
    holds (``core_claims``), and start the helpers on the cores left; returns how many helpers run. Only an
    engine whose ranks are all on this host (``world`` of them) and some of whose models run on packed Linears
    (``packs``: the helpers share only packed products) gets helpers: ranks of other nodes, maybe on this host
    too, would wait on a pinned worker whose core is busy. Where its cores are taken, it is neither pinned nor
    helped (one INFO line says so)."""
    from . import affinity, core_claims
    cores = usable_cores()
    enabled = device.type == "cpu" and config.cpu_helpers and packs
    helpers = affinity.helper_count(enabled and local_world == world, len(cores), local_world, threads)
    wanted = "auto" if helpers else config.pin_workers
    if not hasattr(os, "sched_setaffinity") or affinity.worker_cores(wanted, cores, local_rank, local_world,
                                                                     threads) is None:
        return 0
    mine = core_claims.claim(affinity.claim_order(cores, local_rank, local_world, threads), threads)
    if not mine:
        log.info("worker %d: the cores it would be pinned to are held by other workers "
                                         "on this host: not pinned, no helper threads", local_rank)
        return 0
    os.sched_setaffinity(0, mine)
    where = affinity.helper_cores(helpers, cores, mine, [c for c in cores if core_claims.held_elsewhere(c)])
    if not where:
        return 0
    from ..kernels.cpu import gemm as cpu_gemm
    return cpu_gemm.lend_cores(min(helpers, len(where)), where)
