"""The draw of a batch of rows on the logits' device: temperature, ``min_p``, ``top_k`` and ``top_p`` with each
row's own values (``warp``), then one token per row (``draw``).

The draw is the exponential race ``argmax(p / q)`` with ``q ~ Exp(1)``: a sample of ``p``, and exactly what
``torch.multinomial(p, 1, generator=g)`` computes for one sample, without multinomial's validity check (a
device-to-host copy on CUDA). A row with its own generator draws its ``q`` from it alone, so a seeded
sequence gets the same tokens whatever else is in the batch; rows without one share one draw from torch's
default generator of the device. Nothing here copies from the device to the host.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

NEG_INF = float("-inf")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``. On CUDA (the device-specific part) it goes through pinned memory without
    blocking the host, so a step's small inputs never wait for the kernels queued before them."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def device_tensor(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a tensor on ``device`` (``to_device``)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def _rows(x: torch.Tensor, needs: Sequence[bool], cut) -> torch.Tensor:
    """``x`` with ``cut`` applied to the rows that ``needs`` (only those are computed)."""
    at = [i for i, n in enumerate(needs) if n]
    if len(at) == len(needs):
        return cut(x, list(range(len(needs))))
    index = device_tensor(at, torch.int64, x.device)
    return x.index_copy(0, index, cut(x.index_select(0, index), at))


def warp(x: torch.Tensor, temperature: Sequence[float], min_p: Sequence[float] = (), top_k: Sequence[int] = (),
         top_p: Sequence[float] = ()) -> torch.Tensor:
    """The probabilities [R, V] each row of logits ``x`` [R, V] is drawn from: divided by its ``temperature``
    (> 0), cut to the tokens at least ``min_p`` times as likely as the likeliest, to its ``top_k`` and to its
    ``top_p`` nucleus, in that order (per row; an empty sequence, 0, 0 and 1.0 do not cut). Each cut computes
    only the rows that ask for it."""
    dev = x.device
    x = x / device_tensor(list(temperature), x.dtype, dev)[:, None]

    def cut_min_p(rows: torch.Tensor, at: List[int]) -> torch.Tensor:
        probs = rows.softmax(-1)
        floor = device_tensor([float(min_p[i]) for i in at], x.dtype, dev)[:, None] * probs.amax(-1, keepdim=True)
        return rows.masked_fill(probs < floor, NEG_INF)

    def cut_top_k(rows: torch.Tensor, at: List[int]) -> torch.Tensor:
        ks = [min(int(top_k[i]), rows.shape[-1]) for i in at]
        kth = torch.topk(rows, max(ks), dim=-1).values.gather(1, device_tensor([k - 1 for k in ks], torch.int64,
                                                                               dev)[:, None])
        return rows.masked_fill(rows < kth, NEG_INF)

    def cut_top_p(rows: torch.Tensor, at: List[int]) -> torch.Tensor:
        sorted_x, order = torch.sort(rows, descending=True, dim=-1)
        probs = sorted_x.softmax(-1)
        drop = probs.cumsum(-1) - probs > device_tensor([float(top_p[i]) for i in at], x.dtype, dev)[:, None]
        return torch.full_like(rows, NEG_INF).scatter(-1, order, sorted_x.masked_fill(drop, NEG_INF))

    if any(min_p):
        x = _rows(x, [bool(p) for p in min_p], cut_min_p)
    if any(top_k):
        x = _rows(x, [bool(k) for k in top_k], cut_top_k)
    if any(p < 1.0 for p in top_p):
        x = _rows(x, [p < 1.0 for p in top_p], cut_top_p)
    return x.softmax(-1)


def draw(probs: torch.Tensor, generators: Sequence[Optional[torch.Generator]]) -> torch.Tensor:
    """One token per row of ``probs`` [R, V] (int64 [R], on their device): row ``i`` with ``generators[i]``
    where it is not None, the others with one draw of the device's default generator."""
    race = torch.empty_like(probs)
    own = [i for i, g in enumerate(generators) if g is not None]
    if len(own) < len(generators):
        race.exponential_()
    for i in own:
        race[i].exponential_(generator=generators[i])
    return probs.div_(race).argmax(-1)


def sample_rows(logits: torch.Tensor, temperature: Optional[float], top_k: Optional[int] = 0,
                top_p: Optional[float] = 1.0, generator: Optional[torch.Generator] = None,
                min_p: float = 0.0) -> torch.Tensor:
    """One token per row of ``logits`` [N, V], every row with the same sampling parameters, drawn with one
    generator in one call (the request-level path): greedy where ``temperature`` is 0 or ``top_k`` is 1, else
    ``warp`` then ``draw``. ``top_k`` 0 or None, ``top_p`` 1.0 or None and ``min_p`` 0 do not cut."""
    if not temperature or top_k == 1:
        return logits.argmax(-1)
    n = logits.shape[0]
    probs = warp(logits, [float(temperature)] * n, [float(min_p or 0.0)] * n, [int(top_k or 0)] * n,
                 [1.0 if top_p is None else float(top_p)] * n)
    race = torch.empty_like(probs).exponential_(generator=generator)
    return probs.div_(race).argmax(-1)


__all__: List[str] = ["NEG_INF", "to_device", "device_tensor", "warp", "draw", "sample_rows"]
