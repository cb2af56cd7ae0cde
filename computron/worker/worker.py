"""A worker rank: builds its shard of every model, then executes commands in order.

Models added while serving are built on a thread beside the command loop
(``shard_builder.BackgroundJobs``) and removed on the loop itself. Under
``host_budget``, which shards stay in host memory (and the models kept there by
plan, read ahead of their loads) is ``host_tier.HostTier``'s business.

Commands arrive in the same order on every rank. LOAD starts an asynchronous
copy and returns at once, so batches of other models keep running meanwhile;
OFFLOAD and RUN execute in the command loop. Each command type has one handler
(``Worker._handlers``) and one reply type (see ``messages``). Any command that
raises is reported to the master as ``CommandFailed`` and the loop goes on.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import traceback
from functools import partial
from typing import Any, Callable, Dict, List, Optional

import torch

from ..comm import messages as msg
from ..comm import p2p
from ..config import EngineConfig, ModelConfig
from ..models.base import GenerativeRunner, ParkResult, StageRunner
from ..storage.memory import DevicePool, HostPool
from ..storage.store import Store
from .changes import ModelChanges
from .host_tier import HostTier
from .master_watch import MasterSilence, MasterWatch, exit_master_gone
from .shard_builder import BackgroundJobs, ShardBuilder, held_format

log = logging.getLogger("computron.worker")


class StepAborted(RuntimeError):
    """A step sent ahead of one that failed on some rank: no rank ran it (``messages.Step.ahead``)."""


class Worker(ModelChanges, HostTier):
    def __init__(self, rank: int, groups, channel, model_configs: List[ModelConfig],
                 engine_config: EngineConfig, device: torch.device):
        self.rank = rank
        self.groups = groups
        self.channel = channel
        self.config = engine_config
        self.device = device
        self.model_configs = {mc.model_id: mc for mc in model_configs}
        self.runners: Dict[str, StageRunner] = {}
        self.stores: Dict[str, Store] = {}
        self.pool = DevicePool(device) if device.type == "cpu" else None
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.host_pool = HostPool(pin=device.type == "cuda") if engine_config.host_budget is not None else None
        self._host_clock = 0  # host LRU: last load of each model
        self._busy: Optional[tuple] = None  # (seq, since) of the command being executed
        self._failed_steps: set = set()  # models whose last step raised here (a step sent ahead then aborts)
        self._stop_heartbeat = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None
        self._watch: Optional[MasterWatch] = None
        """The watchdog on the master (a remote one only): told of every contact."""
        self._leaving = threading.Event()
        """Set when the master is gone: no command starts after it."""
        self._builder = ShardBuilder(rank, groups, device, engine_config, self.pool, self.copy_stream,
                                     self.host_pool)
        self._builds = BackgroundJobs(rank)
        self._init_host_tier()
        self.lora: Dict[str, Any] = {}
        """Model key -> its ``lora.slots.LoraSlots``, once an adapter was added to it."""
        self._registry_lock = threading.Lock()
        """Models added or removed while serving replace ``runners``/``stores``/``model_configs`` with new
        dicts under this lock (never mutate them): another thread may be iterating over the old ones."""
        self._handlers: Dict[type, Callable[[Any], None]] = {
            msg.Load: self._on_load, msg.Offload: self._on_offload, msg.Drop: self._on_drop,
            msg.RunBatch: self._on_run, msg.Step: self._on_step, msg.QueryStats: self._on_stats,
            msg.AddModel: self._on_add_model, msg.RemoveModel: self._on_remove_model,
            msg.AddAdapter: self._on_add_adapter, msg.RemoveAdapter: self._on_remove_adapter,
            msg.SetHostModels: self._on_set_host_models}
        """The command loop's dispatch: one handler per command type (``Shutdown`` ends the loop)."""

    # ---- start-up ------------------------------------------------------------
    def build(self) -> None:
        """Build this rank's shard of every configured model (``shard_builder``), in the same order on
        every rank, into host memory while ``host_budget`` allows."""
        budget = self.config.host_budget
        read_s, read_bytes = 0.0, 0
        n = len(self.model_configs)
        t_start = time.perf_counter()
        for k, (mid, mc) in enumerate(self.model_configs.items()):
            try:
                built = self._builder.build(mid, mc, partial(self._reserve_host, mid))
                self.runners[mid], self.stores[mid] = built.runner, built.store
            finally:
                self._settle_host(mid)
            read_s, read_bytes = read_s + built.read_s, read_bytes + built.read_bytes
            self._log_built(mid, built, f"({k + 1}/{n})")
        if read_bytes:
            log.info("rank %d read %.1f MB of checkpoint slices in %.2fs = %.2f GB/s", self.rank,
                     read_bytes / 2**20, read_s, read_bytes / max(read_s, 1e-9) / 1e9)
        log.info("rank %d built all %d models in %.2fs", self.rank, n, time.perf_counter() - t_start)
        with self._host_lock:
            used = self._host_used()
        if budget is not None and used > budget:
            log.warning("rank %d: models without a safetensors checkpoint hold %.1f MB of host memory, over "
                        "host_budget=%d bytes (they cannot go back to disk)", self.rank, used / 2**20, budget)

    def _log_built(self, mid: str, built, count: str) -> None:
        log.info("rank %d built %s %s: %.1f MB shard %s in %.2fs [%s]", self.rank, mid, count,
                 built.store.nbytes / 2**20,
                 "from checkpoint slices" if built.from_checkpoint else "from model_fn", built.seconds,
                 built.where)

    def host_resident(self) -> tuple:
        """Models whose shard this rank holds in host memory."""
        return tuple(m for m, s in self.stores.items() if s.host_resident)

    def ready_message(self) -> msg.WorkerReady:
        return msg.WorkerReady(rank=self.rank, pid=os.getpid(), host=socket.gethostname(),
                               device=str(self.device),
                               host_bytes={m: s.nbytes for m, s in self.stores.items()},
                               device_memory=_device_memory(self.device),
                               host_resident=self.host_resident(),
                               batching={m: r.batching_defaults() for m, r in self.runners.items()
                                         if isinstance(r, GenerativeRunner)},
                               weight_formats={m: held_format(self.runners[m], s) for m, s in self.stores.items()},
                               device_need={m: s.device_need for m, s in self.stores.items()
                                            if getattr(s, "device_need", 0) > s.nbytes})

    def device_bytes(self) -> int:
        """Weights and KV caches held on this rank's device."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return sum(s.device_bytes() for s in self.stores.values()) + self.kv_bytes()

    def kv_bytes(self) -> int:
        """KV caches on this rank's device (all models)."""
        return sum(r.kv_bytes() for r in self.runners.values())

    def host_kv_bytes(self) -> int:
        """KV caches of paused sequences parked in host memory (all models)."""
        return sum(r.host_kv_bytes() for r in self.runners.values())

    # ---- liveness ------------------------------------------------------------
    def start_heartbeat(self, interval_s: float) -> None:
        """Tell the master we are alive, and what the command loop is doing, from a thread of its own."""
        self._heartbeat = threading.Thread(target=self._beat, args=(interval_s,),
                                           name=f"computron-heartbeat-{self.rank}", daemon=True)
        self._heartbeat.start()

    def _beat(self, interval_s: float) -> None:
        """The heartbeat thread. It stops on the first failure, always out loud: a silent stop would
        look like a hung worker to the master."""
        while not self._stop_heartbeat.wait(interval_s):
            try:
                beat = self._heartbeat_message()
            except Exception:  # noqa: BLE001 - a bug: said with its traceback
                log.exception("rank %d: heartbeats stop: building one failed", self.rank)
                return
            try:
                self.channel.reply(beat)
            except Exception as exc:  # noqa: BLE001 - said out loud: a silent stop looks like a hang
                log.warning("rank %d: heartbeats stop: %s: %s (the master is gone, or the control "
                            "plane broke)", self.rank, type(exc).__name__, exc)
                return
            watch = self._watch
            if watch is not None:  # the master's receiver took it: the master is there
                watch.heard()

    def _heartbeat_message(self) -> msg.Heartbeat:
        busy = self._busy
        now = time.perf_counter()
        return msg.Heartbeat(rank=self.rank, sent=time.time(), busy_seq=busy[0] if busy else None,
                             busy_s=now - busy[1] if busy else 0.0)

    # ---- the command loop ----------------------------------------------------
    def serve(self, master_pid: Optional[int] = None) -> None:
        """Execute commands until SHUTDOWN. ``master_pid``: the master's process where it runs on this host
        (the watchdog on the master, ``master_watch``, then tells a busy master from a gone one)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # attach mode runs worker 0 in a thread of its own
        watch = None
        if getattr(self.channel, "remote", False):  # not the master's own worker 0 in attach mode
            silence = MasterSilence(self.config.resolved_master_timeout_s(), self.config.heartbeat_late_limit_s,
                                    time.monotonic(), master_pid, start_s=self.config.start_timeout_s)
            watch = self._watch = MasterWatch(self.rank, silence, on_gone=self._leave)
            watch.start()
        self.start_heartbeat(min(self.config.heartbeat_timeout_s / 4, 1.0))
        while True:
            try:
                cmd = self.channel.recv()
            except Exception as exc:  # noqa: BLE001 - the master's end closed: said in one line, then exit
                if watch is None:
                    raise
                watch.broken(exc)
                raise
            if watch is not None:
                watch.heard()
            if isinstance(cmd, msg.Keepalive):
                continue
            if isinstance(cmd, msg.Shutdown):
                if watch is not None:
                    watch.stop()
                self._shut_down()
                return
            if self._leaving.is_set():  # the watchdog is ending the process: start nothing more
                continue
            self._busy = (cmd.seq, time.perf_counter())
            try:
                self._execute(cmd)
            except Exception as exc:  # noqa: BLE001 - reported, the loop goes on
                failure = self._failure(cmd.seq, getattr(cmd, "model_id", None), exc,  # QueryStats has none
                                        fatal=is_fatal_transport_error(exc))
                log.warning("rank %d: %s failed%s: %s\n%s", self.rank, type(cmd).__name__,
                            " (fatal)" if failure.fatal else "", failure.error, traceback.format_exc())
                self.channel.reply(failure)
            finally:
                self._busy = None

    def _leave(self, rank: int, why: str) -> None:
        """The master is gone (``master_watch``): no command starts any more, then the process ends (its memory
        with it) even if the command loop is stuck in a receive."""
        self._leaving.set()
        exit_master_gone(rank, why, cleanup=self._release_for_exit)

    def _release_for_exit(self) -> None:
        """Best effort, bounded by ``master_watch.CLEANUP_S``: stop the threads that would still talk to the
        master, and on a GPU abort the data plane's communicators so that no kernel waits on a cut-off peer."""
        self._stop_heartbeat.set()
        if self.device.type != "cuda":
            return
        import torch.distributed as dist
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is None:
            return
        for group in [self.groups.data, *self.groups.tp_groups]:
            if isinstance(group, dist.ProcessGroup):  # not the stages' groups this rank is no member of
                abort(group)

    def _shut_down(self) -> None:
        # a beat sent after our goodbye would wait forever for a master that stopped receiving,
        # and a thread left inside a send aborts the process at exit: let the last one land first
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=self.config.heartbeat_timeout_s)
        self._builds.close(timeout=self.config.shutdown_grace_s)
        self._close_host_tier(timeout=self.config.shutdown_grace_s)
        for store in self.stores.values():
            try:
                store.wait_loaded()
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass

    def _execute(self, cmd) -> None:
        handler = self._handlers.get(type(cmd))
        if handler is None:
            raise TypeError(f"unknown command {type(cmd).__name__}")
        handler(cmd)

    def _failure(self, seq: int, model_id: Optional[str], exc: BaseException,
                 fatal: bool = False) -> msg.CommandFailed:
        return msg.CommandFailed(seq=seq, rank=self.rank, model_id=model_id, error=f"{type(exc).__name__}: {exc}",
                                 fatal=fatal, exc_type=type(exc).__name__,
                                 upstream=isinstance(exc, p2p.UpstreamFailed))

    def _store(self, model_id: str) -> Store:
        try:
            return self.stores[model_id]
        except KeyError:
            raise KeyError(f"unknown model id {model_id!r}") from None

    def _sync_device(self) -> None:
        """Wait for the queued kernels, so that a reply's end time is the computation's."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # ---- one handler per command ---------------------------------------------
    def _on_load(self, cmd: msg.Load) -> None:
        store = self._store(cmd.model_id)
        self._host_clock += 1
        store.last_used = self._host_clock

        def done(start: float, end: float, error: Optional[BaseException]) -> None:  # on the load thread
            if error is not None:
                self.channel.reply(self._failure(cmd.seq, cmd.model_id, error))
                return
            self.channel.reply(msg.Loaded(seq=cmd.seq, rank=self.rank, model_id=cmd.model_id, start=start,
                                          end=end, nbytes=store.nbytes, device_bytes=self.device_bytes(),
                                          tier=store.last_tier, read_s=store.last_read_s,
                                          read_bytes=store.last_read_bytes, host_resident=self.host_resident(),
                                          model_device_bytes=store.device_bytes()))
        with self._host_lock:  # the read-ahead thread changes which stores hold host memory too
            if not store.resident and not store.host_resident:
                self._make_host_room(cmd.model_id, store)  # the disk read itself runs on the load thread
            store.begin_load(done)  # returns at once, except in paper mode where it copies here

    def _on_step(self, cmd: msg.Step) -> None:
        store = self._store(cmd.model_id)
        runner = self.runners[cmd.model_id]
        if not isinstance(runner, GenerativeRunner):
            raise TypeError(f"model {cmd.model_id!r} does not generate tokens step by step")
        t0 = time.perf_counter()
        if cmd.ahead and p2p.any_rank(cmd.model_id in self._failed_steps, runner.ctx.groups.data, runner.ctx.device):
            raise StepAborted(f"model {cmd.model_id!r}: not run: the step it was sent behind failed")
        self._failed_steps.add(cmd.model_id)
        with torch.no_grad():  # not inference_mode: see _on_run
            out = runner.step(cmd, store.wait_segment)
        self._sync_device()
        self._failed_steps.discard(cmd.model_id)
        if not runner.ctx.is_output_rank:  # every rank knows the step's outcome; one reports the tokens
            out = dataclasses.replace(out, sids=(), tokens=(), ended=(), logprobs=(), prompt_logprobs={})
        self.channel.reply(msg.StepDone(seq=cmd.seq, rank=self.rank, model_id=cmd.model_id, start=t0,
                                        end=time.perf_counter(), kv_bytes=runner.kv_bytes(), **vars(out)))

    def _on_offload(self, cmd: msg.Offload) -> None:
        store = self._store(cmd.model_id)
        t0 = time.perf_counter()
        runner = self.runners[cmd.model_id]
        parked = runner.park_running(cmd.recompute) if isinstance(runner, GenerativeRunner) else ParkResult()
        store.offload()
        runner.release_resident()
        if cmd.model_id in self.lora:  # adapters stay in host memory; their device slots go with the base
            self.lora[cmd.model_id].drop_device()
        self.channel.reply(msg.Offloaded(seq=cmd.seq, rank=self.rank, model_id=cmd.model_id, start=t0,
                                         end=time.perf_counter(), device_bytes=self.device_bytes(), **vars(parked)))

    def _on_drop(self, cmd: msg.Drop) -> None:
        t0 = time.perf_counter()
        runner = self.runners[cmd.model_id]
        if isinstance(runner, GenerativeRunner):
            runner.drop_sequences(cmd.sids)
        self.channel.reply(msg.Dropped(seq=cmd.seq, rank=self.rank, model_id=cmd.model_id, start=t0,
                                       end=time.perf_counter(), kv_bytes=runner.kv_bytes()))

    def _on_run(self, cmd: msg.RunBatch) -> None:
        store = self._store(cmd.model_id)
        runner = self.runners[cmd.model_id]
        t0 = time.perf_counter()
        # no_grad, not inference_mode: on inference tensors DTensor's sharding propagation misses its cache
        # and reaches the TP layouts through all-gathers (benchmarks/tp_forward.py: 3x the step's time)
        with torch.no_grad():  # the runner waits for the weights inside its failure handling
            out = runner.run(cmd.batch, store.wait_segment)
        self._sync_device()
        mine = runner.ctx.is_output_rank
        self.channel.reply(msg.BatchDone(seq=cmd.seq, rank=self.rank, model_id=cmd.model_id, start=t0,
                                         end=time.perf_counter(), output=out if mine else None, has_output=mine))

    def _on_stats(self, cmd: msg.QueryStats) -> None:
        self.channel.reply(msg.Stats(
            seq=cmd.seq, rank=self.rank, device_bytes=self.device_bytes(),
            device_reserved_bytes=self._reserved_bytes(),
            host_bytes=sum(s.host_bytes() for s in self.stores.values()),
            resident=tuple(m for m, s in self.stores.items() if s.resident),
            kv_bytes=self.kv_bytes(), host_kv_bytes=self.host_kv_bytes(), host_resident=self.host_resident(),
            host_kept=tuple(sorted(self.host_kept)),
            lora_fills=sum(s.fills for s in self.lora.values()),
            lora_fill_s=sum(s.fill_s for s in self.lora.values())))

    def _reserved_bytes(self) -> int:
        """Device memory held for reuse beyond what is allocated."""
        if self.pool is not None:
            return self.pool.reserved_bytes()
        return torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


_FATAL_MARKERS = ("connection closed", "connection reset", "timed out", "timeout", "broken pipe",
                  "socket closed")


def is_fatal_transport_error(exc: BaseException) -> bool:
    """A data-plane failure (a collective timed out, a peer's connection closed): the ranks are out
    of step and no later command can succeed, so the engine must die rather than fail one request."""
    import torch.distributed as dist
    dist_errors = tuple(getattr(dist, n) for n in ("DistError", "DistBackendError", "DistNetworkError")
                        if hasattr(dist, n))
    if isinstance(exc, dist_errors):
        return True
    if not isinstance(exc, RuntimeError) or isinstance(exc, p2p.UpstreamFailed):
        return False
    text = str(exc).lower()
    return any(m in text for m in _FATAL_MARKERS) and any(w in text for w in ("gloo", "pair", "nccl"))
