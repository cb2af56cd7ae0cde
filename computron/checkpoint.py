"""Shards straight from a local safetensors checkpoint: each rank reads only its own slices.

The full model is never built. ``meta_model`` builds the transformers model from
its ``config.json`` with every *parameter* on the meta device (no memory; buffers
such as rotary ``inv_freq`` or BERT's ``position_ids`` are computed on the CPU as
usual, since checkpoints do not hold the non-persistent ones); the runner then cuts
it to this rank's pipeline stage and applies its DTensor TP plan, both of which
work on meta tensors. ``CheckpointSource`` maps every tensor this rank keeps to
the checkpoint entry it comes from (tied weights through the object they share)
and, for a DTensor, to its slice (``compute_local_shape_and_global_offset``, so
any 1-D plan works), and reads those bytes with ``os.preadv`` straight into the
store's host buffer (``read_segments``: sorted by file offset, coalesced into
large scattered requests, several in flight), never the whole file.

A model is read this way when its ``ModelConfig.checkpoint`` names a directory, or
its ``model_fn`` is ``zoo.load_causal_lm`` / ``zoo_understanding.load_encoder``
with a ``path``; the directory must hold ``model.safetensors`` or an
``model.safetensors.index.json`` with its shards, and the model must be of a
family the runners know (causal LMs of ``models.causal_lm``, encoders of
``models.registry``). Anything else goes through ``model_fn`` as before.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

log = logging.getLogger("computron.checkpoint")

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CHUNK_BYTES = 64 << 20
"""The scratch buffer of a read that converts dtypes."""
REQUEST_BYTES = 8 << 20
"""Largest single ``preadv`` (a larger tensor is read by several threads at once)."""
GAP_BYTES = 256 << 10
"""Runs of one file closer than this are read as one request, the bytes between them into a discard
buffer: small tensors side by side, and a dim-1 slice's rows (the disk reads the rows around them
anyway, and the machine's other TP ranks find them in the page cache); farther ones are skipped."""
READ_THREADS = 2
"""Requests in flight per read."""
AHEAD_BYTES = 64 << 20
"""How far ahead of the requests being read the kernel is asked to read."""
ADVICE_BYTES = 16 << 20
"""The piece of file one read-ahead advice covers."""
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if "SC_IOV_MAX" in getattr(os, "sysconf_names", {}) else 1024
"""Buffers one ``preadv`` takes."""

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _ST_DTYPES[_name] = getattr(torch, _attr)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CheckpointError(RuntimeError):
    """A checkpoint file that is missing, truncated or does not hold what the model needs."""


class Unsupported(Exception):
    """This model cannot be read slice-wise (no safetensors, unknown family): use model_fn."""


# ---- where a model's checkpoint is --------------------------------------------------------------


def checkpoint_of(model_config) -> Optional[Tuple[str, Optional[str]]]:
    """``(directory, dtype name or None)`` when the model's weights come from a local checkpoint, else None."""
    ck = getattr(model_config, "checkpoint", None)
    kw = model_config.model_kwargs or {}
    if ck is not None:
        return str(ck), None
    from . import zoo
    loaders = [zoo.load_causal_lm]
    try:
        from . import zoo_understanding
        loaders.append(zoo_understanding.load_encoder)
    except ImportError:  # pragma: no cover - optional part
        pass
    if any(model_config.model_fn is f for f in loaders) and isinstance(kw.get("path"), (str, os.PathLike)):
        if set(kw) - {"path", "dtype"}:
            return None  # arguments we do not know the meaning of: model_fn decides
        return str(kw["path"]), kw.get("dtype")
    return None


def weight_files(path: str) -> List[str]:
    """The safetensors files of a checkpoint directory (sorted); Unsupported when it has none."""
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, WEIGHTS_NAME)
    if os.path.isfile(single):
        return [single]
    raise Unsupported(f"{path!r} holds no {WEIGHTS_NAME} or {INDEX_NAME}")


@dataclass(frozen=True)
class Entry:
    file: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def read_header(file: str, model_id: str = "") -> Tuple[Dict[str, Entry], int]:
    """The entries of one safetensors file and the byte size its header says the file has."""
    who = f"model {model_id!r}: " if model_id else ""
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{who}checkpoint file {file!r} is truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 << 20:
                raise CheckpointError(f"{who}checkpoint file {file!r} is not a safetensors file (header of {n} bytes)")
            head = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{who}checkpoint file {file!r} does not exist") from None
    if len(head) < n:
        raise CheckpointError(f"{who}checkpoint file {file!r} is truncated (header cut short)")
    try:
        meta = json.loads(head)
    except ValueError as exc:
        raise CheckpointError(f"{who}checkpoint file {file!r} has a corrupt header: {exc}") from None
    base = 8 + n
    out, size = {}, base
    for key, v in meta.items():
        if key == "__metadata__":
            continue
        if v["dtype"] not in _ST_DTYPES:
            raise CheckpointError(f"{who}{file!r}: tensor {key!r} has dtype {v['dtype']} that torch cannot hold")
        a, b = v["data_offsets"]
        out[key] = Entry(file, _ST_DTYPES[v["dtype"]], tuple(v["shape"]), base + a, base + b)
        size = max(size, base + b)
    return out, size


def read_entries(path: str, model_id: str = "") -> Tuple[Dict[str, Entry], Dict[str, int]]:
    """Every tensor entry of the checkpoint at ``path`` and the size each file must have."""
    entries, sizes = {}, {}
    for file in weight_files(path):
        e, size = read_header(file, model_id)
        entries.update(e)
        sizes[file] = size
    return entries, sizes


# ---- the model, without its weights --------------------------------------------------------------


@contextlib.contextmanager
def params_on_meta():
    """Parameters created inside go to the meta device; buffers stay real (accelerate's
    ``init_empty_weights(include_buffers=False)``), so computed buffers keep their values."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def meta_model(path: str, dtype: Optional[str] = None, model_id: str = ""):
    """The model of checkpoint ``path`` with its parameters on the meta device, and the map
    ``(id(module), attr) -> checkpoint names`` that ``CheckpointSource`` needs (keep it until then)."""
    import transformers
    from transformers import AutoConfig
    from .models import causal_lm_family, encoder_family
    weight_files(path)  # Unsupported without safetensors
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise Unsupported(f"config.architectures={getattr(config, 'architectures', None)!r} names no "
                          "transformers class")
    torch_dtype = _DTYPES[dtype] if dtype is not None else _config_dtype(config)
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch_dtype)
        with params_on_meta():
            model = cls(config)
    finally:
        torch.set_default_dtype(old)
    model.eval()
    if causal_lm_family(model) is None and encoder_family(model) is None:
        raise Unsupported(f"{type(model).__name__} is of no family the runners split")
    return model, ParamNames(model)


def _config_dtype(config) -> torch.dtype:
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, torch.dtype):
        return d
    return _DTYPES.get(str(d), torch.float32)


class ParamNames:
    """Every name a parameter or buffer of the full model is known by, found again after the runner
    cut the model and TP replaced parameters: by the module that holds it and the attribute name."""

    def __init__(self, model: nn.Module):
        by_id: Dict[int, List[str]] = {}
        for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
                model.named_buffers(remove_duplicate=False)):
            by_id.setdefault(id(t), []).append(name)
        self.names: Dict[Tuple[int, str], List[str]] = {}
        self._keep = []  # ids stay valid while the objects live
        for mod in model.modules():
            self._keep.append(mod)
            for attr, t in list(mod._parameters.items()) + list(mod._buffers.items()):
                if t is not None:
                    self.names[(id(mod), attr)] = by_id.get(id(t), [])
        self.prefix = getattr(model, "base_model_prefix", "") or ""

    def of(self, mod: nn.Module, attr: str) -> Optional[List[str]]:
        return self.names.get((id(mod), attr))


def materialize(module: nn.Module) -> None:
    """Give every meta tensor empty CPU memory of its (shard) shape, keeping tied parameters tied.
    ``torch.empty`` does not touch the pages: nothing counts against the resident set until the
    store replaces them with its own buffer."""
    ties: Dict[int, List[Tuple[nn.Module, str]]] = {}
    for mod in module.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                ties.setdefault(id(p), []).append((mod, attr))
    module._apply(lambda t: torch.empty_like(t, device="cpu") if t.is_meta else t)
    for holders in ties.values():
        (m0, a0), rest = holders[0], holders[1:]
        for m, a in rest:
            if m._parameters[a] is not m0._parameters[a0]:
                m._parameters[a] = m0._parameters[a0]


# ---- reading slices ------------------------------------------------------------------------------


@dataclass
class Read:
    """Where one of this rank's tensors comes from."""
    key: Optional[str]             # checkpoint name; None: a computed buffer, copied from ``value``
    offsets: Tuple[int, ...] = ()  # of this rank's slice in the full tensor
    shape: Tuple[int, ...] = ()    # of this rank's slice
    value: Optional[torch.Tensor] = None


def _local_slice(t: torch.Tensor) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
    """(global shape, local offsets, local shape) of a parameter; a plain tensor is its whole self."""
    if not (hasattr(t, "placements") and hasattr(t, "device_mesh")):
        return tuple(t.shape), (0,) * t.dim(), tuple(t.shape)
    full = tuple(t.shape)
    mesh = t.device_mesh
    if mesh.ndim == 1:  # this rank's place from its global rank (a mesh object may be shared by equal meshes)
        import torch.distributed as dist
        ranks = mesh.mesh.reshape(-1).tolist()
        me = ranks.index(dist.get_rank())
        offset, shape = [0] * len(full), list(full)
        for p in t.placements:
            if p.is_shard():
                d, n, k = p.dim % len(full), full[p.dim % len(full)], len(ranks)
                chunk = -(-n // k)  # DTensor's Shard: torch.chunk sizes
                offset[d] = min(me * chunk, n)
                shape[d] = max(0, min(n, offset[d] + chunk) - offset[d])
            elif not p.is_replicate():
                raise Unsupported(f"placement {p} of a parameter")
    else:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
    local = getattr(t, "_local_tensor", None)
    if local is not None and tuple(local.shape) != tuple(shape):
        raise Unsupported(f"local shard shape {list(local.shape)} differs from the computed slice {list(shape)}")
    return full, tuple(offset), tuple(shape)


class CheckpointSource:
    """Reads this rank's shard of a model from its checkpoint into the store's host buffers."""

    def __init__(self, model_id: str, path: str, names: ParamNames, module: nn.Module):
        """``module``: the runner's module (cut to this stage, TP applied, still on meta)."""
        self.model_id = model_id
        self.path = path
        self.entries, self.sizes = read_entries(path, model_id)
        self.reads: Dict[int, Read] = {}  # id(local tensor) -> Read, once materialized
        pending = []
        for mod in module.modules():
            for attr, t in list(mod._parameters.items()) + list(mod._buffers.items()):
                if t is None:
                    continue
                known = names.of(mod, attr)
                if known is None:
                    raise Unsupported(f"{type(mod).__name__}.{attr} was not part of the model the config builds")
                key = self._key(known, names.prefix)
                if key is None:
                    if t.is_meta or attr in mod._parameters:
                        raise Unsupported(f"checkpoint {path!r} holds no tensor named {known or [attr]}")
                    pending.append((mod, attr, Read(None, value=t.detach().clone())))
                    continue
                full, off, shape = _local_slice(t)
                e = self.entries[key]
                if tuple(e.shape) != full:
                    raise Unsupported(f"checkpoint tensor {key!r} has shape {list(e.shape)}, the model "
                                      f"expects {list(full)}")
                pending.append((mod, attr, Read(key, off, shape)))
        materialize(module)
        for mod, attr, r in pending:
            t = mod._parameters.get(attr) if attr in mod._parameters else mod._buffers.get(attr)
            inner = getattr(t, "_local_tensor", None)
            self.reads[id(inner if inner is not None else t)] = r
        del names
        self.last_read_s = 0.0
        self.last_read_bytes = 0

    def _key(self, names: Sequence[str], prefix: str = "") -> Optional[str]:
        """The checkpoint's name for a tensor known by ``names``: as is, or without/with the base model
        prefix (a base model's checkpoint under a task model, or the other way round)."""
        for n in names:
            if n in self.entries:
                return n
        if prefix:
            p = prefix + "."
            for n in names:
                alt = n[len(p):] if n.startswith(p) else p + n
                if alt in self.entries:
                    return alt
        return None

    def check(self, slots) -> None:
        missing = [s.name for s in slots if id(s.tensor) not in self.reads]
        if missing:
            raise Unsupported(f"no checkpoint entry found for {missing[:5]}")

    def plan(self, slots) -> List[Tuple["object", Read]]:
        return [(s, self.reads[id(s.tensor)]) for s in slots]

    # ---- the reading itself ------------------------------------------------
    def open(self) -> "_Reader":
        """Re-read the headers (a file may have been rewritten since start-up) and check every file
        is long enough: a missing or truncated file fails here, naming the model and the file."""
        entries = {}
        for file in self.sizes:  # the files found at start-up
            try:
                have = os.path.getsize(file)
            except FileNotFoundError:
                raise CheckpointError(f"model {self.model_id!r}: checkpoint file {file!r} does not exist") from None
            found, need = read_header(file, self.model_id)
            entries.update(found)
            if have < need:
                raise CheckpointError(f"model {self.model_id!r}: checkpoint file {file!r} is truncated "
                                      f"({have} bytes, its header needs {need})")
        return _Reader(self.model_id, entries)


class _Reader:
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

    def will_need(self, file: str, begin: int, end: int) -> None:
        """Ask the kernel to start reading ``[begin, end)`` in the background (read-ahead of what the
        next requests read while these are copied out)."""
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(self._fd(file), begin, end - begin, os.POSIX_FADV_WILLNEED)
            except OSError:  # advice only
                pass

    def preadv(self, file: str, bufs: List[memoryview], offset: int) -> None:
        """Fill ``bufs`` in order with the file's bytes from ``offset``, through short reads."""
        fd = self._fd(file)
        while bufs:
            got = os.preadv(fd, bufs, offset)
            if got <= 0:
                raise CheckpointError(f"model {self.model_id!r}: checkpoint file {file!r} is truncated "
                                      f"(no bytes at offset {offset})")
            offset += got
            while bufs and got >= len(bufs[0]):
                got -= len(bufs[0])
                bufs = bufs[1:]
            if got:
                bufs = [bufs[0][got:]] + bufs[1:]

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

    def plan(self, r: Read, dest: torch.Tensor, name: str):
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
            planned = reader.plan(r, dest, s.name)
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
    dt = time.perf_counter() - t0
    source.last_read_s, source.last_read_bytes = dt, nbytes
    return dt, nbytes


def _run_tasks(reader: _Reader, tasks, n_segments: int, on_segment, threads: int, discard: memoryview) -> None:
    """Execute ``(segment, task)`` in order on ``threads`` threads (this one among them), advising the
    kernel ahead, calling ``on_segment`` as segments complete; raises the first error."""
    left = [0] * n_segments
    for seg, _ in tasks:
        left[seg] += 1
    # read-ahead advice: the tasks' file ranges, bridged over gaps of up to AHEAD_BYTES (the other TP
    # ranks' parts of a tensor are read too: they are about to ask for them), in pieces of
    # ADVICE_BYTES, each due when the reads come within AHEAD_BYTES of it
    spans: List[list] = []  # [bytes of the tasks before it, file, begin, end]
    before, at = [], 0
    for _, t in tasks:
        before.append(at)
        if isinstance(t, (_Request, _Rows)):
            last = spans[-1] if spans else None
            if last is not None and last[1] == t.file and 0 <= t.begin - last[3] <= AHEAD_BYTES:
                last[3] = max(last[3], t.end)
            else:
                spans.append([at, t.file, t.begin, t.end])
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


__all__ = ["CheckpointError", "CheckpointSource", "Unsupported", "checkpoint_of", "meta_model", "read_header",
           "read_entries", "weight_files", "params_on_meta", "materialize", "read_segments"]
