"""Per-worker storage of model shards, and the two ways of swapping them.

``ShardStore`` (the fast path) keeps each model's shard in one contiguous host
buffer per dtype (pinned where CUDA exists). A load takes one device buffer per
dtype (reused across swaps: on CPU through ``DevicePool``, on CUDA through
torch's caching allocator), points every parameter at a view of it, and copies
the host buffer over in a few large chunks, segment by segment in execution
order, marking each segment ready as it lands so a forward may start on the
first layers while later ones are still copying. An offload only drops the
device buffer: inference never changes the weights, so the host copy stays
valid. Buffers named in ``mutable_buffers`` are the only tensors copied back.

``PaperStore`` swaps the way the paper did, for side-by-side comparison: one
``.to()`` per tensor into freshly allocated memory on load, and on offload a
fresh host copy of every tensor.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

log = logging.getLogger("computron.store")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds a parameter's data (the local shard of a DTensor)."""
    inner = getattr(t, "_local_tensor", None)
    return inner if inner is not None else t


@dataclass
class Slot:
    tensor: torch.Tensor  # the persistent tensor object whose .data is rebound
    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    numel: int
    segment: int
    offset: int = 0  # within its dtype's flat buffer
    mutable: bool = False


def collect_slots(module: nn.Module, segments: Sequence[nn.Module],
                  mutable_buffers: Sequence[str] = ()) -> List[Slot]:
    """Every distinct parameter/buffer of ``module``, tagged with its readiness segment.

    Segment ``i + 1`` holds the tensors of ``segments[i]``; segment 0 holds the
    rest, which must be ready before any forward starts.
    """
    seg_of: Dict[int, int] = {}
    for i, seg in enumerate(segments):
        for t in list(seg.parameters()) + list(seg.buffers()):
            seg_of.setdefault(id(_local(t)), i + 1)
    slots: List[Slot] = []
    seen = set()
    named = list(module.named_parameters(remove_duplicate=False)) + list(
        module.named_buffers(remove_duplicate=False))
    for name, t in named:
        local = _local(t)
        if id(local) in seen:
            continue
        seen.add(id(local))
        slots.append(Slot(tensor=local, name=name, shape=tuple(local.shape), dtype=local.dtype,
                          numel=local.numel(), segment=seg_of.get(id(local), 0),
                          mutable=name in mutable_buffers))
    missing = set(mutable_buffers) - {s.name for s in slots}
    if missing:
        raise ValueError(f"mutable_buffers names no buffer of the model: {sorted(missing)}")
    slots.sort(key=lambda s: s.segment)  # stable: module order within a segment
    return slots


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host buffer of exactly ``numel`` elements.

    torch's pinned allocator rounds every block up to a power of two (a 13.3 GB
    shard would lock 16 GB), so the buffer is allocated pageable and registered
    with CUDA in place; where registration is refused, the pinned allocator it is.
    The buffers live as long as the worker, so they are never unregistered.
    """
    buf = torch.empty(numel, dtype=dtype)
    try:
        cudart = torch.cuda.cudart()
        cudart.cudaHostRegister(buf.data_ptr(), numel * buf.element_size(), 0)
        if buf.is_pinned():
            return buf
        cudart.cudaHostUnregister(buf.data_ptr())  # registered in some other way than copies can use
    except Exception:  # noqa: BLE001 - fall back to the allocator below
        pass
    return torch.empty(numel, dtype=dtype, pin_memory=True)


class DevicePool:
    """Device buffers kept for reuse (CPU only; CUDA has torch's caching allocator).

    Writing into memory that is already mapped runs 3-4x faster on CPU than into
    fresh memory, where every page faults on first touch.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._free: Dict[torch.dtype, List[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(dtype, [])
            fits = [b for b in free if b.numel() >= numel]
            if fits:
                best = min(fits, key=lambda b: b.numel())
                free.remove(best)
                return best
            free.clear()  # nothing fits: give the memory back before asking for more
        return torch.empty(numel, dtype=dtype, device=self.device)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(buf.dtype, []).append(buf)

    def reserved_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() * b.element_size() for bufs in self._free.values() for b in bufs)


class _Readiness:
    """Per-segment 'weights have arrived' flags: threading events on CPU, CUDA events on GPU."""

    def __init__(self, n: int, cuda: bool):
        self.cuda = cuda
        self.host = [threading.Event() for _ in range(n)]
        self.dev: List[Optional[torch.cuda.Event]] = [None] * n
        self.done = threading.Event()
        self.error: Optional[BaseException] = None

    def mark(self, i: int, event=None) -> None:
        self.dev[i] = event
        self.host[i].set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        for e in self.host:
            e.set()
        self.done.set()

    def wait(self, i: int) -> None:
        if self.done.is_set() and self.error is None:
            return  # all has arrived (on CUDA the copy stream was synchronised): every later forward
        self.host[i].wait()
        if self.error is not None:
            raise RuntimeError(f"loading the weights failed: {self.error}")
        if self.cuda and self.dev[i] is not None:
            torch.cuda.current_stream().wait_event(self.dev[i])


class _StoreBase:
    def __init__(self, module: nn.Module, segments: Sequence[nn.Module], device: torch.device,
                 mutable_buffers: Sequence[str] = ()):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.slots = collect_slots(module, segments, mutable_buffers)
        self.n_segments = len(segments) + 1
        self.nbytes = sum(s.numel * s.dtype.itemsize for s in self.slots)
        self._empty = {}
        self._ready: Optional[_Readiness] = None
        self._hooks = [seg.register_forward_pre_hook(self._make_hook(i + 1))
                       for i, seg in enumerate(segments)]
        self.resident = False

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


class ShardStore(_StoreBase):
    """The fast path: contiguous (pinned) host buffers, reused device buffers, chunked copies."""

    def __init__(self, module, segments, device, pool: Optional[DevicePool] = None,
                 mutable_buffers: Sequence[str] = (), copy_stream=None):
        super().__init__(module, segments, device, mutable_buffers)
        self.pool = pool
        self.copy_stream = copy_stream
        pin = self.cuda
        totals: Dict[torch.dtype, int] = {}
        for s in self.slots:
            s.offset = totals.get(s.dtype, 0)
            totals[s.dtype] = s.offset + s.numel
        self.host: Dict[torch.dtype, torch.Tensor] = {
            dt: pinned_empty(n, dt) if pin else torch.empty(n, dtype=dt) for dt, n in totals.items()}
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
                self.host[s.dtype][s.offset:s.offset + s.numel].copy_(s.tensor.detach().reshape(-1))
                s.tensor.data = self._placeholder(s.dtype)
        self._dev: Dict[torch.dtype, torch.Tensor] = {}
        self._loader: Optional[threading.Thread] = None

    def device_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._dev.values())

    def begin_load(self, on_done: Callable[[float, float, Optional[BaseException]], None]) -> None:
        """Start copying; returns at once. ``on_done(start, end, error)`` runs when all has arrived."""
        if self.resident:
            raise RuntimeError("model is already loaded on this worker")
        t0 = time.perf_counter()
        bufs: Dict[torch.dtype, torch.Tensor] = {}
        try:
            for dt, host in self.host.items():
                n = host.numel()
                bufs[dt] = (self.pool.take(dt, n) if self.pool is not None
                            else torch.empty(n, dtype=dt, device=self.device))
        except BaseException:
            self._release(bufs)
            raise
        self._dev = bufs
        for s in self.slots:
            s.tensor.data = bufs[s.dtype][s.offset:s.offset + s.numel].view(s.shape)
        if self.cuda:  # the buffers came from the compute stream: copy only after its pending work
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        ready = _Readiness(self.n_segments, self.cuda)
        self._ready = ready
        self.resident = True
        self._loader = threading.Thread(target=self._copy, args=(ready, t0, on_done),
                                        name="computron-load", daemon=True)
        self._loader.start()

    def _copy(self, ready: _Readiness, t0: float, on_done) -> None:
        error = None
        try:
            if self.cuda:
                torch.cuda.set_device(self.device)  # a new thread starts on device 0
                with torch.cuda.stream(self.copy_stream):
                    for i, ranges in enumerate(self._ranges):
                        for dt, a, b in ranges:
                            self._dev[dt][a:b].copy_(self.host[dt][a:b], non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(self.copy_stream)
                        ready.mark(i, ev)
                    self.copy_stream.synchronize()
            else:
                for i, ranges in enumerate(self._ranges):
                    for dt, a, b in ranges:
                        self._dev[dt][a:b].copy_(self.host[dt][a:b])
                    ready.mark(i)
        except BaseException as exc:  # noqa: BLE001 - reported to the master
            error = exc
            ready.fail(exc)
        else:
            ready.done.set()
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
        self._release(self._dev)
        self._dev = {}
        self._ready = None
        self._loader = None
        self.resident = False


class PaperStore(_StoreBase):
    """The paper's swap: ``.to(device)`` per tensor on load, a fresh host copy of each on offload."""

    def __init__(self, module, segments, device, mutable_buffers: Sequence[str] = ()):
        super().__init__(module, segments, device, mutable_buffers)
        self.host_tensors: List[torch.Tensor] = []
        with torch.no_grad():
            for s in self.slots:
                self.host_tensors.append(s.tensor.detach().to("cpu", copy=True))
                s.tensor.data = self._placeholder(s.dtype)

    def device_bytes(self) -> int:
        if not self.resident:
            return 0
        return sum(s.tensor.numel() * s.tensor.element_size() for s in self.slots)

    def begin_load(self, on_done) -> None:
        if self.resident:
            raise RuntimeError("model is already loaded on this worker")
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                for s, h in zip(self.slots, self.host_tensors):
                    s.tensor.data = h.to(self.device, copy=True)
            if self.cuda:
                torch.cuda.current_stream().synchronize()
        except BaseException as exc:  # noqa: BLE001
            self.resident = True
            self.offload()
            on_done(t0, time.perf_counter(), exc)
            return
        self.resident = True
        self._ready = None
        on_done(t0, time.perf_counter(), None)

    def offload(self) -> None:
        if not self.resident:
            return
        with torch.no_grad():
            for i, s in enumerate(self.slots):
                if s.tensor.numel() == s.numel:
                    self.host_tensors[i] = s.tensor.data.to("cpu", copy=True)
                s.tensor.data = self._placeholder(s.dtype)
        if self.cuda:
            torch.cuda.current_stream().synchronize()
        self.resident = False
