"""One rank's share of a LoRA adapter, in host memory (worker side).

For the Linear ``y = x W^T`` LoRA adds ``scaling * (x A^T) B^T`` (A: [r, in], B: [out, r]). A rank keeps
only its pipeline stage's layers, and under TP the slice that matches its slice of the base Linear:

- column-parallel base (W split by output rows, ``Shard(0)``): this rank computes out-features
  ``[o0, o1)``, so it keeps B's rows ``[o0, o1)`` and all of A;
- row-parallel base (W split by input columns, ``Shard(1)``): this rank sees in-features ``[i0, i1)``, so it
  keeps A's columns ``[i0, i1)`` and all of B; ``x_local A_local^T`` is then a partial sum that
  ``slots`` all-reduces over the TP group before multiplying by B.

The slice bounds are read off the base weight's own DTensor layout (``local_shape_and_offset``), so they
are the base's whatever chunking DTensor applies (``torch.chunk``-like: ceil-sized chunks first; the
family table's TP checks make Llama's k/v heads divide evenly anyway). Slices are read with safetensors'
``get_slice``, never the whole file. Each factor is stored as ``A`` [r, in_local] and ``Bt`` [r, out_local]
= ``scaling * B^T`` (the scaling folded in, in float32, before the cast to the base's dtype), both
contiguous, so a device slot is filled by two contiguous copies.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Tuple

import torch
from torch import nn

from .._torch_compat import local_shape_and_offset, local_tensor
from .adapter import AdapterError, AdapterInfo, tensor_key_pattern


@dataclass(frozen=True)
class LinearSplit:
    """How this rank holds one base Linear under TP."""
    row_parallel: bool
    """Split by input features: the rank's LoRA partial sums must be all-reduced."""
    in_range: Tuple[int, int]
    out_range: Tuple[int, int]
    in_features: int
    out_features: int

    @property
    def in_local(self) -> int:
        return self.in_range[1] - self.in_range[0]

    @property
    def out_local(self) -> int:
        return self.out_range[1] - self.out_range[0]


def linear_split(module: nn.Module) -> LinearSplit:
    """This rank's slice of ``module.weight`` ([out, in]), from its DTensor layout (whole when plain)."""
    w = module.weight
    # the Linear's own sizes: while its model is offloaded the weight's data is an empty placeholder
    out_f, in_f = getattr(module, "out_features", None), getattr(module, "in_features", None)
    if out_f is None or in_f is None:
        out_f, in_f = w.shape
    if not hasattr(w, "placements"):
        from ..models.row_split import pieces_of
        rows = pieces_of(module, "weight")
        if rows is None:
            return LinearSplit(False, (0, in_f), (0, out_f), in_f, out_f)
        if len(rows[1]) != 1:
            raise ValueError("LoRA: cannot follow a fused Linear split part by part")
        (r0, n), = rows[1]
        return LinearSplit(False, (0, in_f), (r0, r0 + n), in_f, out_f)
    shards = [p.dim % 2 for p in w.placements if p.is_shard()]
    if len(shards) > 1 or any(p.is_partial() for p in w.placements):
        raise ValueError(f"LoRA: cannot follow the TP layout {w.placements} of a Linear weight")
    (rows, cols), (r0, c0) = local_shape_and_offset(w)
    return LinearSplit(shards == [1], (c0, c0 + cols), (r0, r0 + rows), in_f, out_f)


@dataclass
class RankAdapter:
    """This rank's share of one adapter: ``weights[(local layer index, layer-relative path)] = (A, Bt)``."""
    info: AdapterInfo
    weights: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    pinned: bool = False

    @property
    def adapter_id(self) -> str:
        return self.info.adapter_id

    @property
    def r(self) -> int:
        return self.info.r

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ab in self.weights.values() for t in ab)


def load_rank_adapter(info: AdapterInfo, runner, pin: bool) -> RankAdapter:
    """Read ``info``'s A/B weights for ``runner``'s stage layers and TP slice into host memory (pinned when
    ``pin`` and CUDA is there), cast to the base's dtype. AdapterError when the file no longer fits."""
    from safetensors import safe_open
    fam = runner.family_entry
    local_of = {layer_id: i for i, layer_id in enumerate(runner.layer_ids)}
    pattern = tensor_key_pattern(fam)
    paths = set(fam.colwise + fam.rowwise)
    pin = bool(pin) and torch.cuda.is_available()
    out = RankAdapter(info, pinned=pin)
    try:
        f = safe_open(info.weights_file, framework="pt", device="cpu")
    except Exception as exc:  # noqa: BLE001 - missing or corrupt since the master checked it
        raise AdapterError(info.adapter_id, f"cannot read {info.weights_file}: {exc}") from None
    with f:
        pairs: Dict[Tuple[int, str], Dict[str, str]] = {}
        for key in f.keys():
            m = pattern.match(key)
            if m is None or m.group(2) not in paths:
                raise AdapterError(info.adapter_id, f"tensor {key!r} is not a LoRA weight of this base "
                                                    "(the file changed since it was checked?)")
            layer = int(m.group(1))
            if layer in local_of:
                pairs.setdefault((local_of[layer], m.group(2)), {})[m.group(3)] = key
        for (local, path), keys in sorted(pairs.items()):
            module = runner.base.layers[local].get_submodule(path)
            split = linear_split(module)
            dtype = local_tensor(module.weight).dtype
            a_sl, b_sl = f.get_slice(keys["A"]), f.get_slice(keys["B"])
            a_shape, b_shape = list(a_sl.get_shape()), list(b_sl.get_shape())
            if a_shape != [info.r, split.in_features] or b_shape != [split.out_features, info.r]:
                raise AdapterError(info.adapter_id, f"layer {runner.layer_ids[local]} {path}: lora_A {a_shape} / "
                                                    f"lora_B {b_shape} do not fit the base Linear "
                                                    f"[{split.out_features}, {split.in_features}] for r={info.r}")
            (i0, i1), (o0, o1) = split.in_range, split.out_range
            a = a_sl[:, i0:i1] if split.row_parallel else a_sl[:]
            b = b_sl[o0:o1, :]
            a = a.to(dtype).contiguous()
            bt = (b.float() * info.scaling).t().to(dtype).contiguous()
            if pin:
                a, bt = a.pin_memory(), bt.pin_memory()
            out.weights[(local, path)] = (a, bt)
    return out


__all__ = ["RankAdapter", "LinearSplit", "linear_split", "load_rank_adapter"]
