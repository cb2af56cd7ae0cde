"""Per-worker storage of model shards: the ``Store`` interface and ``ShardStore``, the fast swap.

``ShardStore`` (the fast path) keeps each model's shard in one contiguous host
buffer per dtype (pinned where CUDA exists). A load takes one device buffer per
dtype (reused across swaps: on CPU through ``DevicePool``, on CUDA through
torch's caching allocator), points every parameter at a view of it, and copies
the host buffer over in a few large chunks, segment by segment in execution
order, marking each segment ready as it lands so a forward may start on the
first layers while later ones are still copying. An offload only drops the
device buffer: inference never changes the weights, so the host copy stays
valid. Buffers named in ``mutable_buffers`` are the only tensors copied back.

A ``ShardStore`` with a ``source`` (``checkpoint.CheckpointSource``) has a disk
tier below: its host buffers may be released (``release_host``) and are read
back from the checkpoint on the next load, on the load thread, segment by
segment, with the host → device copy of each segment starting as soon as it has
been read. ``HostPool`` keeps released host buffers (pinned on CUDA) for the
next model read from disk.

``PaperStore`` (``paper_store.py``) swaps the way the paper did, for side-by-side
comparison. Both are a ``Store``, the one interface the worker uses; its defaults
describe a store without a disk tier. The host and device buffer pools live in
``memory.py``; how a shard is laid out in its buffers (``Slot``) and which
segments have arrived (``Readiness``) in ``segments.py``.
"""
from __future__ import annotations

import abc
import logging
import queue
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .memory import DevicePool, HostPool, free_host, pinned_empty  # the pools: still importable from here
from .segments import Readiness, arrivals, collect_slots

log = logging.getLogger("computron.store")


class Store(abc.ABC):
    """One model's shard on one worker. The defaults describe a store without a disk tier: its shard
    stays in host memory for good and every load finds it there."""

    def __init__(self, module: nn.Module, segments: Sequence[nn.Module], device: torch.device,
                 mutable_buffers: Sequence[str] = ()):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.slots = collect_slots(module, segments, mutable_buffers)
        self.n_segments = len(segments) + 1
        self.nbytes = sum(s.numel * s.dtype.itemsize for s in self.slots)
        self.arrivals = arrivals(module, segments)
        """Per segment, the modules that make their compute weights on arrival (quantized Linears)."""
        self.device_need = self.nbytes + sum(m.computron_made_bytes() for ms in self.arrivals for m in ms)
        """Device bytes a load takes: the shard, and what its quantized Linears make of it on arrival."""
        self._empty = {}
        self._ready: Optional[Readiness] = None
        self._hooks = [seg.register_forward_pre_hook(self._make_hook(i + 1))
                       for i, seg in enumerate(segments)]
        self.resident = False
        self.last_tier = "host"   # where the last load found the shard: "host" or "disk"
        self.last_read_s = 0.0    # disk read of the last load (or of start-up), seconds and bytes
        self.last_read_bytes = 0
        self.last_used = 0        # the worker's host LRU clock

    @abc.abstractmethod
    def begin_load(self, on_done: Callable[[float, float, Optional[BaseException]], None]) -> None:
        """Start copying to the device. ``on_done(start, end, error)`` runs when all has arrived."""

    @abc.abstractmethod
    def offload(self) -> None:
        """Drop the device copy."""

    @abc.abstractmethod
    def device_bytes(self) -> int:
        """Bytes of this shard on the device."""

    # ---- the disk tier (none here) -------------------------------------------
    @property
    def host_resident(self) -> bool:
        """Whether the shard is in host memory."""
        return True

    def host_bytes(self) -> int:
        """Host memory the shard holds now."""
        return self.nbytes

    @property
    def evictable(self) -> bool:
        """May leave host memory for disk now (``release_host``)."""
        return False

    def release_host(self) -> int:
        """Let the host copy go; returns the bytes freed."""
        raise RuntimeError(f"{type(self).__name__} keeps its shard in host memory: it has no disk tier")

    def close(self) -> None:
        """The model is removed: wait for a load in flight, drop the device copy and every host buffer."""
        try:
            self.wait_loaded()
        except RuntimeError:  # a failed load: offload releases what it took
            pass
        self.offload()
        for hook in self._hooks:
            hook.remove()

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._empty:
            self._empty[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return self._empty[dtype]

    def _make_hook(self, i: int):
        def hook(_module, _args):
            if self._ready is not None:
                self._ready.wait(i)
        return hook

    def wait_segment(self, i: int = 0) -> None:
        """Block (CPU) or make the compute stream wait (CUDA) until segment ``i`` has arrived."""
        if not self.resident:
            raise RuntimeError("model is not loaded on this worker")
        if self._ready is not None:
            self._ready.wait(i)

    def wait_loaded(self) -> None:
        if self._ready is not None:
            self._ready.done.wait()
            if self._ready.error is not None:
                raise RuntimeError(f"loading the weights failed: {self._ready.error}")


class ShardStore(Store):
    """The fast path: contiguous (pinned) host buffers, reused device buffers, chunked copies."""

    def __init__(self, module, segments, device, pool: Optional[DevicePool] = None,
                 mutable_buffers: Sequence[str] = (), copy_stream=None, source=None,
                 host_pool: Optional[HostPool] = None, keep_host: bool = True):
        """``source``: a ``checkpoint.CheckpointSource`` the shard is read from (the module's tensors
        are then empty); the host copy is read at once when ``keep_host``, else on the first load."""
        super().__init__(module, segments, device, mutable_buffers)
        self.pool = pool
        self.copy_stream = copy_stream
        self.source = source
        self.host_pool = host_pool
        pin = self.cuda
        totals: Dict[torch.dtype, int] = {}
        for s in self.slots:
            s.offset = totals.get(s.dtype, 0)
            totals[s.dtype] = s.offset + s.numel
        self.host_numels = totals
        """Elements of the contiguous host buffer per dtype (what a host pool must keep to reuse)."""
        if source is not None:
            source.check(self.slots)
            self.host: Dict[torch.dtype, torch.Tensor] = {}
        else:
            self.host = {dt: pinned_empty(n, dt) if pin else torch.empty(n, dtype=dt) for dt, n in totals.items()}
        # contiguous [start, end) per (segment, dtype): slots are sorted by segment
        self._ranges: List[List[Tuple[torch.dtype, int, int]]] = [[] for _ in range(self.n_segments)]
        bounds: Dict[Tuple[int, torch.dtype], List[int]] = {}
        for s in self.slots:
            b = bounds.setdefault((s.segment, s.dtype), [s.offset, s.offset])
            b[1] = s.offset + s.numel
        for (seg, dt), (a, b) in sorted(bounds.items(), key=lambda kv: (kv[0][0], kv[1][0])):
            self._ranges[seg].append((dt, a, b))
        with torch.no_grad():
            for s in self.slots:
                if source is None:
                    self.host[s.dtype][s.offset:s.offset + s.numel].copy_(s.tensor.detach().reshape(-1))
                s.tensor.data = self._placeholder(s.dtype)
        self._dev: Dict[torch.dtype, torch.Tensor] = {}
        self._loader: Optional[threading.Thread] = None
        if source is not None and keep_host:
            self.read_host()

    def device_bytes(self) -> int:
        made = sum(m.computron_device_bytes() for ms in self.arrivals for m in ms) if self.resident else 0
        return sum(b.numel() * b.element_size() for b in self._dev.values()) + made

    # ---- the disk tier -------------------------------------------------------
    @property
    def host_resident(self) -> bool:
        """Whether the shard is in host memory (always, without a checkpoint source)."""
        return bool(self.host)

    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.host.values())

    @property
    def evictable(self) -> bool:
        """May leave host memory now: read from a checkpoint, held in host memory, neither resident on
        the device nor loading, and no buffer a forward changed (the checkpoint lacks those changes)."""
        return (self.source is not None and bool(self.host) and not self.resident
                and not any(s.mutable for s in self.slots))

    def alloc_host(self) -> Dict[torch.dtype, torch.Tensor]:
        """Fresh host buffers of this shard's size, one per dtype (from the host pool when there is one)."""
        if self.host_pool is not None:
            return {dt: self.host_pool.take(dt, n) for dt, n in self.host_numels.items()}
        return {dt: pinned_empty(n, dt) if self.cuda else torch.empty(n, dtype=dt)
                for dt, n in self.host_numels.items()}

    def _drop_host(self) -> None:
        host, self.host = self.host, {}
        self.give_host(host)

    def give_host(self, host: Dict[torch.dtype, torch.Tensor]) -> None:
        """Let host buffers go (back to the host pool when there is one)."""
        for buf in host.values():
            if self.host_pool is not None:
                self.host_pool.give(buf)
            else:
                free_host(buf)

    def read_host_copy(self) -> Tuple[Dict[torch.dtype, torch.Tensor], float, int]:
        """Read the shard from the checkpoint into fresh host buffers that are not yet the store's:
        (buffers, seconds, bytes). The caller makes them the host copy (``adopt_host``) or lets them go
        (``give_host``): a read ahead of a load runs beside the command loop, which may meanwhile have
        started a load reading the shard itself."""
        from .slice_reads import read_segments
        host = self.alloc_host()
        try:
            dt, n = read_segments(self.source, self.slots, host, n_segments=self.n_segments)
        except BaseException:  # any way out: the buffers go back to the pool; re-raised
            self.give_host(host)
            raise
        return host, dt, n

    def adopt_host(self, host: Dict[torch.dtype, torch.Tensor]) -> None:
        """Make buffers of ``read_host_copy`` the host copy (the store must have none, and not be loading)."""
        if self.host or self.resident:
            raise RuntimeError("the shard already has a host copy, or is resident or loading")
        self.host = host

    def read_host(self) -> Tuple[float, int]:
        """Read the shard from the checkpoint into host memory now (start-up); (seconds, bytes)."""
        host, dt, n = self.read_host_copy()
        self.host = host
        self.last_read_s, self.last_read_bytes = dt, n
        return dt, n

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._drop_host()

    def release_host(self) -> int:
        """Let the host copy go (the disk tier: the next load reads it again); returns the bytes freed."""
        if self.source is None:
            raise RuntimeError("this model has no checkpoint to read it back from")
        if self.resident:
            raise RuntimeError("the model is resident on the device or loading")
        n = self.host_bytes()
        self._drop_host()
        return n

    def begin_load(self, on_done: Callable[[float, float, Optional[BaseException]], None]) -> None:
        """Start copying; returns at once. ``on_done(start, end, error)`` runs when all has arrived."""
        if self.resident:
            raise RuntimeError("model is already loaded on this worker")
        t0 = time.perf_counter()
        bufs: Dict[torch.dtype, torch.Tensor] = {}
        from_disk = self.source is not None and not self.host
        self.last_tier = "disk" if from_disk else "host"
        self.last_read_s, self.last_read_bytes = 0.0, 0
        try:
            for dt, n in self.host_numels.items():
                bufs[dt] = (self.pool.take(dt, n) if self.pool is not None
                            else torch.empty(n, dtype=dt, device=self.device))
        except BaseException:  # any way out: the buffers go back to the pool; re-raised
            self._release(bufs)
            raise
        self._dev = bufs
        for s in self.slots:
            s.tensor.data = bufs[s.dtype][s.offset:s.offset + s.numel].view(s.shape)
        if self.cuda:  # the buffers came from the compute stream: copy only after its pending work
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        ready = Readiness(self.n_segments, self.cuda)
        self._ready = ready
        self.resident = True
        self._loader = threading.Thread(target=self._copy, args=(ready, t0, on_done, from_disk),
                                        name="computron-load", daemon=True)
        self._loader.start()

    def _start_read(self):
        """Read the shard from disk on a thread of its own; returns (thread, ``next_segment``), which
        gives the segments in the order they arrive (the copy of each waits only for it: read-ahead
        overlapping the copy) and raises the read's error."""
        from .slice_reads import read_segments
        arrived: "queue.Queue" = queue.Queue()
        state = {"error": None}
        host = self.alloc_host()
        self.host = host

        def read():
            try:
                dt, n = read_segments(self.source, self.slots, host, n_segments=self.n_segments,
                                      on_segment=arrived.put)
                self.last_read_s, self.last_read_bytes = dt, n
            except BaseException as exc:  # noqa: BLE001 - the copier reports it
                state["error"] = exc
                arrived.put(None)

        reader = threading.Thread(target=read, name="computron-read", daemon=True)
        reader.start()

        def next_segment() -> int:
            i = arrived.get()
            if i is None:
                raise state["error"]
            return i
        return reader, next_segment

    def _copy(self, ready: Readiness, t0: float, on_done, from_disk: bool = False) -> None:
        error = None
        reader = None
        try:
            if self.cuda:
                torch.cuda.set_device(self.device)  # a new thread starts on device 0 (before pinning host memory)
            order = iter(range(len(self._ranges)))
            next_segment = lambda: next(order)  # noqa: E731 - the host copy is all there
            if from_disk:
                reader, next_segment = self._start_read()
            if self.cuda:
                with torch.cuda.stream(self.copy_stream):
                    for _ in range(len(self._ranges)):
                        i = next_segment()
                        for dt, a, b in self._ranges[i]:
                            self._dev[dt][a:b].copy_(self.host[dt][a:b], non_blocking=True)
                        for m in self.arrivals[i]:  # on the copy stream, after its bytes
                            m.computron_arrive()
                        ev = torch.cuda.Event()
                        ev.record(self.copy_stream)
                        ready.mark(i, ev)
                    self.copy_stream.synchronize()
            else:
                for _ in range(len(self._ranges)):
                    i = next_segment()
                    for dt, a, b in self._ranges[i]:
                        self._dev[dt][a:b].copy_(self.host[dt][a:b])
                    for m in self.arrivals[i]:
                        m.computron_arrive()
                    ready.mark(i)
        except BaseException as exc:  # noqa: BLE001 - reported to the master
            error = exc
            ready.fail(exc)
        else:
            ready.done.set()
        if reader is not None:
            reader.join()
            if error is not None:  # a partial host copy is no copy: the next load reads again
                self._drop_host()
        try:
            on_done(t0, time.perf_counter(), error)
        except Exception:  # noqa: BLE001 - a reply that cannot be sent: the master notices the silence
            log.exception("could not report the end of a load")

    def wait_loaded(self) -> None:
        if self._loader is not None:
            self._loader.join()  # also waits for its reply to go out
        super().wait_loaded()

    def _release(self, bufs: Dict[torch.dtype, torch.Tensor]) -> None:
        if self.pool is not None:
            for buf in bufs.values():
                self.pool.give(buf)

    def offload(self) -> None:
        """Drop the device copy. Never raises for a failed load: it just releases what was taken."""
        if not self.resident:
            return
        if self._loader is not None:
            self._loader.join()
        failed = self._ready is not None and self._ready.error is not None
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        with torch.no_grad():
            for s in self.slots:
                if s.mutable and not failed:  # a forward changed it: the only tensors copied back
                    self.host[s.dtype][s.offset:s.offset + s.numel].copy_(s.tensor.reshape(-1))
                s.tensor.data = self._placeholder(s.dtype)
            for ms in self.arrivals:
                for m in ms:
                    m.computron_leave()
        self._release(self._dev)
        self._dev = {}
        self._ready = None
        self._loader = None
        self.resident = False
