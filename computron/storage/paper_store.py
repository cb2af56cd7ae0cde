"""The paper's swap, for side-by-side comparison with ``store.ShardStore``: one ``.to()`` per tensor
into freshly allocated memory on load, and on offload a fresh host copy of every tensor."""
from __future__ import annotations

import time
from typing import List, Sequence

import torch

from .store import Store


class PaperStore(Store):
    """The paper's swap: ``.to(device)`` per tensor on load, a fresh host copy of each on offload."""

    def __init__(self, module, segments, device, mutable_buffers: Sequence[str] = ()):
        super().__init__(module, segments, device, mutable_buffers)
        self.host_tensors: List[torch.Tensor] = []
        with torch.no_grad():
            for s in self.slots:
                self.host_tensors.append(s.tensor.detach().to("cpu", copy=True))
                s.tensor.data = self._placeholder(s.dtype)

    def device_bytes(self) -> int:
        if not self.resident:
            return 0
        return sum(s.tensor.numel() * s.tensor.element_size() for s in self.slots)

    def begin_load(self, on_done) -> None:
        if self.resident:
            raise RuntimeError("model is already loaded on this worker")
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                for s, h in zip(self.slots, self.host_tensors):
                    s.tensor.data = h.to(self.device, copy=True)
            if self.cuda:
                torch.cuda.current_stream().synchronize()
        except BaseException as exc:  # noqa: BLE001
            self.resident = True
            self.offload()
            on_done(t0, time.perf_counter(), exc)
            return
        self.resident = True
        self._ready = None
        on_done(t0, time.perf_counter(), None)

    def offload(self) -> None:
        if not self.resident:
            return
        with torch.no_grad():
            for i, s in enumerate(self.slots):
                if s.tensor.numel() == s.numel:
                    self.host_tensors[i] = s.tensor.data.to("cpu", copy=True)
                s.tensor.data = self._placeholder(s.dtype)
        if self.cuda:
            torch.cuda.current_stream().synchronize()
        self.resident = False
