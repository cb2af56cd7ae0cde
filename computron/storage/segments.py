"""How a shard is laid out in its buffers, and which of its segments have arrived on the device.

``collect_slots`` lists every distinct parameter and buffer of a model as a ``Slot``, tagged with the
segment (layer) a forward needs it for; ``Readiness`` holds the per-segment "weights have arrived"
flags a load sets and a forward waits on.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._torch_compat import local_tensor as _local  # the tensor that holds a parameter's data


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


def arrivals(module: nn.Module, segments: Sequence[nn.Module]) -> List[List[nn.Module]]:
    """The modules that make something from their weights once these arrive (``computron_arrive``: a
    quantized Linear's expanded or packed weight), by readiness segment (as ``collect_slots`` numbers them)."""
    out: List[List[nn.Module]] = [[] for _ in range(len(segments) + 1)]
    seen = set()
    for i, seg in enumerate(segments):
        for m in seg.modules():
            if hasattr(m, "computron_arrive") and id(m) not in seen:
                seen.add(id(m))
                out[i + 1].append(m)
    for m in module.modules():
        if hasattr(m, "computron_arrive") and id(m) not in seen:
            seen.add(id(m))
            out[0].append(m)
    return out


class Readiness:
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
