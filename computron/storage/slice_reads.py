"""Reading one rank's slices of a safetensors checkpoint into its host buffer, fast.

``checkpoint.CheckpointSource`` says which bytes of which file each of the rank's tensors
comes from; ``read_segments`` reads them. Each tensor's slice becomes runs of file bytes (one
for a contiguous slice, one per row of a dim-1 slice); neighbouring runs become large scattered
``preadv`` requests (the bytes between them into a discard buffer), issued in file order on a
few threads, and the store hears of each segment (layer) as soon as all of it has arrived.
``prefetch_startup`` has the kernel read the checkpoints the workers read at start-up while they
start; ``read_spans`` says which bytes a read reads (the benchmarks' bare readers read the same).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .checkpoint import CheckpointError, CheckpointSource, Entry, Read, read_header

CHUNK_BYTES = 64 << 20
"""The scratch buffer of a read that converts dtypes."""
REQUEST_BYTES = 8 << 20
"""Largest single ``preadv`` (a larger tensor is read by several threads at once)."""
GAP_BYTES = 256 << 10
"""Runs of one file closer than this are read as one request, the bytes between them into a discard
buffer: small tensors side by side, and a dim-1 slice's rows (the disk reads the rows around them
anyway, and the machine's other TP ranks find them in the page cache); farther ones are skipped."""
READ_THREADS = 4
"""Requests in flight per read. Nothing else asks the kernel to read ahead (``POSIX_FADV_WILLNEED`` of
the next 64 MB before each request took a disk-tier load from 0.98 to 0.67 of a bare read of the same
bytes at opt-125m on this machine's virtual disk: the advising thread waits while the kernel submits it)."""
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if "SC_IOV_MAX" in getattr(os, "sysconf_names", {}) else 1024
"""Buffers one ``preadv`` takes."""


class Reader:
    """Open files and the freshly read headers of one read; thread-safe (``os.preadv`` on shared fds)."""

    def __init__(self, model_id: str, entries: Dict[str, Entry]):
        self.model_id = model_id
        self.entries = entries
        self.fds: Dict[str, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()  # the scratch buffer of converting reads, one per thread

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _fd(self, file: str) -> int:
        with self._lock:
            fd = self.fds.get(file)
            if fd is None:
                try:
                    fd = os.open(file, os.O_RDONLY)
                except FileNotFoundError:
                    raise CheckpointError(f"model {self.model_id!r}: checkpoint file {file!r} does not exist") from None
                self.fds[file] = fd
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger kernel read-ahead window
            return fd

    def preadv(self, file: str, bufs: List[memoryview], offset: int) -> None:
        """Fill ``bufs`` in order with the file's bytes from ``offset``, through short reads."""
        fd = self._fd(file)
        left = sum(len(b) for b in bufs)
        while left:
            got = os.preadv(fd, bufs, offset)
            if got <= 0:
                raise CheckpointError(f"model {self.model_id!r}: checkpoint file {file!r} is truncated "
                                      f"(no bytes at offset {offset})")
            offset, left = offset + got, left - got
            if left:  # a short read: on from the first buffer not filled (slicing the list buffer by
                k = 0  # buffer made a 1024-row read quadratic: a third of a warm shard's read)
                while got >= len(bufs[k]):
                    got -= len(bufs[k])
                    k += 1
                bufs = [bufs[k][got:]] + bufs[k + 1:]

    def _scratch(self, nbytes: int) -> torch.Tensor:
        buf = getattr(self._local, "scratch", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.scratch = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8)
        return buf[:nbytes]

    def _runs(self, r: Read, name: str) -> Tuple[Entry, int, int, int, int]:
        """The entry of ``r.key`` and where this rank's slice lies in its file, in the order of its
        elements: ``count`` runs of ``run`` bytes, the k-th at ``first + k * row`` (one run for a
        contiguous slice, one per row of a dim-1 slice)."""
        e = self.entries.get(r.key)
        if e is None:
            raise CheckpointError(f"model {self.model_id!r}: the checkpoint no longer holds {r.key!r}")
        full, item = e.shape, e.dtype.itemsize
        # the one dimension d this rank's slice is partial in (a 1-D mesh shards one dimension)
        partial = [d for d in range(len(full)) if r.shape[d] != full[d]]
        if len(partial) > 1:
            raise CheckpointError(f"model {self.model_id!r}: {name} is split along several dimensions")
        if not partial:
            return e, e.begin, e.end - e.begin, e.end - e.begin, 1
        d = partial[0]
        outer = int(torch.Size(full[:d]).numel())
        along, inner = full[d], int(torch.Size(full[d + 1:]).numel())
        run = r.shape[d] * inner * item
        return e, e.begin + r.offsets[d] * inner * item, run, along * inner * item, outer

    def runs_into(self, r: Read, dest: torch.Tensor, name: str):
        """``(contiguous runs, row tasks)`` that read this rank's slice of ``r.key`` into ``dest``: runs
        ``(file, begin, end, bytes of dest)`` for ``_coalesce``, ``_Rows`` for a dim-1 slice; None when the
        checkpoint's dtype differs from ``dest``'s (``read_converting`` reads it)."""
        e, first, run, row, count = self._runs(r, name)
        if e.dtype != dest.dtype:
            return None
        mv = memoryview(dest.view(-1).view(torch.uint8).numpy())
        if run * count != len(mv):
            raise CheckpointError(f"model {self.model_id!r}: {name} needs {len(mv)} bytes, its checkpoint "
                                  f"slice {r.key!r} has {run * count}")
        if count == 1 or row == run:
            return [(e.file, first, first + run * count, mv)], []
        per = max(1, REQUEST_BYTES // row)
        return [], [_Rows(e.file, first + k * row, run, row, min(per, count - k), mv[k * run:(k + per) * run])
                    for k in range(0, count, per)]

    def read_rows(self, t: "_Rows", discard: memoryview) -> None:
        """A dim-1 slice's rows: the bytes between them go to ``discard`` when they are few (one large
        scattered read), else each row is read on its own."""
        gap = t.row - t.run
        if gap > len(discard):
            for k in range(t.count):
                self.preadv(t.file, [t.dest[k * t.run:(k + 1) * t.run]], t.begin + k * t.row)
            return
        per = (_IOV_MAX + 1) // 2
        for k0 in range(0, t.count, per):
            k1 = min(t.count, k0 + per)
            bufs = []
            for k in range(k0, k1):
                bufs.append(t.dest[k * t.run:(k + 1) * t.run])
                if k + 1 < k1:
                    bufs.append(discard[:gap])
            self.preadv(t.file, bufs, t.begin + k0 * t.row)

    def read_converting(self, r: Read, dest: torch.Tensor, name: str) -> None:
        """Fill ``dest`` with this rank's slice of ``r.key`` stored in another dtype: through a scratch
        buffer of at most ``CHUNK_BYTES``, converted by ``copy_``."""
        e, first, run, row, count = self._runs(r, name)
        item, at = e.dtype.itemsize, 0
        step = max(item, CHUNK_BYTES // item * item)
        for k in range(count):
            for a in range(0, run, step):
                n = min(step, run - a)
                buf = self._scratch(n)
                self.preadv(e.file, [memoryview(buf.numpy())], first + k * row + a)
                dest[at:at + n // item].copy_(buf.view(e.dtype))
                at += n // item


@dataclass
class _Rows:
    """``count`` rows of a dim-1 slice: ``run`` bytes each, ``row`` bytes apart from ``begin``, into ``dest``."""
    file: str
    begin: int
    run: int
    row: int
    count: int
    dest: memoryview

    @property
    def end(self) -> int:
        return self.begin + (self.count - 1) * self.row + self.run


@dataclass
class _Request:
    """One ``preadv``: consecutive bytes of one file, scattered over ``bufs`` (slices of the host buffer,
    and a discard buffer for the gaps between them)."""
    file: str
    begin: int
    end: int
    bufs: List[memoryview]


def _coalesce(runs, discard: memoryview) -> List[_Request]:
    """Sort one segment's runs by file offset and merge neighbours less than ``GAP_BYTES`` apart into
    requests of at most ``REQUEST_BYTES`` (the rows of a dim-1 slice become one request; the other
    ranks' halves of a dim-0 slice are skipped); a run longer than that is split."""
    out: List[_Request] = []
    cur: Optional[_Request] = None
    for file, a, b, mv in sorted(runs, key=lambda x: (x[0], x[1])):
        while a < b:
            n = min(b - a, REQUEST_BYTES)
            gap = a - cur.end if cur is not None and cur.file == file else -1
            if 0 <= gap <= GAP_BYTES and n + gap + cur.end - cur.begin <= REQUEST_BYTES \
                    and len(cur.bufs) < _IOV_MAX - 1:
                if gap:
                    cur.bufs.append(discard[:gap])
                cur.bufs.append(mv[:n])
                cur.end = a + n
            else:
                cur = _Request(file, a, a + n, [mv[:n]])
                out.append(cur)
            a, mv = a + n, mv[n:]
    return out


def open_reader(source: CheckpointSource) -> "Reader":
    """A reader of ``source``'s files, their headers read again (a file may have been rewritten since
    start-up) and each checked to be long enough: a missing or truncated file fails here, naming the
    model and the file."""
    entries = {}
    for file in source.sizes:  # the files found at start-up
        try:
            have = os.path.getsize(file)
        except FileNotFoundError:
            raise CheckpointError(f"model {source.model_id!r}: checkpoint file {file!r} does not exist") from None
        found, need = read_header(file, source.model_id)
        entries.update(found)
        if have < need:
            raise CheckpointError(f"model {source.model_id!r}: checkpoint file {file!r} is truncated "
                                  f"({have} bytes, its header needs {need})")
    return Reader(source.model_id, entries)


def read_segments(source: CheckpointSource, slots, host: Dict[torch.dtype, torch.Tensor],
                  n_segments: int = 0, on_segment=None, threads: Optional[int] = None) -> Tuple[float, int]:
    """Read every slot into ``host``, calling ``on_segment(i)`` as each segment ``i`` is complete
    (once each, in the order they complete). Returns (seconds, bytes of the slices read).

    The reads of each segment are coalesced into large scattered ``preadv`` requests, and all are
    issued in file order (not segment order: a checkpoint stores layers 1, 10, 11, ..., 2 by name,
    and jumping about defeats the disk's and the kernel's read-ahead) by ``threads`` threads
    (``READ_THREADS``; a virtual or NVMe disk needs several requests in flight)."""
    t0 = time.perf_counter()
    plan = source.plan(slots)
    n_segments = max(n_segments, max((s.segment for s, _ in plan), default=-1) + 1)
    with open_reader(source) as reader:
        discard = memoryview(bytearray(GAP_BYTES))
        runs: Dict[int, list] = {}
        by_segment: Dict[int, list] = {}  # _Request, _Rows, or (Read, dest, name) for a converting read
        nbytes = 0
        for s, whole in plan:
            dest_all = host[s.dtype][s.offset:s.offset + s.numel]
            nbytes += dest_all.numel() * dest_all.element_size()
            if whole.key is None:
                made = whole.produce(reader) if whole.produce is not None else whole.value
                dest_all.copy_(made.reshape(-1))
                continue
            at = 0
            for r in whole.pieces():
                n = int(torch.Size(r.shape).numel()) if whole.parts else dest_all.numel()
                dest, at = dest_all[at:at + n], at + n
                planned = reader.runs_into(r, dest, s.name)
                if planned is None:
                    by_segment.setdefault(s.segment, []).append((r, dest, s.name))
                else:
                    runs.setdefault(s.segment, []).extend(planned[0])
                    by_segment.setdefault(s.segment, []).extend(planned[1])
        for seg, rs in runs.items():
            by_segment[seg].extend(_coalesce(rs, discard))
        tasks = sorted(((seg, t) for seg, ts in by_segment.items() for t in ts),
                       key=lambda x: (getattr(x[1], "file", ""), getattr(x[1], "begin", 0)))
        _run_tasks(reader, tasks, n_segments, on_segment, max(1, threads or READ_THREADS), discard)
    return time.perf_counter() - t0, nbytes


def _run_tasks(reader: Reader, tasks, n_segments: int, on_segment, threads: int, discard: memoryview) -> None:
    """Execute ``(segment, task)`` in order on ``threads`` threads (this one among them), calling
    ``on_segment`` as segments complete; raises the first error."""
    left = [0] * n_segments
    for seg, _ in tasks:
        left[seg] += 1
    lock = threading.Lock()
    state = {"next": 0}
    error: List[BaseException] = []
    if on_segment is not None:
        for seg in range(n_segments):
            if not left[seg]:
                on_segment(seg)

    def work():
        while True:
            with lock:
                i = state["next"]
                if error or i >= len(tasks):
                    return
                state["next"] = i + 1
            seg, t = tasks[i]
            try:
                if isinstance(t, _Request):
                    reader.preadv(t.file, list(t.bufs), t.begin)
                elif isinstance(t, _Rows):
                    reader.read_rows(t, discard)
                else:
                    reader.read_converting(*t)
            except BaseException as exc:  # noqa: BLE001 - raised by the caller
                with lock:
                    error.append(exc)
                return
            with lock:
                left[seg] -= 1
                if not left[seg] and on_segment is not None:
                    on_segment(seg)

    pool = [threading.Thread(target=work, name=f"computron-read-{j}", daemon=True)
            for j in range(min(threads, len(tasks)) - 1)]
    for th in pool:
        th.start()
    work()
    for th in pool:
        th.join()
    if error:
        raise error[0]


def read_spans(source: CheckpointSource, slots) -> List[Tuple[str, int, int, List[Tuple[int, int, int, int]]]]:
    """What ``read_segments`` of these slots reads, for a reader of its own to read the same bytes (the
    benchmarks' floor): ``(file, begin, end, pieces)`` in file order, the runs of one file less than
    ``GAP_BYTES`` apart merged as ``read_segments`` merges them; ``pieces`` are the slices' bytes inside
    ``[begin, end)`` as ``(first, run, stride, count)``: ``count`` runs of ``run`` bytes, ``stride`` apart."""
    runs = []
    with open_reader(source) as reader:
        for s, whole in source.plan(slots):
            for r in whole.pieces() if whole.key is not None else ():
                e, first, run, row, count = reader._runs(r, s.name)
                runs.append((e.file, first, first + (count - 1) * row + run, (first, run, row, count)))
    spans: List[list] = []
    for file, a, b, piece in sorted(runs):
        last = spans[-1] if spans else None
        if last is not None and last[0] == file and a - last[2] <= GAP_BYTES:
            last[2] = max(last[2], b)
            last[3].append(piece)
        else:
            spans.append([file, a, b, [piece]])
    return [tuple(s) for s in spans]


__all__ = ["Reader", "open_reader", "read_segments", "read_spans"]
