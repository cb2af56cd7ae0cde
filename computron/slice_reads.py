"""Reading one rank's slices of a safetensors checkpoint into its host buffer, fast.

``checkpoint.CheckpointSource`` says which bytes of which file each of the rank's tensors
comes from; ``read_segments`` reads them. Each tensor's slice becomes runs of file bytes (one
for a contiguous slice, one per row of a dim-1 slice). A contiguous slice only this rank reads is
read with ``O_DIRECT`` straight into the host buffer (``file_reads``: the store lays the buffer out
for it, ``direct_phases``); the rest, which the machine's other ranks read too, goes through the page
cache: neighbouring runs become large scattered ``preadv`` requests (the bytes between them into a
discard buffer), with the kernel advised ahead. All is issued in file order on a few threads, and
the store hears of each segment (layer) as soon as all of it has arrived.
"""
from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional, Tuple

import torch

from .checkpoint import CheckpointError, CheckpointSource, Read
from .file_reads import IOV_MAX, Reader, _Direct, _Request, _Rows, direct_span
from .memory import HOST_ALIGN

REQUEST_BYTES = 8 << 20
"""Largest single ``preadv`` (a larger tensor is read by several threads at once)."""
GAP_BYTES = 256 << 10
"""Runs of one file closer than this are read as one request, the bytes between them into a discard
buffer: small tensors side by side, and a dim-1 slice's rows (the disk reads the rows around them
anyway, and the machine's other TP ranks find them in the page cache); farther ones are skipped."""
DIRECT_IO = False
"""Read the slices only this rank reads with ``O_DIRECT`` (False: all through the page cache)."""
DIRECT_MIN_BYTES = 1 << 20
"""The smallest slice read with ``O_DIRECT`` (more than ``GAP_BYTES``: a request never spans one)."""
READ_THREADS = 2
"""Requests in flight per read."""
AHEAD_BYTES = 64 << 20
"""How far ahead of the requests being read the kernel is asked to read."""
ADVICE_BYTES = 16 << 20
"""The piece of file one read-ahead advice covers."""


def _direct_part(reader: Reader, r: Read, name: str, itemsize: int) -> Optional[Tuple[str, int, int, int]]:
    """``(file, begin, end, aligned begin)`` of this rank's slice of ``r.key`` when it is read with
    ``O_DIRECT`` wherever it lands in the host buffer at the same offset modulo ``HOST_ALIGN``: a
    contiguous slice only this rank reads, stored in the dtype it is held in, ``DIRECT_MIN_BYTES`` or
    more of it aligned. None otherwise."""
    if not DIRECT_IO or r.key is None:
        return None
    e, first, run, row, count = reader.runs(r, name)
    a, b = first, first + run * count
    if e.dtype.itemsize != itemsize or first % itemsize or not reader.exclusive(r, e, count, row, run):
        return None
    lo, hi = direct_span(a, b)
    return (e.file, a, b, lo) if hi - lo >= DIRECT_MIN_BYTES else None


def direct_phases(source: CheckpointSource, slots) -> Dict[int, int]:
    """``{slot index: byte offset of its slice in its file, modulo HOST_ALIGN}`` for the slots read with
    ``O_DIRECT``: the store starts each at the same offset modulo ``HOST_ALIGN`` in its host buffer."""
    reader = Reader(source.model_id, source.entries, source.tp)
    out = {}
    for k, (s, r) in enumerate(source.plan(slots)):
        part = _direct_part(reader, r, s.name, s.dtype.itemsize)
        if part is not None and reader.entries[r.key].dtype == s.dtype:
            out[k] = part[1] % HOST_ALIGN
    return out


def runs_into(reader: Reader, r: Read, dest: torch.Tensor, name: str):
    """``(contiguous runs, tasks)`` that read this rank's slice of ``r.key`` into ``dest``: runs
    ``(file, begin, end, bytes of dest)`` for ``_coalesce``; tasks: ``_Rows`` for a dim-1 slice, ``_Direct``
    for the aligned part of a slice read with ``O_DIRECT`` (its unaligned ends are runs); None when the
    checkpoint's dtype differs from ``dest``'s (``read_converting`` reads it)."""
    e, first, run, row, count = reader.runs(r, name)
    if e.dtype != dest.dtype:
        return None
    mv = memoryview(dest.view(-1).view(torch.uint8).numpy())
    if run * count != len(mv):
        raise CheckpointError(f"model {reader.model_id!r}: {name} needs {len(mv)} bytes, its checkpoint "
                              f"slice {r.key!r} has {run * count}")
    if count == 1 or row == run:
        part = _direct_part(reader, r, name, dest.element_size())
        if part is not None and (dest.data_ptr() - first) % HOST_ALIGN == 0 and reader.direct_fd(e.file) is not None:
            file, a, b, lo = part
            hi = direct_span(a, b)[1]
            step = max(HOST_ALIGN, REQUEST_BYTES // HOST_ALIGN * HOST_ALIGN)
            runs = [(file, a, lo, mv[:lo - a])] if lo > a else []
            if b > hi:
                runs.append((file, hi, b, mv[hi - a:]))
            return runs, [_Direct(file, x, min(x + step, hi), mv[x - a:min(x + step, hi) - a])
                          for x in range(lo, hi, step)]
        return [(e.file, first, first + run * count, mv)], []
    per = max(1, REQUEST_BYTES // row)
    return [], [_Rows(e.file, first + k * row, run, row, min(per, count - k), mv[k * run:(k + per) * run])
                for k in range(0, count, per)]


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
                    and len(cur.bufs) < IOV_MAX - 1:
                if gap:
                    cur.bufs.append(discard[:gap])
                cur.bufs.append(mv[:n])
                cur.end = a + n
            else:
                cur = _Request(file, a, a + n, [mv[:n]])
                out.append(cur)
            a, mv = a + n, mv[n:]
    return out


def read_segments(source: CheckpointSource, slots, host: Dict[torch.dtype, torch.Tensor],
                  n_segments: int = 0, on_segment=None, threads: Optional[int] = None) -> Tuple[float, int]:
    """Read every slot into ``host``, calling ``on_segment(i)`` as each segment ``i`` is complete
    (once each, in the order they complete). Returns (seconds, bytes of the slices read).

    The reads of each segment are coalesced into large scattered ``preadv`` requests, and all are
    issued in file order (not segment order: a checkpoint stores layers 1, 10, 11, ..., 2 by name,
    and jumping about defeats the disk's and the kernel's read-ahead) by ``threads`` threads
    (``READ_THREADS``; a virtual or NVMe disk needs several requests in flight), the kernel told
    (``POSIX_FADV_WILLNEED``) about the next ``AHEAD_BYTES`` before they are asked for."""
    t0 = time.perf_counter()
    plan = source.plan(slots)
    n_segments = max(n_segments, max((s.segment for s, _ in plan), default=-1) + 1)
    with source.open() as reader:
        discard = memoryview(bytearray(GAP_BYTES))
        runs: Dict[int, list] = {}
        by_segment: Dict[int, list] = {}  # _Request, _Rows, or (Read, dest, name) for a converting read
        nbytes = 0
        for s, r in plan:
            dest = host[s.dtype][s.offset:s.offset + s.numel]
            nbytes += dest.numel() * dest.element_size()
            if r.key is None:
                dest.copy_(r.value.reshape(-1))
                continue
            planned = runs_into(reader, r, dest, s.name)
            if planned is None:
                by_segment.setdefault(s.segment, []).append((r, dest, s.name))
            else:
                runs.setdefault(s.segment, []).extend(planned[0])
                by_segment.setdefault(s.segment, []).extend(planned[1])
        for seg, rs in runs.items():
            by_segment[seg].extend(_coalesce(rs, discard))
        tasks = sorted(((seg, t) for seg, ts in by_segment.items() for t in ts),
                       key=lambda x: (getattr(x[1], "file", ""), getattr(x[1], "begin", 0)))
        # a slice the page cache holds whole already is copied from there, not read from the disk again
        tasks = [(seg, _Request(t.file, t.begin, t.end, [t.dest]) if isinstance(t, _Direct)
                  and reader.cached(t.file, t.begin, t.end) else t) for seg, t in tasks]
        reader.direct = any(isinstance(t, _Direct) for _, t in tasks)
        _run_tasks(reader, tasks, n_segments, on_segment, max(1, threads or READ_THREADS), discard)
    return time.perf_counter() - t0, nbytes


def read_spans(source: CheckpointSource, slots) -> List[Tuple[str, int, int, List[Tuple[int, int, int, int]]]]:
    """What ``read_segments`` of these slots reads, for a reader of its own to read the same bytes (the
    benchmarks' floor): ``(file, begin, end, pieces)`` in file order, the runs of one file less than
    ``GAP_BYTES`` apart merged as ``read_segments`` merges them; ``pieces`` are the slices' bytes inside
    ``[begin, end)`` as ``(first, run, stride, count)``: ``count`` runs of ``run`` bytes, ``stride`` apart."""
    runs = []
    with source.open() as reader:
        for s, r in source.plan(slots):
            if r.key is not None:
                e, first, run, row, count = reader.runs(r, s.name)
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


def _run_tasks(reader: Reader, tasks, n_segments: int, on_segment, threads: int, discard: memoryview) -> None:
    """Execute ``(segment, task)`` in order on ``threads`` threads (this one among them), advising the
    kernel ahead, calling ``on_segment`` as segments complete; raises the first error."""
    left = [0] * n_segments
    for seg, _ in tasks:
        left[seg] += 1
    # read-ahead advice: the buffered tasks' file ranges in pieces of ADVICE_BYTES, each due when the
    # reads come within AHEAD_BYTES of it; bridged over gaps of up to AHEAD_BYTES when nothing is read
    # with O_DIRECT (the other TP ranks' parts of a tensor are read too: they are about to ask for them),
    # else not at all (the bytes between are read with O_DIRECT, here or by another rank)
    bridge = -1 if reader.direct else AHEAD_BYTES
    spans: List[list] = []  # [bytes of the tasks before it, file, begin, end]
    before, at = [], 0
    for _, t in tasks:
        before.append(at)
        if isinstance(t, (_Request, _Rows)):
            last = spans[-1] if spans else None
            if last is not None and last[1] == t.file and t.begin - last[3] <= bridge:
                last[3] = max(last[3], t.end)
            else:
                spans.append([at, t.file, t.begin, t.end])
        if isinstance(t, (_Request, _Rows, _Direct)):
            at += t.end - t.begin
    spans = [[pos + a - begin, file, a, min(end, a + ADVICE_BYTES)]
             for pos, file, begin, end in spans for a in range(begin, end, ADVICE_BYTES)]
    lock = threading.Lock()
    state = {"next": 0, "advised": 0}
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
                k = state["advised"]
                while state["advised"] < len(spans) and spans[state["advised"]][0] <= before[i] + AHEAD_BYTES:
                    state["advised"] += 1
                advise = spans[k:state["advised"]]
            seg, t = tasks[i]
            try:
                for _, file, a, b in advise:
                    reader.will_need(file, a, b)
                if isinstance(t, _Request):
                    reader.preadv(t.file, list(t.bufs), t.begin)
                elif isinstance(t, _Direct):
                    reader.read_direct(t)
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


__all__ = ["Reader", "read_segments"]
