"""Building one rank's shard of one model, at start-up and while serving.

At start-up every rank builds every configured model on its command loop, in the
same order, before it serves: TP splitting may then scatter rank 0's weights over
the TP group. A model added while serving (``messages.AddModel``) is built on
``BackgroundJobs``' thread instead, beside the command loop, so the models that
are generating keep stepping; it must not use the TP group the steps use, so each
rank cuts its own slices out of identical full weights (a checkpoint, or a
``model_fn`` seeded by the model's id) without communicating.

Building is mostly Python (module construction): a thread doing it would hold
the GIL for whole switch intervals against the command loop, whose every torch
call releases and retakes it. While a build runs the switch interval is short
and the build thread's CPU priority low (``niceness.py``), so a step waits
microseconds for the GIL, not milliseconds.
"""
from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..config import EngineConfig, ModelConfig
from ..loading import checkpoint_of
from ..models import StageContext, make_runner
from ..models.base import StageRunner
from ..niceness import lower_this_thread
from ..storage.paper_store import PaperStore
from ..storage.store import ShardStore, Store

log = logging.getLogger("computron.worker")

BUILD_SWITCH_INTERVAL_S = 2e-4
"""The GIL switch interval while a model is built beside the command loop (Python's default is 5 ms)."""


@dataclass
class BuiltShard:
    runner: StageRunner
    store: Store
    from_checkpoint: bool
    seconds: float
    where: str
    """Where the shard is now, for the log: host memory (with its read rate), or disk."""
    read_s: float = 0.0
    read_bytes: int = 0
    in_host: bool = True


class ShardBuilder:
    """Builds this rank's runner and store of one model."""

    def __init__(self, rank: int, groups, device: torch.device, config: EngineConfig, pool, copy_stream,
                 host_pool):
        self.rank = rank
        self.groups = groups
        self.device = device
        self.config = config
        self.pool = pool
        self.copy_stream = copy_stream
        self.host_pool = host_pool

    def build(self, mid: str, mc: ModelConfig, host_room: Callable[[int], bool],
              while_serving: bool = False) -> BuiltShard:
        """A model with a local safetensors checkpoint (``loading.checkpoint_of``) is built on the meta
        device and only this rank's slices are read, into host memory when ``host_room(bytes)`` says they
        fit, else left on disk until its first load; any other model is built in full by its ``model_fn``
        and cut down."""
        t0 = time.perf_counter()
        ctx = StageContext(groups=self.groups, device=self.device, model_id=mid,
                           scatter_from=None if while_serving else 0, kv_cache=self.config.kv_cache,
                           kv_block_size=self.config.kv_block_size, kv_reserve=self.config.kv_reserve,
                           pack_linears=self.config.pack_cpu_linears, prefix_cache=self.config.prefix_cache,
                           compile_decode=self.config.compile_decode,
                           cpu_attention=self.config.cpu_decode_attention,
                           attention_backend=self.config.attention_backend)
        runner, source = self._from_checkpoint(mid, mc, ctx)
        if runner is None:
            if while_serving and ctx.tp > 1:
                torch.manual_seed(zlib.crc32(mid.encode()))  # identical full weights on every rank
            module = mc.model_fn(**mc.model_kwargs)
            if not isinstance(module, torch.nn.Module):
                raise TypeError(f"model {mid!r}: model_fn returned {type(module).__name__}, not a torch.nn.Module")
            module.eval()
            runner = make_runner(module, mc, ctx)
        if self.config.paper_mode:
            store = PaperStore(runner.module, runner.segments, self.device, mc.mutable_buffers)
        else:
            store = ShardStore(runner.module, runner.segments, self.device, pool=self.pool,
                               mutable_buffers=mc.mutable_buffers, copy_stream=self.copy_stream,
                               source=source, host_pool=self.host_pool, keep_host=False)
        built = BuiltShard(runner, store, source is not None, 0.0, "host")
        if source is not None:
            if host_room(store.nbytes):
                dt, nb = store.read_host()
                built.read_s, built.read_bytes = dt, nb
                built.where = f"host, read {nb / 2**20:.1f} MB in {dt:.2f}s = {nb / max(dt, 1e-9) / 1e9:.2f} GB/s"
            else:
                built.in_host = False
                built.where = "disk (beyond host_budget: read on first load)"
        built.seconds = time.perf_counter() - t0
        return built

    def _from_checkpoint(self, mid: str, mc: ModelConfig, ctx: StageContext):
        """(runner, source) built from checkpoint slices, or (None, None) to use model_fn."""
        from ..storage import checkpoint as ck
        where = checkpoint_of(mc)
        if where is None or self.config.paper_mode:
            return None, None
        path, dtype = where
        if mc.checkpoint is not None and not os.path.isdir(path):
            raise FileNotFoundError(f"model {mid!r}: ModelConfig.checkpoint={path!r} is not a directory")
        try:
            module, names = ck.meta_model(path, dtype, mid)
            runner = make_runner(module, mc, ctx)
            source = ck.CheckpointSource(mid, path, names, runner.module)
        except ck.Unsupported as exc:
            log.info("rank %d: %s is read through its model_fn (%s)", self.rank, mid, exc)
            return None, None
        return runner, source


class BackgroundJobs:
    """One thread that runs a worker's background jobs one at a time, in the order they were submitted: the
    builds of models added while serving (in their commands' order, the same on every rank), and, as a second
    instance named ``what``, the reads ahead of ``host_tier`` (mostly I/O, so ``switch_interval_s`` None
    leaves the GIL's alone)."""

    def __init__(self, rank: int, what: str = "build", switch_interval_s: Optional[float] = BUILD_SWITCH_INTERVAL_S):
        self._rank = rank
        self._what = what
        self._switch_interval_s = switch_interval_s
        self._jobs: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def submit(self, job: Callable[[], None]) -> None:
        """``job`` does its work and replies itself; it must not raise."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"computron-{self._what}-{self._rank}",
                                            daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        lower_this_thread(f"{self._what} work beside the command loop")
        while True:
            job = self._jobs.get()
            if job is None:
                return
            before = sys.getswitchinterval()
            if self._switch_interval_s is not None:
                sys.setswitchinterval(self._switch_interval_s)
            try:
                job()
            except Exception:  # noqa: BLE001 - a job replies its own failures; this is a bug, said out loud
                log.exception("rank %d: a background %s job failed unexpectedly", self._rank, self._what)
            finally:
                if self._switch_interval_s is not None:
                    sys.setswitchinterval(before)

    def close(self, timeout: float) -> None:
        """Let the build in hand finish (within ``timeout``); builds not started are dropped."""
        if self._thread is None:
            return
        while True:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
        self._jobs.put(None)
        self._thread.join(timeout)
