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
from ..quant.apply import default_mode, float_rows, quantize_shard, weight_format
from ..storage.paper_store import PaperStore
from ..storage.store import ShardStore, Store

log = logging.getLogger("computron.worker")

BUILD_SWITCH_INTERVAL_S = 2e-4
"""The GIL switch interval while a model is built beside the command loop (Python's default is 5 ms)."""


def packs_linears(config: EngineConfig, mc: ModelConfig) -> bool:
    """Whether a CPU rank runs this model's Linears on packed weights (``EngineConfig.pack_cpu_linears``): with
    'pinned', only a model pinned as its shard is built, which never leaves the device. A model that swaps keeps
    its weights as the load copies them: a pack would be dropped at each offload and made again at the first
    forward after each load, a layout every swap pays for."""
    return config.pack_cpu_linears is True or (config.pack_cpu_linears == "pinned" and mc.pinned)


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
                           pack_linears=packs_linears(self.config, mc), prefix_cache=self.config.prefix_cache,
                           compile_decode=self.config.compile_decode,
                           cpu_attention=self.config.cpu_decode_attention,
                           attention_backend=self.config.attention_backend)
        runner, source = self._from_checkpoint(mid, mc, ctx)
        if runner is None and mc.quantization is not None:
            raise ValueError(f"model {mid!r}: quantization={mc.quantization!r} needs a safetensors checkpoint "
                             "(ModelConfig.checkpoint) of a family the runners split; this model is built by its "
                             "model_fn")
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
        from ..storage import gguf_native
        gguf_file = gguf_native.source_of(path)
        if gguf_file is not None and mc.quantization is not None:
            raise ValueError(f"model {mid!r}: quantization={mc.quantization!r}: a GGUF file ({gguf_file}) is "
                             "served at the quantization it holds")
        try:
            module, names = ck.meta_model(path, dtype, mid)
            gguf_names = gguf_native.name_map(module) if gguf_file is not None else None
            runner = make_runner(module, mc, ctx)
            if gguf_file is not None:
                source = gguf_native.GGUFSource(mid, path, names, runner.module, gguf_names, module.config)
            else:
                source = ck.CheckpointSource(mid, path, names, runner.module)
        except ck.Unsupported as exc:
            log.info("rank %d: %s is read through its model_fn (%s)", self.rank, mid, exc)
            return None, None
        if gguf_file is not None:
            counts = quantize_shard(runner, source, mid, ctx.tp, self.device, source.formats, mc.quant_compute)
            source.finish()
            runner.weight_format = weight_format(counts, "gguf")
            log.info("rank %d: %s: Linears read from %s as they are stored (%s), computed %s", self.rank, mid,
                     gguf_file, ", ".join(f"{n} {f}" for f, n in sorted(counts.items())) or "none quantized",
                     mc.quant_compute or default_mode(self.device))
        elif mc.quantization is not None:
            self._quantize(mid, mc, ctx, runner, source)
        return runner, source

    def _quantize(self, mid: str, mc: ModelConfig, ctx: StageContext, runner, source) -> None:
        from ..quant.formats import parse_quantization
        from ..storage.checkpoint import Read
        fmt = parse_quantization(mc.quantization)

        def formats(key):
            e = source.entries[key]
            return (fmt, float_rows(fmt, key, e.shape[1], Read), e.shape[1]) if len(e.shape) == 2 else None
        counts = quantize_shard(runner, source, mid, ctx.tp, self.device, formats, mc.quant_compute)
        runner.weight_format = fmt.name
        log.info("rank %d: %s: %s Linears quantized at load to %s, computed %s", self.rank, mid,
                 sum(counts.values()), fmt.name, mc.quant_compute or default_mode(self.device))


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


def held_format(runner, store) -> str:
    """How a model's weights are held on this rank: ``quant``'s format of its quantized Linears, else the dtype
    most of its bytes are in."""
    fmt = getattr(runner, "weight_format", None)
    if fmt:
        return fmt
    by_dtype: dict = {}
    for s in store.slots:
        by_dtype[s.dtype] = by_dtype.get(s.dtype, 0) + s.numel * s.dtype.itemsize
    return str(max(by_dtype, key=by_dtype.get)).replace("torch.", "") if by_dtype else ""
