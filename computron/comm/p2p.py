"""Activations between pipeline stages, with failure passed downstream; failures agreed on by every rank.

Each transfer sends a small int64 header first: ``[status, dtype code, ndim,
*shape]``. A stage that failed sends status 1 and no data, so the stages
after it raise instead of waiting forever for activations that never come.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.bool, torch.uint8, torch.int8]
_MAX_DIMS = 8
OK, FAILED = 0, 1


class UpstreamFailed(RuntimeError):
    """An earlier pipeline stage failed on this batch; its own rank reports why."""


def send_tensor(t: Optional[torch.Tensor], dst: int, group, device: torch.device) -> None:
    header = torch.zeros(3 + _MAX_DIMS, dtype=torch.int64, device=device)
    if t is None:
        header[0] = FAILED
        dist.send(header, dst=dst, group=group)
        return
    if t.dim() > _MAX_DIMS:
        raise ValueError(f"activation has {t.dim()} dims; at most {_MAX_DIMS} can cross a stage")
    header[1] = _DTYPES.index(t.dtype)
    header[2] = t.dim()
    header[3:3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    dist.send(header, dst=dst, group=group)
    dist.send(t.contiguous(), dst=dst, group=group)


def recv_tensor(src: int, group, device: torch.device) -> torch.Tensor:
    header = torch.zeros(3 + _MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=group)
    h = header.tolist()
    if h[0] != OK:
        raise UpstreamFailed(f"pipeline stage of rank {src} failed on this batch")
    shape = h[3:3 + h[2]]
    out = torch.empty(shape, dtype=_DTYPES[h[1]], device=device)
    dist.recv(out, src=src, group=group)
    return out


def any_rank(flag: bool, group, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank of ``group`` (every rank calls it; one rank alone asks nobody)."""
    if dist.get_world_size(group) == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def broadcast_with_status(t: torch.Tensor, ok: bool, src: int, group) -> bool:
    """Broadcast the int64 tensor ``t`` from ``src`` together with whether ``src`` succeeded.

    One transfer: the status travels as an extra element. Returns the source's
    status; ``t`` holds the source's values only when it is True.
    """
    if dist.get_world_size(group) == 1:
        return ok
    packed = torch.empty(t.numel() + 1, dtype=torch.int64, device=t.device)
    packed[0] = OK if ok else FAILED
    packed[1:] = t.reshape(-1)
    dist.broadcast(packed, src=src, group=group)
    if packed[0].item() != OK:
        return False
    t.copy_(packed[1:].view(t.shape))
    return True
