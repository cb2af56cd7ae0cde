"""Shards straight from a local safetensors checkpoint: each rank reads only its own slices.

The full model is never built. ``meta_model`` builds the transformers model from
its ``config.json`` with every *parameter* on the meta device (no memory; buffers
such as rotary ``inv_freq`` or BERT's ``position_ids`` are computed on the CPU as
usual, since checkpoints do not hold the non-persistent ones); the runner then cuts
it to this rank's pipeline stage and applies its DTensor TP plan, both of which
work on meta tensors. ``CheckpointSource`` maps every tensor this rank keeps to
the checkpoint entry it comes from (tied weights through the object they share)
and, for a DTensor, to its slice (``compute_local_shape_and_global_offset``, so
any 1-D plan works); ``slice_reads.read_segments`` reads those bytes with
``os.preadv`` straight into the store's host buffer, never the whole file.

A model is read this way when its ``ModelConfig.checkpoint`` names a directory
(what ``computron serve`` sets), or, for callers that name only the loader, its
``model_fn`` is ``loading.load_causal_lm`` / ``loading.load_encoder`` with a
``path``; the directory must hold ``model.safetensors`` or an
``model.safetensors.index.json`` with its shards, and the model must be of a
family ``models.families`` lists. Anything else goes through ``model_fn`` as before.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._torch_compat import (direct_tensor, direct_tensors, local_shape_and_offset, local_tensor, map_tensors,
                             mark_loaded, set_parameter)
from ..loading import DTYPES, architecture_class, torch_dtype

log = logging.getLogger("computron.checkpoint")

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _ST_DTYPES[_name] = getattr(torch, _attr)


class CheckpointError(RuntimeError):
    """A checkpoint file that is missing, truncated or does not hold what the model needs."""


class Unsupported(Exception):
    """This model cannot be read slice-wise (no safetensors, unknown family): use model_fn."""


# ---- where a model's checkpoint is --------------------------------------------------------------


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


_on_meta = threading.local()
_patch_lock = threading.Lock()
_plain_register_parameter = nn.Module.register_parameter


def _register_parameter(module, name, param):
    _plain_register_parameter(module, name, param)
    if getattr(_on_meta, "depth", 0) and param is not None and param.device.type != "meta":
        p = direct_tensor(module, name)
        set_parameter(module, name, mark_loaded(type(p)(p.to("meta"), requires_grad=p.requires_grad)))


@contextlib.contextmanager
def params_on_meta():
    """Parameters this thread creates inside go to the meta device; buffers stay real (accelerate's
    ``init_empty_weights(include_buffers=False)``), so computed buffers keep their values.

    Each meta parameter is flagged loaded (``_torch_compat.mark_loaded``), so that transformers' weight
    initialisation skips it: on meta tensors it computes nothing, through torch's Python reference kernels
    (a third of building a model's shard). ``nn.Module.register_parameter`` is replaced once for the
    process, but acts only on the threads inside this context: a model the command loop builds beside a
    shard build (``worker/shard_builder.py``) keeps its real parameters."""
    with _patch_lock:
        if nn.Module.register_parameter is not _register_parameter:
            nn.Module.register_parameter = _register_parameter
    _on_meta.depth = getattr(_on_meta, "depth", 0) + 1
    try:
        yield
    finally:
        _on_meta.depth -= 1


def meta_model(path: str, dtype: Optional[str] = None, model_id: str = ""):
    """The model of checkpoint ``path`` with its parameters on the meta device, and the map
    ``(id(module), attr) -> checkpoint names`` that ``CheckpointSource`` needs (keep it until then)."""
    from transformers import AutoConfig
    from ..models import causal_lm_family, encoder_family
    if not os.path.isfile(os.path.join(path, "gguf_source.json")):  # a GGUF file's metadata directory
        weight_files(path)  # Unsupported without safetensors
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    cls = architecture_class(config)
    if cls is None:
        raise Unsupported(f"config.architectures={getattr(config, 'architectures', None)!r} names no "
                          "transformers class")
    default = torch_dtype(dtype, f"model {model_id!r}") if dtype is not None else _config_dtype(config)
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(default)
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
    return torch_dtype(str(d)) if str(d) in DTYPES else torch.float32


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
            for attr, t, _ in direct_tensors(mod):
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
        for attr, p, is_param in direct_tensors(mod):
            if is_param:
                ties.setdefault(id(p), []).append((mod, attr))
    map_tensors(module, lambda t: torch.empty_like(t, device="cpu") if t.is_meta else t)
    for holders in ties.values():
        (m0, a0), rest = holders[0], holders[1:]
        for m, a in rest:
            if direct_tensor(m, a) is not direct_tensor(m0, a0):
                set_parameter(m, a, direct_tensor(m0, a0))


# ---- reading slices ------------------------------------------------------------------------------


@dataclass
class Read:
    """Where one of this rank's tensors comes from."""
    key: Optional[str]             # checkpoint name; None: a computed buffer, copied from ``value``
    offsets: Tuple[int, ...] = ()  # of this rank's slice in the full tensor
    shape: Tuple[int, ...] = ()    # of this rank's slice
    value: Optional[torch.Tensor] = None
    parts: Tuple["Read", ...] = ()
    """Several row ranges of ``key``, one after the other in this rank's tensor (``models.row_split``)."""
    produce: Optional[Callable] = None
    """With ``key`` None: ``produce(reader) -> tensor`` makes this rank's tensor (``quant.apply``: a
    quantized weight's bytes from the float checkpoint or the GGUF file's blocks)."""

    def pieces(self) -> Tuple["Read", ...]:
        """The single-slice reads this one is made of."""
        return self.parts or (self,)


def _local_slice(t: torch.Tensor, places: Dict[int, tuple]) -> Tuple[
        Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
    """(global shape, local offsets, local shape) of a parameter; a plain tensor is its whole self.
    ``places``: by ``id`` of each device mesh met so far, ``(mesh, this rank's index or None, size)``
    (None: not a 1-D mesh); asking a mesh costs more than all the rest."""
    if not (hasattr(t, "placements") and hasattr(t, "device_mesh")):
        return tuple(t.shape), (0,) * t.dim(), tuple(t.shape)
    full = tuple(t.shape)
    mesh = t.device_mesh
    place = places.get(id(mesh))
    if place is None or place[0] is not mesh:
        place = places[id(mesh)] = (mesh, None, 0)
        if mesh.ndim == 1:  # this rank's place from its global rank (a mesh object may be shared by equal meshes)
            import torch.distributed as dist
            ranks = mesh.mesh.reshape(-1).tolist()
            place = places[id(mesh)] = (mesh, ranks.index(dist.get_rank()), len(ranks))
    _, me, n_ranks = place
    if me is not None:
        offset, shape = [0] * len(full), list(full)
        for p in t.placements:
            if p.is_shard():
                d, n, k = p.dim % len(full), full[p.dim % len(full)], n_ranks
                chunk = -(-n // k)  # DTensor's Shard: torch.chunk sizes
                offset[d] = min(me * chunk, n)
                shape[d] = max(0, min(n, offset[d] + chunk) - offset[d])
            elif not p.is_replicate():
                raise Unsupported(f"placement {p} of a parameter")
    else:
        shape, offset = local_shape_and_offset(t)
    local = local_tensor(t)
    if tuple(local.shape) != tuple(shape):
        raise Unsupported(f"local shard shape {list(local.shape)} differs from the computed slice {list(shape)}")
    return full, tuple(offset), tuple(shape)


class CheckpointSource:
    """Reads this rank's shard of a model from its checkpoint into the store's host buffers."""

    def __init__(self, model_id: str, path: str, names: ParamNames, module: nn.Module):
        """``module``: the runner's module (cut to this stage, TP applied, still on meta)."""
        from ..models.row_split import pieces_of
        self.model_id = model_id
        self.path = path
        self.entries, self.sizes = self._entries(path, model_id)
        self.reads: Dict[int, Read] = {}  # id(local tensor) -> Read, once materialized
        pending, places = [], {}
        for mod in module.modules():
            for attr, t, is_param in direct_tensors(mod):
                known = names.of(mod, attr)
                if known is None:
                    raise Unsupported(f"{type(mod).__name__}.{attr} was not part of the model the config builds")
                key = self._key(known, names.prefix)
                if key is None:
                    if t.is_meta or is_param:
                        raise Unsupported(f"checkpoint {path!r} holds no tensor named {known or [attr]}")
                    pending.append((mod, attr, Read(None, value=t.detach().clone())))
                    continue
                rows = pieces_of(mod, attr)
                full, off, shape = _local_slice(t, places) if rows is None else (rows[0], (), ())
                e = self.entries[key]
                if tuple(e.shape) != tuple(full):
                    raise Unsupported(f"checkpoint tensor {key!r} has shape {list(e.shape)}, the model "
                                      f"expects {list(full)}")
                if rows is None:
                    pending.append((mod, attr, Read(key, off, shape)))
                else:
                    rest = tuple(full[1:])
                    parts = tuple(Read(key, (a,) + (0,) * len(rest), (n,) + rest) for a, n in rows[1])
                    pending.append((mod, attr, Read(key, parts=parts)))
        materialize(module)
        for mod, attr, r in pending:
            self.reads[id(local_tensor(direct_tensor(mod, attr)))] = r
        del names

    def _entries(self, path: str, model_id: str):
        """``(entries, file sizes)`` of the checkpoint (``gguf_native.GGUFSource``: of a GGUF file)."""
        return read_entries(path, model_id)

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


__all__ = ["CheckpointError", "CheckpointSource", "Unsupported", "meta_model", "read_header",
           "read_entries", "weight_files", "params_on_meta", "materialize"]
