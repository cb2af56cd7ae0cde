"""Memory tiers beside the shard store: host buffers (pinned where CUDA is) and reusable device buffers.

``pinned_empty`` allocates a page-locked host buffer of exactly the size asked for and ``free_host``
lets one go. ``HostPool`` keeps the host buffers of models that left host memory for the next model
read from disk; ``DevicePool`` keeps device buffers for the next load (CPU only: CUDA has torch's
caching allocator).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, List, Optional

import torch

log = logging.getLogger("computron.store")


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host buffer of exactly ``numel`` elements.

    torch's pinned allocator rounds every block up to a power of two (a 13.3 GB
    shard would lock 16 GB), so the buffer is allocated pageable and registered
    with CUDA in place; where registration is refused, the pinned allocator it is.
    Buffers of models that stay in host memory live as long as the worker; ``free_host`` unregisters
    the ones the disk tier lets go.
    """
    buf = torch.empty(numel, dtype=dtype)
    try:
        cudart = torch.cuda.cudart()
        cudart.cudaHostRegister(buf.data_ptr(), numel * buf.element_size(), 0)
        if buf.is_pinned():
            _REGISTERED.add(buf.data_ptr())
            return buf
        cudart.cudaHostUnregister(buf.data_ptr())  # registered in some other way than copies can use
    except Exception:  # noqa: BLE001 - fall back to the allocator below
        pass
    return torch.empty(numel, dtype=dtype, pin_memory=True)


_REGISTERED: set = set()  # data_ptr of host buffers registered by pinned_empty


def free_host(buf: torch.Tensor) -> None:
    """Let a host buffer go (unregistering it from CUDA if pinned_empty registered it)."""
    ptr = buf.data_ptr()
    if ptr in _REGISTERED:
        _REGISTERED.discard(ptr)
        try:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        except Exception:  # noqa: BLE001 - freed anyway
            log.warning("could not unregister a pinned host buffer", exc_info=True)


class _BufferPool:
    """Free buffers by dtype; ``take`` hands out the smallest one that fits."""

    def __init__(self):
        self._free: Dict[torch.dtype, List[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def _reuse(self, dtype: torch.dtype, fits: Callable[[int], bool],
               drop_rest: bool = False) -> Optional[torch.Tensor]:
        """The smallest free buffer of ``dtype`` whose element count ``fits``, out of the pool; None if
        none does (then, with ``drop_rest``, the pool lets go of its ``dtype`` buffers)."""
        with self._lock:
            free = self._free.get(dtype, [])
            fitting = [b for b in free if fits(b.numel())]
            if fitting:
                best = min(fitting, key=lambda b: b.numel())
                free[:] = [b for b in free if b is not best]  # by identity: == on tensors compares values
                return best
            if drop_rest:
                free.clear()
        return None

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(buf.dtype, []).append(buf)

    def reserved_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() * b.element_size() for bufs in self._free.values() for b in bufs)


def _host_fit(numel: int) -> Callable[[int], bool]:
    """A host buffer serves ``numel`` elements if it has at least as many, and at most a quarter more."""
    return lambda n: numel <= n <= numel + numel // 4


class HostPool(_BufferPool):
    """Host buffers (pinned on CUDA) of models that left host memory, kept for the next model read from
    disk: same-shaped models reuse them without allocating, pinning or page-faulting again."""

    def __init__(self, pin: bool):
        super().__init__()
        self.pin = pin

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A buffer of at least ``numel`` elements (at most a quarter more than asked)."""
        buf = self._reuse(dtype, _host_fit(numel))
        if buf is not None:
            return buf
        return pinned_empty(numel, dtype) if self.pin else torch.empty(numel, dtype=dtype)

    def trim(self, keep_bytes: int, keep_for: Optional[Dict[torch.dtype, int]] = None) -> None:
        """Free buffers, largest first, until at most ``keep_bytes`` stay in the pool besides the ones
        ``take`` would hand out for ``keep_for`` (dtype -> elements: the model about to be read)."""
        with self._lock:
            spared = set()
            for dt, numel in (keep_for or {}).items():
                fit = _host_fit(numel)
                fits = [b for b in self._free.get(dt, []) if fit(b.numel())]
                if fits:
                    spared.add(id(min(fits, key=lambda b: b.numel())))
            bufs = sorted((b for v in self._free.values() for b in v if id(b) not in spared),
                          key=lambda b: -b.numel() * b.element_size())
            total = sum(b.numel() * b.element_size() for b in bufs)
            for b in bufs:
                if total <= keep_bytes:
                    break
                self._free[b.dtype] = [x for x in self._free[b.dtype] if x is not b]
                total -= b.numel() * b.element_size()
                free_host(b)


class DevicePool(_BufferPool):
    """Device buffers kept for reuse (CPU only; CUDA has torch's caching allocator).

    Writing into memory that is already mapped runs 3-4x faster on CPU than into
    fresh memory, where every page faults on first touch.
    """

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        # nothing fits: the pool gives its memory back before asking for more
        buf = self._reuse(dtype, lambda n: n >= numel, drop_rest=True)
        if buf is not None:
            return buf
        return torch.empty(numel, dtype=dtype, device=self.device)
