"""A GGUF file's tensors read straight into a rank's shard, at the bytes the file holds.

``layout`` parses the file's header (its metadata skipped, never interpreted; the tensor table read) into
where each tensor's rows lie. ``GGUFSource`` is a ``checkpoint.CheckpointSource`` over it: the model comes
from the metadata directory ``storage.gguf`` writes (config, tokenizer; no weights), every tensor is found
under its transformers name through transformers' own GGUF name map, and each of this rank's tensors is read
as rows of the file:

- a quantized Linear weight of the decoder layers (``quant.formats.GGUF_FORMATS``) keeps its block bytes:
  ``formats()`` hands it to ``quant.apply.quantize_shard`` (repacked without any arithmetic);
- every other tensor (norms, embeddings, a Linear of F32/F16/BF16, a quantized embedding) becomes float32
  rows of the slice (dequantized where quantized), converted to the model's dtype by the store.

llama.cpp stores a Llama's q and k projections with each head's rows interleaved (its converter permutes
them for its rotary layout); those rows are read in transformers' order (whole rows: no block is touched).
Architectures whose tensors transformers reshapes in other ways (``TENSOR_PROCESSORS`` other than Llama's)
are refused with a ``GGUFError``, as is any tensor of a block type not listed.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from ..errors import GGUFError
from .checkpoint import CheckpointSource, Entry, Read

SOURCE_FILE = "gguf_source.json"
"""In a GGUF file's metadata directory: which file its weights are read from."""
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_PLAIN_ARCHS_PERMUTED = {"llama"}


@dataclass(frozen=True)
class Tensor:
    name: str
    type_name: str
    rows: int
    cols: int
    """Transformers' shape ``(rows, cols)`` (GGUF lists dimensions innermost first); a 1-D tensor is one row."""
    begin: int
    row_bytes: int
    ndim: int


def source_of(path: str) -> Optional[str]:
    """The ``.gguf`` file a metadata directory stands for, else None."""
    f = os.path.join(path, SOURCE_FILE)
    if not os.path.isfile(f):
        return None
    with open(f) as fh:
        return json.load(fh).get("gguf")


class _Cursor:
    def __init__(self, f):
        self.f = f

    def take(self, fmt: str):
        n = struct.calcsize(fmt)
        raw = self.f.read(n)
        if len(raw) < n:
            raise EOFError("its header ends early")
        return struct.unpack(fmt, raw)[0]

    def string(self) -> str:
        return self.f.read(self.take("<Q")).decode("utf-8", "replace")

    def skip_value(self, kind: int) -> object:
        if kind in _SCALAR:
            return self.take(_SCALAR[kind])
        if kind == 8:
            return self.string()
        if kind == 9:
            inner, n = self.take("<I"), self.take("<Q")
            if inner in _SCALAR:
                self.f.seek(struct.calcsize(_SCALAR[inner]) * n, os.SEEK_CUR)
            else:
                for _ in range(n):
                    self.skip_value(inner)
            return None
        raise ValueError(f"unknown metadata value type {kind}")


def layout(path: str) -> Tuple[Dict[str, Tensor], str]:
    """``({gguf name: Tensor}, architecture)`` from the file's header; ``GGUFError`` for a broken one."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    try:
        with open(path, "rb") as f:
            c = _Cursor(f)
            if f.read(4) != b"GGUF":
                raise GGUFError(f"{path}: not a GGUF file")
            c.take("<I")
            n_tensors, n_kv = c.take("<Q"), c.take("<Q")
            arch, align = "", 32
            for _ in range(n_kv):
                key = c.string()
                value = c.skip_value(c.take("<I"))
                if key == "general.architecture":
                    arch = value
                elif key == "general.alignment":
                    align = int(value)
            infos = []
            for _ in range(n_tensors):
                name = c.string()
                dims = [c.take("<Q") for _ in range(c.take("<I"))]
                infos.append((name, dims, c.take("<I"), c.take("<Q")))
            start = -(-f.tell() // align) * align
    except (EOFError, ValueError, UnicodeDecodeError, struct.error) as exc:
        raise GGUFError(f"{path}: truncated or corrupt GGUF header: {exc}") from None
    out = {}
    for name, dims, kind, offset in infos:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name!r} has block type {kind}, unknown to the gguf package") from None
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        cols = dims[0]
        rows = 1
        for d in dims[1:]:
            rows *= d
        out[name] = Tensor(name, qtype.name, rows, cols, start + offset, cols // block * block_bytes, len(dims))
    return out, arch


def check_types(path: str, tensors: Dict[str, Tensor]) -> None:
    """``GGUFError`` naming the first tensor of a block type this engine does not serve."""
    from ..quant.formats import GGUF_FORMATS
    for t in tensors.values():
        if t.type_name not in FLOAT_TYPES and t.type_name not in GGUF_FORMATS:
            raise GGUFError(f"{path}: tensor {t.name!r} is stored as {t.type_name}, a block type Computron does "
                            f"not serve (it serves {', '.join(list(FLOAT_TYPES) + list(GGUF_FORMATS))})")


def check_architecture(path: str, arch: str) -> None:
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS
    if arch in TENSOR_PROCESSORS and arch not in _PLAIN_ARCHS_PERMUTED:
        raise GGUFError(f"{path}: GGUF architecture {arch!r}: its tensors need transformers' reshaping "
                        f"({TENSOR_PROCESSORS[arch].__name__}), which Computron does not do on the file's blocks")


class GGUFSource(CheckpointSource):
    """This rank's tensors of a model, read from a GGUF file (see the module docstring)."""

    def __init__(self, model_id: str, path: str, names, module, name_map: Dict[str, str], config):
        """``name_map``: ``name_map(model)`` of the whole meta model (before the runner cut it)."""
        self.gguf_file = source_of(path)
        self.tensors, self.arch = layout(self.gguf_file)
        check_types(self.gguf_file, self.tensors)
        check_architecture(self.gguf_file, self.arch)
        self._hf = name_map
        self._config = config
        super().__init__(model_id, path, names, module)

    def _entries(self, path: str, model_id: str):
        entries = {}
        for gname, hf in self._hf.items():
            t = self.tensors.get(gname)
            if t is not None:
                shape = (t.cols,) if t.ndim == 1 else (t.rows, t.cols)
                entries[hf] = Entry(self.gguf_file, torch.float32, shape, t.begin, t.begin + t.rows * t.row_bytes)
        return entries, {}

    def _tensor(self, key: str) -> Tensor:
        return self.tensors[next(g for g, h in self._hf.items() if h == key)]

    def _row_order(self, t: Tensor) -> Optional[torch.Tensor]:
        """GGUF row of each transformers row, where llama.cpp permuted them; else None."""
        if self.arch not in _PLAIN_ARCHS_PERMUTED or not (".attn_q." in t.name or ".attn_k." in t.name):
            return None
        heads = self._config.num_attention_heads
        if ".attn_k." in t.name:
            heads = getattr(self._config, "num_key_value_heads", None) or heads
        d = t.rows // heads // 2
        return torch.arange(t.rows).reshape(heads, d, 2).transpose(1, 2).reshape(-1)

    def raw_rows(self, reader, t: Tensor, first: int, count: int) -> torch.Tensor:
        """``uint8 [count, row_bytes]``: transformers' rows ``[first, first + count)`` of ``t`` as stored."""
        order = self._row_order(t)
        if order is None:
            return _pread(reader, self.gguf_file, t, first, count)
        want = order[first:first + count]
        lo, hi = int(want.min()), int(want.max()) + 1
        return _pread(reader, self.gguf_file, t, lo, hi - lo)[want - lo]

    def formats(self, key: str):
        """``(Format, rows reader, input features)`` of a quantized 2-D tensor, for ``quantize_shard``."""
        from ..quant.formats import GGUF_FORMATS
        t = self._tensor(key)
        fmt = GGUF_FORMATS.get(t.type_name)
        if fmt is None or t.ndim != 2:
            return None
        return fmt, lambda reader, first, count: self.raw_rows(reader, t, first, count), t.cols

    def finish(self) -> None:
        """Every read still naming a tensor becomes float32 rows of its slice (after ``quantize_shard``)."""
        for k, r in list(self.reads.items()):
            if r.key is not None:
                self.reads[k] = Read(None, produce=self._float_read(r))

    def _float_read(self, whole: Read):
        t = self._tensor(whole.key)

        def produce(reader):
            parts = []
            for p in whole.pieces():
                if t.ndim == 1:
                    a, n = (p.offsets[0], p.shape[0]) if p.offsets else (0, t.cols)
                    parts.append(_as_float(t, _pread(reader, self.gguf_file, t, 0, 1))[0, a:a + n])
                    continue
                first, count = p.offsets[0], p.shape[0]
                rows = _as_float(t, self.raw_rows(reader, t, first, count))
                col0, ncols = p.offsets[1], p.shape[1]
                parts.append(rows[:, col0:col0 + ncols])
            return torch.cat([x.reshape(-1) for x in parts])
        return produce


def _pread(reader, file: str, t: Tensor, first: int, count: int) -> torch.Tensor:
    buf = torch.empty(count, t.row_bytes, dtype=torch.uint8)
    reader.preadv(file, [memoryview(buf.view(-1).numpy())], t.begin + first * t.row_bytes)
    return buf


def _as_float(t: Tensor, rows: torch.Tensor) -> torch.Tensor:
    from ..quant.formats import GGUF_FORMATS
    if t.type_name in FLOAT_TYPES:
        return rows.view(FLOAT_TYPES[t.type_name]).float()
    return GGUF_FORMATS[t.type_name].dequantize(rows, t.cols)


def name_map(meta_model) -> Dict[str, str]:
    """GGUF tensor name -> transformers name, by transformers' own map (its Llama processor renames nothing)."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map
    return get_gguf_hf_weights_map(meta_model, TensorProcessor(config=meta_model.config.to_dict()))


__all__ = ["SOURCE_FILE", "FLOAT_TYPES", "GGUFSource", "name_map", "Tensor", "layout", "check_types",
           "check_architecture", "source_of"]
