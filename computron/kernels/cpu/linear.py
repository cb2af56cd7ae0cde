"""Linears on a CPU: weights packed once (``gemm``'s blocks or oneDNN's), else a few rows weight-first.

A Linear computes ``x @ W^T`` for activations ``x`` of ``M`` rows: one row per sequence in a decode step, a
few dozen in a short prefill. For such ``M`` the BLAS behind ``F.linear`` in torch's CPU wheels (MKL) reads
the weight in its stored layout at every call and spreads the work poorly over threads.

Packed (a float32 weight of a model that packs: ``EngineConfig.pack_cpu_linears``, by default a pinned one,
which never leaves the device): the first call after a load lays the weight out once, in
``gemm``'s blocks of 16 output features where a worker computes on one intra-op thread and that kernel
builds (its docstring has the figures: a decode step of SmolLM2 0.6-0.65x oneDNN's time), else in oneDNN's
blocked format (``torch.ops.mkldnn._reorder_linear_weight``), and every call then
runs oneDNN's matmul on it (``_linear_pointwise``), as vLLM's CPU backend does. One layout, made for
``PACK_ROWS`` rows, serves any row count. A pass through every Linear of opt-125m took 0.42-0.87x the time of
``F.linear`` with one thread and 0.34-0.65x with two, from 1 to 64 rows; with two threads a decode step of 8
sequences went from 78 to 33 ms, of one from 42 to 31 ms, a 16-token prefill of 8 from 222 to 142 ms
(``benchmarks/cpu_linear.py``, ``benchmarks/data/cpu_linear_cpu_2026-12-04.json``). The packed copy costs the
Linear weights' bytes once more while the model is resident (``release_packs`` drops it when the model
leaves; a changed weight, as a reload into another buffer or in place, is packed again). It is kept on the
module, not in its state.

Weight-first (where packing is off or unavailable): with more than one intra-op thread and
``2 <= M <= MAX_ROWS``, ``(W @ x^T)^T`` (the bias added by the same ``addmm``), returned contiguous as
``F.linear`` would; in the same run, with two threads, that took 0.39-1.07x as long as ``x @ W^T`` for
opt-125m's Linears at 2 to 64 rows (most at 2 and 4). Everywhere else, on every other device and inside a
compiled trace (``models.decode_compile``: inductor picks its own kernel), it is ``F.linear``. Either way the sums
are the same products in another order: results agree with ``F.linear`` to float rounding, as a batched row
already differs from the same row computed alone.

Once a weight is blocked, its Linear keeps the kernel's call (``gemm.Call``) and takes it first in
inference: what ``linear`` checks and derives at every product is checked once per pack, and a call costs
11.5 us where it cost 16.8 (one row by a 192 x 576 weight, one thread: a decode step of SmolLM2 makes 211).

``use_cpu_kernels(module, pack)`` makes a runner's plain ``nn.Linear`` modules call ``linear`` (a class
swap: the same module objects, hooks and all) and sets whether every such Linear packs its weight.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from . import gemm

MAX_ROWS = 64
"""The most rows computed weight-first: the largest row count measured; a longer prefill keeps ``F.linear``."""

PACK_ROWS = 16
"""The row count oneDNN lays a packed weight out for: a decode batch's size (any row count runs on it)."""

PACK_MIN = 100_000
"""The fewest weight elements worth packing. A smaller Linear keeps ``F.linear``: oneDNN's call costs about
12 us more than MKL's on such a weight, and its pack about 0.1 ms more per load, against a product of a few
microseconds (opt-tiny's 64 x 64 to 512 x 64: 15-44 us packed against 3-35 us; from 512 x 512 packing wins at
8 rows and more; one thread). Packing every Linear of opt-tiny made ``benchmarks/burst.py`` serve 0.83x the
requests per second (89 against 107, two runs each; ``benchmarks/data/burst_cpu_before_after_2026-12-04.jsonl``)."""

_PACK = "_computron_packed"
_CALL = "_computron_call"  # the blocked kernel's call on this pack (``gemm.Call``), for ``FewRowLinear``


def packing_available() -> bool:
    """Whether this torch has oneDNN's packed Linear."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def weight_first(flat: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``flat @ weight^T (+ bias)`` for a 2-D ``flat``, computed as ``(weight @ flat^T)^T``, contiguous."""
    out = torch.mm(weight, flat.t()) if bias is None else torch.addmm(bias[:, None], weight, flat.t())
    return out.t().contiguous()


BLOCKED, ONEDNN = "blocked", "onednn"


def pack_kind() -> str:
    """The layout a weight is packed in now: ``gemm``'s blocks where its kernel runs (one intra-op thread:
    it is single-threaded) or where oneDNN is missing, else oneDNN's."""
    one = torch.get_num_threads() == 1 or not packing_available()
    return BLOCKED if one and gemm.available() else ONEDNN


def weight_key(weight: torch.Tensor) -> tuple:
    """What a pack was made from: the weight's storage, version counter and shape (any change: pack again)."""
    return weight.data_ptr(), weight._version, tuple(weight.shape)


def packed_weight(holder: nn.Module, weight: torch.Tensor) -> Tuple[str, torch.Tensor]:
    """``(kind, weight packed)``: in ``pack_kind()``'s layout, packed on first use and again whenever the
    weight's storage or contents changed (its data pointer or version counter: a load into another buffer, a
    copy into this one). The pack and its kind are also the holder's ``packed`` and ``packed_kind``
    attributes, which a compiled step reads (``linear``)."""
    key = weight_key(weight)
    held = holder.__dict__.get(_PACK)
    if held is None or held[0] != key:
        kind = pack_kind()
        w = weight.detach()
        held = (key, kind, gemm.block(w) if kind == BLOCKED else
                torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS))
        holder.__dict__[_PACK] = held
        holder.packed, holder.packed_kind = held[2], kind
        holder.__dict__[_CALL] = gemm.Call.of(key, held[2], weight.shape[0]) if kind == BLOCKED else None
    return held[1], held[2]


@torch.library.custom_op("computron::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
                  out_features: int) -> torch.Tensor:
    """oneDNN's matmul on a packed weight, as one opaque operator: inside a compiled step inductor fuses what
    surrounds it and calls this for the product (its own CPU matmul is slower here)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x, packed, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("computron::block_linear", mutates_args=())
def block_linear(x: torch.Tensor, blocked: torch.Tensor, bias: Optional[torch.Tensor],
                 out_features: int) -> torch.Tensor:
    """``gemm``'s product on a blocked weight, as one opaque operator inside a compiled step."""
    return gemm.matmul(x, blocked, bias, out_features)


@block_linear.register_fake
def _(x, blocked, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _packs(x: torch.Tensor, weight: torch.Tensor, holder: Optional[nn.Module]) -> bool:
    return (holder is not None and getattr(holder, "pack_weights", False) and weight.dtype == torch.float32
            and x.dtype == torch.float32
            and weight.numel() >= PACK_MIN
            and x.dim() >= 2 and x.shape[-1] == weight.shape[-1]
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None, holder: Optional[nn.Module] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on a packed weight held by ``holder`` where it packs, else weight-first
    where that is faster (see the module's docstring)."""
    if torch.compiler.is_compiling():  # the pack an eager step made (none where it does not pack)
        packed = getattr(holder, "packed", None) if holder is not None else None
        if packed is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() < 2:
            return F.linear(x, weight, bias)
        if holder.packed_kind == BLOCKED:
            if _rows(x) > gemm.MAX_ROWS:
                return F.linear(x, weight, bias)
            return block_linear(x, packed, bias, weight.shape[0])
        return packed_linear(x, packed, bias, weight.shape[0])
    if x.device.type != "cpu" or x.dim() < 2 or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    if _packs(x, weight, holder):
        kind, packed = packed_weight(holder, weight)
        if kind == ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        if _rows(x) <= gemm.MAX_ROWS:
            return gemm.matmul(x, packed, bias, weight.shape[0])
        return F.linear(x, weight, bias)
    if torch.get_num_threads() < 2:
        return F.linear(x, weight, bias)
    rows = _rows(x)
    if not 2 <= rows <= MAX_ROWS:
        return F.linear(x, weight, bias)
    out = weight_first(x.reshape(rows, x.shape[-1]), weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class FewRowLinear(nn.Linear):
    """An ``nn.Linear`` whose product is ``linear``'s."""

    uses_cpu_linear = True
    pack_weights = False

    def forward(self, x):
        call = self.__dict__.get(_CALL)
        # the common case first: a packed weight's product, few Python steps
        if call is not None and self.pack_weights and not torch.compiler.is_compiling():
            y = call(x, self._parameters["bias"], weight_key(self._parameters["weight"]))
            if y is not None:
                return y
        return linear(x, self.weight, self.bias, self)


def use_cpu_kernels(module: nn.Module, pack: bool = True) -> int:
    """Swap every plain ``nn.Linear`` under ``module`` to ``FewRowLinear``, but those split by DTensor (whose
    product DTensor's dispatch computes), and let every Linear computed by ``linear`` pack its weight where
    ``pack`` (and oneDNN is there); returns how many were swapped. Its RMS norms become one operator each
    where that is the same norm (``norm``)."""
    from ..._torch_compat import local_tensor
    from .norm import use_fused_norms
    use_fused_norms(module)
    n = 0
    pack = pack and (packing_available() or gemm.available())
    for sub in module.modules():
        if type(sub) is nn.Linear and local_tensor(sub.weight) is sub.weight:
            sub.__class__ = FewRowLinear
            n += 1
        if getattr(type(sub), "uses_cpu_linear", False):
            sub.pack_weights = pack
    return n


def release_packs(module: nn.Module) -> int:
    """Drop every packed weight under ``module`` (the model leaves); returns their bytes."""
    freed = 0
    for sub in module.modules():
        held = sub.__dict__.pop(_PACK, None)
        sub.__dict__.pop(_CALL, None)
        sub.__dict__.pop("packed", None)
        sub.__dict__.pop("packed_kind", None)
        if held is not None:
            freed += held[2].numel() * held[2].element_size()
    return freed


def packed_bytes(module: nn.Module) -> int:
    """Bytes of the packed weights held under ``module``."""
    return sum(h[2].numel() * h[2].element_size() for h in (s.__dict__.get(_PACK) for s in module.modules()) if h)


__all__ = ["linear", "weight_first", "packed_weight", "pack_kind", "BLOCKED", "ONEDNN", "FewRowLinear",
           "use_cpu_kernels", "release_packs",
           "packed_bytes", "packing_available", "MAX_ROWS", "PACK_MIN", "PACK_ROWS"]
