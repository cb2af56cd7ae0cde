"""A worker rank: builds its shard of every model, then executes commands in order.

Commands arrive in the same order on every rank. LOAD starts an asynchronous
copy and returns at once, so batches of other models keep running meanwhile;
OFFLOAD and RUN execute in the command loop. Any command that raises is
reported to the master as ``CommandFailed`` and the loop goes on.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from typing import Dict, List, Optional

import torch

from . import messages as msg
from .config import EngineConfig, ModelConfig
from .models import StageContext, make_runner
from .store import DevicePool, PaperStore, ShardStore

log = logging.getLogger("computron.worker")


class Worker:
    def __init__(self, rank: int, groups, channel, model_configs: List[ModelConfig],
                 engine_config: EngineConfig, device: torch.device):
        self.rank = rank
        self.groups = groups
        self.channel = channel
        self.config = engine_config
        self.device = device
        self.model_configs = {mc.model_id: mc for mc in model_configs}
        self.runners: Dict[str, object] = {}
        self.stores: Dict[str, object] = {}
        self.pool = DevicePool(device) if device.type == "cpu" else None
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._busy: Optional[tuple] = None  # (seq, since) of the command being executed
        self._stop_heartbeat = threading.Event()

    # ---- start-up ------------------------------------------------------------
    def build(self) -> None:
        for mid, mc in self.model_configs.items():
            t0 = time.perf_counter()
            module = mc.model_fn(**mc.model_kwargs)
            if not isinstance(module, torch.nn.Module):
                raise TypeError(f"model {mid!r}: model_fn returned {type(module).__name__}, not a torch.nn.Module")
            module.eval()
            ctx = StageContext(groups=self.groups, device=self.device, model_id=mid)
            runner = make_runner(module, mc, ctx)
            if self.config.paper_mode:
                store = PaperStore(runner.module, runner.segments, self.device, mc.mutable_buffers)
            else:
                store = ShardStore(runner.module, runner.segments, self.device, pool=self.pool,
                                   mutable_buffers=mc.mutable_buffers, copy_stream=self.copy_stream)
            self.runners[mid] = runner
            self.stores[mid] = store
            log.info("rank %d built %s: %.1f MB shard in %.2fs", self.rank, mid, store.nbytes / 2**20,
                     time.perf_counter() - t0)

    def ready_message(self) -> msg.WorkerReady:
        return msg.WorkerReady(rank=self.rank, pid=os.getpid(), host=socket.gethostname(),
                               device=str(self.device),
                               host_bytes={m: s.nbytes for m, s in self.stores.items()},
                               batching={m: r.batching_defaults() for m, r in self.runners.items()
                                         if hasattr(r, "batching_defaults")})

    def device_bytes(self) -> int:
        """Weights and KV caches held on this rank's device."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return sum(s.device_bytes() for s in self.stores.values()) + self.kv_bytes()

    def kv_bytes(self) -> int:
        return sum(r.kv_bytes() for r in self.runners.values() if hasattr(r, "kv_bytes"))

    # ---- liveness ------------------------------------------------------------
    def start_heartbeat(self, interval_s: float) -> None:
        """Tell the master we are alive, and what the command loop is doing, from a thread of its own."""
        def beat():
            while not self._stop_heartbeat.wait(interval_s):
                busy = self._busy
                now = time.perf_counter()
                try:
                    self.channel.reply(msg.Heartbeat(rank=self.rank, sent=time.time(),
                                                     busy_seq=busy[0] if busy else None,
                                                     busy_s=now - busy[1] if busy else 0.0))
                except Exception:  # noqa: BLE001 - the master is gone; the parent watch ends us
                    return
        threading.Thread(target=beat, name=f"computron-heartbeat-{self.rank}", daemon=True).start()

    # ---- the command loop ----------------------------------------------------
    def serve(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # attach mode runs worker 0 in a thread of its own
        self.start_heartbeat(min(self.config.heartbeat_timeout_s / 4, 1.0))
        while True:
            cmd = self.channel.recv()
            if isinstance(cmd, msg.Shutdown):
                self._stop_heartbeat.set()
                for store in self.stores.values():
                    try:
                        store.wait_loaded()
                    except Exception:  # noqa: BLE001 - shutting down anyway
                        pass
                return
            self._busy = (cmd.seq, time.perf_counter())
            try:
                self._execute(cmd)
            except Exception as exc:  # noqa: BLE001 - reported, the loop goes on
                detail = f"{type(exc).__name__}: {exc}"
                fatal = is_fatal_transport_error(exc)
                log.warning("rank %d: %s failed%s: %s\n%s", self.rank, type(cmd).__name__,
                            " (fatal)" if fatal else "", detail, traceback.format_exc())
                self.channel.reply(msg.CommandFailed(seq=cmd.seq, rank=self.rank,
                                                     model_id=getattr(cmd, "model_id", None), error=detail,
                                                     fatal=fatal))
            finally:
                self._busy = None

    def _store(self, model_id: str):
        try:
            return self.stores[model_id]
        except KeyError:
            raise KeyError(f"unknown model id {model_id!r}") from None

    def _execute(self, cmd) -> None:
        if isinstance(cmd, msg.Load):
            store = self._store(cmd.model_id)

            def done(start, end, error, seq=cmd.seq, mid=cmd.model_id):
                if error is not None:
                    self.channel.reply(msg.CommandFailed(seq=seq, rank=self.rank, model_id=mid,
                                                         error=f"{type(error).__name__}: {error}"))
                else:
                    self.channel.reply(msg.Loaded(seq=seq, rank=self.rank, model_id=mid, start=start, end=end,
                                                  nbytes=store.nbytes, device_bytes=self.device_bytes()))
            store.begin_load(done)  # returns at once, except in paper mode where it copies here
        elif isinstance(cmd, msg.Step):
            store = self._store(cmd.model_id)
            runner = self.runners[cmd.model_id]
            if not hasattr(runner, "step"):
                raise TypeError(f"model {cmd.model_id!r} does not generate tokens step by step")
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = runner.step(cmd, store.wait_segment)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            is_out = self.rank == self.groups.layout.output_rank
            self.channel.reply(msg.StepDone(
                seq=cmd.seq, rank=self.rank, model_id=cmd.model_id, start=t0, end=time.perf_counter(),
                sids=out["sids"] if is_out else (), tokens=out["tokens"] if is_out else (),
                ended=out["ended"] if is_out else (), running=out["running"], kv_bytes=runner.kv_bytes()))
        elif isinstance(cmd, msg.Offload):
            store = self._store(cmd.model_id)
            t0 = time.perf_counter()
            runner = self.runners[cmd.model_id]
            if hasattr(runner, "drop_running"):  # its KV cache cannot outlive the weights
                runner.drop_running()
            store.offload()
            self.channel.reply(msg.Offloaded(seq=cmd.seq, rank=self.rank, model_id=cmd.model_id, start=t0,
                                             end=time.perf_counter(), device_bytes=self.device_bytes()))
        elif isinstance(cmd, msg.RunBatch):
            store = self._store(cmd.model_id)
            t0 = time.perf_counter()
            with torch.inference_mode():  # the runner waits for the weights inside its failure handling
                out = self.runners[cmd.model_id].run(cmd.batch, store.wait_segment)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            is_out = self.rank == self.groups.layout.output_rank
            self.channel.reply(msg.BatchDone(seq=cmd.seq, rank=self.rank, model_id=cmd.model_id, start=t0,
                                             end=time.perf_counter(), output=out if is_out else None,
                                             has_output=is_out))
        elif isinstance(cmd, msg.QueryStats):
            self.channel.reply(msg.Stats(
                seq=cmd.seq, rank=self.rank, device_bytes=self.device_bytes(),
                device_reserved_bytes=self.pool.reserved_bytes() if self.pool else (
                    torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0),
                host_bytes=sum(s.nbytes for s in self.stores.values()),
                resident=tuple(m for m, s in self.stores.items() if s.resident)))
        else:
            raise TypeError(f"unknown command {type(cmd).__name__}")


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
    if not isinstance(exc, RuntimeError) or type(exc).__name__ == "UpstreamFailed":
        return False
    text = str(exc).lower()
    return any(m in text for m in _FATAL_MARKERS) and any(w in text for w in ("gloo", "pair", "nccl"))
