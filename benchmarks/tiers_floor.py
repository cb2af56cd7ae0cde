"""The floors ``tiers.py`` measures the engine against (bare processes doing only the unavoidable part),
and the other child processes it runs.

- ``write_checkpoints``: random-weight checkpoints, written once by a child process (the benchmark's own
  process, which hosts the engine's master, never holds a model; one child runs every such job until
  ``release_child``, which the benchmarks call before they measure anything).

- ``rank_spans``: which bytes of which checkpoint file each rank reads (``slice_reads.read_spans`` of
  the shard each rank builds), computed in a child process on a fake process group (no collective runs).
- ``BareProcesses``: ``n`` processes started as ``tiers.py``'s engines start their workers (``spawn``), each
  importing only what any worker must (torch, transformers and the model's transformers module), then
  reading the byte ranges it is given: every slice into a destination buffer, the bytes between the
  slices of one merged range into a small discard buffer, one thread, file order, ``preadv`` requests
  of up to 8 MB. Nothing else: no model is built, no readahead advice, no second thread.
- ``drop_cache``: ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file (drops its clean cached pages;
  no root needed), the one way both the engine and the bare processes start cold.
"""
from __future__ import annotations

import importlib
import mmap
import multiprocessing as mp
import os
import time
from typing import Dict, List, Sequence

REQUEST_BYTES = 8 << 20
IOV_MAX = 1024


def drop_cache(files: Sequence[str]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---- checkpoints ---------------------------------------------------------------------------------


def _write_child(jobs, conn) -> None:
    try:
        from computron import zoo
        for name, path, seed, dtype, vocab in jobs:
            model = zoo.random_causal_lm(name, seed=seed, dtype=dtype, fast_init=True,
                                         **({"vocab_size": vocab} if vocab else {}))
            for mod in model.modules():  # layer norms as a trained model has them: greedy answers are not
                if "LayerNorm" in type(mod).__name__:  # decided by near-ties then
                    mod.weight.data.fill_(1.0)
                    mod.bias.data.zero_()
            zoo.write_checkpoint(path, model.save_pretrained)
            del model
        conn.send(None)
    except BaseException as exc:  # noqa: BLE001 - the parent raises it
        conn.send(exc)


def write_checkpoints(name: str, directory: str, n: int, dtype: str, vocab: int, log=print) -> List[str]:
    """``n`` seeded random checkpoints of OPT shape ``name`` in ``directory`` (weights from
    ``zoo.random_causal_lm(fast_init=True)``, layer norms 1 and 0), written once by a child process."""
    paths = [os.path.join(directory, f"{name}-v{vocab or 'full'}-{dtype}-seed{i}") for i in range(n)]
    jobs = [(name, p, i, dtype, vocab) for i, p in enumerate(paths)
            if not os.path.isfile(os.path.join(p, "config.json"))]
    if jobs:
        log(f"writing {len(jobs)} checkpoint(s) of {name} to {directory} (once) ...")
        _in_child(_write_child, jobs)
    return paths


class _Child:
    """The spawned child that runs ``_in_child``'s jobs one after another, so that writing checkpoints, their
    references and each rank's spans pay for one start and one import of torch and transformers."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(theirs,), name="tiers-child", daemon=True)
        self.proc.start()
        theirs.close()

    def run(self, target, args):
        self.conn.send((target, args))
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _child_main(conn) -> None:
    while True:
        job = conn.recv()
        if job is None:
            return
        target, args = job
        target(*args, conn)  # each target sends its result, or the exception it raised


_child = None


def _in_child(target, *args):
    """``target(*args, conn)`` in the spawned child (started at the first call); returns what it sends
    (raises what it raises)."""
    global _child
    if _child is None:
        _child = _Child()
    try:
        out = _child.run(target, args)
    except (EOFError, OSError):  # the child died: the next call starts a new one
        release_child()
        raise
    if isinstance(out, BaseException):
        raise out
    return out


def release_child() -> None:
    """End the child, before anything is measured: the models it built leave no memory behind."""
    global _child
    if _child is not None:
        _child.close()
        _child = None


# ---- which bytes each rank reads ---------------------------------------------------------------


class _FakeGroups:
    """What a runner reads of ``topology.Groups``, on a fake process group."""

    def __init__(self, layout, rank: int):
        import torch.distributed as dist
        self.layout, self.rank = layout, rank
        self.tp_groups = [dist.new_group(layout.stage_ranks(s)) for s in range(layout.pp)] if layout.tp > 1 else []

    stage = property(lambda self: self.layout.stage_of(self.rank))
    tp_rank = property(lambda self: self.layout.tp_rank_of(self.rank))
    tp_group = property(lambda self: self.tp_groups[self.stage])


def _spans_child(paths: List[str], tp: int, pp: int, conn) -> None:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from computron import ModelConfig, zoo
    from computron.storage import checkpoint as ck
    from computron.models import StageContext, make_runner
    from computron.storage.segments import collect_slots
    from computron.storage.slice_reads import read_spans
    from computron.comm.topology import Layout
    out: Dict[int, Dict[int, list]] = {}
    try:
        for rank in range(tp * pp):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp * pp)
            try:
                groups = _FakeGroups(Layout(tp, pp, tp * pp, False), rank)
                for i, p in enumerate(paths):
                    mc = ModelConfig(f"m{i}", zoo.load_causal_lm, {"path": p})
                    module, names = ck.meta_model(p, None, mc.model_id)
                    runner = make_runner(module, mc, StageContext(groups, torch.device("cpu"), mc.model_id))
                    source = ck.CheckpointSource(mc.model_id, p, names, runner.module)
                    out.setdefault(i, {})[rank] = read_spans(source, collect_slots(runner.module, runner.segments))
            finally:
                dist.destroy_process_group()
        conn.send(out)
    except BaseException as exc:  # noqa: BLE001 - the parent raises it
        conn.send(exc)


def rank_spans(paths: List[str], tp: int, pp: int = 1) -> Dict[int, Dict[int, list]]:
    """``{model index: {rank: read_spans}}`` of each rank's shard of each checkpoint."""
    return _in_child(_spans_child, paths, tp, pp)


def slice_bytes(spans) -> int:
    return sum(run * count for *_, pieces in spans for _, run, _, count in pieces)


def span_bytes(spans) -> int:
    return sum(b - a for _, a, b, _ in spans)


# ---- the bare processes --------------------------------------------------------------------------


def _read(spans, dest: memoryview, discard: memoryview) -> int:
    """Read every span's slices into ``dest`` one after another (the bytes between them into
    ``discard``); returns the slice bytes read."""
    at = 0
    fds: Dict[str, int] = {}
    try:
        for file, begin, end, pieces in spans:
            fd = fds.get(file)
            if fd is None:
                fd = fds[file] = os.open(file, os.O_RDONLY)
            parts = []  # (file offset, length, keep)
            pos = begin
            for first, run, stride, count in sorted(pieces):
                for k in range(count):
                    a = first + k * stride
                    if a > pos:
                        parts.append((pos, a - pos, False))
                    parts.append((a, run, True))
                    pos = a + run
            i = 0
            while i < len(parts):
                off, bufs, size = parts[i][0], [], 0
                while i < len(parts) and len(bufs) < IOV_MAX and (not bufs or size + parts[i][1] <= REQUEST_BYTES):
                    _, n, keep = parts[i]
                    if not keep and n > len(discard):
                        break
                    if keep:
                        bufs.append(dest[at:at + n])
                        at += n
                    else:
                        bufs.append(discard[:n])
                    size += n
                    i += 1
                if not bufs:  # a gap longer than the discard buffer: skip it
                    i += 1
                    continue
                left = size
                while left:
                    got = os.preadv(fd, bufs, off)
                    if got <= 0:
                        raise OSError(f"{file}: no bytes at offset {off}")
                    off, left = off + got, left - got
                    if left:  # a short read: on from the first buffer not filled
                        k = 0
                        while got >= len(bufs[k]):
                            got -= len(bufs[k])
                            k += 1
                        bufs = [bufs[k][got:]] + bufs[k + 1:]
    finally:
        for fd in fds.values():
            os.close(fd)
    return at


def _bare_main(conn, module_name: str) -> None:
    for name in ("torch", "transformers", module_name):  # what every worker imports
        importlib.import_module(name)
    conn.send(("imported", time.time(), time.process_time()))
    discard = memoryview(bytearray(1 << 20))
    reused = None
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        jobs, fresh = cmd  # jobs: a list of span lists, each read into a destination of its own
        if fresh:
            t0 = time.time()
            kept, nbytes = [], 0
            for spans in jobs:
                buf = mmap.mmap(-1, max(1, slice_bytes(spans)))  # fresh memory, faulted in by the read
                nbytes += _read(spans, memoryview(buf), discard)
                kept.append(buf)
            t1 = time.time()
            for buf in kept:
                buf.close()
        else:
            need = max(slice_bytes(spans) for spans in jobs)
            if reused is None or len(reused) < need:
                reused = mmap.mmap(-1, need)
            t0 = time.time()
            nbytes = sum(_read(spans, memoryview(reused), discard) for spans in jobs)
            t1 = time.time()
        conn.send(("read", t0, t1, nbytes, time.process_time()))


class BareProcesses:
    """``n`` bare processes (see the module docstring); ``started_s``: spawn until every one has imported."""

    def __init__(self, n: int, module_name: str):
        release_child()
        ctx = mp.get_context("spawn")
        t0 = time.time()
        self.conns, self.procs = [], []
        for i in range(n):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_bare_main, args=(theirs, module_name), name=f"bare-{i}", daemon=True)
            p.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(p)
        got = [c.recv() for c in self.conns]
        self.started_s = max(g[1] for g in got) - t0
        self.cpu_s = sum(g[2] for g in got)
        """CPU seconds of all, so far."""

    def read(self, jobs_per_process: List[List[list]], fresh: bool) -> dict:
        """Every process reads its jobs at once; ``{"s": first start to last end, "max_s": the slowest
        process's own seconds, "bytes": slice bytes of all}``."""
        for c, jobs in zip(self.conns, jobs_per_process):
            c.send((jobs, fresh))
        got = [c.recv() for c in self.conns]
        self.cpu_s = sum(g[4] for g in got)
        return {"s": max(g[2] for g in got) - min(g[1] for g in got), "max_s": max(g[2] - g[1] for g in got),
                "bytes": sum(g[3] for g in got)}

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def model_module(path: str) -> str:
    """The transformers module of the checkpoint's architecture (what a worker imports to build it)."""
    import json
    with open(os.path.join(path, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    import transformers
    return getattr(transformers, arch).__module__


def startup_floor(spans: Dict[int, Dict[int, list]], module_name: str, n: int, files: Sequence[str],
                  cold: bool, models: Sequence[int]) -> dict:
    """``n`` bare processes started at once, then reading at once every slice of ``models`` their rank
    reads at start-up, into fresh memory: ``{"import_s", "read_s", "floor_s", "cpu_s"}`` (``cpu_s``: CPU
    seconds of all the processes)."""
    if cold:
        drop_cache(files)
    with BareProcesses(n, module_name) as bare:
        got = bare.read([[spans[i][r] for i in models] for r in range(n)], fresh=True)
    return {"import_s": bare.started_s, "read_s": got["s"], "floor_s": bare.started_s + got["s"],
            "bytes": got["bytes"], "cpu_s": bare.cpu_s}


def _import_files_child(module_name: str, conn) -> None:
    try:
        import importlib.util
        import sys
        for name in ("torch", "transformers", module_name):  # what every worker imports
            importlib.import_module(name)
        files = set()
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None)
            if path:
                files.add(path)
                if path.endswith(".py"):
                    files.add(importlib.util.cache_from_source(path))
        with open("/proc/self/maps") as maps:  # the shared libraries, the interpreter's own included
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[5].startswith("/"):
                    files.add(fields[5])
        conn.send(sorted(f for f in files if os.path.isfile(f)))
    except BaseException as exc:  # noqa: BLE001 - the parent raises it
        conn.send(exc)


_import_files: Dict[str, List[str]] = {}


def warm_imports(module_name: str) -> None:
    """Read every file that importing what a worker imports reads (sources, compiled caches, shared
    libraries; listed once by the child, which imports them), so that they come from the page cache for
    whatever is measured next, else the first of a pair pays for reading them. Reading them costs a
    fraction of a second where importing them in a throwaway process took ten on 2 cores."""
    if module_name not in _import_files:
        _import_files[module_name] = _in_child(_import_files_child, module_name)
    warm_cache(_import_files[module_name])


def warm_cache(files: Sequence[str]) -> None:
    """Read ``files`` whole (into the page cache)."""
    buf = memoryview(bytearray(16 << 20))
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
